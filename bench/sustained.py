#!/usr/bin/env python3
"""Forward time under short and sustained load, jagflash next to FA2 varlen, with the SM clock
and power the GPU reported meanwhile: tells a kernel that is slower from one the GPU slows down
(power cap) when it runs back to back, as compare.py times it.

For each distribution (bf16, H = 16, D = 128, randn like compare.py) and implementation:
  isolated  - median of single calls, each after a 20 ms pause (the GPU idles between them;
              the call's host work is hidden behind a spin kernel queued ahead of it);
  sustained - median over samples of --calls calls queued back to back, for about --seconds;
with the median SM clock (MHz) and power (W) sampled by nvidia-smi during each phase.
    python bench/sustained.py [--dists onegiant uniform1k] [--causal]
"""
import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))
import jagflash  # noqa: E402
import peers  # noqa: E402


def median_clock_power(lines):
    """Median SM clock (MHz) and power (W) of nvidia-smi's "clock, power" lines; lines it could
    not fill ("[N/A]", a partial last line) are skipped; NaN when none is left."""
    rows = []
    for line in lines:
        try:
            clock, power = (float(x) for x in line.split(","))
        except ValueError:
            continue
        rows.append((clock, power))
    if not rows:
        return float("nan"), float("nan")
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


class Sampler:
    """nvidia-smi's SM clock and power every 50 ms while the block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.clock, self.power = median_clock_power(self.proc.communicate()[0].splitlines())


def isolated_ms(fn, samples=15):
    times = []
    for _ in range(samples):
        time.sleep(0.02)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A ~1 ms spin kernel ahead of the start event: the call's host work (launch, Python)
        # overlaps it instead of being timed as idle GPU time.
        torch.cuda._sleep(2_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sustained_ms(fn, calls, seconds):
    times, t0 = [], time.time()
    while time.time() - t0 < seconds or len(times) < 3:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times[1:])  # the first sample starts from an idle GPU


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dists", nargs="+", default=["onegiant", "uniform1k"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(jagflash.DEFAULT_SEED)
    print("| dist | impl | isolated ms | MHz | W | sustained ms | MHz | W | sustained/isolated |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dist in args.dists:
        lengths, offsets, (q, k, v, dout) = peers.benchmark_batch(dist, 128, gen)
        inputs = peers.Inputs(q, k, v, dout, offsets, lengths, args.causal, 0)
        for name in ("jagflash", "FA2 varlen"):
            fn = peers.make(name, inputs).forward
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with Sampler() as s_iso:
                iso = isolated_ms(fn)
            with Sampler() as s_sus:
                sus = sustained_ms(fn, args.calls, args.seconds)
            print(f"| {dist} | {name} | {iso:.3f} | {s_iso.clock:.0f} | {s_iso.power:.0f} | {sus:.3f} | "
                  f"{s_sus.clock:.0f} | {s_sus.power:.0f} | {sus / iso:.3f} |", flush=True)
        del q, k, v, dout, inputs


if __name__ == "__main__":
    main()

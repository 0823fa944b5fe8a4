#!/usr/bin/env python3
"""Where the PyTorch op's forward time goes, next to the kernel's own time.

For each distribution (bf16, H = 16, D = 128, both masks, randn inputs like compare.py unless
--inputs uniform), prints:
  per call     - CUDA events around one call, as compare.py times it (host time before the
                 launch shows up as idle GPU time);
  back to back - events around 8 calls queued without a sync, divided by 8 (host time hidden
                 whenever it is shorter than the GPU's);
  kernels      - the sum of device kernel times of one call from torch.profiler, by kernel name.
    python bench/op_overhead.py [--dists gemskew ...]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402
import jagflash  # noqa: E402
import peers  # noqa: E402


def events_ms(fn, calls):
    """Median ms per call over 7 samples of `calls` queued calls: compare.py's own timer."""
    return compare.measure(fn, torch.device("cuda"), warmup=0, iters=7, budget_s=60.0, calls=calls)[0]


def kernel_times_ms(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = e.name[:48]
            by_name[key] = by_name.get(key, 0.0) + e.device_time / 1e3
    return by_name


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dists", nargs="+", default=list(jagflash.DISTRIBUTIONS))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--inputs", choices=("randn", "uniform"), default="randn",
                   help="q, k, v from N(0, 1) (compare.py's draw) or U(-1, 1) (the C++ bench's)")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(jagflash.DEFAULT_SEED)
    print("| dist | mask | per call ms | back to back ms | kernels ms | largest kernels |")
    print("|---|---|---|---|---|---|")
    for dist in args.dists:
        _, offsets, (q, k, v, _) = peers.benchmark_batch(dist, args.head_dim, gen, uniform=args.inputs == "uniform")
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for causal in (False, True):
            def fn():
                return jagflash.jagged_attention(q, k, v, offsets, causal=causal, check_offsets="device")
            for _ in range(3):
                fn()
            per_call = events_ms(fn, 1)
            queued = events_ms(fn, 8)
            kernels = kernel_times_ms(fn)
            top = ", ".join(f"{n} {t:.3f}" for n, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
            print(f"| {dist} | {'causal' if causal else 'none'} | {per_call:.3f} | {queued:.3f} | "
                  f"{sum(kernels.values()):.3f} | {top} |", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()

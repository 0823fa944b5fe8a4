#!/usr/bin/env python3
"""jagflash side by side with PyTorch's own kernels (FA2 varlen through aten, varlen_attn,
FlexAttention with a document mask) on the five distributions of shared/bench/distributions.md,
causal and not, D = 128 and 64; one process, the same inputs for all.

Writes compare.json (every number), compare.md (a section for bench/RESULTS.md) and a PNG chart
into --out (default $OUT, else bench/out), and prints the table last.

    python bench/compare.py                              # on the GPU machine
    python bench/compare.py --from DIR --update-results  # here: append DIR's section to RESULTS.md
    python bench/compare.py --device cpu --scale 32 --max-batch 8   # a smoke run without a GPU

Runs are kept short (few timed runs, each measurement capped by --budget-s) because jagflash's
default GPU path may still be the fp32 oracle, which takes up to ~2 s a call on the big batches.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))  # a source checkout: jagflash from python/

import jagflash  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MISMATCH_TOL = 5e-2  # bf16 inputs, fp32 vs bf16 P: a few 1e-3 is normal; this flags a real bug


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")), help="output folder")
    p.add_argument("--dists", nargs="+", default=list(jagflash.DISTRIBUTIONS), choices=jagflash.DISTRIBUTIONS)
    p.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--impls", nargs="+", default=list(peers.IMPLEMENTATIONS), choices=peers.IMPLEMENTATIONS)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=jagflash.DEFAULT_SEED)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=int, default=1, help="divide every length by this (smoke runs)")
    p.add_argument("--max-batch", type=int, default=0, help="keep only the first N sequences (smoke runs)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fwd-calls", type=int, default=4,
                   help="forward calls queued back to back per timed sample (1: one call between two events)")
    p.add_argument("--budget-s", type=float, default=1.0, help="stop timing a measurement after this long")
    p.add_argument("--fwd-order", default="interleaved", choices=["interleaved", "sequential"],
                   help="forward samples of the implementations taken in turns (default), or one "
                        "implementation's samples after another's")
    p.add_argument("--no-compile-flex", action="store_true", help="eager FlexAttention (CPU smoke runs)")
    p.add_argument("--commit", default=None, help="commit measured (default: $JAGFLASH_COMMIT, else git)")
    p.add_argument("--from", dest="from_dir", default=None, help="re-render DIR/compare.json; run nothing")
    p.add_argument("--update-results", action="store_true", help="append the section to bench/RESULTS.md")
    return p.parse_args()


def commit_of_checkout():
    # Set by the GPU scripts: the device machine's copy of the tree may carry a stale .git.
    if os.environ.get("JAGFLASH_COMMIT"):
        return os.environ["JAGFLASH_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("JAGFLASH_COMMIT", "unknown")


def environment(args, device):
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'host'})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": args.commit or commit_of_checkout(),
        "command": "python bench/compare.py " + " ".join(sys.argv[1:]),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_version,
        "python": platform.python_version(),
        "jagflash": jagflash.library_version(),
        "dtype": args.dtype,
        "heads": args.heads,
        "dists": list(args.dists),
        "seed": args.seed,
        "scale_note": "" if args.scale == 1 and not args.max_batch else
        f"; lengths / {args.scale}, first {args.max_batch or 'all'} sequences",
        "iters": args.iters,
        "budget_s": args.budget_s,
        "fwd_calls": args.fwd_calls,
        "fwd_order": args.fwd_order,
        "timer": "CUDA events" if device.type == "cuda" else "wall clock",
        "mismatch_tol": MISMATCH_TOL,
    }


def _sample(fn, device, calls):
    """(ms per call, last result) of `calls` calls of fn() queued between two events."""
    result = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls, result
    t0 = time.perf_counter()
    for _ in range(calls):
        result = fn()
    return (time.perf_counter() - t0) * 1e3 / calls, result


def measure_interleaved(fns, device, warmup, iters, budget_s, calls=1):
    """{name: (median ms per call, last result)} of several functions timed in turns: each round
    takes one sample (`calls` queued calls, as measure()) of every function, in the given order
    on even rounds and reversed on odd ones. On the H200, which of two kernels ran first moved
    their ratio by up to 14% (power and clock carry over from one measurement to the next,
    bench/NOTES.md, session 10); in turns both see the same conditions. A function that raises
    gets {name: exception} and leaves the rotation. A function's warm-up stops early once one
    sample alone would eat the budget (the fp32 oracle takes seconds a call on big batches).
    Rounds stop at `iters`, or once the samples taken add up to budget_s per function (at least
    one round)."""
    results, live = {}, dict(fns)
    times = {name: [] for name in fns}
    for name, fn in list(live.items()):
        try:
            for _ in range(warmup):
                ms, _ = _sample(fn, device, calls)
                if ms * calls * iters > budget_s * 1e3:
                    break
        except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the others
            results[name] = e
            del live[name]
    spent_ms, last = 0.0, {}
    for r in range(iters):
        if r > 0 and spent_ms >= budget_s * 1e3 * max(len(live), 1):
            break
        for name in list(live) if r % 2 == 0 else list(reversed(live)):
            try:
                ms, last[name] = _sample(live[name], device, calls)
            except Exception as e:  # noqa: BLE001
                results[name] = e
                del live[name]
                continue
            times[name].append(ms)
            spent_ms += ms * calls
    for name in live:
        results[name] = (statistics.median(times[name]), last[name])
    return results


def measure(fn, device, warmup, iters, budget_s, calls=1):
    """(median ms per call, last result) of fn(). Each timed sample is `calls` calls queued back to
    back between two events, divided by `calls`: the host's per-call work (Python, argument
    checks, launches) then overlaps the previous call's kernels, as it does in a training step,
    instead of being counted as idle GPU time. Warm-up calls stop early once one sample alone
    would eat the budget, and samples stop once the budget is spent (at least one is taken):
    measure_interleaved() with one function, raising what fn raises."""
    timed = measure_interleaved({"fn": fn}, device, warmup, iters, budget_s, calls)["fn"]
    if isinstance(timed, Exception):
        raise timed
    return timed


def batch_lengths(name, args):
    lengths = jagflash.generate_lengths(name, args.seed)
    if args.max_batch:
        lengths = lengths[: args.max_batch]
    return [max(1, n // args.scale) for n in lengths] if args.scale > 1 else lengths


def normalised_error(actual, expected):
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def _error_text(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def time_forwards(impl_names, inputs, device, args):
    """{name: (implementation, (fwd ms, out)) or exception} for one case: every implementation
    built, then its forward timed (in turns with the others unless --fwd-order sequential)."""
    impls, timed = {}, {}
    for name in impl_names:
        try:
            impls[name] = peers.make(name, inputs, compile_flex=not args.no_compile_flex)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the others
            timed[name] = e
    groups = [impls] if args.fwd_order == "interleaved" else [{n: i} for n, i in impls.items()]
    fwd = {}
    for group in groups:
        fwd.update(measure_interleaved({n: i.forward for n, i in group.items()}, device, args.warmup, args.iters,
                                       args.budget_s, calls=args.fwd_calls))
    for n, i in impls.items():
        timed[n] = fwd[n] if isinstance(fwd[n], Exception) else (i, fwd[n])
    return {n: timed[n] for n in impl_names}


def run_case(impl_name, timed, flops, device, args, reference):
    """One implementation on one case, its forward already timed (time_forwards): its row, and
    its (out, grads) for comparison."""
    row = {"impl": impl_name}
    try:
        if isinstance(timed, Exception):
            raise timed
        impl, (fwd_ms, out) = timed
        bwd_ms, grads = measure(lambda: impl.backward(out), device, args.warmup, args.iters, args.budget_s)
        out, grads = impl.unpad(out, grads)
        row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops / fwd_ms / 1e9, bwd_tflops=2.5 * flops / bwd_ms / 1e9)
        result = (out.detach(), *grads)
        if reference is not None:
            row["max_err"] = max(normalised_error(a, b) for a, b in zip(result, reference))
            row["mismatch"] = row["max_err"] > MISMATCH_TOL
        return row, result
    except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the others
        row["error"] = _error_text(e)
        return row, None


def save(out_dir, meta, rows):
    """Rewritten after every measurement, so a run cut short still leaves what it measured."""
    (out_dir / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def run(args, out_dir):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    meta = environment(args, device)
    all_lengths = {name: batch_lengths(name, args) for name in args.dists}
    # FlexAttention's common padded length: the longest batch, rounded up to its block.
    flex_length = -(-max(sum(v) for v in all_lengths.values()) // 128) * 128
    rows = []
    # Drawn on the device: a CPU draw of the big batches (hundreds of millions of values) would
    # take longer than the measurements.
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for dist, lengths in all_lengths.items():
        total = sum(lengths)
        offsets = peers.offsets_of(lengths, device)
        for head_dim in args.head_dims:
            def rnd():
                return torch.randn((total, args.heads, head_dim), generator=generator, device=device).to(dtype)

            q, k, v, dout = rnd(), rnd(), rnd(), rnd()
            for mask in args.masks:
                causal = mask == "causal"
                pairs = sum(jagflash.visible_pairs(n, n, causal=causal) for n in lengths)
                flops = 4.0 * args.heads * head_dim * pairs
                inputs = peers.Inputs(*(t.clone().requires_grad_() for t in (q, k, v)), dout, offsets, lengths,
                                      causal, flex_length)
                reference = None
                t0 = time.time()
                forwards = time_forwards(args.impls, inputs, device, args)
                for impl_name in args.impls:
                    row, result = run_case(impl_name, forwards[impl_name], flops, device, args, reference)
                    if impl_name == "jagflash" and result is not None:
                        reference = result
                    row.update(dist=dist, mask=mask, head_dim=head_dim, batch=len(lengths), total=total)
                    rows.append(row)
                    save(out_dir, meta, rows)
                    print(_progress(row, time.time() - t0), flush=True)
                    t0 = time.time()
                del inputs, reference, forwards
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return meta, rows


def _progress(row, seconds):
    what = f"{row['dist']:>9} {row['mask']:>6} D{row['head_dim']:<3} {row['impl']:<13}"
    if row.get("error"):
        return f"{what} ERROR {row['error']}"
    err = f"  err {row['max_err']:.2g}" if row.get("max_err") is not None else ""
    return (f"{what} fwd {row['fwd_ms']:9.3f} ms {row['fwd_tflops']:7.3g} TFLOP/s   "
            f"bwd {row['bwd_ms']:9.3f} ms {row['bwd_tflops']:7.3g} TFLOP/s{err}   ({seconds:.0f} s)")


def main():
    args = parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_dir:
        saved = json.loads((Path(args.from_dir) / "compare.json").read_text())
        meta, rows = saved["meta"], saved["rows"]
        if args.commit:
            meta["commit"] = args.commit
    else:
        t0 = time.time()
        meta, rows = run(args, out_dir)
        meta["seconds"] = round(time.time() - t0, 1)
        save(out_dir, meta, rows)
    png_name = f"compare-{meta['date']}-{meta['commit'].replace('+', '-')}.png"
    try:
        report.chart(meta, rows, out_dir / png_name)
    except ImportError as e:  # the table and the numbers matter more than the picture
        print(f"compare.py: no chart ({e}); render it later with --from {out_dir}")
    section = report.markdown(meta, rows, png_name)
    (out_dir / "compare.md").write_text(section)
    if args.update_results:
        png = report.append_results(section, out_dir / png_name, HERE)
        print(f"appended to {HERE / 'RESULTS.md'}; chart {png}")
    if not args.from_dir:
        print(f"compare.py: {meta['seconds']} s")
    print(report.table(rows))
    # A peer that cannot run is recorded and tolerated; jagflash failing, or any implementation
    # disagreeing with jagflash, fails the run.
    failed = [r for r in rows if (r["impl"] == "jagflash" and r.get("error")) or r.get("mismatch")]
    for r in failed:
        print(f"FAILED: {r['impl']} on {r['dist']}/{r['mask']}/D{r['head_dim']}: "
              f"{r.get('error') or 'differs from jagflash by %.3g' % r['max_err']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

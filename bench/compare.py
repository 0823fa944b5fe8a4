#!/usr/bin/env python3
"""jagflash side by side with FlashAttention-3 (FA3 varlen, when flash_attn_interface imports)
and PyTorch's own kernels (FA2 varlen through aten, varlen_attn, FlexAttention with a document
mask; cuDNN's ragged forward through nested-tensor SDPA when asked for) on the five
distributions of shared/bench/distributions.md, causal and not, D = 128 and 64; forward and
backward, and a training step (forward + backward of jagged_attention, gemskew, D = 128)
against FA3 and FA2; one process, the same inputs for all.

Writes compare.json (every number), compare.md (a section for the dated log, bench/log/RESULTS-history.md: the tables and
the bars of issues 4, 13 and 14) and a PNG chart into --out (default $OUT, else bench/out), and
prints the backward's short table (TFLOP/s, jagflash / FA2 and / FA3, the bars) last.

    python bench/compare.py                              # on the GPU machine: everything
    python bench/compare.py --bwd-only                   # the backward bars only (jagflash, FA2, FA3)
    python bench/compare.py --bwd-only --dists short gemskew --head-dims 128 --masks causal
    python bench/compare.py --from DIR --update-results  # here: append DIR's section to log/RESULTS-history.md
    python bench/compare.py --device cpu --scale 32 --max-batch 8   # a smoke run without a GPU
    python bench/compare.py --parts fwd --impls jagflash FA3_varlen FA2_varlen cuDNN_ragged  # forward vs cuDNN

FA3 is a benchmark peer only: put its prebuilt copy (shared/peers/fa3, carried as .fa3/) on
PYTHONPATH, as scripts/gpu-python.sh does; without it the run skips FA3 and says so.

Every measurement is the same: each implementation warmed up, then up to --iters rounds in which
each one takes a sample in turn (the order reversed every other round), a sample being several
calls queued back to back between two CUDA events (--fwd-calls for forwards, --bwd-calls for
backwards and training steps); the median sample, per call. A measurement stops once an
implementation's samples add up to --budget-s, so the fp32 oracle (seconds a call on the big
batches) costs a few seconds, not minutes.

cuDNN ragged (peers.CudnnRagged, only when named in --impls) is the exception: forward only, and
timed by the sum of its GPU kernels' times in one call (torch.profiler, the median of --iters
calls after --warmup), because torch rebuilds its cuDNN graph on every call and spends tens of ms
on the host, which events around queued calls would measure instead. Its output is checked against
jagflash's (or, where jagflash failed, another implementation's) before it is timed; a case it
refuses or gets wrong is skipped with a note, not failed.
"""
import argparse
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))  # a source checkout: jagflash from python/

import jagflash  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MISMATCH_TOL = 5e-2  # bf16 inputs, fp32 vs bf16 P: a few 1e-3 is normal; this flags a real bug
# Useful FLOPs per direction, in units of the forward's 4 * H * D * visible pairs: the backward
# does 2.5 times the forward's work (five GEMMs to the forward's two), a training step both.
BWD_FLOPS = 2.5
STEP_FLOPS = 1.0 + BWD_FLOPS
PARTS = ("fwd", "bwd", "step")
# Issue 14's training step: forward + backward of jagged_attention on this (distribution, head dim).
STEP_CASE = ("gemskew", 128)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")), help="output folder")
    p.add_argument("--dists", nargs="+", default=list(jagflash.DISTRIBUTIONS), choices=jagflash.DISTRIBUTIONS)
    p.add_argument("--head-dims", nargs="+", type=int, default=[128, 64])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--impls", nargs="+", default=None, choices=peers.IMPLEMENTATIONS, type=peers.impl_name,
                   help="default: all but %s (with --bwd-only: %s); _ for spaces also: cuDNN_ragged"
                        % (peers.CUDNN, ", ".join(peers.BAR_IMPLEMENTATIONS)))
    parts = p.add_mutually_exclusive_group()
    parts.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                       help="what to time: fwd and bwd per case, step = the training step (%s, D = %d); "
                            "a case without fwd still runs its forward once, untimed, for the backward"
                            % STEP_CASE)
    parts.add_argument("--bwd-only", action="store_true",
                       help="--parts bwd step, and by default only the implementations the backward "
                            "bars compare: a short device call")
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
    # A backward is 2.5 forwards of work, so two queued calls hide the host's per-call work
    # (autograd, launches) about as well as the forward's four.
    p.add_argument("--bwd-calls", type=int, default=2,
                   help="backward calls (and training steps) queued back to back per timed sample")
    p.add_argument("--budget-s", type=float, default=1.0,
                   help="stop sampling an implementation once its samples add up to this long")
    p.add_argument("--order", "--fwd-order", dest="order", default="interleaved",
                   choices=["interleaved", "sequential"],
                   help="samples of the implementations taken in turns (default), or one "
                        "implementation's samples after another's (forward, backward and steps alike)")
    p.add_argument("--no-compile-flex", action="store_true", help="eager FlexAttention (CPU smoke runs)")
    p.add_argument("--commit", default=None, help="commit measured (default: $JAGFLASH_COMMIT, else git)")
    p.add_argument("--from", dest="from_dir", default=None, help="re-render DIR/compare.json; run nothing")
    p.add_argument("--update-results", action="store_true", help="append the section to bench/log/RESULTS-history.md and put the chart in bench/")
    args = p.parse_args(argv)
    if args.bwd_only:
        args.parts = ["bwd", "step"]
    if args.impls is None:
        args.impls = list(peers.BAR_IMPLEMENTATIONS if args.bwd_only else peers.DEFAULT_IMPLEMENTATIONS)
    args.parts = [part for part in PARTS if part in args.parts]  # in a fixed order, once each
    return args


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
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none",
        "triton": triton_version,
        "python": platform.python_version(),
        "jagflash": jagflash.library_version(),
        "dtype": args.dtype,
        "heads": args.heads,
        "dists": list(args.dists),
        "seed": args.seed,
        "scale_note": "" if args.scale == 1 and not args.max_batch else
        f"; lengths / {args.scale}, first {args.max_batch or 'all'} sequences",
        "impls": list(args.impls),
        "parts": list(args.parts),
        "skipped": {},
        "iters": args.iters,
        "warmup": args.warmup,
        "budget_s": args.budget_s,
        "fwd_calls": args.fwd_calls,
        "bwd_calls": args.bwd_calls,
        "order": args.order,
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
    on even rounds and reversed on odd ones. Which of two kernels runs first moves their ratio
    (power and clock carry over from one measurement to the next; figures: bench/NOTES.md, "Figures
    moved out of code comments"); in turns both see the same conditions. A function that raises
    gets {name: exception} and leaves the rotation. A function's warm-up stops early once one
    sample alone would eat the budget (the fp32 oracle takes seconds a call on big batches).
    Rounds stop at `iters`; a function whose samples add up to budget_s takes no more of them
    (at least one), and the others go on in turns, so one slow function (the oracle) neither
    eats the others' samples nor holds the run for minutes."""
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
    spent_ms, last, sampling = dict.fromkeys(live, 0.0), {}, list(live)
    for r in range(iters):
        for name in sampling if r % 2 == 0 else list(reversed(sampling)):
            try:
                ms, last[name] = _sample(live[name], device, calls)
            except Exception as e:  # noqa: BLE001
                results[name] = e
                del live[name]
                continue
            times[name].append(ms)
            spent_ms[name] += ms * calls
        sampling = [name for name in sampling if name in live and spent_ms[name] < budget_s * 1e3]
        if not sampling:
            break
    for name in live:
        results[name] = (statistics.median(times[name]), last[name])
    return results


def time_beside_reference(impls, names, mine, args, device, notes, reference="flex", bwd_note_suffix=""):
    """The variant benchmarks' timing (bench/score_mod.py and bench/block_mask.py beside "flex",
    bench/v_head_dim.py beside "fa2"): `impls` (name: implementation with forward(), backward(out)
    and unpad(out, grads)) timed forward, then backward on each one's own forward output, in turns
    (measure_interleaved with args.warmup, iters, budget_s, fwd_calls, bwd_calls). Before the
    ratios mean anything, `mine`'s forward output is compared with the implementation named
    `reference` where both ran: error_vs_<reference>, the largest |difference| over the largest
    |reference's|, the reference's output unpadded to [T, H, D] (FlexAttention's padded batch) and
    cut to mine's last dim (v_head_dim.py's reference takes v zero-padded to D, so its first Dv
    columns are the same attention). Returns a row of error_vs_<reference>, then {name}_fwd_ms and
    {name}_bwd_ms for every name in `names` (None where it did not run); failures are written to
    notes[name], a backward's to notes[name + bwd_note_suffix]."""
    fwd = measure_interleaved({n: i.forward for n, i in impls.items()}, device, args.warmup, args.iters,
                              args.budget_s, args.fwd_calls)
    row, error = {}, None
    if reference in impls and not isinstance(fwd.get(reference), Exception) and not isinstance(fwd[mine], Exception):
        ours = fwd[mine][1].detach().float()
        theirs, _ = impls[reference].unpad(fwd[reference][1].detach(), ())
        theirs = theirs.float()[..., :ours.shape[-1]]
        error = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()
    row[f"error_vs_{reference}"] = error
    live = {n: r for n, r in fwd.items() if not isinstance(r, Exception)}
    for n, r in fwd.items():
        if isinstance(r, Exception):
            notes[n] = f"{type(r).__name__}: {r}"
    bwd = measure_interleaved({n: functools.partial(impls[n].backward, live[n][1]) for n in live}, device,
                              args.warmup, args.iters, args.budget_s, args.bwd_calls)
    for n in names:
        row[f"{n}_fwd_ms"] = live[n][0] if n in live else None
        b = bwd.get(n)
        row[f"{n}_bwd_ms"] = b[0] if b is not None and not isinstance(b, Exception) else None
        if isinstance(b, Exception):
            notes[n + bwd_note_suffix] = f"{type(b).__name__}: {b}"
    return row


def fmt(v, spec="{:.2f}"):
    """A table cell: v formatted, "-" where it is None."""
    return "-" if v is None else spec.format(v)


def beside_table(rows, case, names, labels, ratios, reference, reference_label):
    """The markdown table of the variant benchmarks' rows (time_beside_reference's and their
    ratios), one shape for bench/score_mod.py, block_mask.py and v_head_dim.py: the `case` columns
    first, then forward and backward ms of the three `names` ("fwd ms " + labels, their times
    joined by " / "), then the `ratios` columns, then error_vs_<reference> ("err vs " +
    reference_label). A column is (header, how): how is a row key (a case cell: str(value); a
    ratio cell: fmt(value)) or a function of the row giving its cell."""
    def cell(r, how, default):
        return how(r) if callable(how) else default(r[how])

    header = ([h for h, _ in case] + [f"fwd ms {labels}", f"bwd ms {labels}"] + [h for h, _ in ratios]
              + [f"err vs {reference_label}"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = ([cell(r, how, str) for _, how in case]
                 + [" / ".join(fmt(r[f"{n}_{part}_ms"], "{:.3f}") for n in names) for part in ("fwd", "bwd")]
                 + [cell(r, how, fmt) for _, how in ratios] + [fmt(r[f"error_vs_{reference}"], "{:.1e}")])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profiled_events(fn, device):
    """torch.profiler's events of one call of fn, its kernels finished inside the profile (the
    queue drained first, so that no earlier call's kernel is counted)."""
    from torch.profiler import ProfilerActivity, profile

    _synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _synchronize(device)
    return prof.events()


# Device-side events that are not kernels, by the names Kineto gives them: copies and fills. (The
# GPU spans of record_function ranges are the other kind; they are marked as user annotations.)
_NOT_KERNELS = ("Memcpy", "Memset")


def kernel_time_ms(events):
    """(ms, names) from one profiled call's events: the sum of its CUDA kernels' durations, and
    the kernels' names, longest first. The sum, not the span from first to last: a call that
    rebuilds a cuDNN graph between its kernels would otherwise count that host time. Raises when
    the profile holds no kernel (CUPTI unavailable, or the call launched nothing)."""
    from torch.autograd import DeviceType

    per_name = {}
    for e in events:
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if e.name.startswith(_NOT_KERNELS):
            continue
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    if not per_name:
        raise RuntimeError("the profiler recorded no CUDA kernel for the call (is CUPTI available?)")
    names = sorted(per_name, key=per_name.get, reverse=True)
    return sum(per_name.values()) / 1e3, names


def measure_kernels(fn, device, warmup, iters):
    """(median kernel ms per call, median wall ms per call, kernel names of the last profiled
    call) of fn(): `warmup` (at least one) calls timed on the wall clock, each synchronised (what a
    call costs the host and GPU together), then `iters` (at least one) calls each in a profiler
    session of its own, timed by kernel_time_ms(). A session that recorded no kernel is left out
    (the first one in a process starts CUPTI); when none recorded any, kernel_time_ms()'s error."""
    wall = []
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        wall.append((time.perf_counter() - t0) * 1e3)
    kernel, names, empty = [], [], None
    for _ in range(max(1, iters)):
        try:
            ms, names = kernel_time_ms(_profiled_events(fn, device))
        except RuntimeError as e:
            empty = e
            continue
        kernel.append(ms)
    if not kernel:
        raise empty
    return statistics.median(kernel), statistics.median(wall), names


def max_abs_error(actual, expected):
    return (actual.float() - expected.float()).abs().max().item()


def refusal(caught):
    """What torch warned when it found no SDPA backend (its debug pass over each backend's checks),
    cuDNN's reasons first, one line each, once each."""
    lines = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    lines.sort(key=lambda line: "cudnn" not in line.lower())
    return "; ".join(dict.fromkeys(lines))


def check_then_profile(impl, reference, device, args):
    """The time_case entry of a profiler-timed implementation (cuDNN ragged): its forward once,
    compared with reference = (name, out) and only then timed by measure_kernels(). peers.Skip,
    with why, when there is nothing to compare with, when torch finds no backend for the case
    (the reasons it warned), when the output is not finite or differs by more than
    MISMATCH_TOL (normalised), or when the profiler records no kernel; the exception itself for
    any other failure. Without "fwd" in --parts there is nothing of it to time: Skip."""
    if "fwd" not in args.parts:
        return peers.Skip("forward only, and this run times no forward")
    if reference is None:
        return peers.Skip("no other implementation's output to check it against; not timed")
    ref_name, ref_out = reference
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = impl.forward()
            _synchronize(device)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run must not stop the others
            if "No viable backend" not in str(e):
                return e
            return peers.Skip(f"torch found no backend for the case ({refusal(caught) or _error_text(e)})"[:300])
    abs_err, err = max_abs_error(out, ref_out), normalised_error(out, ref_out)
    if not (math.isfinite(abs_err) and err <= MISMATCH_TOL):
        return peers.Skip(f"output differs from {ref_name}'s: max abs error {abs_err:.3g}, normalised {err:.3g} "
                          f"(tolerance {MISMATCH_TOL}); not timed")
    try:
        kernel_ms, wall_ms, kernels = measure_kernels(impl.forward, device, args.warmup, args.iters)
    except Exception as e:  # noqa: BLE001
        return peers.Skip(f"checked (max abs error {abs_err:.3g}) but not timed: {_error_text(e)}")
    return {"impl": impl, "out": out, "fwd_ms": kernel_ms, "grads": (), "bwd_ms": None, "timer": "profiler",
            "wall_ms": wall_ms, "kernels": kernels[:3], "kernel_count": len(kernels), "checked_against": ref_name,
            "max_abs_err": abs_err}


# What a profiler-timed entry of time_case adds to its row (kernels: the three longest's names).
PROFILED_FIELDS = ("timer", "wall_ms", "kernels", "kernel_count", "checked_against")


def reference_output(impl_names, timed):
    """(name, [T, H, D] out) of the first implementation with an output in this case, jagflash
    first: what a profiler-timed implementation is checked against (None: none has one)."""
    for name in sorted(impl_names, key=lambda n: n != "jagflash"):
        t = timed.get(name)
        if isinstance(t, dict) and t.get("out") is not None:
            out, _ = t["impl"].unpad(t["out"], ())
            return name, out.detach()
    return None


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


def measure_all(fns, device, args, calls):
    """measure_interleaved() of all fns together, or (--order sequential) of one after another."""
    groups = [fns] if args.order == "interleaved" else [{name: fn} for name, fn in fns.items()]
    timed = {}
    for group in groups:
        timed.update(measure_interleaved(group, device, args.warmup, args.iters, args.budget_s, calls))
    return timed


def make_all(impl_names, inputs, args):
    """({name: implementation}, {name: exception}) for the implementations that could be built
    and those that could not."""
    impls, failed = {}, {}
    for name in impl_names:
        try:
            impls[name] = peers.make(name, inputs, compile_flex=not args.no_compile_flex)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the others
            failed[name] = e
    return impls, failed


def time_case(impl_names, inputs, device, args):
    """{name: {impl, out, fwd_ms, grads, bwd_ms} or exception} for one case: every implementation
    built; its forward timed (without "fwd" in --parts: called once, untimed, fwd_ms None); then
    its backward through that forward's output timed the same way (without "bwd": grads () and
    bwd_ms None). Each direction's samples of all implementations are taken in turns (--order)."""
    impls, timed = make_all(impl_names, inputs, args)
    profiled = {n: i for n, i in impls.items() if getattr(i, "timer", None) == "profiler"}
    impls = {n: i for n, i in impls.items() if n not in profiled}
    if "fwd" in args.parts:
        forwards = measure_all({n: i.forward for n, i in impls.items()}, device, args, args.fwd_calls)
    else:
        forwards = {}
        for name, impl in impls.items():
            try:
                forwards[name] = (None, impl.forward())
            except Exception as e:  # noqa: BLE001
                forwards[name] = e
    live = {}
    for name, impl in impls.items():
        if isinstance(forwards[name], Exception):
            timed[name] = forwards[name]
        else:
            fwd_ms, out = forwards[name]
            live[name] = {"impl": impl, "out": out, "fwd_ms": fwd_ms, "grads": (), "bwd_ms": None}
    # The profiler-timed (forward-only) implementations: checked against the others' forwards,
    # then timed, before any backward runs.
    reference = reference_output(impl_names, live) if profiled else None
    for name, impl in profiled.items():
        timed[name] = check_then_profile(impl, reference, device, args)
    del reference
    if "bwd" in args.parts:
        backwards = measure_all({n: functools.partial(t["impl"].backward, t["out"]) for n, t in live.items()},
                                device, args, args.bwd_calls)
        for name, result in backwards.items():
            if isinstance(result, Exception):
                timed[name] = result
                del live[name]
            else:
                live[name]["bwd_ms"], live[name]["grads"] = result
    timed.update(live)
    return {name: timed[name] for name in impl_names}


def case_row(impl_name, timed, flops, reference):
    """One implementation's row on one case (time_case's entry for it), and its (out, *grads)
    for comparison with the reference (jagflash's). A skipped case (peers.Skip) has "skipped",
    why, in place of figures; a profiler-timed one says so ("timer") and carries its wall time a
    call and the kernels it summed."""
    row = {"impl": impl_name}
    if isinstance(timed, peers.Skip):
        row["skipped"] = str(timed)
        return row, None
    try:
        if isinstance(timed, Exception):
            raise timed
        out, grads = timed["impl"].unpad(timed["out"], timed["grads"])
        for direction, factor in (("fwd", 1.0), ("bwd", BWD_FLOPS)):
            ms = timed[f"{direction}_ms"]
            if ms is not None:
                row[f"{direction}_ms"] = ms
                row[f"{direction}_tflops"] = factor * flops / ms / 1e9
        row.update({key: timed[key] for key in PROFILED_FIELDS if key in timed})
        result = (out.detach(), *grads)
        if reference is not None:
            pairs = list(zip(result, reference))
            row["max_err"] = max(normalised_error(a, b) for a, b in pairs)
            row["max_abs_err"] = max(max_abs_error(a, b) for a, b in pairs)
            row["mismatch"] = row["max_err"] > MISMATCH_TOL
        elif "max_abs_err" in timed:  # checked against another peer, jagflash having failed
            row["max_abs_err"] = timed["max_abs_err"]
        return row, result
    except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the others
        row["error"] = _error_text(e)
        return row, None


def time_steps(impl_names, inputs, device, args):
    """{name: step ms or exception}: a training step (forward, then backward through it) of each
    implementation, timed like a backward (--bwd-calls queued steps per sample, in turns)."""
    impls, timed = make_all(impl_names, inputs, args)
    for name, result in measure_all({n: i.step for n, i in impls.items()}, device, args, args.bwd_calls).items():
        timed[name] = result if isinstance(result, Exception) else result[0]
    return {name: timed[name] for name in impl_names}


def step_row(impl_name, timed, flops):
    row = {"impl": impl_name}
    if isinstance(timed, Exception):
        row["error"] = _error_text(timed)
    else:
        row.update(step_ms=timed, step_tflops=STEP_FLOPS * flops / timed / 1e9)
    return row


def save(out_dir, meta, rows, steps):
    """Rewritten after every measurement, so a run cut short still leaves what it measured."""
    (out_dir / "compare.json").write_text(json.dumps({"meta": meta, "rows": rows, "steps": steps}, indent=1))


def skip_unavailable(args, meta):
    """Drops from the run FA3 when flash_attn_interface does not import, and cuDNN ragged when
    this process or device cannot run it (peers.cudnn_ragged_unavailable), noting why in meta.
    With cuDNN in the run, first sets the variable that lets torch give it nested inputs: this
    runs before any measurement, hence before the process's first SDPA call."""
    reasons = {}
    if "FA3 varlen" in args.impls:
        reason = peers.fa3_import_error()
        if reason is not None:
            reasons["FA3 varlen"] = (f"flash_attn_interface does not import ({reason}); put FA3's prebuilt "
                                     "copy on PYTHONPATH (scripts/gpu-python.sh does, from .fa3/)")
    if peers.CUDNN in args.impls:
        peers.enable_cudnn_nested()
        reason = peers.cudnn_ragged_unavailable(torch.device(args.device))
        if reason is not None:
            reasons[peers.CUDNN] = reason
    if not reasons:
        return
    args.impls = [name for name in args.impls if name not in reasons]
    meta["impls"] = list(args.impls)
    for name, reason in reasons.items():
        meta["skipped"][name] = reason
        print(f"compare.py: {name} skipped: {reason}", flush=True)


def run(args, out_dir):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    meta = environment(args, device)
    skip_unavailable(args, meta)
    all_lengths = {name: batch_lengths(name, args) for name in args.dists}
    # FlexAttention's common padded length: the longest batch, rounded up to its block.
    flex_length = -(-max(sum(v) for v in all_lengths.values()) // 128) * 128
    case_parts = "fwd" in args.parts or "bwd" in args.parts
    step_impls = [name for name in args.impls if name in peers.BAR_IMPLEMENTATIONS]
    rows, steps = [], []
    # Drawn on the device: a CPU draw of the big batches (hundreds of millions of values) would
    # take longer than the measurements.
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for dist, lengths in all_lengths.items():
        total = sum(lengths)
        offsets = peers.offsets_of(lengths, device)
        for head_dim in args.head_dims:
            with_step = "step" in args.parts and (dist, head_dim) == STEP_CASE and bool(step_impls)
            if not case_parts and not with_step:
                continue

            def rnd():
                return torch.randn((total, args.heads, head_dim), generator=generator, device=device).to(dtype)

            q, k, v, dout = rnd(), rnd(), rnd(), rnd()

            # A forward-only run takes inputs without grad, so a call whose backward no path serves
            # (jagflash past head dim 128 on CUDA) still times its forward.
            needs_grad = "bwd" in args.parts or with_step

            def inputs_for(causal):
                return peers.Inputs(*(t.clone().requires_grad_(needs_grad) for t in (q, k, v)), dout, offsets,
                                    lengths, causal, flex_length)

            for mask in args.masks:
                causal = mask == "causal"
                pairs = sum(jagflash.visible_pairs(n, n, causal=causal) for n in lengths)
                flops = 4.0 * args.heads * head_dim * pairs
                where = {"dist": dist, "mask": mask, "head_dim": head_dim, "batch": len(lengths), "total": total}
                if case_parts:
                    t0 = time.time()
                    timed = time_case(args.impls, inputs_for(causal), device, args)
                    reference = None
                    for impl_name in args.impls:
                        row, result = case_row(impl_name, timed[impl_name], flops, reference)
                        if impl_name == "jagflash" and result is not None:
                            reference = result
                        rows.append({**row, **where})
                        save(out_dir, meta, rows, steps)
                        print(_progress(rows[-1], time.time() - t0), flush=True)
                        t0 = time.time()
                    del timed, reference
                if with_step:
                    t0 = time.time()
                    timed = time_steps(step_impls, inputs_for(causal), device, args)
                    for impl_name in step_impls:
                        steps.append({**step_row(impl_name, timed[impl_name], flops), **where})
                        save(out_dir, meta, rows, steps)
                        print(_progress(steps[-1], time.time() - t0), flush=True)
                        t0 = time.time()
                    del timed
            del q, k, v, dout
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return meta, rows, steps


def progress_note(row):
    """What a progress line adds for a row's max abs error and, profiler-timed, its kernels."""
    note = f" (abs {row['max_abs_err']:.2g})" if row.get("max_abs_err") is not None else ""
    if row.get("timer") == "profiler":
        count = row.get("kernel_count", len(row["kernels"]))
        note += (f"  [kernel time, {count} kernel(s), longest {row['kernels'][0][:48]}; "
                 f"{row['wall_ms']:.1f} ms a call on the wall clock]")
    return note


def _progress(row, seconds):
    what = f"{row['dist']:>9} {row['mask']:>6} D{row['head_dim']:<3} {row['impl']:<13}"
    if row.get("error"):
        return f"{what} ERROR {row['error']}"
    if row.get("skipped"):
        return f"{what} SKIPPED {row['skipped']}"
    parts = [f"{name} {row[f'{key}_ms']:9.3f} ms {row[f'{key}_tflops']:7.3g} TFLOP/s"
             for key, name in (("fwd", "fwd"), ("bwd", "bwd"), ("step", "training step"))
             if row.get(f"{key}_ms") is not None]
    err = f"  err {row['max_err']:.2g}" if row.get("max_err") is not None else ""
    err += progress_note(row)
    return f"{what} {'   '.join(parts)}{err}   ({seconds:.0f} s)"


def main():
    args = parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_dir:
        saved = json.loads((Path(args.from_dir) / "compare.json").read_text())
        meta, rows, steps = saved["meta"], saved["rows"], saved.get("steps", [])
        if args.commit:
            meta["commit"] = args.commit
    else:
        t0 = time.time()
        meta, rows, steps = run(args, out_dir)
        meta["seconds"] = round(time.time() - t0, 1)
        save(out_dir, meta, rows, steps)
    png_name = f"compare-{meta['date']}-{meta['commit'].replace('+', '-')}.png"
    try:
        if rows:
            report.chart(meta, rows, out_dir / png_name)
    except ImportError as e:  # the table and the numbers matter more than the picture
        print(f"compare.py: no chart ({e}); render it later with --from {out_dir}")
    section = report.markdown(meta, rows, png_name, steps)
    (out_dir / "compare.md").write_text(section)
    if args.update_results:
        chart_file = out_dir / png_name
        history, png = report.append_results(section, chart_file if chart_file.exists() else None, HERE)
        print(f"appended to {history}; chart {png}; bring bench/RESULTS.md's section up to date by hand")
    if not args.from_dir:
        print(f"compare.py: {meta['seconds']} s")
    if rows:
        print(report.table(rows))
    for impl, reason in meta.get("skipped", {}).items():
        print(f"compare.py: {impl} skipped: {reason}")
    print("compare.py: backward and training step, TFLOP/s; jagflash / FA2 varlen and / FA3 varlen; "
          "the bars of issues 13 and 14")
    print(report.short_table(rows, steps))
    # A peer that cannot run is recorded and tolerated; jagflash failing, or any implementation
    # disagreeing with jagflash, fails the run.
    failed = [(r, "") for r in rows if (r["impl"] == "jagflash" and r.get("error")) or r.get("mismatch")]
    failed += [(r, ", training step") for r in steps if r["impl"] == "jagflash" and r.get("error")]
    for r, what in failed:
        print(f"FAILED: {r['impl']} on {r['dist']}/{r['mask']}/D{r['head_dim']}{what}: "
              f"{r.get('error') or 'differs from jagflash by %.3g' % r['max_err']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Per-call cost of attention on small jagged batches (issue 18 §5): host time and GPU time apart.

On the GPU (default): bf16, H = 16, D = 128, causal; batches of B = 1, 8, 64, 256 sequences with
lengths drawn uniformly from [1, L], L = 128, 256, 512 (a fixed seed per batch); the forward alone
and forward + backward (torch.autograd.grad, or aten's backward for FA2). Implementations, in one
process on the same inputs:
  jagflash eager     jagflash.jagged_attention (check_offsets="device": no sync, as the peers,
                     which check nothing; max_seqlen_q = the batch's longest length, which FA2 and
                     FA3 get too);
  jagflash compile   the same under torch.compile(fullgraph=True, dynamic=True): one graph for all
                     batches (Inductor);
  jagflash graph     the eager call captured in a CUDA graph, replayed (one graph per batch);
  FA2 varlen         aten._flash_attention_forward / _backward (the kernels behind SDPA's varlen),
                     called directly: no autograd in its forward + backward (the issue's 25 us);
  varlen_attn        torch.nn.attention.varlen.varlen_attn: the same FA2 kernels through a custom
                     op with autograd, as jagflash's and FA3's forward + backward go;
  FA3 varlen         flash_attn_interface.flash_attn_varlen_func, when it imports (.fa3/ on
                     PYTHONPATH: ../shared/peers/fa3/README.md).
Three numbers per call, each the median of --iters samples:
  latency  CUDA events around one call made on an idle GPU: the host time until the last launch
           plus the GPU time after it (what a caller waiting for the result sees);
  host     wall clock of the Python call alone (time.perf_counter), with a sleep kernel queued
           ahead so that no call waits for the GPU;
  gpu      CUDA events around one call queued behind that sleep kernel: the GPU's time for the
           call's kernels back to back, host time hidden.
A markdown table is printed (per batch: latency, host / gpu, in microseconds) with the issue's
bars checked last; --out DIR (or $OUT) also gets op_overhead.json with every number.

--cpu: the host time of jagflash's eager calls on tiny CPU tensors (B = 1, 4 tokens, H = 1,
D = 64: the C++ reference's math is then negligible), per layer of the call (the binding's op,
_launch.forward, jagged_attention without and with grad, forward + backward) next to the C
library's own call (ctypes, the same problem): what the binding and the Python layers add.

    python bench/op_overhead.py [--batches 1 8 64 256] [--lengths 128 256 512] [--impls ...]
    python bench/op_overhead.py --cpu
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

IMPLS = ("jagflash eager", "jagflash compile", "jagflash graph", "FA2 varlen", "varlen_attn", "FA3 varlen")
DIRECTIONS = ("fwd", "fwd+bwd")
# Issue 18's bars: host time per eager forward call, and latency against FA2 at these batch sizes.
HOST_BAR_US = 15.0
LATENCY_BAR_BATCHES = (8, 64)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512], help="L: lengths drawn from [1, L]")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--directions", nargs="+", default=list(DIRECTIONS), choices=DIRECTIONS)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", action="store_true", help="no mask (default: causal)")
    p.add_argument("--iters", type=int, default=50, help="samples per number (median)")
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for op_overhead.json (default: $OUT)")
    p.add_argument("--cpu", action="store_true", help="jagflash's host time per layer on tiny CPU tensors")
    return p.parse_args(argv)


def _import_jagflash():
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "python"))
    sys.path.insert(0, str(root / "bench"))
    import jagflash  # noqa: F401

    return jagflash


# ---------------------------------------------------------------------------------------------
# GPU: latency, host and GPU time per call


def batch(torch, b, max_len, args, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (b,), generator=g).tolist()
    total = sum(lengths)
    offsets = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    shape = (total, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=g).to(device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return lengths, offsets, q, k, v, dout


class Case:
    """One batch's inputs and the callables of every implementation for one direction."""

    def __init__(self, torch, jagflash, lengths, offsets, q, k, v, dout, causal):
        self.torch, self.jagflash = torch, jagflash
        self.lengths, self.offsets, self.causal = lengths, offsets, causal
        self.max_len = max(lengths)
        # The forward alone runs on tensors that require no grad (what inference passes: no
        # autograd node, and no torch.no_grad() context timed with the call); forward + backward
        # on leaves that do.
        self.qd, self.kd, self.vd = q, k, v
        self.q, self.k, self.v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        self.dout = dout

    def jagflash_fwd(self, q, k, v, offsets):
        return self.jagflash.jagged_attention(q, k, v, offsets, causal=self.causal, check_offsets="device",
                                              max_seqlen_q=self.max_len)


def make_callable(impl, direction, case, compiled_cache):
    """A no-argument callable doing one call (its outputs kept alive until the next), or raises."""
    torch = case.torch
    leaves = (case.q, case.k, case.v)

    if impl == "jagflash eager":
        if direction == "fwd":
            return lambda: case.jagflash_fwd(case.qd, case.kd, case.vd, case.offsets)

        def fn():
            out = case.jagflash_fwd(case.q, case.k, case.v, case.offsets)
            return torch.autograd.grad(out, leaves, case.dout)
        return fn

    if impl == "jagflash compile":
        # One compiled function per (direction, mask, L): dynamic shapes serve every batch size;
        # L, a Python int closed over, is a constant of the graph (the hint, as eager passes it).
        key = (direction, case.causal, case.max_len)
        if key not in compiled_cache:
            causal, max_len, attention = case.causal, case.max_len, case.jagflash.jagged_attention
            compiled_cache[key] = torch.compile(
                lambda q, k, v, offsets: attention(q, k, v, offsets, causal=causal, check_offsets="device",
                                                   max_seqlen_q=max_len),
                fullgraph=True, dynamic=True)
        compiled = compiled_cache[key]
        if direction == "fwd":
            return lambda: compiled(case.qd, case.kd, case.vd, case.offsets)

        def fn():
            out = compiled(case.q, case.k, case.v, case.offsets)
            return torch.autograd.grad(out, leaves, case.dout)
        return fn

    if impl == "jagflash graph":
        if direction == "fwd":
            def body():
                return case.jagflash_fwd(case.qd, case.kd, case.vd, case.offsets)
        else:
            def body():
                out = case.jagflash_fwd(case.q, case.k, case.v, case.offsets)
                return torch.autograd.grad(out, leaves, case.dout)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            case.graph_outputs = body()
        return graph.replay

    if impl == "FA2 varlen":
        aten = torch.ops.aten
        q, k, v = (t.detach() for t in leaves)
        off, n = case.offsets, case.max_len

        def forward():
            return aten._flash_attention_forward(q, k, v, off, off, n, n, 0.0, case.causal, False)

        if direction == "fwd":
            return forward

        def fn():
            out, lse, rng_state, unused, _ = forward()
            return aten._flash_attention_backward(case.dout, q, k, v, out, lse, off, off, n, n, 0.0, case.causal,
                                                  rng_state, unused)
        return fn

    if impl == "varlen_attn":
        from torch.nn.attention.varlen import varlen_attn

        off, n, window = case.offsets, case.max_len, (-1, 0) if case.causal else (-1, -1)
        if direction == "fwd":
            return lambda: varlen_attn(case.qd, case.kd, case.vd, off, off, n, n, window_size=window)

        def fn():
            out = varlen_attn(case.q, case.k, case.v, off, off, n, n, window_size=window)
            return torch.autograd.grad(out, leaves, case.dout)
        return fn

    if impl == "FA3 varlen":
        import flash_attn_interface

        f = flash_attn_interface.flash_attn_varlen_func
        off, n = case.offsets, case.max_len

        def forward(q, k, v):
            out = f(q, k, v, off, off, n, n, causal=case.causal)
            return out[0] if isinstance(out, tuple) else out

        if direction == "fwd":
            return lambda: forward(case.qd, case.kd, case.vd)

        def fn():
            return torch.autograd.grad(forward(*leaves), leaves, case.dout)
        return fn

    raise ValueError(impl)


def measure(torch, fn, iters):
    """(latency, host, gpu) medians in microseconds."""
    stream = torch.cuda.current_stream()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    latency, host, gpu = [], [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        latency.append(start.elapsed_time(end) * 1e3)
    # A sleep long enough that the GPU is still busy when the last of the calls below is queued.
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        start.record(stream)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record(stream)
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return statistics.median(latency), statistics.median(host), statistics.median(gpu)


def gpu_main(args):
    import torch

    jagflash = _import_jagflash()
    if not torch.cuda.is_available():
        raise SystemExit("op_overhead.py: no CUDA device (--cpu measures jagflash's host time on the CPU)")
    import peers

    impls = list(args.impls)
    skipped = {}
    if "FA3 varlen" in impls and peers.fa3_import_error():
        skipped["FA3 varlen"] = peers.fa3_import_error()
        impls.remove("FA3 varlen")
    rows = []
    compiled_cache = {}
    for b in args.batches:
        for max_len in args.lengths:
            lengths, offsets, q, k, v, dout = batch(torch, b, max_len, args, args.seed + 1000 * b + max_len)
            case = Case(torch, jagflash, lengths, offsets, q, k, v, dout, causal=not args.no_causal)
            for direction in args.directions:
                for impl in impls:
                    row = {"B": b, "L": max_len, "tokens": sum(lengths), "direction": direction, "impl": impl}
                    try:
                        fn = make_callable(impl, direction, case, compiled_cache)
                        row["latency_us"], row["host_us"], row["gpu_us"] = measure(torch, fn, args.iters)
                    except Exception as e:  # noqa: BLE001 - recorded in the table, the run goes on
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            case.graph_outputs = None
            del case, q, k, v, dout
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": args.heads,
            "head_dim": args.head_dim, "causal": not args.no_causal, "iters": args.iters, "skipped": skipped,
            "library": jagflash.library_path()}
    print(table(rows, impls, args))
    print(bars(rows))
    for name, why in skipped.items():
        print(f"op_overhead.py: {name} skipped: {why}")
    save(args.out, meta, rows)


def table(rows, impls, args):
    lines = []
    for direction in args.directions:
        lines.append(f"\n{direction}: latency us (host / gpu us) per call")
        lines.append("| B | L | tokens | " + " | ".join(impls) + " |")
        lines.append("|---|---|---|" + "---|" * len(impls))
        keys = sorted({(r["B"], r["L"]) for r in rows if r["direction"] == direction})
        for b, max_len in keys:
            cells = []
            tokens = ""
            for impl in impls:
                found = [r for r in rows if (r["B"], r["L"], r["direction"], r["impl"]) == (b, max_len, direction, impl)]
                if not found:
                    cells.append("")
                    continue
                r = found[0]
                tokens = r["tokens"]
                cells.append(f"{r['latency_us']:.0f} ({r['host_us']:.0f} / {r['gpu_us']:.0f})" if "error" not in r
                             else "error")
            lines.append(f"| {b} | {max_len} | {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bars(rows):
    """Issue 18's bars, checked on this run's numbers."""
    def get(impl, direction, b=None):
        return [r for r in rows if r["impl"] == impl and r["direction"] == direction and "error" not in r
                and (b is None or r["B"] == b)]

    lines = ["\nbars (issue 18):"]
    eager = get("jagflash eager", "fwd")
    if eager:
        worst = max(r["host_us"] for r in eager)
        lines.append(f"  host time per eager forward call <= {HOST_BAR_US:.0f} us: worst {worst:.1f} us "
                     f"({'met' if worst <= HOST_BAR_US else 'NOT met'})")
    for direction in DIRECTIONS:
        for b in LATENCY_BAR_BATCHES:
            ours, fa2 = get("jagflash eager", direction, b), get("FA2 varlen", direction, b)
            for r in ours:
                peer = [p for p in fa2 if p["L"] == r["L"]]
                if peer:
                    ok = r["latency_us"] <= peer[0]["latency_us"]
                    lines.append(f"  {direction} B={b} L={r['L']}: jagflash {r['latency_us']:.0f} us vs FA2 "
                                 f"{peer[0]['latency_us']:.0f} us ({'met' if ok else 'NOT met'})")
    return "\n".join(lines)


def save(out, meta, rows):
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / "op_overhead.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"op_overhead.py: wrote {path}")


# ---------------------------------------------------------------------------------------------
# CPU: jagflash's host time per layer


def per_call_us(fns, calls=100, rounds=300):
    """Per call, for each of fns: the smallest mean over `rounds` blocks of `calls` back-to-back
    calls, the functions' blocks taken in turn (round robin), in wall-clock time. On a shared
    machine short blocks taken in turn give every function the same quiet moments; the smallest
    block is the least disturbed one."""
    for fn in fns:
        for _ in range(200):
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls * 1e6)
    return best


def cpu_main(args):
    import ctypes

    import torch

    jagflash = _import_jagflash()
    from jagflash import _capi, _launch, _lib

    tokens, heads, head_dim = 4, 1, 64
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (torch.randn(tokens, heads, head_dim, generator=g) for _ in range(4))
    offsets = torch.tensor([0, tokens], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    # The C library's own call on the same problem (ctypes; the reference's work at this size).
    out, lse = torch.empty_like(q), torch.empty(heads, tokens)
    c_args = _capi.FwdArgs(problem=_launch._problem(q, k, v, offsets, offsets, _capi.MASK_CAUSAL, -1, -1, 0.0),
                           out=_launch._describe(out), lse=lse.data_ptr())
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lib = _lib.lib()
    lib.jagflash_fwd(ctypes.byref(c_args))
    c_bwd = _capi.BwdArgs(problem=c_args.problem, out=_launch._describe(out), dout=_launch._describe(dout),
                          lse=lse.data_ptr(), dq=_launch._describe(dq), dk=_launch._describe(dk),
                          dv=_launch._describe(dv))
    rows = [("C jagflash_fwd (ctypes, the reference's own time)", lambda: lib.jagflash_fwd(ctypes.byref(c_args))),
            ("C jagflash_bwd (ctypes, the reference's own time)", lambda: lib.jagflash_bwd(ctypes.byref(c_bwd)))]
    if hasattr(_lib, "binding"):
        _lib.binding()
        op = torch.ops.jagflash_c.fwd.default
        rows.append(("torch.ops.jagflash_c.fwd (the binding)",
                     lambda: op(q, k, v, offsets, offsets, _capi.MASK_CAUSAL, -1, -1, 0.0, _capi.CHECK_OFFSETS_HOST, 0)))
    problem = _launch.Problem(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, mask=_capi.MASK_CAUSAL,
                              window_left=-1, window_right=-1, scale=0.0, check_offsets="host")
    rows.append(("_launch.forward", lambda: _launch.forward(problem)))

    def fwd_no_grad():
        jagflash.jagged_attention(q, k, v, offsets, causal=True)

    def fwd_grad():
        jagflash.jagged_attention(*leaves, offsets, causal=True)

    def fwd_bwd():
        out = jagflash.jagged_attention(*leaves, offsets, causal=True)
        torch.autograd.grad(out, leaves, dout)

    rows += [("jagged_attention, inputs need no grad", fwd_no_grad), ("jagged_attention, q/k/v require grad", fwd_grad),
             ("jagged_attention + autograd.grad", fwd_bwd),
             ("torch.ops.jagflash.fwd (the custom op)",
              lambda: torch.ops.jagflash.fwd(q, k, v, offsets, offsets, _capi.MASK_CAUSAL, -1, -1, 0.0, "host"))]
    print(f"jagflash host time per call, CPU tensors [{tokens}, {heads}, {head_dim}], B = 1, causal "
          f"(smallest mean of 300 blocks of 100 calls, the calls' blocks in turn); library {jagflash.library_path()}")
    print("| call | us |")
    print("|---|---|")
    results = dict(zip([name for name, _ in rows], per_call_us([fn for _, fn in rows])))
    for name, us in results.items():
        print(f"| {name} | {us:.1f} |")
    save(args.out, {"mode": "cpu", "library": jagflash.library_path()}, [{"call": n, "us": t} for n, t in results.items()])


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        cpu_main(args)
    else:
        gpu_main(args)


if __name__ == "__main__":
    main()

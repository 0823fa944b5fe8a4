#!/usr/bin/env python3
"""Where an eager forward's host time goes (issue 18): the wall clock of one call through each
layer, outermost first, on one small batch (B = 8, lengths up to 128, bf16, H = 16, D = 128,
causal), with the GPU kept busy by a sleep kernel queued ahead so no call waits for it (runs of 25
calls back to back). Medians of --iters calls after a warm-up.

  jagged_attention      the public call (no grad needed)
  _launch.forward       the package's launch layer: the compiled op plus the Python around it
  jagflash_c.fwd        the compiled binding's op alone (torch dispatch, allocations, C API)
  C fwd (ctypes)        jagflash_fwd through ctypes on prebuilt arguments and workspace: the C
                        library's own host time (plus about 1 us of ctypes)
  C size (ctypes)       jagflash_fwd_workspace_size alone
  aten FA2 forward      torch's _flash_attention_forward, for scale
  3 x torch.empty       the outputs' and the workspace's allocations, for scale

    python bench/host_layers.py [--iters N]      # on the GPU machine
"""
import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import jagflash  # noqa: E402
from jagflash import _capi, _launch, _lib  # noqa: E402


def host_us(fn, iters, batch=25):
    """Median wall clock of fn, timed call by call in runs of `batch` back-to-back calls behind one
    sleep kernel long enough for all of them (a sync per call would let the CPU idle between calls,
    which measured every layer slower, and not in order)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    while len(samples) < iters:
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU work ahead of the run
        for _ in range(batch):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 129, (8,), generator=g).tolist()
    total, h, d = sum(lengths), 16, 128
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    lmax = max(lengths)
    rows = []

    rows.append(("jagged_attention", host_us(lambda: jagflash.jagged_attention(
        q, k, v, offsets, offsets, causal=True, check_offsets="device", max_seqlen_q=lmax, max_seqlen_kv=lmax),
        args.iters)))
    problem = _launch.Problem(q=q, k=k, v=v, q_offsets=offsets, kv_offsets=offsets, mask=_capi.MASK_CAUSAL,
                              window_left=-1, window_right=-1, scale=0.0, check_offsets="device", max_seqlen=lmax)
    rows.append(("_launch.forward", host_us(lambda: _launch.forward(problem), args.iters)))
    _launch._ops()
    op = torch.ops.jagflash_c.fwd.default
    rows.append(("jagflash_c.fwd", host_us(lambda: op(
        q, k, v, offsets, offsets, _capi.MASK_CAUSAL, -1, -1, 0.0, _capi.CHECK_OFFSETS_DEVICE, lmax), args.iters)))

    lib = _lib.lib()
    out = torch.empty_like(q)
    lse = torch.empty(h, total, device=dev, dtype=torch.float32)
    fa = _capi.FwdArgs(
        problem=_launch._problem(q, k, v, offsets, offsets, _capi.MASK_CAUSAL, -1, -1, 0.0),
        out=_launch._describe(out), lse=lse.data_ptr())
    fa.launch.stream = torch.cuda.current_stream().cuda_stream
    fa.launch.offsets_check = _capi.CHECK_OFFSETS_DEVICE
    fa.launch.max_seqlen_hint = lmax
    fa.launch.caller_checked_pointers = 1
    size = ctypes.c_size_t(0)
    assert lib.jagflash_fwd_workspace_size(ctypes.byref(fa), ctypes.byref(size)) == 0, lib.jagflash_last_error()
    ws = torch.empty(size.value, dtype=torch.uint8, device=dev)
    fa.launch.workspace, fa.launch.workspace_bytes = ws.data_ptr(), size.value
    run, query = lib.jagflash_fwd, lib.jagflash_fwd_workspace_size
    ref = ctypes.byref(fa)
    rows.append(("C fwd (ctypes)", host_us(lambda: run(ref), args.iters)))
    size_ref = ctypes.byref(size)
    rows.append(("C size (ctypes)", host_us(lambda: query(ref, size_ref), args.iters)))

    aten = torch.ops.aten._flash_attention_forward.default
    rows.append(("aten FA2 forward", host_us(lambda: aten(
        q, k, v, offsets, offsets, lmax, lmax, 0.0, True, False, scale=None), args.iters)))
    rows.append(("3 x torch.empty", host_us(lambda: (torch.empty_like(q), torch.empty_like(lse),
                                                    torch.empty(size.value, dtype=torch.uint8, device=dev)),
                                           args.iters)))
    print(f"host time per call, B = 8 ({total} tokens), bf16, H = {h}, D = {d}, causal; median of {args.iters}")
    print("| layer | host us |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()

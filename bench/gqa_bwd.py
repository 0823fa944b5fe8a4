#!/usr/bin/env python3
"""The backward on batches that leave a GQA/MQA tile grid short of the GPU's 132 SMs: jagflash
beside FA3 varlen (when flash_attn_interface imports), same inputs, one process; CUDA events
around several calls, medians. jagflash runs with its own choice of group splits (a query-head
group split over that many tiles, each writing fp32 dK/dV partials: kernels::backward_group_splits)
and with each split count forced (JAGFLASH_BWD_GROUP_SPLITS, read at every call), so the table
shows what the rule chose against what it could have chosen.

    python bench/gqa_bwd.py            # on the GPU machine (FA3 from .fa3/ on PYTHONPATH)
"""
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import jagflash  # noqa: E402

SPLITS = (1, 2, 4, 8, 16)
CASES = [  # (name, lengths, heads, heads_kv)
    ("2 x 4096, MHA 16/16", [4096] * 2, 16, 16),
    ("1 x 8192, MQA 16/1", [8192], 16, 1),
    ("2 x 4096, GQA 16/4", [4096] * 2, 16, 4),
    ("2 x 4096, MQA 16/1", [4096] * 2, 16, 1),
    ("8 x 2048, MQA 16/1", [2048] * 8, 16, 1),
    ("64 x 1024, MQA 16/1", [1024] * 64, 16, 1),
]


def time_bwd(fwd, leaves, dout, calls=5, rounds=7):
    out = fwd()
    torch.autograd.grad(out, leaves, dout)  # warm-up
    samples = []
    for _ in range(rounds):
        outs = [fwd() for _ in range(calls)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for o in outs:
            torch.autograd.grad(o, leaves, dout)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def main():
    dev = torch.device("cuda")
    try:
        import flash_attn_interface as fa3
    except Exception as e:  # noqa: BLE001
        fa3 = None
        print(f"gqa_bwd.py: FA3 skipped: {e}")
    g = torch.Generator(device=dev).manual_seed(7)
    head = " | ".join(f"S={n}" for n in SPLITS)
    print(f"| case | mask | FA3 TFLOP/s | jagflash (rule) | jagflash/FA3 | {head} |")
    print("|---|---|---|---|---|" + "---|" * len(SPLITS))
    for name, lengths, h, hkv in CASES:
        total, d = sum(lengths), 128
        offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        q = torch.randn((total, h, d), generator=g, device=dev).to(torch.bfloat16)
        k = torch.randn((total, hkv, d), generator=g, device=dev).to(torch.bfloat16)
        v = torch.randn((total, hkv, d), generator=g, device=dev).to(torch.bfloat16)
        dout = torch.randn((total, h, d), generator=g, device=dev).to(torch.bfloat16)
        for causal in (False, True):
            pairs = sum(jagflash.visible_pairs(n, n, causal=causal) for n in lengths)
            flops = 2.5 * 4.0 * h * d * pairs
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def ours():
                return jagflash.jagged_attention(*leaves, offsets, offsets, causal=causal)

            rule = flops / time_bwd(ours, leaves, dout) / 1e9
            forced = []
            for n in SPLITS:
                if (h // hkv) % n:
                    forced.append("-")
                    continue
                os.environ["JAGFLASH_BWD_GROUP_SPLITS"] = str(n)
                try:
                    forced.append(f"{flops / time_bwd(ours, leaves, dout) / 1e9:.1f}")
                finally:
                    del os.environ["JAGFLASH_BWD_GROUP_SPLITS"]
            theirs = None
            if fa3 is not None:
                leaves3 = [t.clone().requires_grad_() for t in (q, k, v)]
                L = max(lengths)

                def f3():
                    o = fa3.flash_attn_varlen_func(*leaves3, offsets, offsets, L, L, causal=causal)
                    return o[0] if isinstance(o, tuple) else o

                theirs = flops / time_bwd(f3, leaves3, dout) / 1e9
            ratio = f"{rule / theirs:.2f}" if theirs else "-"
            fa3_text = f"{theirs:.1f}" if theirs else "-"
            print(f"| {name} | {'causal' if causal else 'none'} | {fa3_text} | {rule:.1f} | {ratio} | "
                  + " | ".join(forced) + " |", flush=True)

if __name__ == "__main__":
    main()

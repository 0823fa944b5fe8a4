#!/usr/bin/env python3
"""One backward of jagflash and one of FA3 varlen (when flash_attn_interface imports) on the same
batch, a few times each, for ncu: scripts/gpu-profile.sh runs this under ncu with a kernel filter
and writes the reports' text next to them. Not a timing tool (compare.py is): ncu replays kernels.

    python bench/profile_bwd.py --dist uniform1k --head-dim 128 [--causal] [--impls jagflash,fa3]
    python bench/profile_bwd.py --uniform 16384 --tokens 131072   # bench/sweep.py's batch at L = 16k
    python bench/profile_bwd.py --softcap 30 --impls jagflash     # with a tanh softcap (its forward too)
"""
import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
import jagflash  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dist", default="uniform1k")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--impls", default="jagflash,fa3")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--pooled", type=int, default=0, metavar="LQ",
                    help="pooled attention: one shared q of LQ rows over the first --batch sequences "
                         "(FA3 given q repeated per sequence)")
    ap.add_argument("--batch", type=int, default=256, help="with --pooled: how many sequences")
    ap.add_argument("--uniform", type=int, default=0, metavar="L",
                    help="instead of --dist: --tokens / L sequences of L tokens (bench/sweep.py's batches)")
    ap.add_argument("--tokens", type=int, default=131072, help="with --uniform: tokens of the batch")
    ap.add_argument("--softcap", type=float, default=0.0, help="jagflash with a tanh softcap (FA3's build has none)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="print each kernel's CUDA time over --calls backward calls (torch.profiler), not for ncu")
    args = ap.parse_args()
    if args.uniform:
        lengths = [args.uniform] * max(1, args.tokens // args.uniform)
        args.dist = f"uniform{args.uniform}"
    else:
        lengths = jagflash.generate_lengths(args.dist, args.seed)
    if args.pooled:
        lengths = lengths[: args.batch]
    total = sum(lengths)
    dev = torch.device("cuda")
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(args.seed)

    def rnd():
        return torch.randn((total, args.heads, args.head_dim), generator=g, device=dev).to(torch.bfloat16)

    q, k, v, dout = rnd(), rnd(), rnd(), rnd()
    b, lq = len(lengths), args.pooled
    if lq:
        q = q[:lq].contiguous()
        dout = torch.randn((b * lq, args.heads, args.head_dim), generator=g, device=dev).to(torch.bfloat16)
        cu_q = torch.arange(b + 1, device=dev, dtype=torch.int32) * lq
    for impl in args.impls.split(","):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if impl == "jagflash" and lq:
            def fwd():
                return jagflash.pooled_attention(*leaves, offsets)
        elif impl == "jagflash":
            def fwd():
                return jagflash.jagged_attention(*leaves, offsets, offsets, causal=args.causal,
                                                 **({"softcap": args.softcap} if args.softcap else {}))
        elif impl == "fa3":
            try:
                import flash_attn_interface as fa3
            except Exception as e:  # noqa: BLE001
                print(f"profile_bwd.py: FA3 skipped: {e}")
                continue
            L = max(lengths)

            def fwd():
                if lq:
                    out = fa3.flash_attn_varlen_func(leaves[0].repeat(b, 1, 1), leaves[1], leaves[2], cu_q,
                                                     offsets, lq, L)
                    return out[0] if isinstance(out, tuple) else out
                out = fa3.flash_attn_varlen_func(*leaves, offsets, offsets, L, L, causal=args.causal)
                return out[0] if isinstance(out, tuple) else out
        else:
            raise SystemExit(f"unknown impl {impl}")
        for _ in range(args.calls):
            out = fwd()
            torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        if args.torch_profile:
            outs = [fwd() for _ in range(args.calls)]
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for out in outs:
                    torch.autograd.grad(out, leaves, dout)
                torch.cuda.synchronize()
            print(f"== {impl} {args.dist} D={args.head_dim} causal={args.causal} pooled={lq}: backward kernels, {args.calls} calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(f"profile_bwd.py: {impl} {args.dist} D={args.head_dim} causal={args.causal} B={len(lengths)} total={total}")


if __name__ == "__main__":
    main()

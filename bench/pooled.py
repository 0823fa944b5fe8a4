#!/usr/bin/env python3
"""Pooled attention (issue 17's bar): one learned query set of Lq rows over every user history of
a batch, forward and backward, jagflash.pooled_attention beside the peers fed with the queries
repeated per sequence (q.repeat -> [B*Lq, H, D], cu_seqlens_q = b * Lq; the repeat and, in the
backward, the sum of its gradient timed with them, as a user pays them): FA3 varlen (when
flash_attn_interface imports) and torch's varlen_attn (FA2's kernels with autograd). Histories:
gemskew lengths (the shared generator), the first B = 256; H = 16, D = 128, bf16; Lq 16, 32, 64.
CUDA events around --calls calls, median of --rounds; peak memory (torch.cuda.max_memory_allocated
above what the inputs hold) of one forward + backward.

    python bench/pooled.py [--out DIR]      # on the GPU machine (.fa3/ on PYTHONPATH for FA3)
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import jagflash  # noqa: E402


def timed(fn, calls, rounds):
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def peak_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    lengths = jagflash.generate_lengths("gemskew", jagflash.DEFAULT_SEED)[: args.batch]
    b, h, d = len(lengths), 16, 128
    kv_offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    total_kv, max_kv = sum(lengths), max(lengths)
    g = torch.Generator(device=dev).manual_seed(17)
    k = torch.randn(total_kv, h, d, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
    v = torch.randn(total_kv, h, d, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
    try:
        import flash_attn_interface as fa3
    except Exception as e:  # noqa: BLE001
        fa3 = None
        print(f"pooled.py: FA3 skipped: {e}")
    from torch.nn.attention.varlen import varlen_attn

    rows = []
    for lq in (16, 32, 64):
        q = torch.randn(lq, h, d, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
        dout = torch.randn(b * lq, h, d, generator=g, device=dev).to(torch.bfloat16)
        cu_q = (torch.arange(b + 1, device=dev, dtype=torch.int32) * lq)

        def ours():
            return jagflash.pooled_attention(q, k, v, kv_offsets, check_offsets="device")

        def repeated(call):
            def fwd():
                q_rep = q.repeat(b, 1, 1)  # [B*Lq, H, D]; its backward sums dq over the copies
                return call(q_rep)
            return fwd

        impls = {"jagflash pooled": ours}
        if fa3 is not None:
            def fa3_call(q_rep):
                o = fa3.flash_attn_varlen_func(q_rep, k, v, cu_q, kv_offsets, lq, max_kv)
                return o[0] if isinstance(o, tuple) else o
            impls["FA3 varlen, q repeated"] = repeated(fa3_call)
        impls["varlen_attn, q repeated"] = repeated(
            lambda q_rep: varlen_attn(q_rep, k, v, cu_q, kv_offsets, lq, max_kv))
        for name, fwd in impls.items():
            fwd_us = timed(lambda: fwd(), args.calls, args.rounds)
            outs = []

            def prep():
                outs.clear()
                outs.extend(fwd() for _ in range(args.calls))

            # Backward alone: forwards made before the timed region, one grad per forward.
            samples = []
            for _ in range(args.rounds):
                prep()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for o in outs:
                    torch.autograd.grad(o, (q, k, v), dout)
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / args.calls)
            outs.clear()
            bwd_us = statistics.median(samples)
            peak = peak_bytes(lambda: torch.autograd.grad(fwd(), (q, k, v), dout))
            rows.append({"Lq": lq, "impl": name, "fwd_us": fwd_us, "bwd_us": bwd_us, "peak_mib": peak / 2**20})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\npooled attention, gemskew B = {b} ({total_kv} keys), H = {h}, D = {d}, bf16")
    print("| Lq | implementation | forward us | backward us | peak MiB | fwd: best peer / jagflash | bwd: best peer / jagflash |")
    print("|---|---|---|---|---|---|---|")
    for lq in (16, 32, 64):
        group = [r for r in rows if r["Lq"] == lq]
        ours_row = next(r for r in group if r["impl"] == "jagflash pooled")
        peers = [r for r in group if r is not ours_row]
        best_f = min(r["fwd_us"] for r in peers)
        best_b = min(r["bwd_us"] for r in peers)
        for r in group:
            extra = f"{best_f / ours_row['fwd_us']:.2f} | {best_b / ours_row['bwd_us']:.2f}" if r is ours_row else "|"
            print(f"| {lq} | {r['impl']} | {r['fwd_us']:.1f} | {r['bwd_us']:.1f} | {r['peak_mib']:.1f} | {extra} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "pooled.json").write_text(json.dumps(rows, indent=1))
        title = (f"pooled attention, gemskew B = {b} ({total_kv} keys), H = {h}, D = {d}, bf16, "
                 f"{torch.cuda.get_device_name()}, commit {os.environ.get('JAGFLASH_COMMIT', '?')}")
        chart(rows, title, Path(args.out) / "pooled.png")


def chart(rows, title, path):
    """Forward and backward time and peak memory per Lq, one bar per implementation; over the
    jagflash bars the best peer's time (or memory) / jagflash's: the numbers issue 17's bar is about."""
    try:
        import matplotlib
    except ImportError:
        print("pooled.py: no matplotlib, no chart")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lqs = sorted({r["Lq"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    width = 0.8 / len(impls)
    for ax, key, label in zip(axes, ("fwd_us", "bwd_us", "peak_mib"),
                              ("forward, us", "backward, us", "peak memory of fwd + bwd, MiB")):
        for i, impl in enumerate(impls):
            values = [next(r[key] for r in rows if r["Lq"] == lq and r["impl"] == impl) for lq in lqs]
            xs = [x + (i - (len(impls) - 1) / 2) * width for x in range(len(lqs))]
            ax.bar(xs, values, width, label=impl)
            if impl == "jagflash pooled":
                for x, lq, value in zip(xs, lqs, values):
                    best = min(r[key] for r in rows if r["Lq"] == lq and r["impl"] != impl)
                    ax.annotate(f"x{best / value:.2f}", (x, value), xytext=(0, 2), textcoords="offset points",
                                ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(lqs)))
        ax.set_xticklabels([f"Lq = {lq}" for lq in lqs])
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(impls), fontsize=8,
               title="x over a jagflash bar: best peer / jagflash", title_fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How fast can a forward on this batch be, if it only had to move its bytes? The memory floor of
each distribution next to jagflash's and FA2's forward, in one process.

A forward must read Q, K and V once and write O once; on batches of short sequences (`short`:
2048 sequences of 16..256 tokens) that traffic, not the tensor cores, is what the time is made
of. The floor is timed as `torch.addcmul(q, k, v, out=o)`: an elementwise kernel with exactly
that traffic (three [T, H, D] reads, one write; far larger than L2), so it runs at the DRAM
bandwidth a streaming kernel reaches on this GPU. The last column, FA2's time over the floor's,
is the highest jagflash/FA2 ratio any forward can reach on that batch without moving fewer bytes.

Timing as compare.py: --calls calls queued back to back, median of --samples samples, the
three taken in turns, after a warm-up; bf16, H = 16, randn inputs (never zeros), the generator's fixed seed.
    python bench/memory_floor.py [--dists short gemskew] [--head-dim 128] [--masks none causal]
"""
import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE))
import compare  # noqa: E402
import jagflash  # noqa: E402
import peers  # noqa: E402


def forward_bytes(total_tokens, heads, head_dim, element_bytes):
    """Bytes a forward moves at the least: Q, K, V read once, O written once (lse is 1/head_dim of
    one of them and left out)."""
    return 4 * total_tokens * heads * head_dim * element_bytes


def best_ratio(peer_ms, floor_ms):
    """The highest speed-up over the peer a kernel held to the floor's traffic and bandwidth can
    reach: the peer's time over the floor's."""
    return peer_ms / floor_ms


def timed_ms(fns, calls, samples, warmup=3):
    """{name: ms per call} with compare.py's timing: `calls` calls queued back to back per
    sample, median of `samples`, the functions' samples taken in turns."""
    timed = compare.measure_interleaved(fns, torch.device("cuda"), warmup, samples, budget_s=60.0, calls=calls)
    for name, result in timed.items():
        if isinstance(result, Exception):
            raise RuntimeError(f"{name} failed") from result
    return {name: ms for name, (ms, _) in timed.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dists", nargs="+", default=["short"])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--samples", type=int, default=9)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(jagflash.DEFAULT_SEED)
    print("| dist | mask | D | MB moved | floor ms | floor GB/s | jagflash ms | FA2 ms | jagflash/FA2 | "
          "floor TFLOP/s | FA2/floor (best ratio) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dist in args.dists:
        lengths, offsets, (q, k, v, dout) = peers.benchmark_batch(dist, args.head_dim, gen, heads=args.heads)
        total = sum(lengths)
        o = torch.empty_like(q)
        moved = forward_bytes(total, args.heads, args.head_dim, q.element_size())
        for mask in args.masks:
            causal = mask == "causal"
            inputs = peers.Inputs(q, k, v, dout, offsets, lengths, causal, 0)
            fns = {name: peers.make(name, inputs).forward for name in ("jagflash", "FA2 varlen")}
            fns["floor"] = lambda: torch.addcmul(q, k, v, out=o)
            ms = timed_ms(fns, args.calls, args.samples)
            floor_ms = ms["floor"]
            pairs = sum(jagflash.visible_pairs(n, n, causal=causal) for n in lengths)
            flops = 4.0 * args.heads * args.head_dim * pairs
            print(f"| {dist} | {mask} | {args.head_dim} | {moved / 1e6:.0f} | {floor_ms:.3f} | "
                  f"{moved / floor_ms / 1e6:.0f} | {ms['jagflash']:.3f} | {ms['FA2 varlen']:.3f} | "
                  f"{ms['FA2 varlen'] / ms['jagflash']:.2f} | {flops / floor_ms / 1e9:.0f} | "
                  f"{best_ratio(ms['FA2 varlen'], floor_ms):.2f} |", flush=True)
        del q, k, v, dout, o


if __name__ == "__main__":
    main()

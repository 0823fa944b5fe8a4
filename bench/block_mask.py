"""Block-sparse attention on the GPU: jagflash with a block mask (jagflash.BlockMask) against the
same call without it (the same causal mask, every block visible: bar sparse/dense <= 0.35x at 25%
density) and against FlexAttention running the same map as its BlockMask (bar: jagflash >= 2x
faster), forward and backward, on the five distributions.

    python bench/block_mask.py [--dists ...] [--head-dims 128 64] [--masks none causal]
                               [--patterns random documents] [--density 0.25]
                               [--flex-mask blocks|create_block_mask] [--out DIR]

Each case draws q, k, v, dout from N(0, 1) in bf16 (compare.py's draw) and a map per sequence:
  random     each 128 x 128 block visible with probability --density (seeded);
  documents  each sequence cut into block-aligned documents of round(density * blocks) blocks
             (the last one shorter), attending within themselves: about `density` of the blocks of
             a long sequence, more of a short one (a sequence of one block is one document).
The table gives the map's density (visible / all blocks, before the causal mask) per case.
FlexAttention runs compiled on the batch padded to one length (peers.FlexAttention's padding),
with a mask_mod that reads a per-token lookup of the same map over the packed sequence (the
sequence of each token, the map row of its query block, the block of its key) AND the
sequence's causal mask, BLOCK_SIZE 128. Its BlockMask is built at block level from the map
(flex_block_mask: which 128-token blocks of the packed sequence hold a visible pair, and which
are visible throughout), or with --flex-mask create_block_mask by torch's create_block_mask on
the mask_mod (_compile=True; it evaluates every token pair, seconds at the largest batches);
python/tests/test_block_mask_tool.py checks that both give the same blocks, and that
FlexAttention with them gives jagflash's output (CPU, forward). Before timing,
jagflash's output is checked against FlexAttention's (max |difference| / max |FlexAttention's|);
a case over 5e-2 is reported as wrong and its ratios are left out. Timing: compare's
measure_interleaved (medians of CUDA-event samples, the implementations in turns). Writes
block_mask.json and prints a table last.
"""
import argparse
import json
import os
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import peers  # noqa: E402
from compare import fmt  # noqa: E402

import jagflash  # noqa: E402
from jagflash import BlockMask  # noqa: E402

PATTERNS = ("random", "documents")
WRONG = 5e-2
BLOCK = BlockMask.BLOCK
SPARSE_BAR = 0.35  # sparse time / dense time at 25% density
FLEX_BAR = 2.0  # FlexAttention time / jagflash time


def document_lengths(lengths, density):
    """Per sequence, block-aligned documents of max(1, round(density * blocks)) blocks (the last
    one takes the rest)."""
    out = []
    for length in lengths:
        blocks = -(-length // BLOCK)
        per_doc = max(1, round(density * blocks)) * BLOCK
        docs = []
        left = length
        while left > per_doc:
            docs.append(per_doc)
            left -= per_doc
        docs.append(left)
        out.append(docs)
    return out


def make_block_mask(pattern, lengths, offsets, density, seed):
    if pattern == "random":
        return BlockMask.random(offsets, density=density, seed=seed)
    return BlockMask.documents(document_lengths(lengths, density), offsets)


# ---- FlexAttention's view of the same map: per-token lookups over the packed (padded) sequence.
# The mask_mod's functions stay the same objects and the tensors keep one shape per run (the common
# padded length), so the compiled kernels are reused for every batch, as in peers.py.
_flex_state = {}


def token_lookups(lengths, block_mask, length, device):
    """(sequence id, map row offset, key block) of every token of the packed sequence padded to
    `length`: the query side's row offset is offsets[b] + (query block) * nk_b, the key side's
    block is the key's block within its sequence. Padding gets sequence -1 (queries) / -2 (keys),
    so it never matches."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    total = int(sum(lengths))
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    local_block = (torch.arange(total, device=device) - starts[seq]) // BLOCK
    nk = (lengths_t + BLOCK - 1) // BLOCK
    q_seq = torch.full((length,), -1, dtype=torch.int64, device=device)
    kv_seq = torch.full((length,), -2, dtype=torch.int64, device=device)
    q_row = torch.zeros(length, dtype=torch.int64, device=device)
    kv_block = torch.zeros(length, dtype=torch.int64, device=device)
    q_seq[:total], kv_seq[:total] = seq, seq
    q_row[:total] = block_mask.offsets.to(device=device, dtype=torch.int64)[seq] + local_block * nk[seq]
    kv_block[:total] = local_block
    return q_seq, kv_seq, q_row, kv_block


def set_flex_state(lengths, block_mask, length, device, capacity=None):
    """The mask_mod's lookups for this batch. The map is copied into `capacity` bytes (the run's
    largest map and one more; None: this map's size and one more): every tensor the mask_mod reads
    then has one shape for the whole run, so compiled flex_attention does not recompile per batch
    (with dynamic=False a new shape is a new compilation, and past dynamo's recompile limit it
    would run uncompiled). The last byte stays 0: the index of a pair from different sequences
    points there."""
    q_seq, kv_seq, q_row, kv_block = token_lookups(lengths, block_mask, length, device)
    entries = block_mask.blocks.numel()
    capacity = entries + 1 if capacity is None else capacity
    if capacity <= entries:
        raise ValueError(f"capacity {capacity}: expected more than the map's {entries} bytes")
    blocks = torch.zeros(capacity, dtype=torch.uint8, device=device)
    blocks[:entries] = block_mask.blocks.to(device)
    _flex_state.update(q_seq=q_seq, kv_seq=kv_seq, q_row=q_row, kv_block=kv_block, blocks=blocks)


def _map_mask(b, h, q_idx, kv_idx):
    s = _flex_state
    same = s["q_seq"][q_idx] == s["kv_seq"][kv_idx]
    index = torch.where(same, s["q_row"][q_idx] + s["kv_block"][kv_idx], s["blocks"].shape[0] - 1)
    return same & (s["blocks"][index] != 0)


def _map_causal_mask(b, h, q_idx, kv_idx):
    # Self-attention, both sides at the same packed offsets: bottom-right causal is q >= kv.
    return _map_mask(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)


def mask_mod(causal):
    return _map_causal_mask if causal else _map_mask


def flex_block_mask(lengths, block_mask, length, causal, device, capacity=None):
    """FlexAttention's BlockMask for the map (self-attention: q and kv share the lengths) over the
    packed sequence padded to `length`, built at
    block level (never token x token): packed query block I and key block J are listed when a
    visible map entry has tokens in both (and, causal, J <= I); full (no mask_mod) when every
    (sequence, map block) piece of I sees every piece of J, neither holds padding, and (causal)
    J < I. A packed block holds pieces of several map blocks where sequences do not start on a
    multiple of 128."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    set_flex_state(lengths, block_mask, length, device, capacity)
    n = length // BLOCK
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    nq = (lengths_t + BLOCK - 1) // BLOCK
    total = int(sum(lengths))
    # Pieces: runs of tokens with one (packed block, sequence, map block); per packed block, how many.
    q_seq, q_row = _flex_state["q_seq"], _flex_state["q_row"]
    t = torch.arange(total, device=device)
    new_piece = torch.ones(total, dtype=torch.bool, device=device)
    if total > 1:
        new_piece[1:] = (t[1:] % BLOCK == 0) | (q_seq[1:total] != q_seq[:total - 1]) | \
            (q_row[1:total] != q_row[:total - 1])
    pieces = torch.zeros(n, dtype=torch.int64, device=device).index_add_(0, t // BLOCK, new_piece.long())
    padded = torch.ones(n, dtype=torch.bool, device=device)
    padded[:total // BLOCK] = False  # blocks wholly inside the real tokens
    # Every visible map entry (b, i, j) and the packed blocks its tokens fall in (one or two a side).
    flat = block_mask.blocks.to(device) != 0
    b_of_entry = torch.repeat_interleave(torch.arange(len(lengths), device=device), nq * nq)
    entry = torch.nonzero(flat).squeeze(1)
    b = b_of_entry[entry]
    local = entry - block_mask.offsets.to(device=device, dtype=torch.int64)[b]
    i, j = local // nq[b], local % nq[b]
    first = starts[b]
    last = starts[b] + lengths_t[b] - 1
    q_lo = (first + i * BLOCK) // BLOCK
    q_hi = torch.minimum(first + i * BLOCK + BLOCK - 1, last) // BLOCK
    kv_lo = (first + j * BLOCK) // BLOCK
    kv_hi = torch.minimum(first + j * BLOCK + BLOCK - 1, last) // BLOCK
    count = torch.zeros(n * n, dtype=torch.int64, device=device)
    for qb, q_distinct in ((q_lo, None), (q_hi, q_hi != q_lo)):
        for kb, kv_distinct in ((kv_lo, None), (kv_hi, kv_hi != kv_lo)):
            keep = torch.ones_like(qb, dtype=torch.bool)
            if q_distinct is not None:
                keep &= q_distinct
            if kv_distinct is not None:
                keep &= kv_distinct
            if causal:
                # Pieces in one packed block see each other only if the query piece is not before
                # the key piece (i >= j); across blocks, only below the diagonal.
                keep &= (kb < qb) | ((kb == qb) & (i >= j))
            count.index_add_(0, (qb * n + kb)[keep], torch.ones_like(qb)[keep])
    count = count.view(n, n)
    listed = count > 0
    full = (count == pieces[:, None] * pieces[None, :]) & ~padded[:, None] & ~padded[None, :] & listed
    if causal:
        idx = torch.arange(n, device=device)
        full &= idx[None, :] < idx[:, None]
    partial = listed & ~full
    return FlexBlockMask.from_kv_blocks(*peers._ordered(partial), *peers._ordered(full), BLOCK_SIZE=BLOCK,
                                        mask_mod=mask_mod(causal), seq_lengths=(length, length))


def flex_block_mask_created(lengths, block_mask, length, causal, device, capacity=None):
    """The same BlockMask from torch's create_block_mask on the mask_mod (every token pair)."""
    from torch.nn.attention.flex_attention import create_block_mask

    set_flex_state(lengths, block_mask, length, device, capacity)
    return create_block_mask(mask_mod(causal), None, None, length, length, device=device, BLOCK_SIZE=BLOCK,
                             _compile=device.type == "cuda")


class JagflashSparse(peers.Jagflash):
    def __init__(self, x, block_mask):
        super().__init__(x)
        self.block_mask = block_mask

    def forward(self):
        return jagflash.jagged_attention(self.x.q, self.x.k, self.x.v, self.x.offsets, causal=self.x.causal,
                                         check_offsets="device", max_seqlen_q=self.x.max_len,
                                         block_mask=self.block_mask)


class FlexSparse(peers.FlexAttention):
    def __init__(self, x, block_mask, how, capacity):
        super().__init__(x, compile_flex=True)
        build = flex_block_mask_created if how == "create_block_mask" else flex_block_mask
        self.block_mask = build(x.lengths, block_mask, x.flex_length, x.causal, x.q.device, capacity)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", str(HERE / "out")))
    p.add_argument("--dists", nargs="+", default=list(jagflash.DISTRIBUTIONS), choices=list(jagflash.DISTRIBUTIONS))
    p.add_argument("--head-dims", nargs="+", type=int, default=[128])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--density", type=float, default=0.25)
    p.add_argument("--flex-mask", default="blocks", choices=["blocks", "create_block_mask"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fwd-calls", type=int, default=4)
    p.add_argument("--bwd-calls", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=1.0)
    p.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (quick runs)")
    args = p.parse_args(argv)
    if not 0.0 < args.density <= 1.0:
        p.error(f"--density: expected a number in (0, 1], got {args.density}")
    return args


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def run_case(x, block_mask, args, device, capacity=None):
    impls = {"dense": peers.Jagflash(x), "sparse": JagflashSparse(x, block_mask)}
    notes = {}
    if not args.no_flex:
        try:
            impls["flex"] = FlexSparse(x, block_mask, args.flex_mask, capacity)
        except Exception as e:  # noqa: BLE001 - the peer missing must not stop the run
            notes["flex"] = f"{type(e).__name__}: {e}"
    row = {"density": block_mask.density()}
    row.update(compare.time_beside_reference(impls, ("dense", "sparse", "flex"), "sparse", args, device, notes))
    error = row["error_vs_flex"]
    wrong = error is not None and error > WRONG
    for d in ("fwd", "bwd"):
        # sparse/dense: a time ratio (< 1 is faster; bar <= 0.35). vs flex: flex time / sparse time (bar >= 2).
        row[f"{d}_sparse_over_dense"] = ratio(row[f"sparse_{d}_ms"], row[f"dense_{d}_ms"])
        row[f"{d}_vs_flex"] = None if wrong else ratio(row[f"flex_{d}_ms"], row[f"sparse_{d}_ms"])
    row["notes"] = notes
    return row


def bar(value, limit, below):
    """The value with a mark where it misses its bar (* ), for reading the table."""
    if value is None:
        return "-"
    missed = value > limit if below else value < limit
    return f"{value:.2f}{' *' if missed else ''}"


def table(rows):
    return compare.beside_table(
        rows, [("dist", "dist"), ("D", "head_dim"), ("pattern", "pattern"), ("mask", "mask"),
               ("density", lambda r: fmt(r["density"]))],
        ("dense", "sparse", "flex"), "dense / sparse / flex",
        [("fwd sparse/dense", lambda r: bar(r["fwd_sparse_over_dense"], SPARSE_BAR, True)),
         ("bwd sparse/dense", lambda r: bar(r["bwd_sparse_over_dense"], SPARSE_BAR, True)),
         ("fwd vs flex", lambda r: bar(r["fwd_vs_flex"], FLEX_BAR, False)),
         ("bwd vs flex", lambda r: bar(r["bwd_vs_flex"], FLEX_BAR, False))], "flex", "flex")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/block_mask.py needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths_of = {d: jagflash.generate_lengths(d, jagflash.DEFAULT_SEED) for d in args.dists}
    flex_length = -(-max(sum(v) for v in lengths_of.values()) // BLOCK) * BLOCK
    # The largest map of the run, and the byte past it (set_flex_state).
    capacity = max(sum((-(-n // BLOCK)) ** 2 for n in v) for v in lengths_of.values()) + 1
    # One compilation per (head dim, mask_mod) is what the fixed shapes leave; room for all of them.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    generator = torch.Generator(device=device).manual_seed(jagflash.DEFAULT_SEED)
    rows = []
    for dist, lengths in lengths_of.items():
        offsets = peers.offsets_of(lengths, device)
        for head_dim in args.head_dims:
            shape = (sum(lengths), args.heads, head_dim)
            q, k, v, dout = (torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
                             for _ in range(4))
            for pattern in args.patterns:
                block_mask = make_block_mask(pattern, lengths, offsets, args.density, jagflash.DEFAULT_SEED)
                for mask in args.masks:
                    t0 = time.time()
                    x = peers.Inputs(*(t.clone().requires_grad_() for t in (q, k, v)), dout, offsets, lengths,
                                     mask == "causal", flex_length)
                    row = {"dist": dist, "head_dim": head_dim, "pattern": pattern, "mask": mask,
                           **run_case(x, block_mask, args, device, capacity)}
                    rows.append(row)
                    (out_dir / "block_mask.json").write_text(json.dumps(rows, indent=1))
                    print(f"{dist:>9} D{head_dim} {pattern:>9} {mask:>6} density {row['density']:.2f}: sparse/dense "
                          f"fwd {fmt(row['fwd_sparse_over_dense'])} bwd {fmt(row['bwd_sparse_over_dense'])}; vs flex "
                          f"fwd {fmt(row['fwd_vs_flex'])} bwd {fmt(row['bwd_vs_flex'])}; err "
                          f"{fmt(row['error_vs_flex'], '{:.1e}')} {row['notes'] or ''} ({time.time() - t0:.0f} s)",
                          flush=True)
                    del x
            del q, k, v, dout
            torch.cuda.empty_cache()
    print(f"\nblock-sparse attention ({torch.cuda.get_device_name(device)}, bf16, H = {args.heads}, map density "
          f"{args.density:g}; sparse/dense: time ratio, bar <= {SPARSE_BAR}; vs flex: FlexAttention's time / "
          f"jagflash's, bar >= {FLEX_BAR}; * misses its bar)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bench/block_mask.py without a GPU: its options, its document pattern, the table, and its
FlexAttention BlockMask built at block level against torch's create_block_mask on the same
mask_mod (both on the CPU, small batches): the same partial and full blocks; FlexAttention with it
gives jagflash's output with the same map."""
import sys
from pathlib import Path

import pytest
import torch

import jagflash

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import block_mask as bench  # noqa: E402
import peers  # noqa: E402


def test_options():
    args = bench.parse_args([])
    assert args.dists == list(jagflash.DISTRIBUTIONS) and args.density == 0.25 and args.masks == ["none", "causal"]
    assert args.patterns == ["random", "documents"] and args.flex_mask == "blocks"
    with pytest.raises(SystemExit):
        bench.parse_args(["--density", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--patterns", "stripes"])


def test_help_runs():
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--help"])
    assert exit_info.value.code == 0


def test_document_pattern_is_block_aligned_at_the_density():
    docs = bench.document_lengths([128 * 16, 300, 1, 0], 0.25)
    assert docs == [[512, 512, 512, 512], [128, 128, 44], [1], [0]]
    offsets = peers.offsets_of([128 * 16, 300, 1, 0], "cpu")
    mask = bench.make_block_mask("documents", [128 * 16, 300, 1, 0], offsets, 0.25, 1)
    assert mask.to_maps(offsets)[0].float().mean().item() == 0.25


def _dense_blocks(num, indices, n):
    out = torch.zeros(n, n, dtype=torch.bool)
    for row in range(n):
        out[row, indices[0, 0, row, :num[0, 0, row]].long()] = True
    return out


# Sequences that start off block edges (and end inside them), one of exactly 128, one of 1.
LENGTHS = [[300, 5, 128, 260, 1, 200], [129, 511, 1, 128, 256]]


@pytest.mark.parametrize("lengths", LENGTHS, ids=["a", "b"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", ["random", "documents"])
def test_flex_block_mask_equals_create_block_mask(lengths, causal, pattern):
    pytest.importorskip("torch.nn.attention.flex_attention")
    offsets = peers.offsets_of(lengths, "cpu")
    mask = bench.make_block_mask(pattern, lengths, offsets, 0.4, 5)
    length = -(-sum(lengths) // 128) * 128 + 128  # a padding block too
    device = torch.device("cpu")
    built = bench.flex_block_mask(lengths, mask, length, causal, device)
    created = bench.flex_block_mask_created(lengths, mask, length, causal, device)
    n = length // 128
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        got = _dense_blocks(getattr(built, num), getattr(built, idx), n)
        want = _dense_blocks(getattr(created, num), getattr(created, idx), n)
        assert torch.equal(got, want), num


def test_mask_mod_reads_the_map_per_token():
    """The mask_mod's token-level answer is the map's byte AND the sequence match (and causal)."""
    lengths = [300, 130]
    offsets = peers.offsets_of(lengths, "cpu")
    mask = jagflash.BlockMask.random(offsets, density=0.5, seed=2)
    maps = mask.to_maps(offsets)
    bench.set_flex_state(lengths, mask, 512, torch.device("cpu"))
    q_idx = torch.arange(512).view(-1, 1)
    kv_idx = torch.arange(512).view(1, -1)
    got = bench._map_causal_mask(None, None, q_idx, kv_idx)
    want = torch.zeros(512, 512, dtype=torch.bool)
    start = 0
    for m, n in zip(maps, lengths):
        per_token = m.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :n]
        want[start:start + n, start:start + n] = per_token & torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    assert torch.equal(got, want)


def test_table_marks_missed_bars():
    row = {"dist": "gemskew", "head_dim": 128, "pattern": "random", "mask": "causal", "density": 0.25,
           "dense_fwd_ms": 1.0, "sparse_fwd_ms": 0.3, "flex_fwd_ms": 0.9, "dense_bwd_ms": 2.0, "sparse_bwd_ms": 0.8,
           "flex_bwd_ms": 2.0, "fwd_sparse_over_dense": 0.3, "bwd_sparse_over_dense": 0.4, "fwd_vs_flex": 3.0,
           "bwd_vs_flex": 2.5, "error_vs_flex": 1e-3}
    text = bench.table([row])
    assert "| 0.30 | 0.40 * | 3.00 | 2.50 |" in text
    assert bench.table([dict(row, fwd_vs_flex=None)]).count("| - |") == 1


def test_flex_lookups_keep_one_shape_for_the_run():
    """Every tensor the mask_mod reads has the run's shape whatever the batch (no recompilation)."""
    shapes = []
    for lengths in LENGTHS:
        offsets = peers.offsets_of(lengths, "cpu")
        mask = jagflash.BlockMask.random(offsets, density=0.5, seed=1)
        bench.set_flex_state(lengths, mask, 2048, torch.device("cpu"), capacity=200)
        assert bench._flex_state["blocks"][mask.blocks.numel():].eq(0).all()
        shapes.append({name: tuple(t.shape) for name, t in bench._flex_state.items()})
    assert shapes[0] == shapes[1]
    offsets = peers.offsets_of(LENGTHS[0], "cpu")
    with pytest.raises(ValueError, match="capacity"):
        bench.set_flex_state(LENGTHS[0], jagflash.BlockMask.full(offsets), 2048, torch.device("cpu"), capacity=3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", ["random", "documents"])
def test_flex_with_the_bench_mask_matches_jagflash(causal, pattern):
    """FlexAttention (eager, CPU, forward) with the BlockMask the benchmark builds gives
    jagflash's output with the same map: the check the benchmark makes before timing."""
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    lengths = LENGTHS[0]
    offsets = peers.offsets_of(lengths, "cpu")
    mask = bench.make_block_mask(pattern, lengths, offsets, 0.4, 11)
    length = -(-sum(lengths) // 128) * 128
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(sum(lengths), 2, 32, generator=g) for _ in range(3))
    mine = jagflash.jagged_attention(q, k, v, offsets, causal=causal, block_mask=mask)

    def padded(t):
        p = torch.zeros(length, 2, 32)
        p[:sum(lengths)] = t
        return p.unsqueeze(0).transpose(1, 2)

    flex_mask = bench.flex_block_mask(lengths, mask, length, causal, torch.device("cpu"))
    theirs = flex_attention(padded(q), padded(k), padded(v), block_mask=flex_mask)[0].transpose(0, 1)[:sum(lengths)]
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)

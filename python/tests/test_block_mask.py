"""Block-sparse attention (jagflash.BlockMask, jf_block_mask): the constructors, and
jagged_attention with a block mask on CPU tensors (the C++ float64 reference) against a float64
dense implementation written out here (each query-key pair's visibility built from the map and
the mask), forward out/lse and the gradients of q, k and v; the eager path, the custom ops (fake
kernels, opcheck, torch.compile) and the nested path; bad arguments refused naming the argument;
on CUDA tensors the same through the Hopper kernels (and the GPU oracle where they do not serve)."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import jagflash
from jagflash import BlockMask
from conftest import (MASKS, TOLERANCES, LSE_TOLERANCE, assert_close, assert_lse_close, assert_same,
                      assert_compiled_matches_eager, modifier_batch, needs_cuda, offsets_of, opcheck_fwd_bwd, visible,
                      skip_unless_hopper_serves)

BLOCK = BlockMask.BLOCK
# Lengths on both sides of block edges (127, 128, 129, 257), 0 and 1, q != kv.
Q_LENGTHS = [300, 0, 1, 129, 257, 128, 5]
KV_LENGTHS = [260, 5, 0, 129, 400, 1, 131]


def _batch(seed, **kwargs):
    """modifier_batch (4 heads over 2 KV heads, D = 32) on the lengths above unless given others:
    the modifier tests' lengths (17 at most) fit in one 128-token block, and the maps are tested
    on sequences across block edges."""
    kwargs.setdefault("q_lengths", Q_LENGTHS)
    kwargs.setdefault("kv_lengths", KV_LENGTHS)
    return modifier_batch(seed, **kwargs)


def _lengths(offsets):
    values = offsets.tolist()
    return [b - a for a, b in zip(values, values[1:])]


def dense_reference(batch, maps, *, causal=False, window=(-1, -1), scale=None):
    """float64 out, lse, dq, dk, dv (CPU) with the visibility of every (query, key) pair written
    out: the mask's (conftest.visible) AND the map's byte of the pair's blocks. Rows that see no key
    give out 0, lse -inf and no gradient."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (batch.q, batch.k, batch.v))
    q_off, kv_off = batch.q_offsets.tolist(), batch.kv_offsets.tolist()
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    outs, lses = [], []
    for b in range(len(q_off) - 1):
        qs = q[q_off[b]:q_off[b + 1]]
        ks = k[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        vs = v[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        len_q, len_kv = qs.shape[0], ks.shape[0]
        allowed = visible(len_q, len_kv, causal, window)
        block_map = maps[b].cpu().bool()
        assert block_map.shape == (-(-len_q // BLOCK), -(-len_kv // BLOCK))
        # Element (i, j) takes the byte of block (i // 128, j // 128).
        per_element = block_map.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:len_q, :len_kv]
        allowed &= per_element
        sees_any = allowed.any(dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        safe = allowed | ~sees_any.unsqueeze(1)  # rows with no key: any finite softmax, zeroed below
        p = torch.softmax(s.masked_fill(~safe, -math.inf), dim=-1) if len_kv else s
        outs.append(torch.einsum("hqk,khd->qhd", p, vs) * sees_any.view(-1, 1, 1))
        lses.append(torch.logsumexp(s.detach().masked_fill(~allowed, -math.inf), dim=-1) if len_kv
                    else torch.full((heads, len_q), -math.inf, dtype=torch.float64))
    out = torch.cat(outs)
    lse = torch.cat(lses, dim=1)
    grads = torch.autograd.grad(out, (q, k, v), batch.dout.double().cpu(), allow_unused=True)
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    return out.detach(), lse, dq, dk, dv


def check_block_mask(batch, block_mask, *, causal=False, window=(-1, -1), scale=None, **kwargs):
    """jagged_attention with block_mask, forward and backward, against dense_reference."""
    maps = block_mask.to_maps(batch.q_offsets, batch.kv_offsets)
    q, k, v = batch.leaves()
    blocks_before = block_mask.blocks.clone()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=causal, window=window,
                                         scale=scale, return_lse=True, block_mask=block_mask, **kwargs)
    out.backward(batch.dout)
    assert torch.equal(block_mask.blocks, blocks_before)  # the caller's map is never written
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = dense_reference(batch, maps, causal=causal, window=window, scale=scale)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    assert out.dtype == batch.q.dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, tol_out, batch.seed)
    assert_lse_close(lse, ref_lse, LSE_TOLERANCE[batch.q.dtype], batch.seed)
    assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
    assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
    assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)
    return out, lse


# ---- The constructors (no library call).

def test_from_fn_matches_maps_built_by_hand():
    q_off, kv_off = offsets_of(Q_LENGTHS), offsets_of(KV_LENGTHS)
    mask = BlockMask.from_fn(lambda b, i, j: (b + 2 * i + j) % 3 == 0, q_off, kv_off)
    by_hand = []
    for b, (lq, lk) in enumerate(zip(Q_LENGTHS, KV_LENGTHS)):
        nq, nk = -(-lq // BLOCK), -(-lk // BLOCK)
        by_hand.append(torch.tensor([[(b + 2 * i + j) % 3 == 0 for j in range(nk)] for i in range(nq)],
                                    dtype=torch.bool).view(nq, nk))
    assert torch.equal(mask.blocks, BlockMask.from_maps(by_hand, q_off, kv_off).blocks)
    assert mask.blocks.dtype == torch.uint8 and mask.offsets.dtype == torch.int32
    expected = [0]
    for lq, lk in zip(Q_LENGTHS, KV_LENGTHS):
        expected.append(expected[-1] + (-(-lq // BLOCK)) * (-(-lk // BLOCK)))
    assert mask.offsets.tolist() == expected
    for got, want in zip(mask.to_maps(q_off, kv_off), by_hand):
        assert torch.equal(got, want)


def test_from_fn_may_return_a_python_bool_or_a_broadcast_tensor():
    q_off = offsets_of([300, 129])
    assert BlockMask.from_fn(lambda b, i, j: True, q_off).density() == 1.0
    assert BlockMask.from_fn(lambda b, i, j: torch.tensor(False), q_off).density() == 0.0
    assert torch.equal(BlockMask.full(q_off).blocks, torch.ones(9 + 4, dtype=torch.uint8))


def test_documents_and_prefix_lm_patterns():
    q_off = offsets_of([300, 0, 1, 512])
    docs = BlockMask.documents([[128, 172], [], [1], [256, 128, 128]], q_off).to_maps(q_off)
    assert docs[0].int().tolist() == [[1, 0, 0], [0, 1, 1], [0, 1, 1]]
    assert docs[1].shape == (0, 0) and docs[2].int().tolist() == [[1]]
    assert docs[3].int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    prefix = BlockMask.prefix_lm([2, 0, 0, 1], q_off).to_maps(q_off)
    assert prefix[0].int().tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert prefix[3].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # q != kv: the causal part is bottom-right aligned (300 queries, 500 keys: shift 200).
    kv_off = offsets_of([500, 0, 0, 512])
    shifted = BlockMask.prefix_lm([0, 0, 0, 0], q_off, kv_off).to_maps(q_off, kv_off)
    assert shifted[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert shifted[2].shape == (1, 0)


def test_random_density_and_seed():
    q_off = offsets_of([128 * 40])
    a = BlockMask.random(q_off, density=0.25, seed=3)
    b = BlockMask.random(q_off, density=0.25, seed=3)
    assert torch.equal(a.blocks, b.blocks)
    assert abs(a.density() - 0.25) < 0.05
    assert BlockMask.random(q_off, density=0.0, seed=1).density() == 0.0


def test_constructors_never_write_the_callers_maps():
    maps = [torch.eye(3, dtype=torch.bool), torch.ones(1, 2, dtype=torch.uint8)]
    copies = [m.clone() for m in maps]
    mask = BlockMask.from_maps(maps, offsets_of([300, 10]), offsets_of([300, 200]))
    mask.blocks.zero_()
    for m, c in zip(maps, copies):
        assert torch.equal(m, c)


CONSTRUCTOR_ERRORS = [
    (lambda: BlockMask.from_maps([torch.ones(2, 2, dtype=torch.bool)], offsets_of([300])),
     r"^maps\[0\]: expected shape \(3, 3\) = \(ceil\(300 / 128\), ceil\(300 / 128\)\), got \(2, 2\)$"),
    (lambda: BlockMask.from_maps([torch.ones(3, 3)], offsets_of([300])),
     r"^maps\[0\]: expected a 2-D \[nq_b, nk_b\] bool \(or integer\) tensor, got torch.float32"),
    (lambda: BlockMask.from_maps([torch.ones(3, 3, dtype=torch.bool)] * 2, offsets_of([300])),
     r"^maps: expected 1 maps \(B of q_offsets\), got 2$"),
    (lambda: BlockMask.from_maps(torch.ones(3, 3, dtype=torch.bool)), r"^maps: expected a list of 2-D"),
    # Without offsets a 1 x 2 map would pass for a sequence that needs 2 x 1 (the same bytes), read
    # transposed: the offsets are required, and the shape checked against them.
    (lambda: BlockMask.from_maps([torch.ones(1, 2, dtype=torch.bool)]),
     r"^q_offsets: expected the batch's offsets \(each map's shape is checked against its sequence's lengths\), "
     r"got None$"),
    (lambda: BlockMask.from_maps([torch.ones(1, 2, dtype=torch.bool)], offsets_of([200]), offsets_of([100])),
     r"^maps\[0\]: expected shape \(2, 1\) = \(ceil\(200 / 128\), ceil\(100 / 128\)\), got \(1, 2\)$"),
    (lambda: BlockMask.from_fn(lambda b, i, j: i, offsets_of([300])),
     r"^fn\(b, q_block, kv_block\): expected a bool tensor broadcastable to \(9,\), got torch.int64"),
    (lambda: BlockMask.from_fn(lambda b, i, j: torch.ones(2, dtype=torch.bool), offsets_of([300])),
     r"^fn\(b, q_block, kv_block\): expected a bool tensor broadcastable to \(9,\)"),
    (lambda: BlockMask.from_fn("all", offsets_of([300])), r"^fn: expected a function"),
    (lambda: BlockMask.from_fn(lambda b, i, j: True, torch.tensor([0, 5, 3], dtype=torch.int32)),
     r"^q_offsets\[2\]: expected a value >= q_offsets\[1\] = 5 \(non-decreasing\), got 3$"),
    (lambda: BlockMask.from_fn(lambda b, i, j: True, torch.tensor([1, 5], dtype=torch.int32)),
     r"^q_offsets\[0\]: expected 0, got 1$"),
    (lambda: BlockMask.from_fn(lambda b, i, j: True, [0, 5]), r"^q_offsets: expected an int32 or int64 vector"),
    (lambda: BlockMask.from_fn(lambda b, i, j: True, offsets_of([5]), offsets_of([5, 5])),
     r"^kv_offsets: expected B\+1 = 2 entries \(as many as q_offsets\), got 3$"),
    (lambda: BlockMask.documents([[100, 200]], offsets_of([300])),
     r"^document_lengths\[0\]\[0\]: expected a multiple of 128 tokens"),
    (lambda: BlockMask.documents([[128, 100]], offsets_of([300])),
     r"^sum\(document_lengths\[0\]\): expected sequence 0's length 300, got 228$"),
    (lambda: BlockMask.documents([[300]], offsets_of([300]), offsets_of([200])),
     r"^kv_document_lengths: expected the key side's documents"),
    (lambda: BlockMask.prefix_lm([1, 2], offsets_of([300])),
     r"^prefix_blocks: expected 1 ints >= 0 \(one per sequence\), got 2$"),
    (lambda: BlockMask.prefix_lm([-1], offsets_of([300])), r"^prefix_blocks\[0\]: expected an int >= 0"),
    (lambda: BlockMask.random(offsets_of([300]), density=1.5), r"^density: expected a number in \[0, 1\], got 1.5$"),
    (lambda: BlockMask(torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 4], dtype=torch.int32)),
     r"^blocks: expected offsets\[B\] = 4 map bytes, got 3 bytes$"),
    (lambda: BlockMask(torch.zeros(3), torch.tensor([0, 3], dtype=torch.int32)),
     r"^blocks: expected a uint8 \(or bool\) vector of map bytes, got torch.float32"),
    (lambda: BlockMask(torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 3])),
     r"^offsets: expected an int32 vector of B\+1 >= 1 map offsets, got torch.int64"),
]


@pytest.mark.parametrize("build,message", CONSTRUCTOR_ERRORS, ids=[str(i) for i in range(len(CONSTRUCTOR_ERRORS))])
def test_constructors_refuse_bad_arguments(build, message):
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        build()


# ---- jagged_attention with a block mask against the dense float64 implementation (CPU).

@pytest.mark.parametrize("density", [0.25, 0.6])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2", "window_4_unbounded_right"])
def test_random_maps_match_the_dense_reference(density, mask):
    causal, window = MASKS[mask]
    seed = 3000 + int(density * 100) + list(MASKS).index(mask)
    batch = _batch(seed)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=density, seed=seed)
    check_block_mask(batch, block_mask, causal=causal, window=window)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gqa(kv_heads):
    batch = _batch(3100 + kv_heads, kv_heads=kv_heads)
    check_block_mask(batch, BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=kv_heads),
                     causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype):
    batch = _batch(3110, dtype=dtype)
    check_block_mask(batch, BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=7))


@pytest.mark.parametrize("causal", [False, True])
def test_documents(causal):
    lengths = [512, 300, 1, 0, 385]
    batch = _batch(3120 + causal, q_lengths=lengths, kv_lengths=lengths)
    docs = [[128, 256, 128], [256, 44], [1], [], [128, 128, 129]]
    check_block_mask(batch, BlockMask.documents(docs, batch.q_offsets), causal=causal)


def test_documents_equal_separate_sequences():
    """A block-aligned document mask over one packed sequence gives what the documents as
    sequences of their own give."""
    batch = _batch(3125, q_lengths=[384], kv_lengths=[384])
    mask = BlockMask.documents([[128, 256]], batch.q_offsets)
    packed = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, causal=True, block_mask=mask)
    split = jagflash.jagged_attention(batch.q, batch.k, batch.v, offsets_of([128, 256]), causal=True)
    torch.testing.assert_close(packed, split, rtol=1e-5, atol=1e-6)


def test_prefix_lm():
    lengths = [512, 300, 1, 129]
    batch = _batch(3130, q_lengths=lengths, kv_lengths=lengths)
    check_block_mask(batch, BlockMask.prefix_lm([2, 1, 0, 5], batch.q_offsets))
    # q != kv, bottom-right aligned.
    batch = _batch(3131)
    check_block_mask(batch, BlockMask.prefix_lm([1, 0, 0, 1, 2, 0, 0], batch.q_offsets, batch.kv_offsets))


def test_a_row_of_blocks_that_sees_nothing():
    """Query block 1 of sequence 0 sees no key block: out 0, lse -inf, no gradient for its rows."""
    batch = _batch(3140, q_lengths=[300, 129], kv_lengths=[260, 129])
    maps = [torch.ones(3, 3, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool)]
    maps[0][1] = False
    block_mask = BlockMask.from_maps(maps, batch.q_offsets, batch.kv_offsets)
    out, lse = check_block_mask(batch, block_mask)
    assert torch.all(out[128:256] == 0) and torch.all(lse[:, 128:256] == -math.inf)
    assert torch.isfinite(lse[:, :128]).all() and torch.isfinite(lse[:, 256:]).all()


def test_a_whole_sequence_hidden():
    batch = _batch(3150, q_lengths=[200, 300, 7], kv_lengths=[150, 260, 9])
    maps = [torch.zeros(2, 2, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool),
            torch.zeros(1, 1, dtype=torch.bool)]
    block_mask = BlockMask.from_maps(maps, batch.q_offsets, batch.kv_offsets)
    q, k, v = batch.leaves()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, return_lse=True,
                                         block_mask=block_mask)
    out.backward(batch.dout)
    assert torch.all(out[:200] == 0) and torch.all(lse[:, :200] == -math.inf) and torch.all(out[500:] == 0)
    assert torch.all(k.grad[:150] == 0) and torch.all(v.grad[:150] == 0) and torch.all(q.grad[:200] == 0)
    check_block_mask(batch, block_mask, causal=True)


def test_lengths_zero_and_one_only():
    batch = _batch(3160, q_lengths=[0, 1, 1, 0], kv_lengths=[1, 0, 1, 0])
    check_block_mask(batch, BlockMask.full(batch.q_offsets, batch.kv_offsets))
    maps = [torch.ones(0, 1, dtype=torch.bool), torch.ones(1, 0, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.bool),
            torch.ones(0, 0, dtype=torch.bool)]
    check_block_mask(batch, BlockMask.from_maps(maps, batch.q_offsets, batch.kv_offsets))


def test_an_empty_map():
    """No sequence has both a query and a key block: a map of no bytes."""
    batch = _batch(3165, q_lengths=[0, 3], kv_lengths=[4, 0])
    block_mask = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    assert block_mask.blocks.numel() == 0
    check_block_mask(batch, block_mask)


def test_a_full_map_is_no_block_mask():
    batch = _batch(3170)
    full = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    for causal in (False, True):
        results = []
        for block_mask in (None, full):
            q, k, v = batch.leaves()
            out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=causal,
                                                 return_lse=True, block_mask=block_mask)
            out.backward(batch.dout)
            results.append((out, lse, q.grad, k.grad, v.grad))
        for got, expected in zip(*results):
            assert_same(got, expected)


def test_the_map_changes_the_result():
    batch = _batch(3175)
    plain = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    sparse = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                       block_mask=BlockMask.random(batch.q_offsets, batch.kv_offsets, seed=1))
    assert (plain - sparse).abs().max() > 1e-2


def test_the_eager_path_and_the_custom_op_agree():
    batch = _batch(3180)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=2)
    results = []
    for through_op in (False, True):
        q, k, v = batch.leaves()
        if through_op:
            out, _ = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 1, -1, -1, 0.0, "auto", 0,
                                            False, 0.0, None, block_mask.blocks, block_mask.offsets)
        else:
            out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True,
                                            block_mask=block_mask)
        out.backward(batch.dout)
        results.append((out, q.grad, k.grad, v.grad))
    for got, expected in zip(*results):
        assert_same(got, expected)


def test_no_grad_path_and_score_modifiers():
    batch = _batch(3185)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=3)
    with torch.no_grad():
        out = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                        block_mask=block_mask)
    ref_out = dense_reference(batch, block_mask.to_maps(batch.q_offsets, batch.kv_offsets))[0]
    assert_close("out", out, ref_out, TOLERANCES[batch.q.dtype][0], batch.seed)
    # With a softcap the map still hides its blocks: a hidden sequence stays 0.
    with torch.no_grad():
        capped = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, softcap=2.0,
                                           block_mask=BlockMask.from_fn(lambda b, i, j: b != 0, batch.q_offsets,
                                                                        batch.kv_offsets))
    assert torch.all(capped[:Q_LENGTHS[0]] == 0) and capped[Q_LENGTHS[0]:].abs().max() > 0


def test_strided_and_bool_maps_are_read_as_their_values():
    batch = _batch(3190)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=4)
    strided = torch.stack([block_mask.blocks, torch.zeros_like(block_mask.blocks)], dim=1)[:, 0]
    assert strided.stride(0) == 2
    offsets_strided = torch.stack([block_mask.offsets, block_mask.offsets], dim=1)[:, 1]
    want = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                     block_mask=block_mask)
    for other in (BlockMask(strided, offsets_strided), BlockMask(block_mask.blocks.bool(), block_mask.offsets)):
        got = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                        block_mask=other)
        assert_same(got, want)


@pytest.mark.parametrize("through_op", [False, True], ids=["eager", "op"])
def test_the_map_gets_no_gradient_and_is_saved_for_the_backward(through_op):
    """The backward uses the forward's map: a map changed in place in between raises autograd's
    "modified by an inplace operation" (as offsets do), not a silent other gradient."""
    batch = _batch(3195)

    def forward(block_mask):
        q, k, v = batch.leaves()
        if through_op:
            out, _ = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto", 0,
                                            False, 0.0, None, block_mask.blocks, block_mask.offsets)
        else:
            out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, block_mask=block_mask)
        return q, out

    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=5)
    q, out = forward(block_mask)
    out.backward(batch.dout)
    assert q.grad is not None and not block_mask.blocks.requires_grad
    _, out = forward(block_mask)
    block_mask.blocks.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(batch.dout)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_attention():
    lengths = [300, 1, 129]
    batch = _batch(3200, q_lengths=lengths, kv_lengths=lengths)
    block_mask = BlockMask.random(batch.q_offsets, density=0.5, seed=6)

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, batch.q_offsets)

    q, k, v = batch.leaves()
    out = jagflash.attention(nested(q), nested(k), nested(v), causal=True, block_mask=block_mask)
    out.values().backward(batch.dout)
    ref_out, _, ref_dq, ref_dk, ref_dv = dense_reference(batch, block_mask.to_maps(batch.q_offsets), causal=True)
    tol_out, tol_grad = TOLERANCES[q.dtype]
    assert_close("out", out.values(), ref_out, tol_out, batch.seed)
    assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
    assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
    assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)


def test_backend_takes_a_block_mask():
    batch = _batch(3205)
    block_mask = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    assert jagflash.backend(*args, block_mask=block_mask) == "reference"
    assert jagflash.backend(*args, block_mask=block_mask, backward=True) == "reference"
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^block_mask: expected a jagflash.BlockMask or None"):
        jagflash.backend(*args, block_mask=(block_mask.blocks, block_mask.offsets))


# ---- Bad arguments: refused before anything runs, naming the argument.

def _bad_block_masks():
    off = offsets_of(Q_LENGTHS)
    kv_off = offsets_of(KV_LENGTHS)
    good = BlockMask.full(off, kv_off)
    wrong_batch = BlockMask.full(offsets_of(Q_LENGTHS[:3]), offsets_of(KV_LENGTHS[:3]))
    meta = BlockMask(torch.empty(good.blocks.numel(), dtype=torch.uint8, device="meta"),
                     torch.empty(good.offsets.numel(), dtype=torch.int32, device="meta"))
    short = BlockMask(good.blocks, good.offsets)
    short.blocks = good.blocks[:-1]  # past the constructor's check, as a hand-made object could be
    return [
        ((good.blocks, good.offsets), r"^block_mask: expected a jagflash.BlockMask or None, got tuple$"),
        (wrong_batch, r"^block_mask: expected a map for B = 7 sequences \(as q_offsets\), got one for 3$"),
        (meta, r"^block_mask.device: expected cpu \(q's device; BlockMask.to moves it\), got meta$"),
        (short, r"^block_mask.offsets\[B=7\]: expected <= block_mask.blocks.numel\(\) = \d+ \(the size of the blocks "
                r"buffer\), got \d+$"),
    ]


BAD_BLOCK_MASKS = _bad_block_masks()


@pytest.mark.parametrize("block_mask,message", BAD_BLOCK_MASKS, ids=[str(i) for i in range(len(BAD_BLOCK_MASKS))])
def test_bad_block_masks_are_refused(block_mask, message):
    batch = _batch(3210)
    q, k, v = batch.leaves()
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, block_mask=block_mask)
    with torch.no_grad(), pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                  block_mask=block_mask)


def test_bad_map_offsets_are_refused_by_the_library():
    """Offsets whose differences are not the sequences' block counts: the C library's check,
    worded with the caller's names."""
    batch = _batch(3215, q_lengths=[300, 129], kv_lengths=[260, 129])
    good = BlockMask.full(batch.q_offsets, batch.kv_offsets)  # offsets [0, 9, 13]
    bad = BlockMask(good.blocks, torch.tensor([0, 8, 13], dtype=torch.int32))
    for check_offsets in ("host", "auto"):
        with pytest.raises(jagflash.InvalidArgumentError, match=r"block_mask\.offsets"):
            jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, block_mask=bad,
                                      check_offsets=check_offsets)


def _short_block_mask(batch):
    """A map whose offsets claim one byte more than its blocks hold (offsets[B] = blocks.numel() + 1):
    the C library reads offsets[B] bytes, so it must refuse it (jf_block_mask.bytes)."""
    good = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    short = BlockMask(good.blocks, good.offsets)
    short.blocks = good.blocks[:-1].clone()  # a buffer of its own: nothing past it belongs to the map
    return short


def test_offsets_past_the_blocks_buffer_are_refused_by_the_library():
    """offsets[B] > blocks.numel(): refused at the call (CPU tensors are checked on the host) in
    both directions, by jagged_attention in the caller's names and by the custom op in the C
    library's, naming the offsets' last entry and the buffer's size."""
    batch = _batch(3217)
    short = _short_block_mask(batch)
    last, size = int(short.offsets[-1]), short.blocks.numel()
    assert last == size + 1
    q, k, v = batch.leaves()
    message = (rf"^block_mask.offsets\[B=7\]: expected <= block_mask.blocks.numel\(\) = {size} \(the size of the "
               rf"blocks buffer\), got {last}$")
    for check_offsets in ("host", "auto"):
        with pytest.raises(jagflash.InvalidArgumentError, match=message):
            jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, block_mask=short,
                                      check_offsets=check_offsets)
    c_message = (rf"problem.block_mask.offsets\[B=7\]: expected <= problem.block_mask.bytes = {size} \(the size of "
                 rf"the blocks buffer\), got {last}")
    with pytest.raises(jagflash.InvalidArgumentError, match=c_message):
        torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "host",
                               0, False, 0.0, None, short.blocks, short.offsets)
    good = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    out, lse = torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0,
                                      "host", 0, False, 0.0, None, good.blocks, good.offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=c_message):
        torch.ops.jagflash.bwd(torch.ones_like(out), batch.q, batch.k, batch.v, out, lse, batch.q_offsets,
                               batch.kv_offsets, 0, -1, -1, 0.0, "host", 0, False, 0.0, None, short.blocks,
                               short.offsets)


def test_the_op_refuses_half_a_block_mask():
    batch = _batch(3220)
    good = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^block_mask_offsets: expected a tensor"):
        torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto",
                               0, False, 0.0, None, good.blocks, None)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^block_mask.blocks: expected a uint8 vector on cpu"):
        torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto",
                               0, False, 0.0, None, good.blocks.float(), good.offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^block_mask.offsets: expected an int32 vector of "
                                                            r"B\+1 = 8 entries on cpu"):
        torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto",
                               0, False, 0.0, None, good.blocks, good.offsets[:-1])


# ---- The custom ops: fake kernels, opcheck, torch.compile.

def test_fake_kernels_take_a_block_mask():
    with FakeTensorMode():
        q, k, v = torch.empty(12, 4, 64), torch.empty(9, 2, 64), torch.empty(9, 2, 64)
        off = torch.zeros(3, dtype=torch.int32)
        blocks = torch.empty(2, dtype=torch.uint8)
        out, lse = torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, None, blocks, off)
        assert out.shape == (12, 4, 64) and lse.shape == (4, 12)
        dq, dk, dv, _ = torch.ops.jagflash.bwd(out, q, k, v, out, lse, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0,
                                               None, blocks, off)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        with pytest.raises(jagflash.InvalidArgumentError, match=r"^block_mask.offsets: expected an int32 vector"):
            torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, None, blocks, off[:2])


def test_opcheck():
    batch = _batch(3230, q_lengths=[130, 0, 9, 1], kv_lengths=[5, 2, 200, 0])
    q, k, v = batch.leaves()
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=8)
    opcheck_fwd_bwd(batch, q, k, v, (1, -1, -1, 0.0, "auto", 0, False, 0.0, None, block_mask.blocks,
                                     block_mask.offsets))


def test_compiled_fullgraph_matches_eager():
    batch = _batch(3240)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=9)

    def attention(q, k, v, q_offsets, kv_offsets):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, block_mask=block_mask)

    assert_compiled_matches_eager(attention, batch)


def test_compiled_with_the_mask_as_an_argument():
    """A BlockMask passed into the compiled function (not closed over) traces too."""
    from torch._dynamo.testing import CompileCounterWithBackend

    batch = _batch(3245)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=10)

    def attention(q, k, v, q_offsets, kv_offsets, mask):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, block_mask=mask)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attention, backend=counter, fullgraph=True)
    got = compiled(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, block_mask)
    want = attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, block_mask)
    assert_same(got, want)
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ---- CUDA: fake tensors trace with a block mask (no GPU needed); real ones run the Hopper kernels
# (head dims 64 and 128) or the GPU oracle (256) and match the dense float64 implementation.

def test_fake_cuda_tensors_trace_with_a_block_mask():
    with FakeTensorMode():
        q = torch.empty(12, 4, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(9, 2, 64, dtype=torch.bfloat16, device="cuda")
        off = torch.zeros(3, dtype=torch.int32, device="cuda")
        blocks = torch.empty(2, dtype=torch.uint8, device="cuda")
        out, lse = torch.ops.jagflash.fwd(q, k, k, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, None, blocks, off)
        assert out.shape == (12, 4, 64) and lse.shape == (4, 12)
        dq, dk, dv, _ = torch.ops.jagflash.bwd(q, q, k, k, q, lse, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0,
                                               None, blocks, off)
        assert dq.shape == q.shape and dk.shape == k.shape
        with pytest.raises(jagflash.InvalidArgumentError, match=r"^block_mask.blocks: expected a uint8 vector on "
                                                                r"cuda:0 \(q's device\), got torch.uint8 of shape "
                                                                r"\(2,\) on cpu$"):
            torch.ops.jagflash.fwd(q, k, k, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, None,
                                   torch.empty(2, dtype=torch.uint8), off)
        # A head dim only the Hopper kernels serve is refused with a block mask (not theirs there).
        q96, k96 = torch.empty(12, 4, 96, dtype=torch.bfloat16, device="cuda"), \
            torch.empty(9, 2, 96, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(jagflash.UnsupportedError, match=r"^q.shape\[-1\]"):
            torch.ops.jagflash.fwd(q96, k96, k96, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, None, blocks, off)


CUDA_Q_LENGTHS = [1, 0, 700, 65, 300, 2, 1024]
CUDA_KV_LENGTHS = [3, 5, 900, 64, 300, 0, 1024]


def _cuda_batch(seed, head_dim, **kwargs):
    return _batch(seed, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, head_dim=head_dim, device="cuda",
                  **kwargs)


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_random_maps_match_the_dense_reference(head_dim, dtype, mask):
    causal, window = MASKS[mask]
    batch = _cuda_batch(4000 + head_dim, head_dim, dtype=dtype)
    skip_unless_hopper_serves(dtype, head_dim, backward=True, block_mask=True)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.25, seed=head_dim)
    assert block_mask.device == batch.q.device
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    assert jagflash.backend(*args, block_mask=block_mask) == "hopper"
    assert jagflash.backend(*args, block_mask=block_mask, backward=True) == "hopper"
    check_block_mask(batch, block_mask, causal=causal, window=window)


@needs_cuda
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
def test_cuda_documents_and_prefix_lm(kv_heads):
    lengths = [1024, 300, 1, 0, 640]
    batch = _batch(4010 + kv_heads, q_lengths=lengths, kv_lengths=lengths, kv_heads=kv_heads, head_dim=128,
                   device="cuda")
    docs = BlockMask.documents([[256, 512, 256], [256, 44], [1], [], [128, 512]], batch.q_offsets)
    check_block_mask(batch, docs, causal=True)
    check_block_mask(batch, BlockMask.prefix_lm([2, 1, 0, 0, 3], batch.q_offsets))


@needs_cuda
def test_cuda_hidden_rows_and_sequences():
    batch = _cuda_batch(4020, 128)
    block_mask = BlockMask.from_fn(lambda b, i, j: (b != 2) & (i != 1), batch.q_offsets, batch.kv_offsets)
    out, lse = check_block_mask(batch, block_mask, causal=True)
    start = sum(CUDA_Q_LENGTHS[:2])
    assert torch.all(out[start:start + CUDA_Q_LENGTHS[2]] == 0)


@needs_cuda
def test_cuda_an_empty_map():
    """A map of no bytes on CUDA (torch may give its tensor no address): served, not a half-given mask,
    through the call and the path query that decides the slow-path warning."""
    batch = _batch(4025, q_lengths=[0, 3], kv_lengths=[4, 0], head_dim=128, device="cuda")
    block_mask = BlockMask.full(batch.q_offsets, batch.kv_offsets)
    assert block_mask.blocks.numel() == 0
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    skip_unless_hopper_serves(batch.q.dtype, 128, block_mask=True)
    assert jagflash.backend(*args, block_mask=block_mask) == "hopper"
    check_block_mask(batch, block_mask)


@needs_cuda
@pytest.mark.filterwarnings("ignore::jagflash.SlowPathWarning")
def test_cuda_head_dim_256_on_the_oracle():
    """Either direction: the Hopper kernels of 256 (the backward's wide one too) take no block map."""
    batch = _cuda_batch(4030, 256)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.5, seed=3)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    skip_unless_hopper_serves(batch.q.dtype, 256, backward=True)
    assert jagflash.backend(*args) == "hopper"  # without the map
    assert jagflash.backend(*args, backward=True) == "hopper"
    assert jagflash.backend(*args, block_mask=block_mask) == "oracle"
    assert jagflash.backend(*args, block_mask=block_mask, backward=True) == "oracle"
    check_block_mask(batch, block_mask, causal=True)


@needs_cuda
def test_cuda_full_map_matches_no_block_mask():
    batch = _cuda_batch(4040, 128)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    plain = jagflash.jagged_attention(*args, causal=True)
    full = jagflash.jagged_attention(*args, causal=True, block_mask=BlockMask.full(batch.q_offsets, batch.kv_offsets))
    # The sparse kernels may sum in another order: bf16's rounding apart, not bitwise.
    assert_close("out", full, plain.double(), TOLERANCES[batch.q.dtype][0], batch.seed)


@needs_cuda
def test_cuda_offsets_past_the_blocks_buffer_are_refused():
    """offsets[B] > blocks.numel() on CUDA: "host" refuses it at the call; "device" returns, writes
    nothing, and read_device_error() names the check (kBlockMaskPastEnd)."""
    jagflash.synchronize()  # nothing left over from another test
    batch = _cuda_batch(4045, 128)
    short = _short_block_mask(batch)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=r"^block_mask.offsets\[B=\d+\]: expected <= block_mask.blocks.numel\(\) = \d+"):
        jagflash.jagged_attention(*args, block_mask=short, check_offsets="host")
    with torch.no_grad():
        jagflash.jagged_attention(*args, block_mask=short, check_offsets="device")
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=r"failed a check on the device.*problem.block_mask.offsets: expected \[B\] <= "
                             r"problem.block_mask.bytes"):
        jagflash.read_device_error()
    jagflash.synchronize()


@needs_cuda
def test_cuda_compiled_and_graph_captured():
    batch = _cuda_batch(4050, 128)
    block_mask = BlockMask.random(batch.q_offsets, batch.kv_offsets, density=0.25, seed=4)

    def attention(q, k, v, q_offsets, kv_offsets):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, block_mask=block_mask)

    assert_compiled_matches_eager(attention, batch)
    with torch.no_grad():
        want = attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, causal=True,
                                            block_mask=block_mask, check_offsets="device")
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

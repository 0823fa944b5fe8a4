"""The relative-position bias by bucket (score_mod="relative_bias", src/core/score_mod.hpp's
RelativeBias): score = scale * q.k + table[h, clip(j - i - (Lk - Lq), -R, R) + R], against
conftest's float64 reference with the bias written out here, on CPU tensors (the C++ reference)
and CUDA tensors (the Hopper kernels, the GPU oracle where they do not serve); the custom ops'
fake kernels, opcheck, torch.compile, and the refusals."""
import math

import pytest
import torch

import jagflash
from conftest import (MASKS, needs_cuda, skip_unless_hopper_serves,
                      assert_same, assert_compiled_matches_eager, check_against_reference,
                      modifier_batch, offsets_of, opcheck_fwd_bwd, MODIFIER_CUDA_Q_LENGTHS,
                      MODIFIER_CUDA_KV_LENGTHS)

CUDA_Q_LENGTHS = MODIFIER_CUDA_Q_LENGTHS
CUDA_KV_LENGTHS = MODIFIER_CUDA_KV_LENGTHS
_batch = modifier_batch


def _table(heads, reach, seed, device="cpu"):
    """[H, 2R + 1] biases of a few units, so the bias matters next to the scores."""
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(heads, 2 * reach + 1, generator=g)).to(device)


def _bias(table):
    """The modifier written out for conftest.reference: table[h, clip(j - i - (Lk - Lq), -R, R) + R]."""
    table = table.detach().double().cpu()
    reach = (table.shape[1] - 1) // 2

    def bias(len_q, len_kv):
        relative = torch.arange(len_kv).view(1, -1) - torch.arange(len_q).view(-1, 1) - (len_kv - len_q)
        return table[:, relative.clamp(-reach, reach) + reach]  # [H, Lq, Lk]

    return bias


def _check(batch, table, causal=False, window=(-1, -1), scale=None, **kwargs):
    check_against_reference(batch, causal=causal, window=window, scale=scale, bias=_bias(table),
                            score_mod="relative_bias", score_mod_table=table, **kwargs)


@pytest.mark.parametrize("reach", [0, 3, 40])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2"])
def test_matches_the_reference(reach, kv_heads, mask):
    causal, window = MASKS[mask]
    _check(_batch(3000 + reach + kv_heads, kv_heads=kv_heads), _table(4, reach, 3100 + reach), causal, window)


def test_the_bias_sits_at_the_clipped_bottom_right_distance():
    """One query against keys with equal scores: the table alone decides, entry clip(j - 4) + R."""
    q, k = torch.zeros(1, 1, 8), torch.zeros(5, 1, 8)
    table = torch.tensor([[0.5, -1.0, 2.0, 0.25, 3.0]])  # R = 2: distances -2..2
    _, lse = jagflash.jagged_attention(q, k, torch.randn(5, 1, 8), offsets_of([1]), offsets_of([5]),
                                       return_lse=True, score_mod="relative_bias", score_mod_table=table)
    # The query sits on the diagonal at key 4: keys 0..4 are at -4, -3, -2, -1, 0, clipped to -2.
    want = torch.logsumexp(torch.tensor([0.5, 0.5, 0.5, -1.0, 2.0], dtype=torch.float64), 0)
    assert math.isclose(lse.item(), want.item(), rel_tol=1e-6)


def test_score_mod_kind_names_the_modifiers():
    assert jagflash.score_mod_kind("softcap") == 1 and jagflash.score_mod_kind("alibi") == 2
    assert jagflash.score_mod_kind("relative_bias") == 3
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^score_mod: expected .*\"relative_bias\".*got 'nope'"):
        jagflash.score_mod_kind("nope")


BAD_ARGUMENTS = [
    ({"score_mod": "relative_bias", "score_mod_table": torch.zeros(4, 4)}, jagflash.InvalidArgumentError,
     r"^score_mod_table.shape\[1\]: expected an odd width 2R \+ 1 .*got 4$"),
    ({"score_mod": "relative_bias", "score_mod_table": torch.zeros(4, 5).index_put_((torch.tensor(2), torch.tensor(3)),
                                                                                    torch.tensor(float("inf")))},
     jagflash.InvalidArgumentError, r"^score_mod_table\[2, 3\]: expected a finite number, got inf$"),
    ({"score_mod": "relative_bias", "score_mod_table": torch.zeros(3, 5)}, jagflash.InvalidArgumentError,
     r"^score_mod_table: expected float32 \(4, W\)"),
    ({"score_mod": "relative_bias", "score_mod_table": torch.zeros(4, 5, dtype=torch.float64)},
     jagflash.InvalidArgumentError, r"^score_mod_table: expected float32"),
    ({"score_mod": "relative_bias"}, jagflash.InvalidArgumentError, r"^score_mod_table: expected float32"),
    ({"score_mod_table": torch.zeros(4, 5)}, jagflash.InvalidArgumentError, r"^score_mod: expected the name"),
    ({"score_mod": "softcap", "score_mod_table": torch.zeros(4, 5)}, jagflash.InvalidArgumentError,
     r"^score_mod: expected the name of a modifier with a table"),
    ({"score_mod": "relative_bias", "score_mod_table": torch.zeros(4, 5), "softcap": 2.0},
     jagflash.InvalidArgumentError, r"^softcap: expected unset with score_mod_table"),
    ({"score_mod": "relative_bias", "score_mod_table": torch.zeros(4, 5, requires_grad=True)},
     jagflash.UnsupportedError, r"score_mod_table requires grad"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS, ids=[str(i) for i in range(len(BAD_ARGUMENTS))])
def test_bad_arguments_are_refused(kwargs, error, message):
    batch = _batch(3200)
    q, k, v = batch.leaves()
    with pytest.raises(error, match=message):
        jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, **kwargs)


def test_backend_pooled_and_nested_take_it():
    batch = _batch(3210, kv_heads=4)
    table = _table(4, 5, 3211)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    assert jagflash.backend(*args, backward=True, score_mod="relative_bias", score_mod_table=table) == "reference"
    # pooled: one query set of 3 rows against every sequence, as jagged_attention of the repeats
    q_set = batch.q[:3]
    lengths = (batch.kv_offsets[1:] - batch.kv_offsets[:-1]).tolist()
    pooled = jagflash.pooled_attention(q_set, batch.k, batch.v, batch.kv_offsets, score_mod="relative_bias",
                                       score_mod_table=table)
    repeated = jagflash.jagged_attention(q_set.repeat(len(lengths), 1, 1), batch.k, batch.v,
                                         offsets_of([3] * len(lengths)), batch.kv_offsets, score_mod="relative_bias",
                                         score_mod_table=table)
    assert_same(pooled, repeated)


def test_opcheck_and_compile():
    batch = _batch(3220, q_lengths=[3, 0, 9, 1], kv_lengths=[5, 2, 9, 0])
    q, k, v = batch.leaves()
    table = _table(4, 4, 3221)
    kind = jagflash.score_mod_kind("relative_bias")
    opcheck_fwd_bwd(batch, q, k, v, (1, -1, -1, 0.0, "auto", 0, False, 0.0, None, None, None, kind, table))

    def attention(q, k, v, q_offsets, kv_offsets):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, score_mod="relative_bias",
                                         score_mod_table=table)

    assert_compiled_matches_eager(attention, _batch(3222))


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_matches_the_reference(head_dim, dtype, mask):
    causal, window = MASKS[mask]
    batch = _batch(3300 + head_dim, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, head_dim=head_dim,
                   dtype=dtype, device="cuda")
    skip_unless_hopper_serves(dtype, head_dim, backward=head_dim != 128, score_mod="relative_bias")
    table = _table(4, 100, 3301, "cuda")
    # The backward at 128 runs on the GPU oracle (CMakeLists.txt: the Hopper one spills with it).
    for backward in (False, True):
        want = "oracle" if backward and head_dim == 128 else "hopper"
        assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=backward,
                                score_mod="relative_bias", score_mod_table=table) == want
    _check(batch, table, *MASKS[mask])


@needs_cuda
def test_cuda_head_dim_256_and_deterministic_repeats():
    batch = _batch(3310, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, head_dim=256, device="cuda")
    skip_unless_hopper_serves(batch.q.dtype, 256, score_mod="relative_bias")
    table = _table(4, 7, 3311, "cuda")
    # The forward on the Hopper kernel of 256, the backward on the GPU oracle (the wide backward
    # kernel takes softcap and ALiBi; the relative bias's table reads would spill in its GEMM loop).
    for backward, want in ((False, "hopper"), (True, "oracle")):
        assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=backward,
                                score_mod="relative_bias", score_mod_table=table) == want
    _check(batch, table, causal=True)
    batch = _batch(3312, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, head_dim=128, device="cuda")
    grads = []
    for _ in range(2):
        q, k, v = batch.leaves()
        out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, deterministic=True,
                                        score_mod="relative_bias", score_mod_table=table)
        out.backward(batch.dout)
        grads.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)

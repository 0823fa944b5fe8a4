"""The relative-position bias by bucket (score_mod="relative_bias", src/core/score_mod.hpp's
RelativeBias): score = scale * q.k + table[h, clip(j - i - (Lk - Lq), -R, R) + R], against a
float64 reference written out here, on CPU tensors (the C++ reference) and CUDA tensors (the
Hopper kernels, the GPU oracle where they do not serve); the custom ops' fake kernels, opcheck,
torch.compile, and the refusals."""
import math

import pytest
import torch

import jagflash
from conftest import (MASKS, TOLERANCES, LSE_TOLERANCE, needs_cuda, assert_close, assert_lse_close, assert_same,
                      assert_compiled_matches_eager, make_batch, offsets_of, opcheck_fwd_bwd, visible)

Q_LENGTHS = [7, 0, 1, 13, 5, 9]
KV_LENGTHS = [9, 4, 0, 13, 2, 17]
CUDA_Q_LENGTHS = [1, 0, 200, 65, 130, 2]
CUDA_KV_LENGTHS = [3, 5, 257, 64, 130, 0]


def _table(heads, reach, seed, device="cpu"):
    """[H, 2R + 1] biases of a few units, so the bias matters next to the scores."""
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(heads, 2 * reach + 1, generator=g)).to(device)


def _reference(batch, table, causal=False, window=(-1, -1), scale=None):
    """float64 out, lse, dq, dk, dv with the bias written out per sequence (a row that sees no key:
    out 0, lse -inf, no gradient)."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (batch.q, batch.k, batch.v))
    table = table.detach().double().cpu()
    reach = (table.shape[1] - 1) // 2
    q_off, kv_off = batch.q_offsets.tolist(), batch.kv_offsets.tolist()
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    outs, lses = [], []
    for b in range(len(q_off) - 1):
        qs = q[q_off[b]:q_off[b + 1]]
        ks = k[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        vs = v[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        len_q, len_kv = qs.shape[0], ks.shape[0]
        allowed = visible(len_q, len_kv, causal, window)
        sees_any = allowed.any(dim=1)
        relative = torch.arange(len_kv).view(1, -1) - torch.arange(len_q).view(-1, 1) - (len_kv - len_q)
        bias = table[:, relative.clamp(-reach, reach) + reach]  # [H, Lq, Lk]
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale + bias
        p = torch.softmax(s.masked_fill(~(allowed | ~sees_any.unsqueeze(1)), -math.inf), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs) * sees_any.view(-1, 1, 1))
        lses.append(torch.logsumexp(s.detach().masked_fill(~allowed, -math.inf), dim=-1))
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), batch.dout.double().cpu(), allow_unused=True)
    return out.detach(), lse, *(torch.zeros_like(t) if g is None else g for g, t in zip((dq, dk, dv), (q, k, v)))


def _check(batch, table, causal=False, window=(-1, -1), scale=None, **kwargs):
    q, k, v = batch.leaves()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=causal, window=window,
                                         scale=scale, return_lse=True, score_mod="relative_bias",
                                         score_mod_table=table, **kwargs)
    out.backward(batch.dout)
    ref = _reference(batch, table, causal, window, scale)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    assert_close("out", out, ref[0], tol_out, batch.seed)
    assert_lse_close(lse, ref[1], LSE_TOLERANCE[batch.q.dtype], batch.seed)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref[2:]):
        assert_close(name, got, want, tol_grad, batch.seed)


def _batch(seed, **kwargs):
    kwargs.setdefault("q_lengths", Q_LENGTHS)
    kwargs.setdefault("kv_lengths", KV_LENGTHS)
    kwargs.setdefault("heads", 4)
    kwargs.setdefault("kv_heads", 2)
    kwargs.setdefault("head_dim", 32)
    return make_batch(seed, **kwargs)


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
     r"score_mod_table_width: expected an odd width 2R \+ 1"),
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
    table = _table(4, 7, 3311, "cuda")
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

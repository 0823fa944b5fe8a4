"""Score modifiers, tanh softcap and ALiBi, on CPU tensors (the C++ float64 reference) through
jagged_attention, attention (nested), pooled_attention, flash_attn_varlen_func and the custom ops
(fake kernels, opcheck, torch.compile), against conftest's float64 reference with the modifier
written out there; on CUDA tensors the same through the Hopper kernels (and the GPU oracle where
they do not serve), and the fake kernels trace with a modifier."""
import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import jagflash
from jagflash import ops
from conftest import (MASKS, needs_cuda, skip_unless_hopper_serves,
                      TOLERANCES, assert_close, assert_lse_close, assert_same, check_against_reference,
                      offsets_of, opcheck_fwd_bwd, reference, LSE_TOLERANCE,
                      assert_compiled_matches_eager, modifier_batch, MODIFIER_Q_LENGTHS,
                      MODIFIER_CUDA_Q_LENGTHS, MODIFIER_CUDA_KV_LENGTHS)

Q_LENGTHS = MODIFIER_Q_LENGTHS
CAPS = [0.5, 2.0, 30.0]
_batch = modifier_batch


def _slopes(heads):
    """BLOOM's slopes 2^(-8 h / H), times 4 so the bias matters at these lengths."""
    return torch.tensor([4.0 * 2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2"])
def test_softcap_matches_the_reference(cap, mask):
    causal, window = MASKS[mask]
    # scale 1: scores of a few units, so small caps saturate the tanh and large ones barely touch it.
    check_against_reference(_batch(1000 + CAPS.index(cap)), causal=causal, window=window, scale=1.0, softcap=cap)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2"])
def test_alibi_matches_the_reference(kv_heads, mask):
    causal, window = MASKS[mask]
    batch = _batch(1010 + kv_heads, kv_heads=kv_heads)
    check_against_reference(batch, causal=causal, window=window, alibi_slopes=_slopes(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    check_against_reference(_batch(1020, dtype=dtype), causal=True, scale=1.0, softcap=2.0)
    check_against_reference(_batch(1021, dtype=dtype), alibi_slopes=_slopes(4))


def test_the_modifiers_change_the_result():
    """Neither is a no-op on these batches (so the comparisons above test them)."""
    batch = _batch(1030)
    plain = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, scale=1.0)
    capped = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, scale=1.0,
                                       softcap=2.0)
    biased = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, scale=1.0,
                                       alibi_slopes=_slopes(4))
    assert (plain - capped).abs().max() > 1e-2 and (plain - biased).abs().max() > 1e-2


def test_alibi_is_bottom_right_aligned_and_symmetric():
    """One query against keys with equal scores: the bias alone decides, -slope * |i + Lk - Lq - j|."""
    q = torch.zeros(1, 1, 8)
    k = torch.zeros(5, 1, 8)
    v = torch.eye(5).view(5, 1, 5)[..., :5].repeat(1, 1, 2)[..., :8]
    slope = 0.7
    out, lse = jagflash.jagged_attention(q, k, v, offsets_of([1]), offsets_of([5]), return_lse=True,
                                         alibi_slopes=torch.tensor([slope]))
    # The query sits on the diagonal at key 4 (Lk - Lq = 4): bias 0 there, -slope * (4 - j) left of it.
    bias = torch.tensor([-slope * (4 - j) for j in range(5)], dtype=torch.float64)
    assert math.isclose(lse.item(), torch.logsumexp(bias, 0).item(), rel_tol=1e-6)
    torch.testing.assert_close(out[0, 0, :5].double(), torch.softmax(bias, 0), rtol=1e-6, atol=1e-7)
    # A query set shorter than the keys, with keys right of the diagonal (window (-1, -1)): |.| both sides.
    q2 = torch.zeros(2, 1, 8)
    out2, lse2 = jagflash.jagged_attention(q2, k, v, offsets_of([2]), offsets_of([5]), return_lse=True,
                                           alibi_slopes=torch.tensor([slope]))
    bias0 = torch.tensor([-slope * abs(0 + 3 - j) for j in range(5)], dtype=torch.float64)
    assert math.isclose(lse2[0, 0].item(), torch.logsumexp(bias0, 0).item(), rel_tol=1e-6)


def test_the_eager_path_and_the_custom_op_agree():
    batch = _batch(1040)
    slopes = _slopes(4)
    for modifier in ({"softcap": 2.0}, {"alibi_slopes": slopes}):
        results = []
        for through_op in (False, True):
            q, k, v = batch.leaves()
            if through_op:
                out, _ = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 1, -1, -1, 0.0, "auto", 0,
                                                False, modifier.get("softcap", 0.0), modifier.get("alibi_slopes"))
            else:
                out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, **modifier)
            out.backward(batch.dout)
            results.append((out, q.grad, k.grad, v.grad))
        for got, expected in zip(*results):
            assert_same(got, expected)


def test_no_grad_path_matches():
    batch = _batch(1045)
    with torch.no_grad():
        out = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, softcap=3.0)
    ref_out = reference(batch, softcap=3.0)[0]
    assert_close("out", out, ref_out, TOLERANCES[batch.q.dtype][0], batch.seed)


SLOPES_GRAD = r"^jagflash: alibi_slopes requires grad, and jagflash computes no gradient .*alibi_slopes.detach\(\)"


@pytest.mark.parametrize("entry", ["jagged_attention", "pooled_attention", "flash_attn_varlen_func", "op"])
def test_slopes_that_require_grad_are_refused(entry):
    """jagflash computes no gradient for the slopes: slopes that ask for one are refused (as a
    table that does), not left with grad None while training on a silent zero."""
    batch = _batch(1046)
    slopes = _slopes(4).requires_grad_()
    q, k, v = batch.leaves()
    calls = {
        "jagged_attention": lambda s: jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets,
                                                                alibi_slopes=s),
        "pooled_attention": lambda s: jagflash.pooled_attention(q[:3], k, v, batch.kv_offsets, alibi_slopes=s),
        "flash_attn_varlen_func": lambda s: jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets,
                                                                            batch.kv_offsets, None, None,
                                                                            alibi_slopes=s),
        "op": lambda s: ops.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto", 0, False, 0.0,
                                s)[0],
    }
    with pytest.raises(jagflash.UnsupportedError, match=SLOPES_GRAD):
        calls[entry](slopes)
    # Detached, or under no_grad, they are taken (and q still gets its gradient).
    calls[entry](slopes.detach()).sum().backward()
    assert q.grad is not None and slopes.grad is None
    with torch.no_grad():
        calls[entry](slopes)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_attention():
    batch = _batch(1050, kv_lengths=Q_LENGTHS)

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, batch.q_offsets)

    for modifier in ({"softcap": 1.5, "scale": 1.0}, {"alibi_slopes": _slopes(4)}):
        q, k, v = batch.leaves()
        out = jagflash.attention(nested(q), nested(k), nested(v), causal=True, **modifier)
        out.values().backward(batch.dout)
        ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=True, **modifier)
        tol_out, tol_grad = TOLERANCES[q.dtype]
        assert_close("out", out.values(), ref_out, tol_out, batch.seed)
        assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
        assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
        assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)


def test_pooled_attention_equals_jagged_attention_of_the_repeated_queries():
    kv_lengths = [5, 0, 9]
    kv_off = offsets_of(kv_lengths)
    q_off = offsets_of([3, 3, 3])
    for modifier in ({"softcap": 1.0}, {"alibi_slopes": _slopes(4)}):
        q = torch.randn(3, 4, 32, requires_grad=True)
        k = torch.randn(14, 2, 32, requires_grad=True)
        v = torch.randn(14, 2, 32, requires_grad=True)
        out = jagflash.pooled_attention(q, k, v, kv_off, scale=1.0, **modifier)
        dout = torch.randn_like(out)
        out.backward(dout)
        q_rep = q.detach().repeat(3, 1, 1).requires_grad_()
        k2, v2 = k.detach().requires_grad_(), v.detach().requires_grad_()
        jagged = jagflash.jagged_attention(q_rep, k2, v2, q_off, kv_off, scale=1.0, **modifier)
        jagged.backward(dout)
        assert_same(out.detach(), jagged.detach())
        torch.testing.assert_close(q.grad, q_rep.grad.view(3, 3, 4, 32).sum(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k.grad, k2.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v.grad, v2.grad, rtol=1e-6, atol=1e-6)


def test_flash_attn_varlen_func():
    batch = _batch(1060)
    for modifier, ref_modifier in (({"softcap": 2.0}, {"softcap": 2.0}),
                                   ({"alibi_slopes": _slopes(4)}, {"alibi_slopes": _slopes(4)})):
        q, k, v = batch.leaves()
        out, lse, _ = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, 17, 17,
                                                      softmax_scale=1.0, causal=True, return_attn_probs=True,
                                                      **modifier)
        out.backward(batch.dout)
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(batch, causal=True, scale=1.0, **ref_modifier)
        tol_out, tol_grad = TOLERANCES[q.dtype]
        assert_close("out", out, ref_out, tol_out, batch.seed)
        assert_lse_close(lse, ref_lse, LSE_TOLERANCE[q.dtype], batch.seed)
        assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
        assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
        assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)
    # softcap=0.0 (FA2's default) is none.
    plain = jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 17, 17,
                                            softcap=0.0)
    assert_same(plain, jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets))


def test_flash_attn_varlen_func_refuses_per_sequence_slopes():
    batch = _batch(1065)
    with pytest.raises(jagflash.UnsupportedError, match=r"^flash_attn_varlen_func: alibi_slopes of shape \(6, 4\) "
                                                        r"\(batch_size, nheads\) is not supported"):
        jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 17, 17,
                                        alibi_slopes=torch.ones(6, 4))


BAD_ARGUMENTS = [
    ({"softcap": -1.0}, r"^softcap: expected a finite number > 0 that stays finite and non-zero in float32, or "
                        r"None for no softcap, got -1.0$"),
    # Values float32 (the C API's field) turns into 0 (none) or infinity: named as passed, in Python.
    ({"softcap": 1e-50}, r"^softcap: expected a finite number > 0 that stays finite and non-zero in float32, "
                         r".*got 1e-50$"),
    ({"softcap": 1e39}, r"^softcap: expected a finite number > 0 that stays finite and non-zero in float32, "
                        r".*got 1e\+39$"),
    ({"softcap": 0.0}, r"^softcap: expected a finite number > 0"),
    ({"softcap": float("inf")}, r"^softcap: expected a finite number > 0"),
    ({"softcap": float("nan")}, r"^softcap: expected a finite number > 0"),
    ({"softcap": "30"}, r"^softcap: expected a finite number > 0 .*, or None for no softcap, got '30'$"),
    ({"alibi_slopes": torch.ones(3)}, r"^alibi_slopes: expected float32 \(4,\) \(one slope per query head\) on cpu, "
                                      r"got torch.float32 \(3,\) on cpu$"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, r"^alibi_slopes: expected float32 \(4,\)"),
    ({"alibi_slopes": torch.ones(2, 4)}, r"^alibi_slopes: expected float32 \(4,\)"),
    ({"alibi_slopes": [1.0] * 4}, r"^alibi_slopes: expected float32 \(4,\) .*got list$"),
    ({"alibi_slopes": torch.ones(4), "softcap": 2.0}, r"^softcap: expected 0 with alibi_slopes"),
    # Values that make every score they touch NaN: refused where they are read on the host (CPU).
    ({"alibi_slopes": torch.tensor([0.5, float("nan"), 0.25, 0.125])},
     r"^alibi_slopes\[1\]: expected a finite number, got nan$"),
    ({"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, float("-inf")])},
     r"^alibi_slopes\[3\]: expected a finite number, got -inf$"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS, ids=[str(i) for i in range(len(BAD_ARGUMENTS))])
def test_bad_arguments_are_refused(kwargs, message):
    batch = _batch(1070)
    q, k, v = batch.leaves()
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, **kwargs)
    with torch.no_grad(), pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, **kwargs)


def test_strided_slopes_are_read_as_their_values():
    batch = _batch(1075)
    strided = _slopes(8)[::2]
    got = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, alibi_slopes=strided)
    want = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                     alibi_slopes=strided.contiguous())
    assert_same(got, want)


def test_backend_takes_the_modifiers():
    batch = _batch(1080)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    assert jagflash.backend(*args, softcap=30.0) == "reference"
    assert jagflash.backend(*args, alibi_slopes=_slopes(4), backward=True) == "reference"
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^softcap: expected a finite number > 0"):
        jagflash.backend(*args, softcap=-2.0)


# ---- The custom ops: fake kernels, opcheck, torch.compile.

def test_fake_kernels_check_the_modifiers():
    with FakeTensorMode():
        q, k, v = torch.empty(12, 4, 64), torch.empty(9, 2, 64), torch.empty(9, 2, 64)
        off = torch.zeros(3, dtype=torch.int32)
        out, lse = torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, 30.0, None)
        assert out.shape == (12, 4, 64) and lse.shape == (4, 12)
        dq, dk, dv, _ = torch.ops.jagflash.bwd(out, q, k, v, out, lse, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0,
                                               torch.empty(4))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        pooled_out, _ = torch.ops.jagflash.pooled_fwd(q[:3], k, v, off, 0, -1, -1, 0.0, "auto", 0, False, 5.0, None)
        assert pooled_out.shape == (6, 4, 64)
        with pytest.raises(jagflash.InvalidArgumentError, match=r"^softcap: expected a finite number > 0"):
            torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, -1.0, None)
        with pytest.raises(jagflash.InvalidArgumentError, match=r"^alibi_slopes: expected float32 \(4,\)"):
            torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, torch.empty(2))


def test_opcheck():
    batch = _batch(1090, q_lengths=[3, 0, 9, 1], kv_lengths=[5, 2, 9, 0])
    q, k, v = batch.leaves()
    for modifier in ((2.0, None), (0.0, _slopes(4))):
        scalars = (1, -1, -1, 0.0, "auto", 0, False) + modifier
        opcheck_fwd_bwd(batch, q, k, v, scalars)


def test_compiled_fullgraph_matches_eager():
    slopes = _slopes(4)

    def attention(q, k, v, q_offsets, kv_offsets):
        capped = jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, softcap=2.0)
        biased = jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, alibi_slopes=slopes)
        return capped + biased

    assert_compiled_matches_eager(attention, _batch(1095))


# ---- CUDA: fake tensors trace with a modifier (no GPU needed); real ones run the Hopper kernels
# (head dims 64 and 128 both directions, 256 forward) and match the float64 reference.

def _fake_cuda():
    q = torch.empty(12, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(9, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.empty(9, 2, 64, dtype=torch.bfloat16, device="cuda")
    offsets = torch.zeros(3, dtype=torch.int32, device="cuda")
    return q, k, v, offsets


@pytest.mark.parametrize("name", ["softcap", "alibi_slopes"])
def test_fake_cuda_tensors_trace_with_the_modifiers(name):
    with FakeTensorMode():
        q, k, v, off = _fake_cuda()
        slopes = torch.empty(4, device="cuda")
        op_scalars = (30.0, None) if name == "softcap" else (0.0, slopes)
        out, lse = torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, *op_scalars)
        assert out.shape == (12, 4, 64) and lse.shape == (4, 12)
        dq, dk, dv, _ = torch.ops.jagflash.bwd(q, q, k, v, q, lse, off, off, 0, -1, -1, 0.0, "auto", 0, False,
                                               *op_scalars)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        # Slopes on the wrong device are still refused, naming the argument.
        with pytest.raises(jagflash.InvalidArgumentError, match="^alibi_slopes"):
            torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0,
                                   torch.empty(4, device="cpu"))


CUDA_Q_LENGTHS = MODIFIER_CUDA_Q_LENGTHS
CUDA_KV_LENGTHS = MODIFIER_CUDA_KV_LENGTHS


def _cuda_batch(seed, head_dim, dtype=torch.bfloat16, scale_inputs=1.0):
    batch = _batch(seed, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, head_dim=head_dim, dtype=dtype,
                   device="cuda")
    if scale_inputs != 1.0:  # scores past the cap: randn inputs give scaled scores of about 1
        batch = dataclasses.replace(batch, q=batch.q * scale_inputs, k=batch.k * scale_inputs)
    return batch


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_softcap_matches_the_reference(head_dim, dtype, mask):
    causal, window = MASKS[mask]
    batch = _cuda_batch(2000 + head_dim, head_dim, dtype, scale_inputs=2.0)
    q, k, v = batch.q, batch.k, batch.v
    skip_unless_hopper_serves(dtype, head_dim, backward=True, score_mod="softcap")
    assert jagflash.backend(q, k, v, batch.q_offsets, batch.kv_offsets, softcap=5.0) == "hopper"
    assert jagflash.backend(q, k, v, batch.q_offsets, batch.kv_offsets, backward=True, softcap=5.0) == "hopper"
    check_against_reference(batch, causal=causal, window=window, softcap=5.0)


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_alibi_matches_the_reference(head_dim, kv_heads, mask):
    causal, window = MASKS[mask]
    batch = _batch(2010 + head_dim + kv_heads, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS,
                   kv_heads=kv_heads, head_dim=head_dim, device="cuda")
    slopes = _slopes(4).cuda()
    skip_unless_hopper_serves(batch.q.dtype, head_dim, backward=True, score_mod="alibi")
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=True,
                            alibi_slopes=slopes) == "hopper"
    check_against_reference(batch, causal=causal, window=window, alibi_slopes=slopes)


@needs_cuda
def test_cuda_head_dim_256():
    """Both directions on the Hopper kernels (the backward on the wide kernel of 256) with softcap
    and ALiBi; the relative bias's backward on the GPU oracle (its table reads would spill there)."""
    batch = _cuda_batch(2030, 256, scale_inputs=2.0)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    skip_unless_hopper_serves(batch.q.dtype, 256, score_mod="softcap")
    assert jagflash.backend(*args, softcap=5.0) == "hopper"
    assert jagflash.backend(*args, backward=True, softcap=5.0) == "hopper"
    assert jagflash.backend(*args, backward=True, alibi_slopes=_slopes(4).cuda()) == "hopper"
    check_against_reference(batch, causal=True, softcap=5.0)
    check_against_reference(_cuda_batch(2031, 256), alibi_slopes=_slopes(4).cuda())


@needs_cuda
def test_cuda_flash_attn_varlen_func_takes_softcap_and_alibi():
    batch = _cuda_batch(2040, 128, scale_inputs=2.0)
    q, k, v = batch.q, batch.k, batch.v
    cu_q, cu_k = batch.q_offsets, batch.kv_offsets
    for kwargs, ref_kwargs in (({"softcap": 5.0}, {"softcap": 5.0}),
                               ({"alibi_slopes": _slopes(4).cuda()}, {"alibi_slopes": _slopes(4)})):
        out = jagflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(CUDA_Q_LENGTHS), max(CUDA_KV_LENGTHS),
                                              causal=True, **kwargs)
        ref_out = reference(batch, causal=True, **ref_kwargs)[0]
        assert_close("out", out, ref_out, TOLERANCES[q.dtype][0], batch.seed)


@needs_cuda
def test_cuda_modifiers_change_the_result():
    batch = _cuda_batch(2050, 128, scale_inputs=2.0)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    plain = jagflash.jagged_attention(*args)
    capped = jagflash.jagged_attention(*args, softcap=2.0)
    biased = jagflash.jagged_attention(*args, alibi_slopes=_slopes(4).cuda())
    assert (plain - capped).abs().max() > 1e-1 and (plain - biased).abs().max() > 1e-1

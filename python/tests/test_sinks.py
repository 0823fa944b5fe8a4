"""Learnable attention sinks (learnable_sink=, gpt-oss; FlashAttention-4's learnable_sink): one logit
s_h per query head joins every row's softmax denominator without a value. Against a float64
reference written out here from the definition, on CPU tensors (the C++ float64 reference) and CUDA
tensors (bf16 on the Hopper kernels), forward (out, lse) and backward (dq, dk, dv and d sink, the
last also by finite differences); through jagged_attention, attention (nested), pooled_attention,
flash_attn_varlen_func and the custom ops (fake kernels, opcheck, torch.compile); the refusals."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import jagflash
from jagflash import _launch, ops
from conftest import (LSE_TOLERANCE, MASKS, MODIFIER_CUDA_KV_LENGTHS, MODIFIER_CUDA_Q_LENGTHS, TOLERANCES,
                      assert_close, assert_same, make_batch, modifier_batch, needs_cuda, offsets_of,
                      skip_unless_hopper_serves, visible)


def _sinks(heads, seed, dtype=torch.float32, device="cpu"):
    """Sinks of the size of the rows' logsumexp at these lengths, so that they matter."""
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 2.0 * torch.randn(heads, generator=g)).to(dtype=dtype, device=device)


def reference(batch, sink, *, causal=False, window=(-1, -1), scale=None, softcap=None):
    """float64 out, lse, dq, dk, dv, dsink (on the CPU) from the definition, per sequence: x_ij the
    visible scores (scale * q.k, then the softcap), m_i the max over s_h and them, out_i = sum_j
    exp(x_ij - m_i) v_j / (exp(s_h - m_i) + sum_j exp(x_ij - m_i)), lse_i = m_i + log(that
    denominator); the gradients by autograd of sum(out * dout)."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (batch.q, batch.k, batch.v))
    s = sink.detach().double().cpu().requires_grad_()
    q_off, kv_off = batch.q_offsets.tolist(), batch.kv_offsets.tolist()
    heads = q.shape[1]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    outs, lses = [], []
    for b in range(len(q_off) - 1):
        qs = q[q_off[b]:q_off[b + 1]]
        ks = k[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        vs = v[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        x = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        x = x.masked_fill(~visible(qs.shape[0], ks.shape[0], causal, window), -math.inf)
        # The sink as one more column of logits, without a value: never empty, so m is finite.
        logits = torch.cat([x, s.view(heads, 1, 1).expand(heads, qs.shape[0], 1)], dim=-1)
        m = logits.amax(dim=-1, keepdim=True).detach()
        e = torch.exp(logits - m)
        denominator = e.sum(dim=-1, keepdim=True)
        outs.append(torch.einsum("hqk,khd->qhd", e[..., :-1] / denominator, vs))
        lses.append((m + denominator.log()).squeeze(-1))
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    grads = torch.autograd.grad(out, (q, k, v, s), batch.dout.double().cpu(), allow_unused=True)
    dq, dk, dv, dsink = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v, s)))
    return out.detach(), lse.detach(), dq, dk, dv, dsink


def _run(batch, sink, **kwargs):
    """jagged_attention forward (return_lse) and backward on fresh leaves: out, lse, dq, dk, dv, dsink."""
    q, k, v = batch.leaves()
    s = sink.detach().clone().requires_grad_()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, return_lse=True,
                                         learnable_sink=s, **kwargs)
    out.backward(batch.dout)
    return out, lse, q.grad, k.grad, v.grad, s.grad


def _assert_matches(got, want, dtype, seed):
    """Five results and the sinks' gradient against the reference, within dtype's tolerances."""
    tol_out, tol_grad = TOLERANCES[dtype]
    out, lse, dq, dk, dv, dsink = got
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv, ref_dsink = want
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, tol_out, seed)
    assert torch.isfinite(lse).all(), "with sinks every row's lse is finite"
    assert_close("lse", lse, ref_lse, LSE_TOLERANCE[dtype], seed)
    assert_close("dq", dq, ref_dq, tol_grad, seed)
    assert_close("dk", dk, ref_dk, tol_grad, seed)
    assert_close("dv", dv, ref_dv, tol_grad, seed)
    assert_close("dsink", dsink, ref_dsink, tol_grad, seed)


def _check(batch, sink, **kwargs):
    """jagged_attention with sinks against the reference (kwargs: causal, window, scale, softcap)."""
    _assert_matches(_run(batch, sink, **kwargs), reference(batch, sink, **kwargs), batch.q.dtype, batch.seed)


# ---- CPU: the C++ float64 reference, on modifier_batch's lengths (q != kv lengths, 0 and 1 among
# them, and with window (3, 2) rows that see no key).

@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2", "diagonal"])
def test_matches_the_reference(kv_heads, mask):
    causal, window = MASKS[mask]
    _check(modifier_batch(5000 + kv_heads, kv_heads=kv_heads), _sinks(4, 5010 + kv_heads), causal=causal,
           window=window)


@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_with_a_softcap(mask):
    """The softcap modifies the scores, not the sink."""
    causal, window = MASKS[mask]
    _check(modifier_batch(5020), _sinks(4, 5021), causal=causal, window=window, scale=1.0, softcap=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    _check(modifier_batch(5030, dtype=dtype), _sinks(4, 5031), causal=True)


def test_the_sink_changes_the_result():
    """A sink is no no-op on these batches (so the comparisons above test it), and one far below
    every score is none: out and lse as without sinks."""
    batch = modifier_batch(5040)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    plain, plain_lse = jagflash.jagged_attention(*args, causal=True, return_lse=True)
    sunk = jagflash.jagged_attention(*args, causal=True, learnable_sink=_sinks(4, 5041))
    assert (plain - sunk).abs().max() > 0.05
    drowned, drowned_lse = jagflash.jagged_attention(*args, causal=True, return_lse=True,
                                                     learnable_sink=torch.full((4,), -1000.0))
    torch.testing.assert_close(drowned, plain, rtol=1e-6, atol=1e-7)
    seen = torch.isfinite(plain_lse)
    torch.testing.assert_close(drowned_lse[seen], plain_lse[seen], rtol=1e-6, atol=1e-7)
    assert torch.equal(drowned_lse[~seen], torch.full_like(drowned_lse[~seen], -1000.0))


def test_a_row_that_sees_no_key_gives_zero_and_the_sink_as_lse():
    """Sequence 1 has no keys; with window (0, 0) and Lk < Lq, the first query of sequence 0 sees
    none either. Their out is 0, their lse s_h (float32), and they add nothing to any gradient but
    d sink's -exp(s_h - lse_i) * (dout_i . out_i), which is 0 for them (out_i = 0)."""
    batch = make_batch(5050, q_lengths=[3, 2], kv_lengths=[2, 0], heads=4, kv_heads=2, head_dim=16)
    sink = _sinks(4, 5051)
    out, lse, dq, dk, dv, dsink = _run(batch, sink, window=(0, 0))
    blind = [0, 3, 4]  # rows: sequence 0's first query, sequence 1's two
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert torch.equal(lse[:, blind], sink.view(4, 1).expand(4, 3))
    assert torch.equal(dq[blind], torch.zeros_like(dq[blind]))
    _assert_matches((out, lse, dq, dk, dv, dsink), reference(batch, sink, window=(0, 0)), batch.q.dtype, batch.seed)


def test_the_sinks_gradient_by_finite_differences():
    """d loss / d s_h against central differences of loss(s) = sum(out * dout), computed in float64
    from the CPU reference's outputs (float32 tensors: the package takes no float64; the C++
    reference computes in float64 and rounds out once). The steps 2^-6 are exact in float32 around
    these sinks, so each difference moves s_h by exactly what it says."""
    batch = modifier_batch(5060)
    sink = torch.tensor([0.5, -1.25, 2.0, 0.0])
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    dsink = _run(batch, sink, causal=True)[5]

    def loss(s):
        out = jagflash.jagged_attention(*args, causal=True, learnable_sink=s)
        return (out.double() * batch.dout.double()).sum().item()

    step = 2.0 ** -6
    numeric = torch.tensor([(loss(sink + step * e) - loss(sink - step * e)) / (2 * step)
                            for e in torch.eye(4)], dtype=torch.float64)
    assert_close("dsink", dsink, numeric, 1e-3, batch.seed)
    # And against the closed form from the call's own out and lse.
    q, k, v = batch.leaves()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, return_lse=True,
                                         learnable_sink=sink)
    closed = (-(sink.double().view(4, 1) - lse.double()).exp() * (batch.dout.double() * out.double()).sum(-1).t())
    assert_close("dsink", dsink, closed.sum(1), 1e-5, batch.seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sinks_gradient_comes_in_their_dtype_and_they_are_not_written(dtype):
    batch = modifier_batch(5070)
    sink = _sinks(8, 5071, dtype)[::2]  # strided: copied to float32 for the C call
    before = sink.clone()
    _, _, _, _, _, dsink = _run(batch, sink)
    q, k, v = batch.leaves()
    s = sink.detach().requires_grad_()
    jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, learnable_sink=s).backward(batch.dout)
    assert s.grad.dtype == dtype and dsink.dtype == dtype
    assert torch.equal(sink, before)
    want = reference(batch, sink.float())[5]
    assert_close("dsink", s.grad, want, TOLERANCES[dtype][1], batch.seed)


def test_a_sink_without_grad_gets_none_and_changes_no_other_gradient(monkeypatch):
    """Its gradient is not even asked of the C library (dlearnable_sink NULL)."""
    asked = []
    backward = _launch.backward

    def spy(problem, out, lse, dout, learnable_sink_grad=False):
        asked.append(learnable_sink_grad)
        return backward(problem, out, lse, dout, learnable_sink_grad)

    monkeypatch.setattr(_launch, "backward", spy)
    batch = modifier_batch(5080)
    sink = _sinks(4, 5081)
    with_grad = _run(batch, sink, causal=True)
    q, k, v = batch.leaves()
    out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, learnable_sink=sink)
    out.backward(batch.dout)
    assert sink.grad is None and asked == [True, False]
    for got, expected in zip((out, q.grad, k.grad, v.grad), with_grad[:1] + with_grad[2:5]):
        assert_same(got, expected)


def test_only_the_sink_requires_grad():
    """q, k, v constants (a frozen model with trainable sinks): the sinks still get their gradient."""
    batch = modifier_batch(5090)
    sink = _sinks(4, 5091).requires_grad_()
    jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, causal=True,
                              learnable_sink=sink).backward(batch.dout)
    assert_close("dsink", sink.grad, reference(batch, sink, causal=True)[5], TOLERANCES[torch.float32][1], batch.seed)


def test_a_parameter_takes_the_eager_path(monkeypatch):
    """A model's sinks are an nn.Parameter: plain eager calls with one skip the custom op's dispatch
    (ops.fwd) and give it its gradient."""
    batch = modifier_batch(5100)
    monkeypatch.setattr(ops, "fwd", lambda *args: pytest.fail("the custom op served a plain eager call"))
    sink = torch.nn.Parameter(_sinks(4, 5101))
    q, k, v = batch.leaves()
    jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, learnable_sink=sink).backward(batch.dout)
    assert_close("dsink", sink.grad, reference(batch, sink)[5], TOLERANCES[torch.float32][1], batch.seed)


def test_the_eager_path_and_the_custom_op_agree():
    batch = modifier_batch(5110)
    sink = _sinks(4, 5111)
    results = []
    for through_op in (False, True):
        q, k, v = batch.leaves()
        s = sink.clone().requires_grad_()
        if through_op:
            out, _ = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 1, -1, -1, 0.0, "auto", 0,
                                            False, 0.0, None, None, None, 0, None, s)
        else:
            out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, learnable_sink=s)
        out.backward(batch.dout)
        results.append((out, q.grad, k.grad, v.grad, s.grad))
    for got, expected in zip(*results):
        assert_same(got, expected)


def test_no_grad_path_matches():
    batch = modifier_batch(5120)
    sink = _sinks(4, 5121).requires_grad_()
    with torch.no_grad():
        out = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                        learnable_sink=sink)
    assert_close("out", out, reference(batch, sink)[0], TOLERANCES[torch.float32][0], batch.seed)


def test_double_backward_is_refused():
    batch = modifier_batch(5130)
    q, k, v = batch.leaves()
    sink = _sinks(4, 5131).requires_grad_()
    out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, learnable_sink=sink)
    (dsink,) = torch.autograd.grad(out, (sink,), batch.dout, create_graph=True)
    with pytest.raises(jagflash.UnsupportedError, match="double backward is not supported"):
        dsink.sum().backward()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_attention():
    batch = make_batch(5140, q_lengths=[5, 1, 8], heads=4, kv_heads=2, head_dim=16)
    sink = _sinks(4, 5141)

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, batch.q_offsets.long())

    out = jagflash.attention(nested(batch.q), nested(batch.k), nested(batch.v), causal=True, learnable_sink=sink)
    want = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, causal=True, learnable_sink=sink)
    assert_same(out.values(), want)


def test_pooled_attention_against_the_reference_of_the_repeated_queries():
    """Pooled attention with sinks: the reference on the query set repeated per sequence (a
    sequence of length 0 included: its rows get out 0 and lse s_h), dq summed over the sequences."""
    kv_lengths, lq = [5, 0, 9], 3
    g = torch.Generator().manual_seed(5150)
    q = torch.randn(lq, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(14, 2, 32, generator=g, requires_grad=True)
    v = torch.randn(14, 2, 32, generator=g, requires_grad=True)
    sink = _sinks(4, 5151).requires_grad_()
    out, lse = jagflash.pooled_attention(q, k, v, offsets_of(kv_lengths), return_lse=True, learnable_sink=sink)
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    batch = make_batch(0, q_lengths=[lq] * 3, kv_lengths=kv_lengths)
    batch.q, batch.k, batch.v, batch.dout = q.detach().repeat(3, 1, 1), k.detach(), v.detach(), dout
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv, ref_dsink = reference(batch, sink)
    got = (out, lse, q.grad, k.grad, v.grad, sink.grad)
    want = (ref_out, ref_lse, ref_dq.view(3, lq, 4, 32).sum(0), ref_dk, ref_dv, ref_dsink)
    _assert_matches(got, want, torch.float32, 5150)


def test_flash_attn_varlen_func_takes_learnable_sink():
    """FlashAttention-4's keyword; a row that sees no key has softmax_lse = its head's sink (FA2's +inf
    is for rows that see nothing at all)."""
    batch = modifier_batch(5160)
    sink = _sinks(4, 5161)
    q, k, v = batch.leaves()
    s = sink.clone().requires_grad_()
    out, lse, _ = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, 17, 17, causal=True,
                                                  window_size=(3, 2), return_attn_probs=True, learnable_sink=s)
    out.backward(batch.dout)
    _assert_matches((out, lse, q.grad, k.grad, v.grad, s.grad), reference(batch, sink, causal=True, window=(3, 0)),
                    torch.float32, batch.seed)
    with pytest.raises(TypeError):  # keyword only: FA2's positional order stays FA2's
        jagflash.flash_attn_varlen_func(*batch.leaves(), batch.q_offsets, batch.kv_offsets, 17, 17, 0.0, None,
                                        False, (-1, -1), 0.0, None, False, False, None, sink)


def test_backend_takes_the_sinks():
    batch = modifier_batch(5170)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    assert jagflash.backend(*args, learnable_sink=_sinks(4, 5171)) == "reference"
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^learnable_sink: expected .* shape \(4,\)"):
        jagflash.backend(*args, learnable_sink=torch.zeros(3))


# ---- Refusals: named as learnable_sink, with what was expected and what was given.

BAD_SINKS = [
    (torch.zeros(5), r"^learnable_sink: expected a float32, bfloat16 or float16 tensor of shape \(4,\) \(one logit "
                     r"per query head\) on cpu \(q's device\), got torch.float32 \(5,\) on cpu$"),
    (torch.zeros(1, 4), r"^learnable_sink: expected .* shape \(4,\) .*, got torch.float32 \(1, 4\) on cpu$"),
    (torch.zeros(4, dtype=torch.float64), r"^learnable_sink: expected a float32, bfloat16 or float16 .*, "
                                          r"got torch.float64 \(4,\) on cpu$"),
    (torch.zeros(4, dtype=torch.int64), r"^learnable_sink: expected .*, got torch.int64 \(4,\) on cpu$"),
    (torch.zeros(4, device="meta"), r"^learnable_sink: expected .* on the CPU or a CUDA device, got a meta tensor$"),
    ([0.0] * 4, r"^learnable_sink: expected a float32, bfloat16 or float16 tensor of shape \(H,\).*, got list$"),
]


@pytest.mark.parametrize("sink,message", BAD_SINKS, ids=["length", "rank", "float64", "int64", "meta", "list"])
@pytest.mark.parametrize("entry", ["jagged_attention", "pooled_attention", "flash_attn_varlen_func", "op"])
def test_bad_sinks_are_refused(sink, message, entry):
    batch = modifier_batch(5180)
    q, k, v = batch.q, batch.k, batch.v
    calls = {
        "jagged_attention": lambda: jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets,
                                                              learnable_sink=sink),
        "pooled_attention": lambda: jagflash.pooled_attention(q[:3], k, v, batch.kv_offsets, learnable_sink=sink),
        "flash_attn_varlen_func": lambda: jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets,
                                                                          None, None, learnable_sink=sink),
        "op": lambda: torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto", 0,
                                             False, 0.0, None, None, None, 0, None, sink),
    }
    if entry == "op" and not isinstance(sink, torch.Tensor):
        with pytest.raises(RuntimeError, match="for argument 'learnable_sink' but instead found type 'list'"):
            calls[entry]()  # torch's own check of the schema's Tensor?
        return
    if entry == "op" and sink.is_meta:  # the op's fake kernel runs, and refuses it as on another device
        message = r"^learnable_sink: expected .* on cpu \(q's device\), got torch.float32 \(4,\) on meta$"
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        calls[entry]()


def test_a_sink_that_is_not_finite_is_refused_on_the_cpu():
    batch = modifier_batch(5190)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^learnable_sink\[2\]: expected a finite number, got inf"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                  learnable_sink=torch.tensor([0.0, 1.0, math.inf, 0.0]))


def test_the_backward_op_refuses_a_sink_gradient_without_sinks():
    batch = modifier_batch(5200)
    out, lse = torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0,
                                      "auto")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^learnable_sink_grad: expected False without "
                                                            r"learnable_sink"):
        torch.ops.jagflash.bwd(batch.dout, batch.q, batch.k, batch.v, out, lse, batch.q_offsets, batch.kv_offsets, 0,
                               -1, -1, 0.0, "auto", learnable_sink_grad=True)


def test_the_backward_op_returns_the_sinks_gradient_when_asked():
    batch = modifier_batch(5210)
    sink = _sinks(4, 5211)
    op_args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto")
    out, lse = torch.ops.jagflash.fwd(*op_args, learnable_sink=sink)
    bwd_args = (batch.dout, *op_args[:3], out, lse, *op_args[3:])
    *_, none = torch.ops.jagflash.bwd(*bwd_args, learnable_sink=sink)
    *_, dsink = torch.ops.jagflash.bwd(*bwd_args, learnable_sink=sink, learnable_sink_grad=True)
    assert none.shape == (0,) and dsink.shape == (4,) and dsink.dtype == torch.float32
    assert_close("dsink", dsink, reference(batch, sink)[5], TOLERANCES[torch.float32][1], batch.seed)


def test_fake_kernels_check_and_shape_the_sinks():
    with FakeTensorMode():
        q, k, v = torch.empty(12, 4, 64), torch.empty(9, 2, 64), torch.empty(9, 2, 64)
        off = torch.zeros(3, dtype=torch.int32)
        sink = torch.empty(4)
        scalars = (0, -1, -1, 0.0, "auto")
        out, lse = torch.ops.jagflash.fwd(q, k, v, off, off, *scalars, learnable_sink=sink)
        assert out.shape == (12, 4, 64) and lse.shape == (4, 12)
        grads = torch.ops.jagflash.bwd(out, q, k, v, out, lse, off, off, *scalars, learnable_sink=sink,
                                       learnable_sink_grad=True)
        assert [tuple(g.shape) for g in grads] == [(12, 4, 64), (9, 2, 64), (9, 2, 64), (4,)]
        assert grads[3].dtype == torch.float32
        pooled = torch.ops.jagflash.pooled_bwd(out[:6], q[:3], k, v, out[:6], lse[:, :6], off, *scalars,
                                               learnable_sink=sink)
        assert pooled[3].shape == (0,)
        with pytest.raises(jagflash.InvalidArgumentError,
                           match=r"^learnable_sink: expected .*\(4,\).*got torch.float32 \(2,\)"):
            torch.ops.jagflash.fwd(q, k, v, off, off, *scalars, learnable_sink=torch.empty(2))


def test_opcheck():
    batch = modifier_batch(5220, q_lengths=[3, 0, 9, 1], kv_lengths=[5, 2, 9, 0])
    sink = _sinks(4, 5221)
    q, k, v = batch.leaves()
    fields = (1, -1, -1, 0.0, "auto", 0, False, 0.0, None, None, None, 0, None, sink)
    torch.library.opcheck(torch.ops.jagflash.fwd.default, (q, k, v, batch.q_offsets, batch.kv_offsets, *fields))
    out, lse = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, *fields)
    for sink_grad in (False, True):
        torch.library.opcheck(torch.ops.jagflash.bwd.default,
                              (batch.dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, batch.q_offsets,
                               batch.kv_offsets, *fields, sink_grad))


def test_compiled_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) (aot_eager): one graph, output and every gradient (the sinks'
    included) bitwise the eager call's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    batch = modifier_batch(5230)

    def attention(q, k, v, sink):
        return jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, learnable_sink=sink)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attention, backend=counter, fullgraph=True)
    results = []
    for fn in (compiled, attention):
        q, k, v = batch.leaves()
        sink = _sinks(4, 5231).requires_grad_()
        out = fn(q, k, v, sink)
        out.backward(batch.dout)
        results.append((out, q.grad, k.grad, v.grad, sink.grad))
    for got, expected in zip(*results):
        assert_same(got, expected)
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ---- CUDA: bf16 on the Hopper kernels, gpt-oss's shapes scaled down (8 query heads per KV head).

CUDA_HEADS, CUDA_KV_HEADS = 16, 2
CUDA_MASKS = {"causal": (True, (-1, -1)), "window_128": (True, (127, 0)), "window_128_both": (False, (128, 128))}


def _cuda_batch(seed, head_dim):
    return make_batch(seed, q_lengths=MODIFIER_CUDA_Q_LENGTHS, kv_lengths=MODIFIER_CUDA_KV_LENGTHS, heads=CUDA_HEADS,
                      kv_heads=CUDA_KV_HEADS, head_dim=head_dim, dtype=torch.bfloat16, device="cuda")


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", list(CUDA_MASKS))
def test_cuda_matches_the_reference(head_dim, mask):
    skip_unless_hopper_serves(torch.bfloat16, head_dim, backward=True)
    causal, window = CUDA_MASKS[mask]
    batch = _cuda_batch(5300 + head_dim, head_dim)
    _check(batch, _sinks(CUDA_HEADS, 5301, device="cuda"), causal=causal, window=window)


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_sinks_run_on_the_hopper_kernels(head_dim):
    skip_unless_hopper_serves(torch.bfloat16, head_dim, backward=True)
    batch = _cuda_batch(5310, head_dim)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    sink = _sinks(CUDA_HEADS, 5311, device="cuda")
    for backward in (False, True):
        assert jagflash.backend(*args, backward=backward, learnable_sink=sink) == "hopper"


@needs_cuda
def test_cuda_bf16_parameter_sinks_get_a_bf16_gradient():
    skip_unless_hopper_serves(torch.bfloat16, 64, backward=True)
    batch = _cuda_batch(5320, 64)
    sink = torch.nn.Parameter(_sinks(CUDA_HEADS, 5321, torch.bfloat16, "cuda"))
    q, k, v = batch.leaves()
    jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True,
                              learnable_sink=sink).backward(batch.dout)
    assert sink.grad.dtype == torch.bfloat16 and sink.grad.device == sink.device
    want = reference(batch, sink.float(), causal=True)[5]
    assert_close("dsink", sink.grad, want, TOLERANCES[torch.bfloat16][1], batch.seed)


@needs_cuda
def test_cuda_sinks_on_another_device_are_refused():
    batch = _cuda_batch(5330, 64)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^learnable_sink: expected .* on cuda:0 \(q's device\), "
                                                            r"got torch.float32 \(16,\) on cpu$"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                  learnable_sink=_sinks(CUDA_HEADS, 5331))


def test_fake_cuda_tensors_trace_with_sinks():
    """No GPU needed: the fake kernels shape and check a CUDA call with sinks."""
    with FakeTensorMode():
        q = torch.empty(12, CUDA_HEADS, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(9, CUDA_KV_HEADS, 64, dtype=torch.bfloat16, device="cuda")
        off = torch.zeros(3, dtype=torch.int32, device="cuda")
        sink = torch.empty(CUDA_HEADS, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.jagflash.fwd(q, k, k, off, off, 1, -1, -1, 0.0, "auto", learnable_sink=sink)
        assert out.shape == q.shape and lse.shape == (CUDA_HEADS, 12)
        with pytest.raises(jagflash.InvalidArgumentError, match=r"^learnable_sink: expected .* on cuda"):
            torch.ops.jagflash.fwd(q, k, k, off, off, 1, -1, -1, 0.0, "auto",
                                   learnable_sink=torch.empty(CUDA_HEADS, device="cpu"))

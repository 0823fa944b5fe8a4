"""jagflash in torch.nn.attention's flash-attention registry, without a GPU.

What the CPU can show: `import jagflash` registers "jagflash" and activates nothing; activation
puts jagflash's kernels in the dispatcher's CUDA slot of the six flash ops and restore takes them
out (read from torch's dispatch table). And the kernels themselves, registered for the CPU key
(where aten has no flash kernel) so that varlen_attn, aten's autograd formulas and the dense SDPA
op run through them on the C++ reference: bitwise equal to jagged_attention on the same packed
rows, close to float64 SDPA, outputs in the strides torch's meta kernels promise, every case they
cannot serve refused by name. test_registry_cuda.py runs the same routes on the GPU."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                list_flash_attention_impls, restore_flash_attention_impl)
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import jagflash
from jagflash import _capi, _offsets_check, registry
from conftest import TOLERANCES, assert_close, make_batch, reference

OPS = [
    "aten::_flash_attention_forward",
    "aten::_flash_attention_forward.quantized",
    "aten::_flash_attention_backward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention.quantized",
    "aten::_scaled_dot_product_flash_attention_backward",
]


def kernel_source(op, key="CUDA"):
    """Where the kernel the dispatcher runs for op under key was registered ("" if none)."""
    for line in torch._C._dispatch_dump(op).splitlines():
        if line.startswith(f"{key}: registered at "):
            return line.split("registered at ", 1)[1].split(" :: ")[0]
    return ""


@pytest.fixture
def restored():
    """Leaves the registry as it found it: nothing active."""
    restore_flash_attention_impl(_raise_warn=False)
    yield
    restore_flash_attention_impl(_raise_warn=False)


@pytest.fixture
def cpu_kernels():
    """jagflash's flash kernels registered for CPU tensors for the test."""
    library = registry.register_kernels("CPU")
    yield
    library._destroy()


# --- the registry -------------------------------------------------------------------------------


def test_import_registers_without_activating():
    assert "jagflash" in list_flash_attention_impls()
    assert current_flash_attention_impl() is None
    for op in OPS:
        assert "registry.py" not in kernel_source(op)


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")
def test_activate_routes_the_flash_ops_and_restore_undoes_it(restored):
    before = {op: kernel_source(op) for op in OPS}
    activate_flash_attention_impl("jagflash")
    assert current_flash_attention_impl() == "jagflash"
    for op in OPS:
        assert "jagflash/registry.py" in kernel_source(op), op
    # Only the CUDA slot: CPU tensors keep whatever they had (no flash kernel).
    assert "registry.py" not in kernel_source("aten::_flash_attention_forward", "CPU")
    restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    assert {op: kernel_source(op) for op in OPS} == before


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")
def test_activating_twice_replaces_rather_than_stacks(restored):
    activate_flash_attention_impl("jagflash")
    activate_flash_attention_impl("jagflash")  # the registry restores the first before the second
    assert current_flash_attention_impl() == "jagflash"
    restore_flash_attention_impl()
    for op in OPS:
        assert "registry.py" not in kernel_source(op)


def test_handle_remove_is_idempotent():
    handle = registry.Handle(registry.register_kernels("CPU"))
    assert "registry.py" in kernel_source("aten::_flash_attention_forward", "CPU")
    handle.remove()
    handle.remove()
    assert kernel_source("aten::_flash_attention_forward", "CPU") == ""


# --- varlen: varlen_attn and aten::_flash_attention_forward / _backward --------------------------


def _packed(seed, **kwargs):
    kwargs.setdefault("q_lengths", [7, 0, 1, 31, 12])
    kwargs.setdefault("kv_lengths", [9, 4, 0, 31, 5])
    kwargs.setdefault("heads", 4)
    kwargs.setdefault("kv_heads", 2)
    return make_batch(seed, **kwargs)


def _max(offsets):
    return int((offsets[1:] - offsets[:-1]).max())


# varlen_attn's window_size: (-1, 0) is causal, (W, 0) a causal sliding window.
VARLEN_MASKS = {"none": (-1, -1), "causal": (-1, 0), "causal_left8": (8, 0), "window_3_2": (3, 2)}


@pytest.mark.parametrize("mask", VARLEN_MASKS)
def test_varlen_attn_matches_jagged_attention_and_the_reference(cpu_kernels, mask):
    window = VARLEN_MASKS[mask]
    causal = window == (-1, 0)
    batch = _packed(401)
    max_q, max_k = _max(batch.q_offsets), _max(batch.kv_offsets)
    q, k, v = batch.leaves()
    out, lse = varlen_attn(q, k, v, batch.q_offsets, batch.kv_offsets, max_q, max_k, window_size=window,
                           return_aux=AuxRequest(lse=True))
    grads = torch.autograd.grad(out, (q, k, v), batch.dout)

    q2, k2, v2 = batch.leaves()
    expected, expected_lse = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets,
                                                       causal=causal, window=(-1, -1) if causal else window,
                                                       return_lse=True)
    expected_grads = torch.autograd.grad(expected, (q2, k2, v2), batch.dout)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)

    ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=causal, window=(-1, -1) if causal else window)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    assert_close("out", out, ref_out, tol_out, batch.seed)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref_dq, ref_dk, ref_dv)):
        assert_close(name, got, want, tol_grad, batch.seed)


def test_varlen_scale_window_and_hints_reach_the_launch(cpu_kernels, launches):
    batch = _packed(402)
    q, k, v = batch.leaves()
    out, *_ = torch.ops.aten._flash_attention_forward(q, k, v, batch.q_offsets, batch.kv_offsets, 40, 7, 0.0, True,
                                                       False, scale=0.25, window_size_left=5, window_size_right=0)
    out.backward(batch.dout)
    assert [(d, launch.max_seqlen_hint, launch.offsets_check) for d, launch in launches] == [
        ("fwd", 40, _capi.CHECK_OFFSETS_HOST), ("bwd", 40, _capi.CHECK_OFFSETS_HOST)]
    expected = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, causal=True,
                                         window=(5, 0), scale=0.25)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("max_q,max_k,hint", [(3, 40, 40), (0, 0, 0), (-1, 31, 0), (2**40, 31, 0)])
def test_varlen_max_seqlens_are_hints_that_never_fail(cpu_kernels, launches, max_q, max_k, hint):
    batch = _packed(408)
    out = varlen_attn(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, max_q, max_k)
    assert [(d, launch.max_seqlen_hint) for d, launch in launches] == [("fwd", hint)]
    assert torch.equal(out, jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets))


def test_varlen_offsets_follow_the_module_setting(cpu_kernels, launches):
    batch = _packed(403)
    jagflash.set_check_offsets("device")
    try:
        torch.ops.aten._flash_attention_forward(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 31, 31,
                                                0.0, False, False)
    finally:
        jagflash.set_check_offsets("auto")
    assert [launch.offsets_check for _, launch in launches] == [_capi.CHECK_OFFSETS_DEVICE]


def test_varlen_int64_offset_past_int32_is_named(cpu_kernels):
    batch = _packed(404)
    bad = batch.q_offsets.long()
    bad[2] += 2**32
    with pytest.raises(jagflash.InvalidArgumentError, match=r"cum_seq_q\[2\]: expected an offset that fits int32"):
        torch.ops.aten._flash_attention_forward(batch.q, batch.k, batch.v, bad, batch.kv_offsets, 31, 31, 0.0, False,
                                                False)


def test_varlen_output_strides_are_the_meta_kernels(cpu_kernels):
    """q, k, v as slices of one fused [T, 3, H, D] projection (strided rows): out is contiguous, as
    torch.empty_like(q) is, and the gradients are laid out like their inputs' empty_like."""
    batch = _packed(405, kv_lengths=None, kv_heads=4)
    qkv = torch.stack((batch.q, batch.k, batch.v), dim=1).requires_grad_()
    q, k, v = qkv.unbind(1)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, batch.q_offsets, batch.q_offsets, 31, 31, 0.0,
                                                           False, False)
    assert out.stride() == torch.empty_like(q).stride() == (64 * 4, 64, 1)
    assert lse.shape == (4, q.size(0)) and lse.is_contiguous()
    (dqkv,) = torch.autograd.grad(out, qkv, batch.dout)
    expected = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets)
    assert torch.equal(out, expected)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(batch.dout, q, k, v, out, lse, batch.q_offsets,
                                                          batch.q_offsets, 31, 31, 0.0, False, torch.empty(2),
                                                          torch.empty(()))
    assert torch.equal(dqkv, torch.stack((dq, dk, dv), dim=1))


def test_varlen_compiles_in_one_graph(cpu_kernels):
    from torch._dynamo.testing import CompileCounterWithBackend

    batch = _packed(406)

    def fn(q, k, v, cu_q, cu_k):
        return varlen_attn(q, k, v, cu_q, cu_k, 31, 31, window_size=(-1, 0))

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        q, k, v = batch.leaves()
        out = torch.compile(fn, backend=counter, fullgraph=True)(q, k, v, batch.q_offsets, batch.kv_offsets)
        grads = torch.autograd.grad(out, (q, k, v), batch.dout)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    q2, k2, v2 = batch.leaves()
    expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets, causal=True)
    assert torch.equal(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (q2, k2, v2), batch.dout)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("torch_switch,expected", [(False, 0), (True, 1)])
def test_backward_determinism_follows_torch(cpu_kernels, launches, torch_switch, expected):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_switch)
    try:
        batch = _packed(407)
        q, k, v = batch.leaves()
        varlen_attn(q, k, v, batch.q_offsets, batch.kv_offsets, 31, 31).backward(batch.dout)
        qd, kd, vd = (torch.randn(2, 4, 5, 64, requires_grad=True) for _ in range(3))
        torch.ops.aten._scaled_dot_product_flash_attention(qd, kd, vd)[0].sum().backward()
    finally:
        torch.use_deterministic_algorithms(before)
    assert [(d, launch.deterministic) for d, launch in launches] == [("fwd", 0), ("bwd", expected)] * 2


# --- dense: aten::_scaled_dot_product_flash_attention and _flash_attention_forward without offsets ---


def _dense(seed, layout, *, batch=3, heads=4, kv_heads=4, len_q=13, len_kv=13, head_dim=64):
    """[B, H, S, D] leaves in a memory layout:
      "bhsd"    contiguous [B, H, S, D] (per-head rows, no copy);
      "bshd"    [B, S, H, D] memory seen through transpose(1, 2) (per-token rows, no copy);
      "strided" every other position of a longer sequence (neither: copied)."""
    g = torch.Generator().manual_seed(seed)

    def make(h, s):
        if layout == "bhsd":
            t = torch.randn(batch, h, s, head_dim, generator=g)
        elif layout == "bshd":
            t = torch.randn(batch, s, h, head_dim, generator=g).transpose(1, 2)
        else:
            t = torch.randn(batch, h, 2 * s, head_dim, generator=g)[:, :, ::2]
        return t.requires_grad_()

    q, k, v = make(heads, len_q), make(kv_heads, len_kv), make(kv_heads, len_kv)
    dout = torch.randn(batch, heads, len_q, head_dim, generator=g)
    return q, k, v, dout


def _as_packed(t):
    """[B, H, S, D] -> [B*S, H, D], B sequences of S rows."""
    return t.detach().transpose(1, 2).reshape(-1, t.size(1), t.size(3))


def _dense_reference(q, k, v, dout, causal, scale=None):
    """float64 out, lse and gradients from SDPA's math (causal only for Sq == Sk, where top-left and
    bottom-right agree)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=scale,
                                         enable_gqa=k.size(1) != q.size(1))
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    group = q.size(1) // k.size(1)
    scores = q64.detach() @ k64.detach().repeat_interleave(group, dim=1).transpose(-1, -2)
    scores = scores * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)
    return out.detach(), torch.logsumexp(scores, dim=-1), grads


def _check_strides_like_meta(outputs, inputs):
    for got, like in zip(outputs, inputs):
        assert got.stride() == torch.empty_like(like).stride()


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "strided"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_dense_sdpa_op_matches_jagged_attention_and_the_reference(cpu_kernels, layout, causal, gqa):
    q, k, v, dout = _dense(411, layout, kv_heads=2 if gqa else 4)
    out, lse, cum_q, cum_k, max_q, max_k, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, is_causal=causal)
    assert cum_q is None and cum_k is None and (max_q, max_k) == (13, 13)
    assert lse.shape == (3, 4, 13) and lse.is_contiguous() and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _check_strides_like_meta((out, *grads), (q, q, k, v))

    # The same attention on packed rows (the CPU reference gives every row the same bits however
    # the call describes it).
    qp, kp, vp = (_as_packed(t).requires_grad_() for t in (q, k, v))
    offsets = torch.arange(0, 3 * 13 + 1, 13, dtype=torch.int32)
    expected, expected_lse = jagflash.jagged_attention(qp, kp, vp, offsets, offsets, causal=causal, return_lse=True)
    expected_grads = torch.autograd.grad(expected, (qp, kp, vp), _as_packed(dout))
    assert torch.equal(_as_packed(out), expected)
    assert torch.equal(lse, expected_lse.view(4, 3, 13).transpose(0, 1))
    for got, want in zip(grads, expected_grads):
        assert torch.equal(_as_packed(got), want)

    ref_out, ref_lse, ref_grads = _dense_reference(q, k, v, dout, causal)
    tol_out, tol_grad = TOLERANCES[q.dtype]
    assert_close("out", out, ref_out, tol_out, 411)
    assert_close("lse", lse, ref_lse, 1e-5, 411)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, want, tol_grad, 411)


def test_dense_cross_attention_and_scale(cpu_kernels):
    q, k, v, dout = _dense(412, "bshd", len_q=9, len_kv=20)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=0.2)[0]
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _, ref_grads = _dense_reference(q, k, v, dout, False, scale=0.2)
    tol_out, tol_grad = TOLERANCES[q.dtype]
    assert_close("out", out, ref_out, tol_out, 412)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, want, tol_grad, 412)


def test_dense_offsets_are_checked_on_the_device_and_not_remembered(cpu_kernels, launches):
    """The dense path builds its offsets: no host sync for them, and read_device_error() keeps
    reading the caller's own last "device" call."""
    remembered = dict(_offsets_check._remembered)
    q, k, v, dout = _dense(413, "bhsd")
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0].backward(dout)
    assert [launch.offsets_check for _, launch in launches] == [_capi.CHECK_OFFSETS_DEVICE] * 2
    assert _offsets_check._remembered == remembered


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_dense_flash_attention_forward_takes_bshd(cpu_kernels, layout):
    """aten::_flash_attention_forward without offsets: FlashAttention's dense [B, S, H, D], windows
    included."""
    q, k, v, dout = _dense(414, layout, kv_heads=2)
    q_s, k_s, v_s, dout_s = (t.transpose(1, 2) for t in (q, k, v, dout))
    out_s, lse, *_ = torch.ops.aten._flash_attention_forward(q_s, k_s, v_s, None, None, 13, 13, 0.0, False, False,
                                                             window_size_left=3, window_size_right=1)
    assert out_s.shape == q_s.shape and lse.shape == (3, 4, 13)
    grads = torch.autograd.grad(out_s, (q, k, v), dout_s)
    _check_strides_like_meta((out_s,), (q_s,))
    qp, kp, vp = (_as_packed(t).requires_grad_() for t in (q, k, v))
    offsets = torch.arange(0, 3 * 13 + 1, 13, dtype=torch.int32)
    expected = jagflash.jagged_attention(qp, kp, vp, offsets, offsets, window=(3, 1))
    assert torch.equal(out_s.detach().reshape(-1, 4, 64), expected)
    for got, want in zip(grads, torch.autograd.grad(expected, (qp, kp, vp), _as_packed(dout))):
        assert torch.equal(_as_packed(got), want)


# --- what jagflash cannot serve ------------------------------------------------------------------


def _varlen_call(**overrides):
    batch = _packed(421)
    args = dict(query=batch.q, key=batch.k, value=batch.v, cum_seq_q=batch.q_offsets, cum_seq_k=batch.kv_offsets,
                max_q=31, max_k=31, dropout_p=0.0, is_causal=False, return_debug_mask=False)
    args.update(overrides)
    return lambda: torch.ops.aten._flash_attention_forward(**args)


def _dense_call(**overrides):
    q, k, v, _ = _dense(422, "bhsd")
    args = dict(query=q.detach(), key=k.detach(), value=v.detach())
    args.update(overrides)
    return lambda: torch.ops.aten._scaled_dot_product_flash_attention(**args)


def _backward_call(**overrides):
    batch = _packed(423)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(batch.q, batch.k, batch.v, batch.q_offsets,
                                                           batch.kv_offsets, 31, 31, 0.0, False, False)
    args = dict(grad_out=batch.dout, query=batch.q, key=batch.k, value=batch.v, out=out, logsumexp=lse,
                cum_seq_q=batch.q_offsets, cum_seq_k=batch.kv_offsets, max_q=31, max_k=31, dropout_p=0.0,
                is_causal=False, rng_state=torch.empty(2), unused=torch.empty(()))
    args.update(overrides)
    return lambda: torch.ops.aten._flash_attention_backward(**args)


UNSUPPORTED = {
    "dropout": (lambda: _varlen_call(dropout_p=0.1), "_flash_attention_forward.*dropout_p=0.1"),
    "debug mask": (lambda: _varlen_call(return_debug_mask=True), "return_debug_mask=True"),
    "alibi": (lambda: _varlen_call(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    "seqused_k": (lambda: _varlen_call(seqused_k=torch.ones(5, dtype=torch.int32)), "seqused_k"),
    "head dim": (lambda: _varlen_call(query=torch.randn(51, 4, 96), key=torch.randn(49, 2, 96),
                                      value=torch.randn(49, 2, 96)), "head_dim 96"),
    "dtype": (lambda: _varlen_call(query=torch.randn(51, 4, 64, dtype=torch.float64),
                                   key=torch.randn(49, 2, 64, dtype=torch.float64),
                                   value=torch.randn(49, 2, 64, dtype=torch.float64)), "dtype torch.float64"),
    "backward dropout": (lambda: _backward_call(dropout_p=0.1), "_flash_attention_backward.*dropout_p=0.1"),
    "sdpa dropout": (lambda: _dense_call(dropout_p=0.1), "_scaled_dot_product_flash_attention.*dropout_p=0.1"),
    "sdpa debug mask": (lambda: _dense_call(return_debug_mask=True), "return_debug_mask=True"),
    "sdpa head dims differ": (lambda: _dense_call(value=torch.randn(3, 4, 13, 128)), "one head dim"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_what_jagflash_cannot_serve_raises(cpu_kernels, launches, case):
    make, match = UNSUPPORTED[case]
    call = make()
    with pytest.raises(jagflash.UnsupportedError, match=match) as info:
        call()
    assert "restore_flash_attention_impl()" in str(info.value)
    assert launches == [] or case == "backward dropout"  # that one's forward ran to build its inputs


@pytest.mark.parametrize("op,call", [
    ("_flash_attention_forward.quantized", lambda b: torch.ops.aten._flash_attention_forward.quantized(
        b.q, b.k, b.v, b.q_offsets, b.kv_offsets, 31, 31, 0.0, False, False, torch.ones(1), None, None)),
    ("_scaled_dot_product_flash_attention.quantized", lambda b: torch.ops.aten._scaled_dot_product_flash_attention
        .quantized(torch.randn(1, 4, 5, 64), torch.randn(1, 4, 5, 64), torch.randn(1, 4, 5, 64), None, None,
                   torch.ones(1))),
])
def test_fp8_descales_raise(cpu_kernels, op, call):
    with pytest.raises(jagflash.UnsupportedError, match=r"descale: jagflash has no fp8 path"):
        call(_packed(424))


def test_quantized_overloads_without_descales_are_served(cpu_kernels):
    b = _packed(425)
    out = torch.ops.aten._flash_attention_forward.quantized(b.q, b.k, b.v, b.q_offsets, b.kv_offsets, 31, 31, 0.0,
                                                            True, False, None, None, None)[0]
    assert torch.equal(out, jagflash.jagged_attention(b.q, b.k, b.v, b.q_offsets, b.kv_offsets, causal=True))


@pytest.mark.parametrize("overrides,match", [
    ({"cum_seq_k": None}, "cum_seq_q and cum_seq_k must both be given"),
    ({"window_size_left": -2}, "window_size_left: expected >= -1"),
    ({"query": torch.randn(2, 51, 4, 64)}, "expected 3-D tensors"),
])
def test_malformed_calls_raise(cpu_kernels, overrides, match):
    with pytest.raises(jagflash.InvalidArgumentError, match=match):
        _varlen_call(**overrides)()


@pytest.mark.parametrize("right", [-1, 0, 2, 40, None])
def test_causal_takes_the_right_window_as_0_as_torchs_fa2_does(cpu_kernels, right):
    """PyTorch's FA2 kernels set window_size_right to 0 under is_causal: so does the override,
    forward and backward (a sliding-window causal call, left 3)."""
    b = _packed(421)  # _varlen_call's batch
    out, lse, *_ = _varlen_call(is_causal=True, window_size_left=3, window_size_right=right)()
    expected = jagflash.jagged_attention(b.q, b.k, b.v, b.q_offsets, b.kv_offsets, causal=True, window=(3, 0))
    assert torch.equal(out, expected)
    assert registry._mask(True, 3, right) == registry._mask(True, 3, 0)
    with pytest.raises(jagflash.InvalidArgumentError, match="window_size_right: expected >= -1"):
        registry._mask(True, 3, -2)  # still an int >= -1


def test_dense_shape_mismatch_raises(cpu_kernels):
    with pytest.raises(jagflash.InvalidArgumentError, match="H % H_kv == 0"):
        _dense_call(key=torch.randn(3, 3, 13, 64), value=torch.randn(3, 3, 13, 64))()


def test_a_gpu_without_jagflash_kernels_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(jagflash.UnsupportedError,
                       match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\): jagflash's kernels are built for "
                             r"sm_90a"):
        registry._check_device("_flash_attention_forward", torch.device("cuda", 0))


def test_like_keeps_or_copies_to_the_meta_strides():
    reference_bshd = torch.empty(2, 5, 3, 8).transpose(1, 2)  # dense, permuted: empty_like keeps it
    same = torch.randn(2, 5, 3, 8).transpose(1, 2)
    assert registry._like(reference_bshd, same) is same
    other = torch.randn(2, 3, 5, 8)
    copied = registry._like(reference_bshd, other)
    assert copied.stride() == reference_bshd.stride() and torch.equal(copied, other)
    sliced = torch.empty(2, 3, 10, 8)[:, :, ::2]  # not dense: empty_like is contiguous
    contiguous = torch.randn(2, 3, 5, 8)
    assert registry._like(sliced, contiguous) is contiguous

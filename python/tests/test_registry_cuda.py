"""jagflash activated as PyTorch's flash attention, on the GPU: varlen_attn, SDPA on jagged nested
tensors and dense SDPA give jagflash's results (bitwise, against the jagged_attention call that
describes the same rows, with torch's deterministic switch on so that dq is reproducible too) and
the float64 reference's, forward and backward; torch.compile(fullgraph=True) of a model calling
varlen_attn runs jagflash's kernels; what jagflash cannot serve raises; restore brings back
PyTorch's kernel. Skipped (and reported so) without CUDA; needs an sm_90 GPU (H100/H200)."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import (SDPBackend, activate_flash_attention_impl, current_flash_attention_impl,
                                restore_flash_attention_impl, sdpa_kernel)
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import jagflash
from jagflash import _launch
from conftest import TOLERANCES, Batch, assert_close, make_batch, needs_cuda, offsets_of, reference, rel_err

pytestmark = [needs_cuda, pytest.mark.filterwarnings("ignore:Warning only once for all operators")]

# Awkward lengths: empty, one row, around the 128-row tiles, primes, q != kv.
Q_LENGTHS = [0, 1, 127, 129, 300, 17, 64]
KV_LENGTHS = [5, 0, 127, 200, 301, 17, 1]


@pytest.fixture
def active():
    restore_flash_attention_impl(_raise_warn=False)
    activate_flash_attention_impl("jagflash")
    yield
    restore_flash_attention_impl(_raise_warn=False)


@pytest.fixture
def deterministic():
    """torch's switch on (warn_only: other ops may lack a deterministic variant): the registry's
    backward then runs jagflash's deterministic mode, and so does jagged_attention's default."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _assert_equal(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{name}: differs from jagflash's (max |diff| {(got - want).abs().max().item()})"


def _check_reference(batch, results, causal, window, scale=None):
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=causal, window=window, scale=scale)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), results, (ref_out, ref_dq, ref_dk, ref_dv),
                                    (tol_out, tol_grad, tol_grad, tol_grad)):
        assert_close(name, got, want, tol, batch.seed)


# varlen_attn's window_size: (-1, 0) is causal, (W, 0) a causal sliding window.
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (64, 0), (3, 2)])
@pytest.mark.parametrize("head_dim,kv_heads", [(64, 4), (128, 2)])
def test_varlen_attn(active, deterministic, launches, window, head_dim, kv_heads):
    batch = make_batch(501, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS, heads=4, kv_heads=kv_heads,
                       head_dim=head_dim, device="cuda")
    max_q, max_k = max(Q_LENGTHS), max(KV_LENGTHS)
    q, k, v = batch.leaves()
    out, lse = varlen_attn(q, k, v, batch.q_offsets, batch.kv_offsets, max_q, max_k, window_size=window,
                           return_aux=AuxRequest(lse=True))
    grads = _grads(out, (q, k, v), batch.dout)
    assert [d for d, _ in launches] == ["fwd", "bwd"], "varlen_attn did not run jagflash's kernels"

    # varlen_attn passes is_causal for (-1, 0): jagflash's causal mask, as jagged_attention's causal=True.
    causal = window == (-1, 0)
    window = (-1, -1) if causal else window
    q2, k2, v2 = batch.leaves()
    expected, expected_lse = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets, causal=causal,
                                                       window=window, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                                                       return_lse=True)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                               (expected, expected_lse, *_grads(expected, (q2, k2, v2), batch.dout))):
        _assert_equal(name, got, want)
    _check_reference(batch, (out, *grads), causal=causal, window=window)


def _nested(values, offsets):
    """(B, H, j, D) for SDPA from packed [T, H, D] values; grads flow back to values."""
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)


@pytest.mark.parametrize("causal,cross", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_nested_sdpa(active, deterministic, launches, causal, cross, head_dim):
    """SDPA on jagged nested tensors takes aten::_flash_attention_forward (torch's flash backend is
    the first it tries; forced here). Nested flash needs every length >= 1 and one head count."""
    q_lengths = [1, 127, 129, 300, 17, 64]
    kv_lengths = [9, 1, 200, 129, 17, 300] if cross else q_lengths
    batch = make_batch(502, q_lengths=q_lengths, kv_lengths=kv_lengths, heads=4, head_dim=head_dim, device="cuda")
    q_offsets, kv_offsets = batch.q_offsets.long(), batch.kv_offsets.long()
    if not cross:
        kv_offsets = q_offsets  # one offsets tensor: one ragged size, which causal needs
    q, k, v = batch.leaves()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out_nt = F.scaled_dot_product_attention(_nested(q, q_offsets), _nested(k, kv_offsets), _nested(v, kv_offsets),
                                                is_causal=causal)
    out = out_nt.transpose(1, 2).values()
    grads = _grads(out, (q, k, v), batch.dout)
    assert [d for d, _ in launches] == ["fwd", "bwd"], "nested SDPA did not run jagflash's kernels"

    # Nested SDPA passes the scale it computes, sqrt(1 / D), and the batch's maxima.
    scale = math.sqrt(1.0 / head_dim)
    q2, k2, v2 = batch.leaves()
    expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets, causal=causal, scale=scale,
                                         max_seqlen_q=max(q_lengths), max_seqlen_kv=max(kv_lengths))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads),
                               (expected, *_grads(expected, (q2, k2, v2), batch.dout))):
        _assert_equal(name, got, want)
    _check_reference(batch, (out, *grads), causal=causal, window=(-1, -1), scale=scale)


def _dense_inputs(seed, layout, batch, heads, kv_heads, len_q, len_kv, head_dim):
    """bf16 [B, H, S, D] leaves: "bhsd" contiguous, "bshd" [B, S, H, D] memory seen through
    transpose(1, 2) (what x.view(B, S, H, D).transpose(1, 2) gives); dout in q's layout."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(h, s):
        shape = (batch, h, s, head_dim) if layout == "bhsd" else (batch, s, h, head_dim)
        t = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        return t if layout == "bhsd" else t.transpose(1, 2)

    q, k, v, dout = make(heads, len_q), make(kv_heads, len_kv), make(kv_heads, len_kv), make(heads, len_q)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def _rows(t, per_head):
    """[B, H, S, D] as the rows registry.py describes it with: [B*H*S, 1, D] per head, [B*S, H, D]
    per token."""
    if per_head:
        return t.reshape(-1, 1, t.size(3))
    return t.transpose(1, 2).reshape(-1, t.size(1), t.size(3))


@pytest.mark.parametrize("layout,kv_heads", [("bhsd", 4), ("bshd", 4), ("bshd", 2), ("bhsd", 2)])
@pytest.mark.parametrize("causal,len_q,len_kv", [(False, 129, 129), (True, 129, 129), (False, 100, 77)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dense_sdpa(active, deterministic, launches, monkeypatch, layout, kv_heads, causal, len_q, len_kv,
                    head_dim):
    batch, heads = 3, 4
    q, k, v, dout = _dense_inputs(503, layout, batch, heads, kv_heads, len_q, len_kv, head_dim)
    gqa = kv_heads != heads
    row_heads, scales = [], []

    def spy(launch):
        def recording(problem, *args, **kwargs):
            row_heads.append(problem.q.size(1))
            scales.append(problem.scale)  # the C API's scale (0: 1/sqrt(D) computed there)
            return launch(problem, *args, **kwargs)
        return recording

    # forward(problem) and backward(problem, out, lse, dout)
    monkeypatch.setattr(_launch, "forward", spy(_launch.forward))
    monkeypatch.setattr(_launch, "backward", spy(_launch.backward))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    grads = _grads(out, (q, k, v), dout)
    # The expected call below goes through the spies too. SDPA passes the scale it computes for D:
    # the expected call takes the same number.
    row_heads, scale = row_heads[:2], scales[0] or None
    assert scales[1] == scales[0]
    assert scale is None or abs(scale - 1 / math.sqrt(head_dim)) < 1e-6
    assert [d for d, _ in launches] == ["fwd", "bwd"], "dense SDPA did not run jagflash's kernels"
    for got, like in zip((out, *grads), (q, q, k, v)):
        assert got.stride() == torch.empty_like(like).stride()

    # registry.py describes contiguous [B, H, S, D] without GQA per head (B*H one-head sequences)
    # and [B, S, H, D] memory or GQA per token (B sequences of H heads): the same call on the same
    # rows is jagflash's result. Which one it took is read from the rows it passed on.
    assert row_heads == ([1, 1] if layout == "bhsd" and not gqa else [heads, heads])
    per_head = row_heads[0] == 1
    sequences = batch * heads if per_head else batch
    q_offsets = torch.arange(0, sequences * len_q + 1, len_q, dtype=torch.int32, device="cuda")
    kv_offsets = torch.arange(0, sequences * len_kv + 1, len_kv, dtype=torch.int32, device="cuda")
    q2, k2, v2 = (_rows(t.detach(), per_head).requires_grad_() for t in (q, k, v))
    expected = jagflash.jagged_attention(q2, k2, v2, q_offsets, kv_offsets, causal=causal, scale=scale,
                                         max_seqlen_q=len_q, max_seqlen_kv=len_kv)
    expected_grads = _grads(expected, (q2, k2, v2), _rows(dout, per_head))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (expected, *expected_grads)):
        _assert_equal(name, _rows(got, per_head), want)

    # float64 reference on the per-token packing (B sequences).
    packed = Batch(*(_rows(t.detach(), False) for t in (q, k, v, dout)),
                   offsets_of([len_q] * batch), offsets_of([len_kv] * batch), 503)
    _check_reference(packed, [_rows(t, False) for t in (out, *grads)], causal=causal, window=(-1, -1))


class _Block(torch.nn.Module):
    """Fused QKV projection, varlen_attn (causal), output projection."""

    def __init__(self, heads, head_dim):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x, offsets, max_len):
        tokens = x.size(0)
        q, k, v = self.qkv(x).view(tokens, 3, self.heads, -1).unbind(1)
        out = varlen_attn(q, k, v, offsets, offsets, max_len, max_len, window_size=(-1, 0))
        return self.proj(out.reshape(tokens, -1))


def test_compiled_model_calls_jagflash(active, launches):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(504)
    lengths = [1, 127, 129, 300, 17, 64]
    offsets = offsets_of(lengths, "cuda")
    model = _Block(heads=4, head_dim=64).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(sum(lengths), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(lengths), 256, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        out = fn(x, offsets, max(lengths))
        return (out, *torch.autograd.grad(out, (x, *model.parameters()), dy))

    eager = run(model)
    launches.clear()
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    try:
        compiled = run(torch.compile(model, backend=counter, fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: a graph break"
    assert [d for d, _ in launches] == ["fwd", "bwd"], "the compiled model did not run jagflash's kernels"
    # Inductor fuses the projections' epilogues: bf16 rounding may differ from eager's.
    for i, (got, want) in enumerate(zip(compiled, eager)):
        assert rel_err(got, want) <= 2e-2, f"result {i}: compiled differs from eager by {rel_err(got, want):.3g}"


def test_restore_brings_back_pytorchs_kernel(launches):
    restore_flash_attention_impl(_raise_warn=False)
    batch = make_batch(505, q_lengths=[1, 127, 300], heads=4, head_dim=128, device="cuda")

    def run():
        q, k, v = batch.leaves()
        out = varlen_attn(q, k, v, batch.q_offsets, batch.q_offsets, 300, 300, window_size=(-1, 0))
        return (out, *_grads(out, (q, k, v), batch.dout))

    activate_flash_attention_impl("jagflash")
    try:
        with_jagflash = run()
        assert [d for d, _ in launches] == ["fwd", "bwd"]
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    launches.clear()
    builtin = run()
    assert launches == [], "jagflash still ran after restore_flash_attention_impl()"
    source = [line for line in torch._C._dispatch_dump("aten::_flash_attention_forward").splitlines()
              if line.startswith("CUDA: ")]
    assert source and "registry.py" not in source[0]
    _check_reference(batch, with_jagflash, causal=True, window=(-1, -1))
    _check_reference(batch, builtin, causal=True, window=(-1, -1))


def _dense_call(head_dim=64, dropout_p=0.0):
    q, k, v, _ = _dense_inputs(507, "bshd", 2, 4, 4, 33, 33, head_dim)
    return lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), dropout_p=dropout_p)


def _varlen_call(dtype=torch.bfloat16, dropout_p=0.0, **kwargs):
    batch = make_batch(508, q_lengths=[3, 9], heads=4, head_dim=64, dtype=dtype, device="cuda")
    return lambda: torch.ops.aten._flash_attention_forward(batch.q, batch.k, batch.v, batch.q_offsets,
                                                           batch.q_offsets, 9, 9, dropout_p, False, False, **kwargs)


CUDA_UNSUPPORTED = {
    "varlen dropout": (lambda: _varlen_call(dropout_p=0.1), "dropout_p=0.1"),
    "dense dropout": (lambda: _dense_call(dropout_p=0.1), "dropout_p=0.1"),
    "dense head dim 96": (lambda: _dense_call(head_dim=96), "head_dim 96"),
    "fp32": (lambda: _varlen_call(torch.float32), "dtype torch.float32"),
    "alibi": (lambda: _varlen_call(alibi_slopes=torch.ones(4, device="cuda")), "alibi_slopes"),
    "seqused_k": (lambda: _varlen_call(seqused_k=torch.ones(2, dtype=torch.int32, device="cuda")), "seqused_k"),
}


@pytest.mark.parametrize("case", CUDA_UNSUPPORTED)
def test_what_jagflash_cannot_serve_raises(active, case):
    make, match = CUDA_UNSUPPORTED[case]
    call = make()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(jagflash.UnsupportedError, match=match):
        call()


def test_deterministic_backward_repeats_bitwise(active, deterministic):
    batch = make_batch(509, q_lengths=[1, 600, 129, 4000], heads=4, head_dim=128, device="cuda")
    runs = []
    for _ in range(3):
        q, k, v = batch.leaves()
        out = varlen_attn(q, k, v, batch.q_offsets, batch.q_offsets, 4000, 4000)
        runs.append(_grads(out, (q, k, v), batch.dout))
    for run in runs[1:]:
        for name, got, want in zip(("dq", "dk", "dv"), run, runs[0]):
            _assert_equal(name, got, want)


@pytest.mark.parametrize("scale", [1e-50, 1e39])
def test_a_scale_float32_cannot_hold_is_refused(active, launches, scale):
    """aten's scale reaches jagflash as a float32: 1e-50 became the default 1/sqrt(D) (the C API's
    marker, 0) without a word."""
    message = rf"^scale: expected .*, got {re.escape(repr(scale))}$"
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(jagflash.InvalidArgumentError, match=message):
        _varlen_call(scale=scale)()
    assert launches == []

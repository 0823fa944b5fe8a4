"""Shared pieces of the jagflash tests: devices, random jagged batches, and the float64 oracle
(torch's scaled_dot_product_attention per sequence, on upcast tensors, with the mask built
explicitly)."""
import ctypes
import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

try:
    import jagflash
except ImportError:
    # A source checkout without an install: python/ on the path, the library from build/
    # (jagflash's own search order).
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import jagflash

from jagflash import _capi, _lib  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

# Normalised max error (max |a - b| / max |b|) allowed on out and on the gradients, per dtype:
# bf16/fp16 are rounded once on output (2^-8 / 2^-11 relative); fp32 leaves room for the GPU
# paths' fp32 accumulation.
TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (3e-3, 6e-3),
    torch.bfloat16: (1e-2, 2e-2),
}
LSE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}

# Named masks as (causal, window): every kind the API takes, including windows that leave rows
# with no visible key once sequences are bottom-right aligned.
MASKS = {
    "none": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "causal_left8": (True, (8, 0)),
    "window_3_2": (False, (3, 2)),
    "window_unbounded_left_5": (False, (-1, 5)),
    "window_4_unbounded_right": (False, (4, -1)),
    "diagonal": (False, (0, 0)),
}


# ---- What this build's Hopper kernels serve. A trimmed build (JAGFLASH_HOPPER_DTYPES=bf16, fewer head
# dims) has no kernel for some of the GPU tests' cases; a test that expects the Hopper kernels asks
# first and skips, with the reason, what the build does not serve, so the rest pass or fail for real
# (tests/hopper_served.hpp does the same for the C++ GPU tests).
_DTYPE_ENUMS = {torch.bfloat16: _capi.BF16, torch.float16: _capi.FP16, torch.float32: _capi.FP32}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def hopper_kernel_head_dim(dtype, head_dim, v_head_dim=None, *, backward=False, score_mod=None, block_mask=False):
    """The head dim of this build's Hopper kernel for the call in one direction, 0 for none: the
    C library's answer (jagflash_hopper_kernel, the registry the dispatcher searches), asked of no
    device. score_mod: a modifier's name ("softcap", "alibi", "relative_bias"), None for none."""
    lib = _lib.lib()
    kind = 0 if score_mod is None else jagflash.score_mod_kind(score_mod)
    found = ctypes.c_int32(-1)
    status = lib.jagflash_hopper_kernel(1 if backward else 0, _DTYPE_ENUMS[dtype], head_dim, v_head_dim or 0, kind,
                                        int(block_mask), ctypes.byref(found))
    assert status == _capi.OK, lib.jagflash_last_error().decode()
    return found.value


def hopper_unserved(dtype, head_dim, v_head_dim=None, *, forward=True, backward=False, score_mod=None,
                    block_mask=False):
    """Why this build's Hopper kernels do not serve the call in the directions asked, or None when
    they do."""
    missing = [name for name, asked, is_backward in (("forward", forward, False), ("backward", backward, True))
               if asked and not hopper_kernel_head_dim(dtype, head_dim, v_head_dim, backward=is_backward,
                                                       score_mod=score_mod, block_mask=block_mask)]
    if not missing:
        return None
    call = f"{_DTYPE_NAMES[dtype]}/{head_dim}"
    if v_head_dim not in (None, head_dim):
        call += f" (v {v_head_dim})"
    if score_mod is not None:
        call += f" {score_mod}"
    if block_mask:
        call += " block mask"
    return (f"{call}: this build instantiates no Hopper {' and '.join(missing)} for it (JAGFLASH_HOPPER_DTYPES, "
            "JAGFLASH_HEAD_DIMS, JAGFLASH_FORWARD_HEAD_DIMS, JAGFLASH_BACKWARD_HEAD_DIMS)")


def skip_unless_hopper_serves(dtype, head_dim, v_head_dim=None, **kwargs):
    """pytest.skip, with hopper_unserved's reason, unless this build's Hopper kernels serve the call
    (kwargs: hopper_unserved's)."""
    why = hopper_unserved(dtype, head_dim, v_head_dim, **kwargs)
    if why is not None:
        pytest.skip(why)


class RecordedLaunches(list):
    """The binding's record of its C calls, as ("fwd" or "bwd", jf_launch) pairs, brought in from
    the binding whenever the list is read."""

    def __init__(self, binding):
        super().__init__()
        self._binding = binding
        self._fields = binding.jagflash_torch_record_fields()

    def _pull(self):
        count = self._binding.jagflash_torch_take_records(None, 0)
        if not count:
            return
        while True:
            buffer = (ctypes.c_int64 * count)()
            taken = self._binding.jagflash_torch_take_records(buffer, count)
            if taken <= count:
                break
            count = taken  # more were recorded meanwhile: a larger buffer
        for i in range(0, taken, self._fields):
            (direction, offsets_check, backend, reuse_plan, max_seqlen_hint, deterministic, caller_checked_pointers,
             stream, workspace_bytes, workspace) = buffer[i:i + self._fields]
            launch = _capi.Launch(workspace=workspace or None, workspace_bytes=workspace_bytes, stream=stream or None,
                                  offsets_check=offsets_check, backend=backend, reuse_plan=reuse_plan,
                                  max_seqlen_hint=max_seqlen_hint, deterministic=deterministic,
                                  caller_checked_pointers=caller_checked_pointers)
            super().append(("fwd" if direction == 0 else "bwd", launch))

    def __iter__(self):
        self._pull()
        return super().__iter__()

    def __len__(self):
        self._pull()
        return super().__len__()

    def __getitem__(self, index):
        self._pull()
        return super().__getitem__(index)

    def __eq__(self, other):
        self._pull()
        return list(super().__iter__()) == other

    __hash__ = None

    def clear(self):
        self._pull()
        super().clear()


@pytest.fixture
def launches():
    """Every C call jagflash makes, in order, as ("fwd" or "bwd", a copy of its jf_launch as the
    call saw it): what a test reads when the results cannot show a setting (the CPU reference
    ignores the kernel hints). Recorded by the compiled binding (python/binding/)."""
    binding = _lib.binding()
    recorded = RecordedLaunches(binding)
    binding.jagflash_torch_set_recording(1)
    recorded.clear()
    yield recorded
    binding.jagflash_torch_set_recording(0)
    recorded.clear()


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    q_offsets: torch.Tensor
    kv_offsets: torch.Tensor
    seed: int

    def leaves(self):
        """q, k, v as fresh leaves that require grad."""
        return [t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v)]


def offsets_of(lengths, device="cpu", dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype, device=device)


def random_lengths(generator, count, high):
    """count random lengths in [0, high], with 0 and 1 always among them."""
    lengths = torch.randint(0, high + 1, (count,), generator=generator).tolist()
    lengths[0], lengths[count // 2] = 0, 1
    return lengths


def make_batch(seed, *, q_lengths, kv_lengths=None, heads=4, kv_heads=None, head_dim=64, v_head_dim=None,
               dtype=None, device="cpu"):
    """Random inputs on the given lengths (kv_lengths None: self-attention). dtype None: fp32 on
    the CPU (tight tolerances), bf16 on CUDA (the dtype the fast GPU kernels serve). v_head_dim:
    v's (and dout's) head dim, None for head_dim."""
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    kv_lengths = q_lengths if kv_lengths is None else kv_lengths
    kv_heads = heads if kv_heads is None else kv_heads
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    total_q, total_kv = sum(q_lengths), sum(kv_lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    return Batch(
        q=rnd(total_q, heads, head_dim),
        k=rnd(total_kv, kv_heads, head_dim),
        v=rnd(total_kv, kv_heads, v_head_dim),
        dout=rnd(total_q, heads, v_head_dim),
        q_offsets=offsets_of(q_lengths, device),
        kv_offsets=offsets_of(kv_lengths, device),
        seed=seed,
    )


# The score-modifier tests' CPU batch: q != kv lengths with 0- and 1-length sequences, GQA.
MODIFIER_Q_LENGTHS = [7, 0, 1, 13, 5, 9]
MODIFIER_KV_LENGTHS = [9, 4, 0, 13, 2, 17]
# ... and their CUDA batch: sequences across a 64-row Q block and a 128-key KV block, an empty kv side.
MODIFIER_CUDA_Q_LENGTHS = [1, 0, 200, 65, 130, 2]
MODIFIER_CUDA_KV_LENGTHS = [3, 5, 257, 64, 130, 0]


def modifier_batch(seed, **kwargs):
    """make_batch with the modifier tests' defaults (4 heads over 2 KV heads, D = 32, the lengths above)."""
    kwargs.setdefault("q_lengths", MODIFIER_Q_LENGTHS)
    kwargs.setdefault("kv_lengths", MODIFIER_KV_LENGTHS)
    kwargs.setdefault("heads", 4)
    kwargs.setdefault("kv_heads", 2)
    kwargs.setdefault("head_dim", 32)
    return make_batch(seed, **kwargs)


def visible(len_q, len_kv, causal, window):
    """[Lq, Lk] bool: query i sees key j when i + s - left <= j <= i + s + right, s = Lk - Lq."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(len_q).unsqueeze(1)
    j = torch.arange(len_kv).unsqueeze(0)
    shift = len_kv - len_q
    allowed = torch.ones(len_q, len_kv, dtype=torch.bool)
    if left != -1:
        allowed &= j >= i + shift - left
    if right != -1:
        allowed &= j <= i + shift + right
    return allowed


def reference(batch, *, causal=False, window=(-1, -1), scale=None, softcap=None, alibi_slopes=None, bias=None):
    """float64 out, lse, dq, dk, dv (on the CPU) from torch's SDPA per sequence.

    With a score modifier the scores are written out instead of SDPA: s = scale * q.k, then softcap
    (cap * tanh(s / cap)) or ALiBi (s - slope_h * |i + Lk - Lq - j|, FlashAttention-2's), masked and
    softmaxed, all in float64 with torch's autograd for the gradients. bias(len_q, len_kv) is any
    other modifier that adds to the scaled scores: a float64 [H, Lq, Lk] term (a relative-position
    bias, say), added after softcap and ALiBi.

    A row that sees no key must give out 0, lse -inf and zero gradients; SDPA gives NaN there. So
    such rows attend to every key inside SDPA (finite values and gradients) and their output is
    then multiplied by 0, which also zeroes what flows back through them. v may have a head dim of
    its own (out and dout then have it); the default scale is 1/sqrt of q's."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (batch.q, batch.k, batch.v))
    q_off, kv_off = batch.q_offsets.tolist(), batch.kv_offsets.tolist()
    heads, head_dim, v_head_dim = q.shape[1], q.shape[2], v.shape[2]
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    outs, lses = [], []
    for b in range(len(q_off) - 1):
        qs = q[q_off[b]:q_off[b + 1]]
        ks = k[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        vs = v[kv_off[b]:kv_off[b + 1]].repeat_interleave(group, dim=1)
        len_q, len_kv = qs.shape[0], ks.shape[0]
        allowed = visible(len_q, len_kv, causal, window)
        sees_any = allowed.any(dim=1)
        if len_kv == 0:
            outs.append((qs.sum(-1, keepdim=True) * 0).expand(len_q, heads, v_head_dim))
            lses.append(torch.full((heads, len_q), -math.inf, dtype=torch.float64))
            continue
        safe = allowed | ~sees_any.unsqueeze(1)
        if softcap is None and alibi_slopes is None and bias is None:
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=safe, scale=scale
            ).transpose(0, 1)
            outs.append(o * sees_any.view(-1, 1, 1))
            s = torch.einsum("qhd,khd->hqk", qs, ks).detach() * scale
            lses.append(torch.logsumexp(s.masked_fill(~allowed, -math.inf), dim=-1))
            continue
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            i = torch.arange(len_q).unsqueeze(1)
            j = torch.arange(len_kv).unsqueeze(0)
            distance = (i + len_kv - len_q - j).abs().double()
            s = s - alibi_slopes.detach().double().cpu().view(-1, 1, 1) * distance
        if bias is not None:
            s = s + bias(len_q, len_kv)
        p = torch.softmax(s.masked_fill(~safe, -math.inf), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs) * sees_any.view(-1, 1, 1))
        lses.append(torch.logsumexp(s.detach().masked_fill(~allowed, -math.inf), dim=-1))
    out = torch.cat(outs) if outs else (q.sum(-1, keepdim=True) * 0).expand(q.shape[0], heads, v_head_dim)
    lse = torch.cat(lses, dim=1) if lses else torch.empty(heads, 0, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), batch.dout.double().cpu(), allow_unused=True)
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v)))
    return out.detach(), lse, dq, dk, dv


def opcheck_fwd_bwd(batch, q, k, v, scalars):
    """torch.library.opcheck of jagflash.fwd, then of jagflash.bwd through that forward's output,
    with the same trailing scalars (mask, window, scale, check mode, and what follows)."""
    torch.library.opcheck(torch.ops.jagflash.fwd.default, (q, k, v, batch.q_offsets, batch.kv_offsets, *scalars))
    out, lse = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, *scalars)
    torch.library.opcheck(torch.ops.jagflash.bwd.default,
                          (batch.dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, batch.q_offsets,
                           batch.kv_offsets, *scalars))


def assert_compiled_matches_eager(attention, batch):
    """attention(q, k, v, q_offsets, kv_offsets) under torch.compile(fullgraph=True) (aot_eager):
    one graph, and the output and gradients bitwise the eager call's. Returns the compiled output."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attention, backend=counter, fullgraph=True)
    results = []
    for fn in (compiled, attention):
        q, k, v = batch.leaves()
        out = fn(q, k, v, batch.q_offsets, batch.kv_offsets)
        out.backward(batch.dout)
        results.append((out, q.grad, k.grad, v.grad))
    for got, expected in zip(*results):
        assert_same(got, expected)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    return results[0][0]


def rel_err(actual, expected):
    """max |actual - expected| / max |expected| (absolute when expected is all zero)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if expected.numel() == 0:
        return 0.0
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def assert_same(actual, expected):
    """Two jagflash runs on the same inputs: bitwise on the CPU (the reference is deterministic);
    on the GPU within fp32 rounding, since its paths may sum in another order from run to run."""
    tol = 0.0 if actual.device.type == "cpu" else 1e-5
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def assert_close(name, actual, expected, tol, seed):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)} (seed {seed})"
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: normalised max error {err:.3g} > {tol:g} (seed {seed})"


def assert_lse_close(actual, expected, tol, seed):
    """-inf exactly where the reference has it, close elsewhere."""
    actual = actual.detach().double().cpu()
    inf_a, inf_e = torch.isinf(actual), torch.isinf(expected)
    assert torch.equal(inf_a, inf_e), f"lse: -inf at different rows (seed {seed})"
    if (~inf_e).any():
        err = ((actual - expected)[~inf_e].abs() / expected[~inf_e].abs().clamp_min(1.0)).max().item()
        assert err <= tol, f"lse: max error {err:.3g} > {tol:g} (seed {seed})"


def check_against_reference(batch, *, causal=False, window=(-1, -1), scale=None, softcap=None, alibi_slopes=None,
                            bias=None, **kwargs):
    """Runs jagged_attention forward and backward on batch and compares all five results. kwargs
    go to jagged_attention (score_mod=, score_mod_table= for a modifier the reference takes as
    `bias`, see reference)."""
    q, k, v = batch.leaves()
    modifiers = {}
    if softcap is not None:
        modifiers["softcap"] = softcap
    if alibi_slopes is not None:
        modifiers["alibi_slopes"] = alibi_slopes
    out, lse = jagflash.jagged_attention(
        q, k, v, batch.q_offsets, batch.kv_offsets, causal=causal, window=window, scale=scale,
        return_lse=True, **modifiers, **kwargs,
    )
    out.backward(batch.dout)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(batch, causal=causal, window=window, scale=scale,
                                                         softcap=softcap, alibi_slopes=alibi_slopes, bias=bias)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    assert out.dtype == batch.q.dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, tol_out, batch.seed)
    assert_lse_close(lse, ref_lse, LSE_TOLERANCE[batch.q.dtype], batch.seed)
    assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
    assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
    assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)

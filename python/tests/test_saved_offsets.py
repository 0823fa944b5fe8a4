"""Offsets changed in place between the forward and the backward: every autograd path saves them
for backward (ctx.save_for_backward), so the backward raises torch's "modified by an inplace
operation" instead of computing the gradients of other sequences. The eager fast path kept them
on ctx unsaved: dq came out off by up to 2.0 with no error."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import jagflash
from jagflash import ops
from conftest import DEVICES

INPLACE = "modified by an inplace operation"


def _inputs(device, requires_grad=True):
    """fp32 on the CPU, bf16 on CUDA (the dtype the fast kernels serve)."""
    g = torch.Generator().manual_seed(2501)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(7, 2, 64, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)
    off = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
    return q, off


def _jagged(q, off):
    return jagflash.jagged_attention(q, q, q, off)


def _jagged_kv(q, off):
    return jagflash.jagged_attention(q, q, q, off.clone(), off)  # kv_offsets changed, q's not


def _varlen(q, off):
    return jagflash.flash_attn_varlen_func(q, q, q, off, off, 4, 4)


def _op(q, off):
    return ops.fwd(q, q, q, off, off, 0, -1, -1, 0.0, "auto")[0]


def _compiled(q, off):
    torch._dynamo.reset()
    return torch.compile(_jagged, backend=CompileCounterWithBackend("aot_eager"), fullgraph=True)(q, off)


def _pooled(q, off):
    return jagflash.pooled_attention(q[:2], q, q, off)


PATHS = {"eager": _jagged, "eager-kv": _jagged_kv, "flash_attn_varlen_func": _varlen, "op": _op,
         "compiled": _compiled, "pooled": _pooled}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_offsets_changed_before_the_backward_raise(device, path):
    q, off = _inputs(device)
    out = PATHS[path](q, off)
    off[1] = 5  # same batch size and total, other lengths: a change no shape check sees
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_nested_offsets_changed_before_the_backward_raise(device):
    q, off = _inputs(device)
    nt = torch.nested.nested_tensor_from_jagged(q, off)
    out = jagflash.attention(nt, nt, nt)
    off[1] = 5
    with pytest.raises(RuntimeError, match=INPLACE):
        out.values().sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_unchanged_offsets_still_give_the_gradients(device):
    """Saving the offsets changes nothing else: the eager path and the op agree bitwise
    (deterministic: on the GPU dq is then bitwise reproducible too)."""
    q, off = _inputs(device)
    (dq,) = torch.autograd.grad(jagflash.jagged_attention(q, q, q, off, deterministic=True).sum(), q)
    q2, _ = _inputs(device)
    (dq_op,) = torch.autograd.grad(ops.fwd(q2, q2, q2, off, off, 0, -1, -1, 0.0, "auto", 0, True)[0].sum(), q2)
    assert torch.equal(dq, dq_op)


# The score modifier's tensors, changed in place between the forward and the backward, raise the
# same way on every path (the eager fast path kept them on ctx unsaved: the slopes' case gave dq
# off by 0.075 of 0.218 and the table's by 1e5 relative, with no error).
def _slopes(device):
    return torch.tensor([0.5, 0.25], device=device)


def _table(device):
    return torch.linspace(-1.0, 1.0, 2 * 5, device=device).reshape(2, 5)


MODIFIERS = {
    "alibi_slopes": lambda device: {"alibi_slopes": _slopes(device)},
    "score_mod_table": lambda device: {"score_mod": "relative_bias", "score_mod_table": _table(device)},
}
MODIFIER_PATHS = {
    "eager": lambda q, off, **mod: jagflash.jagged_attention(q, q, q, off, **mod),
    "compiled": lambda q, off, **mod: torch.compile(
        lambda q, off: jagflash.jagged_attention(q, q, q, off, **mod), backend="aot_eager", fullgraph=True)(q, off),
    "pooled": lambda q, off, **mod: jagflash.pooled_attention(q[:2], q, q, off, **mod),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("modifier", MODIFIERS)
@pytest.mark.parametrize("path", MODIFIER_PATHS)
def test_modifier_tensors_changed_before_the_backward_raise(device, modifier, path):
    torch._dynamo.reset()
    q, off = _inputs(device)
    mod = MODIFIERS[modifier](device)
    out = MODIFIER_PATHS[path](q, off, **mod)
    mod[modifier].mul_(20)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_slopes_changed_before_the_backward_raise(device):
    q, off = _inputs(device)
    slopes = _slopes(device)
    out = jagflash.flash_attn_varlen_func(q, q, q, off, off, 4, 4, alibi_slopes=slopes)
    slopes.mul_(20)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("modifier", MODIFIERS)
def test_unchanged_modifier_tensors_give_the_ops_gradients(device, modifier):
    """The eager path with the modifier's tensors saved agrees bitwise with the registered op."""
    q, off = _inputs(device)
    mod = MODIFIERS[modifier](device)
    (dq,) = torch.autograd.grad(jagflash.jagged_attention(q, q, q, off, deterministic=True, **mod).sum(), q)
    q2, _ = _inputs(device)
    slopes, table = mod.get("alibi_slopes"), mod.get("score_mod_table")
    kind = jagflash.score_mod_kind("relative_bias") if table is not None else 0
    out = ops.fwd(q2, q2, q2, off, off, 0, -1, -1, 0.0, "auto", 0, True, 0.0, slopes, None, None, kind, table)[0]
    (dq_op,) = torch.autograd.grad(out.sum(), q2)
    assert torch.equal(dq, dq_op)

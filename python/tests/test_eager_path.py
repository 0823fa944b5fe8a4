"""jagged_attention's eager fast path (an autograd.Function straight onto the C library) and the
registered op torch.ops.jagflash.fwd must be the same function: same outputs and gradients,
bitwise, on the same inputs; and the fast path must step aside whenever something traces."""
import contextlib

import pytest
import torch

import jagflash
from jagflash import _launch, ops
from conftest import make_batch, needs_cuda


def _run(batch, use_op):
    q, k, v = batch.leaves()
    q_off, kv_off = batch.q_offsets.to(torch.int32), batch.kv_offsets.to(torch.int32)
    # JF_MASK_CAUSAL, default scale, no max_seqlen hint, not deterministic
    args = (q, k, v, q_off, kv_off, 1, -1, -1, 0.0, "host", 0, False)
    out, lse = ops.fwd(*args) if use_op else ops.eager_attention(_launch.Problem(*args))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), batch.dout)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_fast_path_equals_registered_op(device):
    batch = make_batch(7, q_lengths=[5, 0, 33, 1], kv_lengths=[9, 4, 33, 0], heads=4, kv_heads=2, device=device)
    for name, fast, slow in zip(("out", "lse", "dq", "dk", "dv"), _run(batch, False), _run(batch, True)):
        assert torch.equal(fast, slow), f"{name} differs between the eager path and the op"


def test_fast_path_only_for_plain_eager_tensors():
    t = torch.zeros(2, 4, 64)
    assert ops.eager_fast_path_allowed(t, t)
    assert not ops.eager_fast_path_allowed(t, torch.zeros(2, 4, 64, device="meta"))
    with torch.overrides.TorchFunctionMode():
        assert not ops.eager_fast_path_allowed(t)


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: enough to make the fast path step aside."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _public_call(q, k, v, batch, use_op):
    """jagged_attention itself, on the eager fast path or (under a function mode, which makes it
    step aside) on the registered op; asserts which one served it."""
    with _PassThrough() if use_op else contextlib.nullcontext():
        out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True)
    assert ("jagflash_fwd" in type(out.grad_fn).__name__) == use_op, type(out.grad_fn).__name__
    return out


@pytest.mark.parametrize("use_op", [False, True], ids=["eager", "op"])
def test_the_public_function_takes_the_path_it_should(use_op):
    batch = make_batch(9, q_lengths=[3, 4])
    _public_call(*batch.leaves(), batch, use_op)


@pytest.mark.parametrize("use_op", [False, True], ids=["eager", "op"])
def test_double_backward_raises_on_both_paths(use_op):
    """create_graph=True still gives the first-order gradients; differentiating them again
    raises. The eager path returned gradients with no graph (a gradient penalty trained on a
    gradient missing the attention's term), the op path raised torch's own error."""
    batch = make_batch(10, q_lengths=[5, 0, 9], kv_lengths=[3, 2, 9], heads=4, kv_heads=2)
    q, k, v = batch.leaves()
    out = _public_call(q, k, v, batch, use_op)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), batch.dout, create_graph=True)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), _run(batch, use_op)[2:]):
        assert torch.equal(got, want), f"{name} differs under create_graph=True"
    with pytest.raises(jagflash.UnsupportedError, match="double backward is not supported"):
        (dq.square().sum() + dk.square().sum() + dv.square().sum()).backward()
    # A gradient of out.sum(): dout has no graph of its own, q, k, v carry the dependence.
    out = _public_call(q, k, v, batch, use_op)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(jagflash.UnsupportedError, match="double backward is not supported"):
        torch.autograd.grad(dq.sum(), k)

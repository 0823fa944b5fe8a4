"""jagged_attention's eager fast path (an autograd.Function straight onto the C library) and the
registered op torch.ops.jagflash.fwd must be the same function: same outputs and gradients,
bitwise, on the same inputs; and the fast path must step aside whenever something traces."""
import pytest
import torch

import jagflash
from jagflash import ops
from conftest import make_batch, needs_cuda


def _run(batch, use_op):
    q, k, v = batch.leaves()
    q_off, kv_off = batch.q_offsets.to(torch.int32), batch.kv_offsets.to(torch.int32)
    args = (q, k, v, q_off, kv_off, 1, -1, -1, 0.0, "host", 0)  # JF_MASK_CAUSAL, default scale, no max_seqlen hint
    out, lse = ops.fwd(*args) if use_op else ops.EagerAttention.apply(*args)
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

"""deterministic reaches the backward's jf_launch.deterministic on every path: the eager fast
path, the registered op, a compiled graph and the nested-tensor entry; None follows
torch.use_deterministic_algorithms. Read from the C call's arguments (the CPU reference is
deterministic either way, so the results cannot show it)."""
import contextlib

import pytest
import torch

import jagflash
from conftest import make_batch


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: jagged_attention then takes the registered op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _flags(launches):
    return [(direction, launch.deterministic) for direction, launch in launches]


@contextlib.contextmanager
def _torch_deterministic(enabled):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _forward_backward(deterministic, path):
    batch = make_batch(71, q_lengths=[5, 0, 9], kv_lengths=[4, 3, 9], heads=4, kv_heads=2)
    q, k, v = batch.leaves()

    def attention(q, k, v, q_offsets, kv_offsets):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, deterministic=deterministic)

    if path == "compiled":
        torch._dynamo.reset()
        attention = torch.compile(attention, backend="aot_eager", fullgraph=True)
    with _PassThrough() if path == "op" else contextlib.nullcontext():
        out = attention(q, k, v, batch.q_offsets, batch.kv_offsets)
    out.backward(batch.dout)
    if path == "compiled":
        torch._dynamo.reset()


PATHS = ["eager", "op", "compiled"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("deterministic,torch_switch,expected", [
    (True, False, 1),
    (False, False, 0),
    (None, False, 0),
    (None, True, 1),  # torch.use_deterministic_algorithms(True)
    (False, True, 0),  # an explicit False wins over torch's switch
])
def test_deterministic_reaches_the_backward(launches, path, deterministic, torch_switch, expected):
    with _torch_deterministic(torch_switch):
        _forward_backward(deterministic, path)
    # The forward is always deterministic: its flag stays 0.
    assert _flags(launches) == [("fwd", 0), ("bwd", expected)]


def test_nested_attention_passes_it_on(launches):
    seqs = [torch.randn(n, 2, 64, requires_grad=True) for n in (3, 1, 6)]
    nt = torch.nested.nested_tensor([s.detach() for s in seqs], layout=torch.jagged, requires_grad=True)
    jagflash.attention(nt, nt, nt, deterministic=True).values().sum().backward()
    assert _flags(launches) == [("fwd", 0), ("bwd", 1)]


def test_deterministic_must_be_a_bool():
    batch = make_batch(72, q_lengths=[3])
    with pytest.raises(jagflash.InvalidArgumentError, match=r"deterministic: expected None, True or False, got 1"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, deterministic=1)


def test_the_ops_keep_their_old_arity(launches):
    """Calls written before the argument existed (max_seqlen and deterministic left out) still
    run, with deterministic off."""
    batch = make_batch(73, q_lengths=[4, 2])
    scalars = (1, -1, -1, 0.0, "host")
    out, lse = torch.ops.jagflash.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, *scalars)
    torch.ops.jagflash.bwd(batch.dout, batch.q, batch.k, batch.v, out, lse, batch.q_offsets, batch.kv_offsets,
                           *scalars)
    assert _flags(launches) == [("fwd", 0), ("bwd", 0)]

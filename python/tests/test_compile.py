"""The custom ops under torch.library.opcheck and torch.compile(fullgraph=True): one graph, no
break, no recompilation for a new batch, the same numbers as eager."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import jagflash
from conftest import DEVICES, assert_same, make_batch, opcheck_fwd_bwd


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _attention(q, k, v, q_offsets, kv_offsets):
    return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, window=(6, 0))


def _run(fn, batch):
    """out and the three gradients; the backward of a compiled fn is AOTAutograd's compiled one."""
    q, k, v = batch.leaves()
    out = fn(q, k, v, batch.q_offsets, batch.kv_offsets)
    out.backward(batch.dout)
    return out, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """Schema, fake kernels, autograd registration and AOT dispatch (static and dynamic)."""
    batch = make_batch(21, q_lengths=[3, 0, 9, 1], kv_lengths=[5, 2, 9, 0], heads=4, kv_heads=2, device=device)
    q, k, v = batch.leaves()
    # The trailing max_seqlen and deterministic left to their defaults, and given.
    for scalars in ((1, -1, -1, 0.0, "auto"), (1, -1, -1, 0.0, "auto", 9, True)):
        opcheck_fwd_bwd(batch, q, k, v, scalars)


@pytest.mark.parametrize("device", DEVICES)
def test_fullgraph_forward_backward_one_graph(device):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_attention, backend=counter, fullgraph=True)
    batch = make_batch(22, q_lengths=[7, 1, 0, 25], kv_lengths=[9, 4, 3, 20], device=device)
    out, grads = _run(compiled, batch)
    expected_out, expected_grads = _run(_attention, batch)
    assert_same(out, expected_out)
    for got, expected in zip(grads, expected_grads):
        assert_same(got, expected)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: a graph break"


@pytest.mark.parametrize("device", DEVICES)
def test_new_batch_does_not_recompile(device):
    """Offsets are data: a batch with other lengths, batch size and totals reuses the graph."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_attention, backend=counter, fullgraph=True, dynamic=True)
    for seed, q_lengths, kv_lengths in ((23, [7, 1, 0, 25], [9, 4, 3, 20]), (24, [2, 30, 5], [3, 3, 40])):
        batch = make_batch(seed, q_lengths=q_lengths, kv_lengths=kv_lengths, device=device)
        (out, grads), (expected_out, expected_grads) = _run(compiled, batch), _run(_attention, batch)
        assert_same(out, expected_out)
        assert_same(grads[0], expected_grads[0])
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs"


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_fullgraph(device):
    """The default backend (Inductor), with int64 offsets converted inside the graph."""
    def step(q, k, v, q_offsets):
        out = jagflash.jagged_attention(q, k, v, q_offsets, causal=True)
        return (out.float() * 2).sum()

    batch = make_batch(25, q_lengths=[5, 0, 12, 1], device=device, dtype=torch.bfloat16)
    q, k, v = batch.leaves()
    loss = torch.compile(step, fullgraph=True)(q, k, v, batch.q_offsets.long())
    loss.backward()
    q2, k2, v2 = batch.leaves()
    expected = step(q2, k2, v2, batch.q_offsets.long())
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want)


def test_int64_offsets_past_int32_raise_in_a_compiled_graph():
    """The graph converts the offsets itself: a value int32 cannot hold must fail the offsets
    check there too (the message names the -1 it became, not the value: only eager calls
    read the offsets back to say which)."""
    batch = make_batch(26, q_lengths=[4, 6])
    compiled = torch.compile(lambda q, k, v, o: jagflash.jagged_attention(q, k, v, o), backend="aot_eager",
                             fullgraph=True)
    good = batch.q_offsets.long()
    assert_same(compiled(batch.q, batch.k, batch.v, good), jagflash.jagged_attention(batch.q, batch.k, batch.v, good))
    bad = torch.tensor([0, 2**32 + 4, 10])
    with pytest.raises(jagflash.InvalidArgumentError, match=r"q_offsets\[1\]: expected non-decreasing offsets .*got -1"):
        compiled(batch.q, batch.k, batch.v, bad)

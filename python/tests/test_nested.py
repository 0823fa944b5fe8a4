"""jagflash.attention on torch.nested jagged tensors (B, j, H, D)."""
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import jagflash
from conftest import DEVICES, assert_same, make_batch


def _nested(values, offsets):
    return torch.nested.nested_tensor_from_jagged(values, offsets.long())


@pytest.mark.parametrize("device", DEVICES)
def test_nested_matches_packed(device):
    batch = make_batch(31, q_lengths=[5, 1, 17, 0, 8], kv_lengths=[6, 3, 17, 2, 0], heads=4, kv_heads=2,
                       device=device)
    q, k, v = batch.leaves()
    out = jagflash.attention(_nested(q, batch.q_offsets), _nested(k, batch.kv_offsets),
                             _nested(v, batch.kv_offsets), causal=True)
    assert out.is_nested and out.layout == torch.jagged and out.dim() == 4
    assert out.shape[0] == 5 and out.shape[2:] == q.shape[1:]
    assert_same(out.offsets(), batch.q_offsets.long())
    out.values().backward(batch.dout)

    q2, k2, v2 = batch.leaves()
    expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets, causal=True)
    expected.backward(batch.dout)
    assert_same(out.values(), expected)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert_same(got, want)


def test_nested_from_list_of_sequences():
    """The usual way to build one: a list of [L_i, H, D] tensors."""
    seqs = [torch.randn(n, 2, 64) for n in (3, 1, 6)]
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    out = jagflash.attention(nt, nt, nt)
    offsets = torch.tensor([0, 3, 4, 10])
    packed = torch.cat(seqs)
    torch.testing.assert_close(out.values(), jagflash.jagged_attention(packed, packed, packed, offsets))
    out_plus_q = out + nt  # same offsets: the output adds to its input (a residual)
    assert out_plus_q.shape[0] == 3


def test_nested_under_compile():
    counter = CompileCounterWithBackend("aot_eager")
    batch = make_batch(32, q_lengths=[5, 1, 17, 8])
    nts = [_nested(t, batch.q_offsets) for t in (batch.q, batch.k, batch.v)]
    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: jagflash.attention(q, k, v, causal=True), backend=counter, fullgraph=True)(*nts)
    assert_same(out.values(), jagflash.attention(*nts, causal=True).values())
    assert counter.frame_count == 1


def test_nested_rejects_other_layouts():
    dense = torch.randn(2, 3, 4, 64)
    with pytest.raises(jagflash.InvalidArgumentError, match="q: expected a torch.nested tensor"):
        jagflash.attention(dense, dense, dense)
    nt = torch.nested.nested_tensor([torch.randn(3, 2, 64), torch.randn(4, 2, 64)], layout=torch.jagged)
    transposed = nt.transpose(1, 2)  # (B, H, j, D): ragged in dim 2
    with pytest.raises(jagflash.InvalidArgumentError, match="ragged in dim 1"):
        jagflash.attention(transposed, transposed, transposed)


@pytest.mark.parametrize("device", DEVICES)
def test_v_must_have_the_offsets_of_k(device):
    """k and v with the same totals but other lengths: v's offsets were never read (the call
    returned attention over k's lengths)."""
    batch = make_batch(33, q_lengths=[3, 5], kv_lengths=[6, 2], device=device)
    q, k = _nested(batch.q, batch.q_offsets), _nested(batch.k, batch.kv_offsets)
    v = _nested(batch.v, torch.tensor([0, 2, 8], device=device))
    # The host check raises at the call, where the eager path names v's offset (the default device
    # check would report the failure at the next call on CUDA, in the C library's words).
    with pytest.raises(jagflash.InvalidArgumentError, match=r"v.offsets\(\)\[1\]: expected k's offset 6 .*, got 2"):
        jagflash.attention(q, k, v, check_offsets="host")


def test_batch_sizes_must_match():
    seqs = [torch.randn(n, 2, 64) for n in (3, 1, 6)]
    q = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    kv = torch.nested.nested_tensor(seqs[:2], layout=torch.jagged)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"k: expected B = 3 sequences \(as q\), got 2"):
        jagflash.attention(q, kv, kv)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"v: expected B = 3 sequences \(as k\), got 2"):
        jagflash.attention(q, q, kv)


def test_v_offsets_are_checked_in_a_compiled_graph():
    """Under compile no eager read-back names v: the call must still fail (on k's offsets,
    made invalid where v's differ)."""
    batch = make_batch(34, q_lengths=[3, 5], kv_lengths=[6, 2])
    q, k = _nested(batch.q, batch.q_offsets), _nested(batch.k, batch.kv_offsets)
    v = _nested(batch.v, torch.tensor([0, 2, 8]))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: jagflash.attention(q, k, v), backend="aot_eager", fullgraph=True)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"kv_offsets\[1\].*got -1"):
        compiled(q, k, v)
    torch._dynamo.reset()


def test_the_first_call_prints_no_torch_warning():
    """The nested result is built without torch.nested.nested_tensor_from_jagged, whose first call
    logs torch's "is_fx_tracing will return true ..." deprecation warning (torch 2.11) into the
    caller's output. In a fresh process: torch logs it once per process."""
    import subprocess
    import sys

    code = (
        "import torch, jagflash\n"
        "seqs = [torch.randn(n, 2, 64) for n in (3, 5)]\n"
        "nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)\n"
        "out = jagflash.attention(nt, nt, nt)\n"
        "assert out.is_nested and (out + nt).shape[0] == 2\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(jagflash.__file__)),
                                                                   os.environ.get("PYTHONPATH")) if p))
    result = subprocess.run([sys.executable, "-W", "default", "-c", code], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "is_fx_tracing" not in result.stderr, result.stderr


def test_errors_name_the_nested_tensors_dims():
    """jagged_attention's words for the packed values (k.shape[1] for the heads) said of the
    (B, j, H, D) tensors the caller passed: heads are their dim 2."""
    q = torch.nested.nested_tensor([torch.randn(3, 4, 64), torch.randn(5, 4, 64)], layout=torch.jagged)
    kv = torch.nested.nested_tensor([torch.randn(3, 3, 64), torch.randn(5, 3, 64)], layout=torch.jagged)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^k.shape\[2\]: expected a divisor of q.shape\[2\] \(4\)"):
        jagflash.attention(q, kv, kv)
    q36 = torch.nested.nested_tensor([torch.randn(3, 4, 36), torch.randn(5, 4, 36)], layout=torch.jagged)
    with pytest.raises(jagflash.UnsupportedError, match=r"^q.shape\[-1\]: expected a multiple of 8 from 8 to 256, got 36$"):
        jagflash.attention(q36, q36, q36)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_what_is_not_a_jagged_nested_tensor_is_named():
    strided = torch.nested.nested_tensor([torch.randn(3, 2, 64), torch.randn(4, 2, 64)], layout=torch.strided)
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=r"^q: expected a torch.nested tensor with layout=torch.jagged, got a nested tensor of "
                             r"layout torch.strided$"):
        jagflash.attention(strided, strided, strided)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^k: expected a torch.nested tensor .*, got None$"):
        nt = torch.nested.nested_tensor([torch.randn(3, 2, 64)], layout=torch.jagged)
        jagflash.attention(nt, None, nt)

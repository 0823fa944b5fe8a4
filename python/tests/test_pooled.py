"""jagflash.pooled_attention: one query set [Lq, H, D] attends over every sequence of a
jagged batch. Against an independent torch float64 computation (the query set attending each
sequence with torch's softmax, the sequences' outputs concatenated, autograd for the gradients:
dq is then the sum over the sequences), on the CPU (the C++ reference) and, where there is one, the
GPU; the nested-tensor entry; errors; torch.compile(fullgraph=True) and opcheck."""
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import jagflash
from conftest import DEVICES, TOLERANCES, assert_close, assert_lse_close, needs_cuda, offsets_of

LENGTHS = [0, 1, 37, 64, 0, 129, 2, 17]


def _inputs(seed, lq, lengths, heads, kv_heads, head_dim, dtype, device):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64).mul_(2).sub_(1).to(dtype).to(device)

    total = sum(lengths)
    q, k, v = rnd(lq, heads, head_dim), rnd(total, kv_heads, head_dim), rnd(total, kv_heads, head_dim)
    dout = rnd(len(lengths) * lq, heads, head_dim)
    return q, k, v, dout, offsets_of(lengths, device)


def _reference(q, k, v, dout, lengths, window=(-1, -1), scale=None):
    """out [B*Lq, H, D], lse [H, B*Lq] and dq, dk, dv in float64: per sequence, the masked softmax
    of the shared queries against its keys (bottom-right aligned window), then autograd."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    lq, heads, head_dim = q.shape
    group = heads // k.shape[1]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    left, right = window
    outs, lses, start = [], [], 0
    for length in lengths:
        kk = k[start:start + length].repeat_interleave(group, dim=1)
        vv = v[start:start + length].repeat_interleave(group, dim=1)
        start += length
        i = torch.arange(lq).unsqueeze(1)
        j = torch.arange(length).unsqueeze(0)
        shift = length - lq
        seen = torch.ones(lq, length, dtype=torch.bool)
        if left >= 0:
            seen &= j >= i + shift - left
        if right >= 0:
            seen &= j <= i + shift + right
        scores = torch.einsum("ihd,jhd->hij", q, kk) * scale
        scores = scores.masked_fill(~seen, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [H, Lq]; -inf where nothing is seen
        p = torch.where(seen, torch.exp(scores - lse.unsqueeze(-1).clamp_min(-1e300)), torch.zeros(()))
        outs.append(torch.einsum("hij,jhd->ihd", p, vv))
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(0, heads, head_dim)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros(heads, 0)
    (out * dout.double().cpu()).sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (q, k, v)]
    return out.detach(), lse.detach(), grads


def _check(seed, lq, lengths, heads, kv_heads, head_dim, dtype, device, window=(-1, -1)):
    q, k, v, dout, offsets = _inputs(seed, lq, lengths, heads, kv_heads, head_dim, dtype, device)
    want_out, want_lse, want_grads = _reference(q, k, v, dout, lengths, window)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = jagflash.pooled_attention(q, k, v, offsets, window=window, return_lse=True)
    out.backward(dout)
    out_tol, grad_tol = TOLERANCES[dtype]
    assert out.shape == (len(lengths) * lq, heads, head_dim) and lse.shape == (heads, len(lengths) * lq)
    assert_close("out", out.detach().double().cpu(), want_out, out_tol, seed)
    assert_lse_close(lse, want_lse, 1e-4 if dtype == torch.float32 else 1e-3, seed)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want_grads):
        assert_close(name, got.double().cpu(), want, grad_tol, seed)
    # Sequences of length 0: out = 0 exactly, lse = -inf.
    for b, length in enumerate(lengths):
        if length == 0:
            assert torch.all(out[b * lq:(b + 1) * lq] == 0)
            assert torch.all(torch.isinf(lse[:, b * lq:(b + 1) * lq]))


@pytest.mark.parametrize("lq", [1, 16, 64, 128, 200])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_cpu_against_torch_float64(lq, heads, kv_heads):
    _check(100 + lq + heads * kv_heads, lq, LENGTHS, heads, kv_heads, 64, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_half_precision(dtype, head_dim):
    _check(200 + head_dim, 16, LENGTHS, 4, 2, head_dim, dtype, "cpu")


@pytest.mark.parametrize("window", [(8, 0), (-1, 3), (5, 9), (0, 0)])
def test_cpu_key_side_window(window):
    _check(300 + window[0], 16, LENGTHS, 4, 2, 64, torch.float32, "cpu", window=window)


def test_scale_and_empty_batch():
    q, k, v, dout, offsets = _inputs(400, 16, [9, 4], 2, 2, 64, torch.float32, "cpu")
    want_out, _, _ = _reference(q, k, v, dout, [9, 4], scale=0.3)
    assert_close("out", jagflash.pooled_attention(q, k, v, offsets, scale=0.3).double(), want_out, 1e-4, 400)
    # B = 0: nothing to attend over; dq is zero.
    q = q.clone().requires_grad_()
    out = jagflash.pooled_attention(q, k[:0], v[:0], offsets_of([]))
    assert out.shape == (0, 2, 64)
    out.sum().backward()
    assert torch.all(q.grad == 0)


def test_int64_offsets_and_their_range():
    q, k, v, _, offsets = _inputs(410, 4, [3, 5], 2, 2, 64, torch.float32, "cpu")
    assert torch.equal(jagflash.pooled_attention(q, k, v, offsets.long()), jagflash.pooled_attention(q, k, v, offsets))
    too_large = offsets.long().clone()
    too_large[1] += 2**32
    with pytest.raises(jagflash.InvalidArgumentError, match=r"kv_offsets\[1\]"):
        jagflash.pooled_attention(q, k, v, too_large)


def test_nested_kv_entry():
    lengths = [5, 0, 12]
    q, k, v, dout, offsets = _inputs(420, 8, lengths, 4, 2, 64, torch.float32, "cpu")
    k_nt = torch.nested.nested_tensor_from_jagged(k, offsets.long())
    v_nt = torch.nested.nested_tensor_from_jagged(v, offsets.long())
    out = jagflash.pooled_attention(q, k_nt, v_nt)
    assert out.shape == (3, 8, 4, 64)
    assert torch.equal(out.flatten(0, 1), jagflash.pooled_attention(q, k, v, offsets))
    with pytest.raises(jagflash.InvalidArgumentError, match="kv_offsets: expected None when k and v are nested"):
        jagflash.pooled_attention(q, k_nt, v_nt, offsets)


def test_errors_name_the_argument():
    q, k, v, _, offsets = _inputs(430, 4, [3, 5], 2, 2, 64, torch.float32, "cpu")
    cases = [
        (lambda: jagflash.pooled_attention(q, k, v), "kv_offsets: expected an int32 or int64 tensor"),
        (lambda: jagflash.pooled_attention(q[0], k, v, offsets), "q: expected a .tokens, heads, head_dim. tensor"),
        (lambda: jagflash.pooled_attention(q[:0], k, v, offsets), "q: expected a query set .Lq, H, D. with Lq >= 1"),
        (lambda: jagflash.pooled_attention(q, k.half(), v, offsets), "k.dtype"),
        (lambda: jagflash.pooled_attention(q, k, v, offsets.float()), "kv_offsets: expected an int32 or int64"),
        (lambda: jagflash.pooled_attention(q, k, v, offsets, window=(-2, 0)), r"window\[0\]"),
        # The C library's own checks, with its message: kv_offsets' values (host check).
        (lambda: jagflash.pooled_attention(q, k, v, torch.tensor([0, 5, 9], dtype=torch.int32), check_offsets="host"),
         r"^kv_offsets\[B=2\]: expected the token count 8, got 9$"),
    ]
    for call, pattern in cases:
        with pytest.raises(jagflash.InvalidArgumentError, match=pattern):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q, k, v, dout, offsets = _inputs(440, 5, [3, 0, 9, 1], 4, 2, 64, torch.float32, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scalars = (jagflash._capi.MASK_WINDOW, 4, 0, 0.0, "auto")
    torch.library.opcheck(torch.ops.jagflash.pooled_fwd.default, (q, k, v, offsets, *scalars))
    out, lse = torch.ops.jagflash.pooled_fwd(q, k, v, offsets, *scalars)
    torch.library.opcheck(torch.ops.jagflash.pooled_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, offsets, *scalars))


@pytest.mark.parametrize("device", DEVICES)
def test_fullgraph_one_graph_no_recompile(device):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, offsets):
        return jagflash.pooled_attention(q, k, v, offsets, window=(16, 0))

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for seed, lengths in ((450, [7, 1, 0, 25]), (451, [2, 30, 5])):
        q, k, v, dout, offsets = _inputs(seed, 8, lengths, 4, 2, 64, torch.float32, device)
        results = []
        for f in (compiled, fn):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = f(*leaves, offsets)
            out.backward(dout)
            results.append((out.detach(), [t.grad for t in leaves]))
        (out, grads), (want, want_grads) = results
        assert torch.equal(out, want)
        for got, expected in zip(grads, want_grads):
            assert torch.equal(got, expected)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    torch._dynamo.reset()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lq", [1, 16, 64, 128, 200])
def test_cuda_against_torch_float64(dtype, head_dim, lq):
    _check(500 + lq + head_dim, lq, LENGTHS, 8, 2, head_dim, dtype, "cuda")


@needs_cuda
def test_cuda_matches_cpu_reference_and_repeats():
    q, k, v, dout, offsets = _inputs(510, 64, [0, 1, 37, 130, 5], 8, 2, 128, torch.bfloat16, "cuda")
    runs = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = jagflash.pooled_attention(*leaves, offsets, deterministic=True)
        out.backward(dout)
        runs.append([out.detach()] + [t.grad for t in leaves])
    for later in runs[1:]:
        for got, first in zip(later, runs[0]):
            assert torch.equal(got, first), "not bitwise repeatable"
    cpu_leaves = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    cpu_out = jagflash.pooled_attention(*cpu_leaves, offsets.cpu())
    cpu_out.backward(dout.cpu())
    assert_close("out", runs[0][0].double().cpu(), cpu_out.detach().double(), TOLERANCES[torch.bfloat16][0], 510)
    for name, got, want in zip(("dq", "dk", "dv"), runs[0][1:], (t.grad for t in cpu_leaves)):
        assert_close(name, got.double().cpu(), want.double(), TOLERANCES[torch.bfloat16][1], 510)


@needs_cuda
def test_cuda_graph_capture_and_compile():
    q, k, v, dout, offsets = _inputs(520, 16, [3, 40, 0, 9], 4, 2, 64, torch.bfloat16, "cuda")
    want = jagflash.pooled_attention(q, k, v, offsets, check_offsets="device")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        jagflash.pooled_attention(q, k, v, offsets, check_offsets="device")  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        got = jagflash.pooled_attention(q, k, v, offsets, check_offsets="device")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    compiled = torch.compile(lambda *a: jagflash.pooled_attention(*a), fullgraph=True)
    assert torch.equal(compiled(q, k, v, offsets), want)

"""What only the GPU has: CUDA-graph capture and replay with new offsets, the device-side offsets
check, the current stream, torch.compile with CUDA graphs. Skipped (and reported so) without CUDA."""
import re

import pytest
import torch

import jagflash
from jagflash import _capi
from conftest import TOLERANCES, Batch, assert_close, make_batch, needs_cuda, offsets_of, reference

pytestmark = needs_cuda

# Two batches of the same batch size and the same totals: a captured graph serves both, since
# only the offsets' values change.
Q_LENGTHS = ([40, 7, 90, 0], [1, 0, 100, 36])
KV_LENGTHS = ([33, 12, 80, 5], [64, 2, 0, 64])


def _batch():
    return make_batch(51, q_lengths=Q_LENGTHS[0], kv_lengths=KV_LENGTHS[0], heads=4, kv_heads=2,
                      dtype=torch.bfloat16, device="cuda")


def _step(q, k, v, q_offsets, kv_offsets, dout, check_offsets=None):
    out = jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True, check_offsets=check_offsets)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _check(results, static, q_lengths, kv_lengths):
    """results (out, dq, dk, dv) against the float64 reference on these lengths."""
    batch = Batch(static.q, static.k, static.v, static.dout, offsets_of(q_lengths), offsets_of(kv_lengths), static.seed)
    tol_out, tol_grad = TOLERANCES[static.q.dtype]
    out, _lse, dq, dk, dv = reference(batch, causal=True)
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), results, (out, dq, dk, dv), (tol_out, *[tol_grad] * 3)):
        assert_close(f"{name} (lengths {q_lengths} / {kv_lengths})", got, want, tol, static.seed)


def _warm_up(fn):
    """Eager runs on a side stream before capture (torch's recipe): libraries and kernels load
    outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for mode in ("host", "device"):
            fn(mode)
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize("mode", ["auto", "device"])
def test_cuda_graph_replay_with_new_offsets(mode):
    static = _batch()
    q, k, v = static.leaves()
    q_offsets, kv_offsets = static.q_offsets.clone(), static.kv_offsets.clone()
    _warm_up(lambda m: _step(q, k, v, q_offsets, kv_offsets, static.dout, m))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = _step(q, k, v, q_offsets, kv_offsets, static.dout, mode)
    for q_lengths, kv_lengths in zip(Q_LENGTHS, KV_LENGTHS):
        q_offsets.copy_(offsets_of(q_lengths))
        kv_offsets.copy_(offsets_of(kv_lengths))
        graph.replay()
        torch.cuda.synchronize()
        _check(results, static, q_lengths, kv_lengths)


def test_host_check_is_refused_under_capture():
    static = _batch()
    q, k, v = static.leaves()
    _warm_up(lambda m: _step(q, k, v, static.q_offsets, static.kv_offsets, static.dout, m))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(jagflash.InvalidArgumentError, match="JF_CHECK_OFFSETS_DEVICE while the stream is being captured"):
        with torch.cuda.graph(graph):
            jagflash.jagged_attention(q, k, v, static.q_offsets, static.kv_offsets, check_offsets="host")


def test_device_check_flags_bad_offsets_in_a_replayed_graph():
    static = _batch()
    q, k, v = static.leaves()
    q_offsets, kv_offsets = static.q_offsets.clone(), static.kv_offsets.clone()
    _warm_up(lambda m: _step(q, k, v, q_offsets, kv_offsets, static.dout, m))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(q, k, v, q_offsets, kv_offsets, static.dout, "device")
    q_offsets[2] = q_offsets[1] - 1  # decreasing
    graph.replay()
    with pytest.raises(jagflash.InvalidArgumentError, match=r"failed a check on the device.*q_offsets: expected non-decreasing"):
        jagflash.read_device_error()
    q_offsets.copy_(offsets_of(Q_LENGTHS[1]))
    kv_offsets.copy_(offsets_of(KV_LENGTHS[1]))
    graph.replay()
    jagflash.read_device_error()


def test_device_check_in_eager_mode():
    """No exception at the call (no sync); read_device_error() reports the forward's flag (and
    the failure counts as reported), and a later good step runs and reads clean."""
    static = _batch()
    q, k, v = static.leaves()
    bad = static.q_offsets.clone()
    bad[0] = 5
    jagflash.jagged_attention(q, k, v, bad, static.kv_offsets, causal=True, check_offsets="device")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"q_offsets: expected \[0\] == 0"):
        jagflash.read_device_error()
    _step(q, k, v, static.q_offsets, static.kv_offsets, static.dout, "device")
    jagflash.read_device_error()


EARLIER = r"an earlier jagflash call on CUDA device \d+ \(reported once, here; this call ran nothing\): "


@pytest.mark.parametrize("mode", [None, "auto", "device"])
def test_default_check_reports_bad_offsets_at_the_next_call(mode, launches):
    """The default never syncs: bad offsets return from the call, and the next call on the device
    raises InvalidArgumentError naming the check (and runs nothing); the call after runs."""
    assert jagflash.get_check_offsets() == "auto"
    jagflash.synchronize()  # nothing left over from another test
    static = _batch()
    bad = static.q_offsets.clone()
    bad[2] = bad[1] - 1  # decreasing
    jagflash.jagged_attention(static.q, static.k, static.v, bad, static.kv_offsets, causal=True, check_offsets=mode)
    assert [launch.offsets_check for _, launch in launches] == [_capi.CHECK_OFFSETS_DEVICE]
    torch.cuda.synchronize()
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=EARLIER + r"the call failed a check on the device \(nothing was written\): "
                                       r"problem.q_offsets: expected non-decreasing values;") as info:
        jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets, causal=True,
                                  check_offsets=mode)
    assert info.value.status == 1  # JF_ERR_INVALID_ARGUMENT
    q, k, v = static.leaves()
    _check(_step(q, k, v, static.q_offsets, static.kv_offsets, static.dout, mode), static, Q_LENGTHS[0], KV_LENGTHS[0])
    jagflash.synchronize()


def test_default_check_writes_nothing():
    """The output of a call with bad offsets keeps the memory it was given. The call's output is
    the block the caching allocator just freed (a 2 MB block, from the large pool, emptied first),
    NaN-filled beforehand."""
    jagflash.synchronize()
    batch = make_batch(52, q_lengths=[1000, 2000, 1096], heads=4, kv_heads=2, dtype=torch.bfloat16, device="cuda")
    bad = batch.q_offsets.clone()
    bad[2] = 500  # [0, 1000, 500, 4096]: decreasing
    torch.cuda.empty_cache()
    poison = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device="cuda")
    poison_ptr = poison.data_ptr()
    del poison
    out = jagflash.jagged_attention(batch.q, batch.k, batch.v, bad, batch.kv_offsets)
    torch.cuda.synchronize()
    reused = out.data_ptr() == poison_ptr
    nan_left = bool(torch.isnan(out).all())
    with pytest.raises(jagflash.InvalidArgumentError, match=EARLIER + r".*problem.q_offsets: expected non-decreasing"):
        jagflash.synchronize()
    if not reused:
        pytest.skip("the caching allocator gave the call another block than the NaN-filled one")
    assert nan_left, "the call with bad offsets wrote its output"


def test_a_bad_forward_is_reported_by_the_backward():
    """Any direction: the backward after a bad forward (once the GPU has run it) raises."""
    jagflash.synchronize()
    static = _batch()
    q, k, v = static.leaves()
    bad = static.q_offsets.clone()
    bad[0] = 1
    out = jagflash.jagged_attention(q, k, v, bad, static.kv_offsets, causal=True)
    torch.cuda.synchronize()
    with pytest.raises(jagflash.InvalidArgumentError, match=EARLIER + r".*problem.q_offsets: expected \[0\] == 0"):
        out.backward(static.dout)
    jagflash.synchronize()


def test_synchronize_reports_once():
    static = _batch()
    bad = static.kv_offsets.clone()
    bad[-1] += 1  # past k's rows
    jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, bad)
    with pytest.raises(jagflash.InvalidArgumentError, match=EARLIER + r".*problem.kv_offsets: expected \[B\] == k.rows"):
        jagflash.synchronize()
    jagflash.synchronize()
    jagflash.synchronize(torch.device("cuda", 0))
    jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets)
    jagflash.read_device_error()  # reads the latch too: nothing


def test_read_device_error_reports_a_default_call():
    """read_device_error() also reports a failure the latch holds ("auto" calls are not remembered)."""
    jagflash.synchronize()
    static = _batch()
    bad = static.q_offsets.clone()
    bad[0] = 3
    jagflash.jagged_attention(static.q, static.k, static.v, bad, static.kv_offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"q_offsets: expected \[0\] == 0"):
        jagflash.read_device_error()
    jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets)
    jagflash.synchronize()


def test_device_check_catches_int64_offsets_past_int32():
    """check_offsets="device" reads nothing back at the call: an int64 offset that int32 cannot
    hold must still fail the device check (it is not wrapped into offsets that look valid)."""
    static = _batch()
    bad = static.q_offsets.long()
    bad[1] += 2**32
    jagflash.jagged_attention(static.q, static.k, static.v, bad, static.kv_offsets, check_offsets="device")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"q_offsets"):
        jagflash.read_device_error()
    jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets, check_offsets="device")
    jagflash.read_device_error()


def test_runs_on_the_current_stream(launches):
    """The result alone cannot show the stream (the default stream gives the same numbers): the
    launch must name the current one."""
    static = _batch()
    expected = jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    streams = [launch.stream or 0 for _, launch in launches]  # ctypes reads a NULL pointer as None
    assert streams == [torch.cuda.current_stream().cuda_stream, stream.cuda_stream]


def test_offsets_on_another_device():
    static = _batch()
    with pytest.raises(jagflash.InvalidArgumentError, match=r"q_offsets.device: expected cuda:0 \(q's device\), got cpu"):
        jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets.cpu(), static.kv_offsets)


def test_compile_with_cuda_graphs():
    """mode="reduce-overhead" records CUDA graphs of forward and backward: the "auto" offsets
    check (the device check) is captured with them, and new offsets replay correctly."""
    static = _batch()
    torch._dynamo.reset()

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def attention(q, k, v, q_offsets, kv_offsets):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True)

    for step in range(4):
        q_lengths, kv_lengths = Q_LENGTHS[step % 2], KV_LENGTHS[step % 2]
        q, k, v = static.leaves()
        torch.compiler.cudagraph_mark_step_begin()
        out = attention(q, k, v, offsets_of(q_lengths).cuda(), offsets_of(kv_lengths).cuda())
        out.backward(static.dout)
        _check((out.detach().clone(), q.grad, k.grad, v.grad), static, q_lengths, kv_lengths)
    torch._dynamo.reset()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_short_max_seqlen_hint_gives_the_same_attention(head_dim, causal):
    """max_seqlen <= 256 picks another forward kernel (64-row tiles, two per CTA; D = 256 has
    one kernel and ignores it): it must match the reference like the default one, including
    length-0 and length-1 sequences."""
    lengths = [17, 0, 1, 200, 64, 65, 129, 256, 3, 97]
    batch = make_batch(61, q_lengths=lengths, heads=4, head_dim=head_dim, device="cuda")
    tol_out, _ = TOLERANCES[batch.q.dtype]
    want, want_lse, *_ = reference(batch, causal=causal)
    for hint in (max(lengths), 300):
        out, lse = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, causal=causal,
                                             max_seqlen_q=hint, return_lse=True)
        assert_close(f"out (max_seqlen {hint})", out, want, tol_out, batch.seed)
        assert_close(f"lse (max_seqlen {hint})", lse, want_lse, tol_out, batch.seed)


@pytest.mark.parametrize("scale", [1e-50, 2.0**-150, 1e39, float("nan")])
def test_a_scale_float32_cannot_hold_is_refused_on_cuda(scale, launches):
    """A scale that rounds to 0 in float32 was the default 1/sqrt(D) (the C API's marker), one
    that rounds to infinity was refused as inf: every entry names the value given and runs
    nothing."""
    static = _batch()
    q, k, v, q_off, kv_off = static.q, static.k, static.v, static.q_offsets, static.kv_offsets
    calls = {
        "jagged_attention": (lambda: jagflash.jagged_attention(q, k, v, q_off, kv_off, scale=scale), "scale"),
        "flash_attn_varlen_func": (lambda: jagflash.flash_attn_varlen_func(q, k, v, q_off, kv_off, 100, 100,
                                                                           softmax_scale=scale), "softmax_scale"),
        "pooled_attention": (lambda: jagflash.pooled_attention(q[:5], k, v, kv_off, scale=scale), "scale"),
        "ops.fwd": (lambda: torch.ops.jagflash.fwd(q, k, v, q_off, kv_off, 0, -1, -1, scale, "auto"), "scale"),
    }
    for entry, (call, name) in calls.items():
        with pytest.raises(jagflash.InvalidArgumentError, match=rf"^{name}: expected .*, got {re.escape(repr(scale))}$"):
            call()
            pytest.fail(f"{entry} served scale={scale!r}")
    assert launches == []


def test_the_smallest_scale_float32_holds_is_served_as_given_on_cuda():
    """2^-149 (a float32 subnormal) is not the default: near-uniform attention, as the reference."""
    static = _batch()
    out = jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets, scale=2.0**-149)
    want = reference(static, scale=2.0**-149)[0]
    assert_close("out (scale 2^-149)", out, want, TOLERANCES[static.q.dtype][0], static.seed)
    default = jagflash.jagged_attention(static.q, static.k, static.v, static.q_offsets, static.kv_offsets)
    assert not torch.equal(out, default)


@pytest.mark.parametrize("path", ["eager", "op", "flash_attn_varlen_func", "pooled"])
def test_offsets_changed_in_place_before_the_backward_raise_on_cuda(path):
    """On the GPU: same batch size and total, other lengths. Without the saved offsets' version
    check the eager path would compute the gradients of the new lengths without a word."""
    static = _batch()
    q, k, v = static.leaves()
    q_off, kv_off = static.q_offsets.clone(), static.kv_offsets.clone()
    if path == "eager":
        out = jagflash.jagged_attention(q, k, v, q_off, kv_off, causal=True)
    elif path == "op":
        out = jagflash.ops.fwd(q, k, v, q_off, kv_off, _capi.MASK_CAUSAL, -1, -1, 0.0, "auto")[0]
    elif path == "flash_attn_varlen_func":
        out = jagflash.flash_attn_varlen_func(q, k, v, q_off, kv_off, 100, 100, causal=True)
    else:
        out = jagflash.pooled_attention(q[:5], k, v, kv_off)
    (kv_off if path == "pooled" else q_off)[1] += 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.ones_like(out))


@pytest.mark.parametrize("w", [1, 4, 64])
def test_flash_attn_varlen_func_causal_sliding_window_as_fa2_on_cuda(w):
    """HuggingFace transformers' call for sliding-window models, causal=True with window_size =
    (w - 1, w - 1): FA2 takes the right side as 0; jagflash refused it. Bitwise the causal window
    (w - 1, 0) of jagged_attention, and close to the float64 reference, forward and backward."""
    static = _batch()
    q, k, v = static.leaves()
    out = jagflash.flash_attn_varlen_func(q, k, v, static.q_offsets, static.kv_offsets, 100, 100, causal=True,
                                          window_size=(w - 1, w - 1), deterministic=True)
    grads = torch.autograd.grad(out, (q, k, v), static.dout)
    q2, k2, v2 = static.leaves()
    expected = jagflash.jagged_attention(q2, k2, v2, static.q_offsets, static.kv_offsets, causal=True,
                                         window=(w - 1, 0), max_seqlen_q=100, max_seqlen_kv=100, deterministic=True)
    expected_grads = torch.autograd.grad(expected, (q2, k2, v2), static.dout)
    assert torch.equal(out, expected)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)
    tol_out, tol_grad = TOLERANCES[static.q.dtype]
    ref_out, _, *ref_grads = reference(static, causal=True, window=(w - 1, 0))
    assert_close("out", out, ref_out, tol_out, static.seed)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, want, tol_grad, static.seed)

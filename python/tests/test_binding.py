"""The compiled binding itself (python/binding/jagflash_torch.cpp, torch.ops.jagflash_c.fwd / .bwd):
registered for CPU and CUDA, loaded next to (and linked to) the library jagflash chose, passing
every argument through to the C API unchanged (bitwise the C library's own result through ctypes),
its errors carrying the C API's message and becoming the package's exceptions, the workspace a
torch allocation, and the jf_launch fields it sets."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

import jagflash
from jagflash import _capi, _errors, _launch, _lib
from conftest import DEVICES, HAS_CUDA, make_batch, needs_cuda, offsets_of

OPS = ("fwd", "bwd")


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    _lib.binding()


@pytest.mark.parametrize("name", OPS)
def test_ops_are_registered_for_cpu_and_cuda(name):
    qualified = f"jagflash_c::{name}"
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), f"{qualified}: no {key} kernel"
    schema = str(getattr(torch.ops.jagflash_c, name).default._schema)
    assert "int offsets_check" in schema and "int max_seqlen" in schema


_MAPS_CHECK = """
import os, torch
from jagflash import _lib
_lib.binding()
with open("/proc/self/maps") as maps:
    loaded = {line.split()[-1] for line in maps if line.rstrip().endswith("/libjagflash.so")}
print(sorted(loaded))
assert loaded == {os.path.realpath(_lib.library_path())}, loaded
"""


def test_binding_is_next_to_the_library_and_uses_that_copy(tmp_path):
    """In a fresh process (other tests load other copies), from a copy of both in a new folder:
    once the binding is loaded, exactly one libjagflash.so is mapped, the one jagflash chose (the
    binding's dependency resolved to it, not to a second copy)."""
    assert os.path.dirname(_lib.binding_path()) == os.path.dirname(_lib.library_path())
    for name in ("libjagflash.so", "libjagflash_torch.so"):
        shutil.copy2(os.path.join(os.path.dirname(_lib.library_path()), name), tmp_path / name)
    env = dict(os.environ, JAGFLASH_LIBRARY=str(tmp_path / "libjagflash.so"),
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(jagflash.__file__)),
                                                        os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _MAPS_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_cuda_stream_query_is_found_in_a_cuda_build_of_torch():
    """The binding links no CUDA library: it looks up torch's aoti_torch_get_current_cuda_stream in
    the libtorch_cuda.so torch loaded. Checked without a GPU wherever torch is a CUDA build."""
    if torch.version.cuda is None:
        pytest.skip("a CPU-only build of torch (no libtorch_cuda.so, no CUDA tensors)")
    assert _lib.binding().jagflash_torch_found_cuda_stream_query() == 1


def _plain(q, k, v, q_offsets, kv_offsets, check_offsets):
    """The problem of a call with no mask, the default scale, no modifier and no block mask."""
    return _launch.Problem(q, k, v, q_offsets, kv_offsets, 0, -1, -1, 0.0, check_offsets)


def _c_forward(q, k, v, q_offsets, kv_offsets, mask, left, right, scale):
    """The C library's own forward through ctypes (what the binding must reproduce bitwise)."""
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    args = _capi.FwdArgs(problem=_launch._problem(q, k, v, q_offsets, kv_offsets, mask, left, right, scale),
                         out=_launch._describe(out), lse=lse.data_ptr() or None)
    lib = _lib.lib()
    _errors.check(lib.jagflash_fwd(ctypes.byref(args)), lib)
    return out, lse


@pytest.mark.parametrize(
    "mask,left,right,scale",
    [(_capi.MASK_NONE, -1, -1, 0.0), (_capi.MASK_CAUSAL, -1, -1, 0.3), (_capi.MASK_WINDOW, 3, 1, 0.0)],
    ids=["none", "causal-scaled", "window"],
)
def test_cpu_forward_is_the_c_reference_bitwise(mask, left, right, scale):
    """GQA, q != kv lengths, a strided q (a slice of a fused buffer): every field reaches the C API."""
    batch = make_batch(181, q_lengths=[3, 0, 17, 1], kv_lengths=[5, 2, 17, 0], heads=4, kv_heads=2)
    fused = torch.randn(batch.q.shape[0], 3 * batch.q.shape[1], batch.q.shape[2])
    fused[:, :4] = batch.q
    q = fused[:, :4]  # row stride 12 * 64: read in place
    assert not q.is_contiguous()
    out, lse, _ = torch.ops.jagflash_c.fwd(q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, mask, left, right,
                                           scale, _capi.CHECK_OFFSETS_HOST, 0)
    expected_out, expected_lse = _c_forward(q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, mask, left, right,
                                            scale)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def test_unusable_layouts_and_offsets_are_copied():
    """A transposed head dim (not readable in place) and offsets with a stride give the result of
    their dense copies."""
    batch = make_batch(182, q_lengths=[6, 9], heads=2)
    q_t = batch.q.transpose(1, 2).contiguous().transpose(1, 2)  # head dim stride != 1
    offsets_strided = torch.stack([batch.q_offsets, batch.q_offsets], dim=1)[:, 0]
    assert q_t.stride(2) != 1 and offsets_strided.stride(0) != 1
    got = torch.ops.jagflash_c.fwd(q_t, batch.k, batch.v, offsets_strided, batch.q_offsets, _capi.MASK_CAUSAL, -1, -1,
                                   0.0, _capi.CHECK_OFFSETS_HOST, 0)
    dense = torch.ops.jagflash_c.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.q_offsets, _capi.MASK_CAUSAL,
                                     -1, -1, 0.0, _capi.CHECK_OFFSETS_HOST, 0)
    assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1])


def test_errors_carry_the_c_message_and_become_the_package_exceptions():
    batch = make_batch(183, q_lengths=[4, 6])
    v_short = batch.v[:9]
    with pytest.raises(RuntimeError, match=r"^\[jagflash status 1\] problem\.v\.rows: expected 10, got 9$"):
        torch.ops.jagflash_c.fwd(batch.q, batch.k, v_short, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, 0, 0)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^problem\.v\.rows: expected 10, got 9$") as caught:
        _launch.forward(_plain(batch.q, batch.k, v_short, batch.q_offsets, batch.kv_offsets, "host"))
    assert caught.value.status == _capi.ERR_INVALID_ARGUMENT
    q36 = torch.randn(10, 4, 36)
    with pytest.raises(jagflash.UnsupportedError,
                       match=r"problem\.q\.head_dim: expected a multiple of 8 from 8 to 256, got 36") as caught:
        _launch.forward(_plain(q36, q36, q36, batch.q_offsets, batch.kv_offsets, "host"))
    assert caught.value.status == _capi.ERR_UNSUPPORTED
    with pytest.raises(RuntimeError, match=r"^\[jagflash status 1\] offsets_check: expected 0 \(host\) or 1"):
        torch.ops.jagflash_c.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, 7, 0)


def test_input_checks_are_worded_by_check_inputs():
    """What the binding refuses before describing the call raises the message of the Python
    check_inputs, which the fake kernels share (a traced call fails as an eager one does)."""
    batch = make_batch(184, q_lengths=[4, 6])
    with pytest.raises(RuntimeError, match=r"^\[jagflash status 1\] input check: "):
        torch.ops.jagflash_c.fwd(batch.q, batch.k, batch.v, batch.q_offsets.long(), batch.kv_offsets, 0, -1, -1, 0.0,
                                 0, 0)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^q_offsets: expected an int32 vector of B\+1 >= 1 offsets, "
                                                            r"got torch.int64 of shape \(3,\)$"):
        _launch.forward(_plain(batch.q, batch.k, batch.v, batch.q_offsets.long(), batch.kv_offsets, "host"))
    problem = _plain(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, "host")
    out, lse = _launch.forward(problem)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^lse: expected float32 \[H, total_q\] = \[4, 10\]"):
        _launch.backward(problem, out, lse.t(), batch.dout)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^dout: expected torch.float32 \(10, 4, 64\)"):
        _launch.backward(problem, out, lse, batch.dout[:, :2])


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_is_a_torch_allocation_and_the_launch_is_as_set(device, launches):
    batch = make_batch(185, q_lengths=[5, 0, 12], device=device)
    mode = _capi.CHECK_OFFSETS_DEVICE if device == "cuda" else _capi.CHECK_OFFSETS_HOST
    out, lse, workspace = torch.ops.jagflash_c.fwd(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                                   _capi.MASK_CAUSAL, -1, -1, 0.0, mode, 77)
    dq, dk, dv, bwd_workspace = torch.ops.jagflash_c.bwd(batch.dout, batch.q, batch.k, batch.v, out, lse,
                                                         batch.q_offsets, batch.kv_offsets, _capi.MASK_CAUSAL, -1, -1,
                                                         0.0, mode, 77, True)
    (d1, fwd_launch), (d2, bwd_launch) = list(launches)
    assert (d1, d2) == ("fwd", "bwd")
    for launch, ws in ((fwd_launch, workspace), (bwd_launch, bwd_workspace)):
        assert launch.caller_checked_pointers == 1 and launch.offsets_check == mode and launch.max_seqlen_hint == 77
        assert launch.backend == _capi.BACKEND_AUTO and launch.reuse_plan == 0
        if launch.workspace_bytes == 0:
            assert ws is None and launch.workspace is None  # nothing allocated for a call that needs nothing
        else:
            # The workspace the C library got is the tensor torch allocated (and returned).
            assert ws.dtype == torch.uint8 and ws.device == batch.q.device
            assert (launch.workspace, launch.workspace_bytes) == (ws.data_ptr(), ws.numel())
    assert (fwd_launch.deterministic, bwd_launch.deterministic) == (0, 1)
    if device == "cuda":
        # ctypes reads a NULL void* (the default stream, 0) as None.
        assert (fwd_launch.stream or 0) == torch.cuda.current_stream().cuda_stream
        assert workspace is not None and workspace.numel() > 0  # the device check's flag lives there
        segments = torch.cuda.memory_snapshot()
        assert any(s["address"] <= workspace.data_ptr() < s["address"] + s["total_size"] for s in segments), \
            "the workspace is not in torch's caching allocator"


@needs_cuda
def test_cuda_call_on_another_stream_and_device_guard(launches):
    """The call launches on torch's current stream (a side stream here) of the tensors' device."""
    batch = make_batch(186, q_lengths=[5, 7], device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _launch.forward(_plain(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, "device"))
    torch.cuda.synchronize()
    assert [launch.stream for _, launch in launches] == [side.cuda_stream]


def test_compiled_graph_runs_the_binding(launches):
    """torch.compile(fullgraph=True) on the CPU: one graph, its forward and backward are the
    binding's calls, and the result is the eager one's."""
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda q, k, v, o: jagflash.jagged_attention(q, k, v, o, causal=True), fullgraph=True,
                           backend="aot_eager")
        batch = make_batch(187, q_lengths=[3, 8, 1])
        q, k, v = batch.leaves()
        out = fn(q, k, v, batch.q_offsets)
        out.backward(batch.dout)
        compiled = [d for d, _ in launches]
        launches.clear()
        q2, k2, v2 = batch.leaves()
        expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, causal=True)
        expected.backward(batch.dout)
    finally:
        torch._dynamo.reset()
    assert compiled == ["fwd", "bwd"]
    assert torch.equal(out, expected) and torch.equal(q.grad, q2.grad) and torch.equal(v.grad, v2.grad)


def test_backward_reaches_the_reference():
    """The binding's backward is the C reference's (against the float64 SDPA oracle elsewhere; here
    the GQA sum and a causal window through the binding alone)."""
    batch = make_batch(188, q_lengths=[7, 2], kv_lengths=[9, 3], heads=4, kv_heads=1)
    args = (batch.q_offsets, batch.kv_offsets, _capi.MASK_WINDOW, 2, 0, 0.0, _capi.CHECK_OFFSETS_HOST, 0)
    out, lse, _ = torch.ops.jagflash_c.fwd(batch.q, batch.k, batch.v, *args)
    dq, dk, dv, _ = torch.ops.jagflash_c.bwd(batch.dout, batch.q, batch.k, batch.v, out, lse, *args, False)
    q, k, v = batch.leaves()
    ref = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, window=(2, 0))
    ref.backward(batch.dout)
    assert torch.equal(out, ref) and torch.equal(dq, q.grad) and torch.equal(dk, k.grad) and torch.equal(dv, v.grad)
    assert dk.shape == batch.k.shape  # [total_kv, 1, D]: the group's sum


def test_offsets_of_another_device_are_refused_by_the_binding():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    batch = make_batch(189, q_lengths=[4])
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^q_offsets\.device: expected cpu \(q's device\), got cuda"):
        _launch.forward(_plain(batch.q, batch.k, batch.v, offsets_of([4], "cuda"), batch.kv_offsets, "host"))

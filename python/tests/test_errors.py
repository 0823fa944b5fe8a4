"""Errors: the C API's messages (argument, expected, given) as Python exceptions, and the few
checks made in Python in the same shape."""
import os
import subprocess
import sys

import pytest
import torch

import jagflash
from jagflash import _capi, _lib, _offsets_check
from conftest import DEVICES, make_batch, offsets_of


def _call(batch, q_offsets=None, kv_offsets=None, **kwargs):
    return jagflash.jagged_attention(
        batch.q, batch.k, batch.v,
        batch.q_offsets if q_offsets is None else q_offsets,
        batch.kv_offsets if kv_offsets is None else kv_offsets, **kwargs,
    )


@pytest.fixture
def batch():
    return make_batch(41, q_lengths=[4, 0, 6], kv_lengths=[5, 2, 3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "offsets,message",
    [
        ([1, 4, 4, 10], r"problem.q_offsets\[0\]: expected 0, got 1"),
        ([0, 6, 4, 10], r"problem.q_offsets\[2\]: expected non-decreasing offsets .*, got 4"),
        ([0, 4, 4, 9], r"problem.q_offsets\[B=3\]: expected the token count 10, got 9"),
    ],
    ids=["first", "decreasing", "last"],
)
def test_bad_offsets_raise_the_c_message(device, offsets, message):
    """The host check (the CPU's always; on CUDA when asked for) raises at the call."""
    batch = make_batch(42, q_lengths=[4, 0, 6], kv_lengths=[5, 2, 3], device=device)
    with pytest.raises(jagflash.InvalidArgumentError, match=message) as info:
        _call(batch, q_offsets=torch.tensor(offsets, dtype=torch.int32, device=device), check_offsets="host")
    assert info.value.status == 1  # JF_ERR_INVALID_ARGUMENT


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["q_offsets", "kv_offsets"])
@pytest.mark.parametrize(
    "offsets,index",
    [
        ([0, 2**32 + 4, 10], 1),  # the cast gave [0, 4, 10]: another batch's valid offsets
        ([0, 4 - 2**32, 10], 1),  # the same 4, from below
        ([0, 4, 2**31 + 10], 2),  # the C message named the wrapped -2147483638
    ],
    ids=["wraps-to-valid", "wraps-from-below", "wraps-negative"],
)
def test_int64_offsets_past_int32_raise_with_the_value_given(device, which, offsets, index):
    batch = make_batch(43, q_lengths=[4, 6], device=device)
    bad = torch.tensor(offsets, dtype=torch.int64, device=device)
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=rf"{which}\[{index}\]: expected an offset that fits int32, got {offsets[index]}$"):
        _call(batch, **{which: bad}, check_offsets="host")


def test_kv_offsets_total_is_checked(batch):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"problem.kv_offsets\[B=3\]: expected the token count 10"):
        _call(batch, kv_offsets=offsets_of([5, 2, 4]))


def test_unsupported_head_dim(batch):
    q = torch.randn(10, 4, 48)
    with pytest.raises(jagflash.UnsupportedError, match=r"problem.q.head_dim: expected 64, 128 or 256, got 48"):
        jagflash.jagged_attention(q, q, q, batch.q_offsets)


def test_heads_must_divide(batch):
    k = torch.randn(10, 3, 64)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"problem.k.heads: expected a divisor of q.heads \(4\), got 3"):
        jagflash.jagged_attention(batch.q, k, k, batch.q_offsets, batch.q_offsets)


def test_value_rows_must_match_keys(batch):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"problem.v.rows: expected 10, got 9"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v[:9], batch.q_offsets, batch.kv_offsets)


def test_backward_errors_surface_too(batch):
    q, k, v = batch.leaves()
    out, lse = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"problem.q_offsets\[0\]: expected 0, got 1"):
        torch.ops.jagflash.bwd(batch.dout, q.detach(), k.detach(), v.detach(), out, lse,
                               offsets_of([4, 0, 6]) + 1, batch.kv_offsets, 0, -1, -1, 0.0, "auto")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"lse: expected float32 \[H, total_q\] = \[4, 10\]"):
        torch.ops.jagflash.bwd(batch.dout, q.detach(), k.detach(), v.detach(), out, lse.t(),
                               batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda b: {"q": b.q.double()}, r"q.dtype: expected torch.bfloat16, torch.float16 or torch.float32, got torch.float64"),
        (lambda b: {"k": b.k.half()}, r"k.dtype: expected torch.float32 \(q's dtype\), got torch.float16"),
        (lambda b: {"q": b.q[0]}, r"q: expected a \[tokens, heads, head_dim\] tensor, got shape \(4, 64\)"),
        (lambda b: {"q_offsets": b.q_offsets.float()}, r"q_offsets: expected an int32 or int64 tensor of B\+1 offsets, got torch.float32"),
        (lambda b: {"q_offsets": [0, 4, 4, 10]}, r"q_offsets: expected an int32 or int64 tensor of B\+1 offsets, got list"),
        (lambda b: {"kv_offsets": offsets_of([5, 5])}, r"kv_offsets: expected B\+1 = 4 entries \(as many as q_offsets\), got 3"),
    ],
    ids=["q-dtype", "mixed-dtypes", "q-rank", "offsets-dtype", "offsets-list", "offsets-length"],
)
def test_python_side_checks(batch, change, message):
    args = {"q": batch.q, "k": batch.k, "v": batch.v, "q_offsets": batch.q_offsets, "kv_offsets": batch.kv_offsets}
    args.update(change(batch))
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.jagged_attention(**args)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"causal": True, "window": (4, 2)}, r"window\[1\]: expected -1 or 0 with causal=True"),
        ({"window": (-2, 0)}, r"window\[0\]: expected >= -1"),
        ({"window": 5}, r"window: expected a pair \(left, right\)"),
        ({"scale": 0.0}, r"scale: expected a non-zero number"),
        ({"check_offsets": "sometimes"}, r"check_offsets: expected \"auto\", \"host\" or \"device\", got 'sometimes'"),
        # Once truncated to (1, 0), counted as causal, wrapped to 0 by ctypes:
        ({"window": (1.9, 0)}, r"window\[0\]: expected an int \(-1 = unbounded\), got 1.9"),
        ({"window": (0, True)}, r"window\[1\]: expected an int \(-1 = unbounded\), got True"),
        ({"causal": "no"}, r"causal: expected True or False, got 'no'"),
        ({"causal": 1}, r"causal: expected True or False, got 1"),
        ({"window": (2**32, 0)}, r"window\[0\]: expected >= -1 \(-1 = unbounded\) and < 2\^31, got 4294967296"),
    ],
    ids=["causal-right-window", "window-below-minus-one", "window-not-a-pair", "zero-scale", "check-mode",
         "float-window", "bool-window", "string-causal", "int-causal", "window-past-int32"],
)
def test_argument_checks(batch, kwargs, message):
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        _call(batch, **kwargs)


def test_errors_are_value_errors(batch):
    """Callers that catch ValueError (or RuntimeError) for bad arguments keep working."""
    with pytest.raises(ValueError):
        _call(batch, q_offsets=offsets_of([4, 0, 5]))
    assert issubclass(jagflash.JagflashError, RuntimeError)


def test_check_offsets_setting_round_trips():
    assert jagflash.get_check_offsets() == "auto"
    jagflash.set_check_offsets("host")
    try:
        assert jagflash.get_check_offsets() == "host"
    finally:
        jagflash.set_check_offsets("auto")
    with pytest.raises(jagflash.InvalidArgumentError):
        jagflash.set_check_offsets("never")


def test_auto_is_the_device_check_on_cuda_and_the_host_check_on_the_cpu():
    """The mode each call passes the C library: "auto" (the default) never syncs a CUDA call."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _offsets_check.launch_value("auto", cuda) == _capi.CHECK_OFFSETS_DEVICE
    assert _offsets_check.launch_value("device", cuda) == _capi.CHECK_OFFSETS_DEVICE
    assert _offsets_check.launch_value("host", cuda) == _capi.CHECK_OFFSETS_HOST
    assert _offsets_check.launch_value(_offsets_check.BUILT, cuda) == _capi.CHECK_OFFSETS_DEVICE
    assert _offsets_check.launch_value("auto", cpu) == _capi.CHECK_OFFSETS_HOST
    assert _offsets_check.launch_value("host", cpu) == _capi.CHECK_OFFSETS_HOST


def test_default_mode_reaches_the_launch_and_cpu_calls_still_raise_at_the_call(batch, launches):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"problem.q_offsets\[0\]: expected 0, got 1"):
        _call(batch, q_offsets=offsets_of([4, 0, 6]) + 1)
    _call(batch)
    assert launches and all(launch.offsets_check == _capi.CHECK_OFFSETS_HOST for _, launch in launches)


def test_synchronize_and_read_device_error_without_cuda_calls_are_quiet(batch):
    _call(batch)  # a CPU call: nothing for either to report
    jagflash.synchronize()
    jagflash.read_device_error()


def test_cpu_is_checked_on_the_host_even_in_device_mode(batch):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"problem.q_offsets\[0\]"):
        _call(batch, q_offsets=offsets_of([4, 0, 6]) + 1, check_offsets="device")


@pytest.mark.parametrize("kwargs,name", [
    ({"max_seqlen_q": -1}, "max_seqlen_q"),
    ({"max_seqlen_q": 8, "max_seqlen_kv": 2.5}, "max_seqlen_kv"),
    ({"max_seqlen_q": True}, "max_seqlen_q"),
    ({"max_seqlen_q": 2**31}, "max_seqlen_q"),
])
def test_bad_max_seqlen(batch, kwargs, name):
    with pytest.raises(jagflash.InvalidArgumentError, match=rf"{name}: expected None or an int in \[0, 2\^31\)"):
        _call(batch, **kwargs)


def test_library_path_the_user_set_must_exist(monkeypatch):
    monkeypatch.setenv("JAGFLASH_LIBRARY", "/nonexistent.so")
    with pytest.raises(OSError, match=r"JAGFLASH_LIBRARY=/nonexistent.so is not a file"):
        _lib.library_path()


def test_library_path_the_user_set_is_not_replaced_in_a_fresh_process():
    """The first call loads the library: with a path that cannot be loaded it must fail there,
    not fall back to the packaged or the build tree's copy (which exists here)."""
    package_parent = os.path.dirname(os.path.dirname(jagflash.__file__))
    env = dict(os.environ, JAGFLASH_LIBRARY="/nonexistent.so", PYTHONPATH=package_parent)
    result = subprocess.run([sys.executable, "-c", "import jagflash; print(jagflash.library_version())"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, f"loaded a library anyway: {result.stdout}"
    assert "JAGFLASH_LIBRARY=/nonexistent.so is not a file" in result.stderr, result.stderr

"""Errors: the C API's messages (argument, expected, given) as Python exceptions, and the few
checks made in Python in the same shape."""
import os
import re
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
        ([1, 4, 4, 10], r"^q_offsets\[0\]: expected 0, got 1$"),
        ([0, 6, 4, 10], r"^q_offsets\[2\]: expected non-decreasing offsets \(>= q_offsets\[1\] = 6\), got 4$"),
        ([0, 4, 4, 9], r"^q_offsets\[B=3\]: expected the token count 10, got 9$"),
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
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^kv_offsets\[B=3\]: expected the token count 10"):
        _call(batch, kv_offsets=offsets_of([5, 2, 4]))


def test_unsupported_head_dim(batch):
    q = torch.randn(10, 4, 36)
    with pytest.raises(jagflash.UnsupportedError, match=r"^q.shape\[-1\]: expected a multiple of 8 from 8 to 256, got 36$"):
        jagflash.jagged_attention(q, q, q, batch.q_offsets)


def test_heads_must_divide(batch):
    k = torch.randn(10, 3, 64)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^k.shape\[1\]: expected a divisor of q.shape\[1\] \(4\), got 3$"):
        jagflash.jagged_attention(batch.q, k, k, batch.q_offsets, batch.q_offsets)


def test_value_rows_must_match_keys(batch):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^v.shape\[0\]: expected 10, got 9$"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v[:9], batch.q_offsets, batch.kv_offsets)


def test_backward_errors_surface_too(batch):
    q, k, v = batch.leaves()
    out, lse = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 0, -1, -1, 0.0, "auto")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^problem.q_offsets\[0\]: expected 0, got 1$"):
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
        ({"scale": 0.0}, r"scale: expected a number that is finite and non-zero in float32 .*, got 0.0$"),
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
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^q_offsets\[0\]: expected 0, got 1$"):
        _call(batch, q_offsets=offsets_of([4, 0, 6]) + 1)
    _call(batch)
    assert launches and all(launch.offsets_check == _capi.CHECK_OFFSETS_HOST for _, launch in launches)


def test_synchronize_and_read_device_error_without_cuda_calls_are_quiet(batch):
    _call(batch)  # a CPU call: nothing for either to report
    jagflash.synchronize()
    jagflash.read_device_error()


def test_cpu_is_checked_on_the_host_even_in_device_mode(batch):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^q_offsets\[0\]"):
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


# ---- A scale that float32 cannot hold (the C API stores a float, and reads 0 as "1/sqrt(D)").
# 1e-50 and 2^-150 round to 0 in float32 and became the default scale without a word; 1e39 rounds
# to infinity and was refused as "inf". Each is refused naming the value given, at every entry.
UNHOLDABLE_SCALES = [1e-50, -1e-46, 2.0**-150, 1e39, -(2.0**128), float("inf"), float("nan")]


@pytest.mark.parametrize("scale", UNHOLDABLE_SCALES)
def test_a_scale_float32_cannot_hold_is_refused_naming_it(scale):
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=rf"^scale: expected a number that is finite and non-zero in float32 .*, got {re.escape(repr(scale))}$"):
        jagflash.jagged_attention(q, q, q, off, scale=scale)


def test_the_issue_s_tiny_scale_is_not_the_default_any_more():
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"got 1e-50$"):
        jagflash.jagged_attention(q, q, q, off, scale=1e-50)
    # The smallest scale float32 holds (a subnormal) is served as given: near-uniform attention.
    tiny = jagflash.jagged_attention(q, q, q, off, scale=2.0**-149)
    uniform = torch.cat([q[:3].mean(0, keepdim=True).expand(3, 2, 64), q[3:].mean(0, keepdim=True).expand(5, 2, 64)])
    torch.testing.assert_close(tiny, uniform, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [1e-50, 1e39])
def test_unholdable_scale_is_refused_by_every_entry(scale):
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    calls = {
        "flash_attn_varlen_func": (lambda: jagflash.flash_attn_varlen_func(q, q, q, off, off, 5, 5, softmax_scale=scale),
                                   "softmax_scale"),
        "pooled_attention": (lambda: jagflash.pooled_attention(q[:2], q, q, off, scale=scale), "scale"),
        "attention": (lambda: jagflash.attention(*[torch.nested.nested_tensor([q[:3], q[3:]], layout=torch.jagged)] * 3,
                                                 scale=scale), "scale"),
        # The ops take scale 0 as the default and refuse what float32 turns into 0 or infinity.
        "ops.fwd": (lambda: torch.ops.jagflash.fwd(q, q, q, off, off, 0, -1, -1, scale, "host"), "scale"),
        "ops.pooled_fwd": (lambda: torch.ops.jagflash.pooled_fwd(q[:2], q, q, off, 0, -1, -1, scale, "host"), "scale"),
    }
    for entry, (call, name) in calls.items():
        with pytest.raises(jagflash.InvalidArgumentError, match=rf"^{name}: expected .*, got {re.escape(repr(scale))}$"):
            call()
            pytest.fail(f"{entry} served scale={scale}")


def test_unholdable_scale_is_refused_by_the_backward_op():
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    out, lse = torch.ops.jagflash.fwd(q, q, q, off, off, 0, -1, -1, 0.0, "host")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^scale: expected .*, got 1e-50$"):
        torch.ops.jagflash.bwd(out, q, q, q, out, lse, off, off, 0, -1, -1, 1e-50, "host")


@pytest.mark.parametrize("scale", ["0.1", True, 1j, torch.tensor(0.1)])
def test_a_scale_that_is_not_a_real_number_is_refused(scale):
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^scale: expected a real number, or None"):
        jagflash.jagged_attention(q, q, q, off, scale=scale)


def test_a_scale_float32_holds_is_served_whatever_its_python_type():
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    expected = jagflash.jagged_attention(q, q, q, off, scale=0.25)
    import numpy
    for scale in (0.25, numpy.float32(0.25), numpy.float64(0.25)):
        assert torch.equal(jagflash.jagged_attention(q, q, q, off, scale=scale), expected)
    assert not torch.equal(jagflash.jagged_attention(q, q, q, off, scale=1), expected)  # an int is a real number


# ---- Tensor arguments: checked for type and layout before anything reads them, with an
# InvalidArgumentError naming the argument (they failed with AttributeError, a dispatcher error or
# NotImplementedError: jagflash.fwd.default).
def _nested3(t):
    return torch.nested.nested_tensor([t[:4], t[4:]], layout=torch.jagged)


NOT_TENSORS = {
    "None": (lambda t: None, r"got None$"),
    "list": (lambda t: t.tolist(), r"got list$"),
    "nested": (_nested3, r"\(for torch.nested jagged tensors call jagflash.attention\), got a nested tensor of layout torch.jagged$"),
    "sparse": (lambda t: t.to_sparse(), r"dense \(layout torch.strided\), got a tensor of layout torch.sparse_coo$"),
    "meta": (lambda t: t.to("meta"), r"on the CPU or a CUDA device, got a meta tensor$"),
}


@pytest.mark.parametrize("case", NOT_TENSORS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_jagged_attention_names_a_tensor_argument_that_is_not_a_plain_tensor(batch, name, case):
    make, message = NOT_TENSORS[case]
    args = {"q": batch.q, "k": batch.k, "v": batch.v}
    args[name] = make(args[name])
    with pytest.raises(jagflash.InvalidArgumentError, match=rf"^{name}: expected a \[tokens, heads, head_dim\] tensor"):
        jagflash.jagged_attention(args["q"], args["k"], args["v"], batch.q_offsets, batch.kv_offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=message):
        jagflash.jagged_attention(args["q"], args["k"], args["v"], batch.q_offsets, batch.kv_offsets)


OFFSETS_NOT_TENSORS = {
    "None": (lambda o: None, r"got None$"),
    "nested": (lambda o: torch.nested.nested_tensor([o[:2], o[2:]], layout=torch.jagged), r"got a nested tensor of layout torch.jagged$"),
    "sparse": (lambda o: o.to_sparse(), r"got a tensor of layout torch.sparse_coo$"),
    "meta": (lambda o: o.to("meta"), r"got a meta tensor$"),
}


@pytest.mark.parametrize("case", OFFSETS_NOT_TENSORS)
@pytest.mark.parametrize("name", ["q_offsets", "kv_offsets"])
def test_offsets_that_are_not_a_plain_tensor_are_named(batch, name, case):
    make, message = OFFSETS_NOT_TENSORS[case]
    if name == "kv_offsets" and case == "None":
        pytest.skip("kv_offsets=None means q's offsets")
    args = {"q_offsets": batch.q_offsets, "kv_offsets": batch.kv_offsets}
    args[name] = make(args[name])
    with pytest.raises(jagflash.InvalidArgumentError, match=rf"^{name}: expected an int32 or int64 tensor .*{message}"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, **args)


@pytest.mark.parametrize("case", NOT_TENSORS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_pooled_attention_names_a_tensor_argument_that_is_not_a_plain_tensor(name, case):
    make, message = NOT_TENSORS[case]
    q, kv = torch.randn(3, 2, 64), torch.randn(8, 2, 64)
    args = {"q": q, "k": kv, "v": kv}
    if name == "k" and case == "nested":
        pytest.skip("nested k (and v) is pooled attention's other form")
    args[name] = make(args[name])
    offsets = torch.tensor([0, 4, 8], dtype=torch.int32)
    if name == "q" and case == "nested":
        message = r"\(pooled q is one plain tensor; k and v may be nested\), got a nested tensor of layout torch.jagged$"
    with pytest.raises(jagflash.InvalidArgumentError, match=rf"^{name}: expected .*{message}"):
        jagflash.pooled_attention(args["q"], args["k"], args["v"], offsets)


GIVEN = {"None": "None", "list": "list", "nested": "a nested tensor of layout torch.jagged", "sparse": "a tensor of layout torch.sparse_coo",
         "meta": "a meta tensor"}


@pytest.mark.parametrize("case", NOT_TENSORS)
@pytest.mark.parametrize("name", ["q", "k", "v", "q_offsets"])
def test_backend_names_a_tensor_argument_that_is_not_a_plain_tensor(batch, name, case):
    make, _ = NOT_TENSORS[case]
    args = {"q": batch.q, "k": batch.k, "v": batch.v, "q_offsets": batch.q_offsets}
    args[name] = make(args[name])
    with pytest.raises(jagflash.InvalidArgumentError, match=rf"^{name}: expected .*, got {GIVEN[case]}$"):
        jagflash.backend(args["q"], args["k"], args["v"], args["q_offsets"])


# ---- Messages in the caller's terms.
def test_k_rows_against_q_offsets_when_no_kv_offsets_were_passed():
    q, k = torch.randn(8, 2, 64), torch.randn(10, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=r"^k.shape\[0\]: expected 8 rows, q_offsets\[B=2\] \(kv_offsets=None: q's offsets serve k "
                             r"and v too; pass kv_offsets for other lengths\), got 10$"):
        jagflash.jagged_attention(q, k, k, off)


def test_offsets_of_the_wrong_shape_are_reported_with_the_dtype_passed(batch):
    bad = torch.tensor([[0, 4, 10]], dtype=torch.int64)
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=r"^q_offsets: expected an int32 or int64 vector of B\+1 >= 1 offsets, got torch.int64 of "
                             r"shape \(1, 3\)$"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, bad, batch.kv_offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^kv_offsets: .*, got torch.int64 of shape \(0,\)$"):
        jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, torch.zeros(0, dtype=torch.int64))


def test_backend_speaks_in_the_caller_s_terms():
    q = torch.randn(7, 4, 64)
    k = torch.randn(7, 3, 64)
    off = torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^k.shape\[1\]: expected a divisor of q.shape\[1\] \(4\)"):
        jagflash.backend(q, k, k, off)
    with pytest.raises(jagflash.UnsupportedError, match=r"^q.shape\[-1\]: expected a multiple of 8 from 8 to 256, got 36$"):
        jagflash.backend(q[..., :36], q[..., :36], q[..., :36], off)


@pytest.mark.parametrize("entry", ["op", "pooled_op", "pooled_attention", "attention"])
def test_unknown_check_offsets_strings_are_refused_at_every_entry(entry):
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    calls = {
        # The ops took any other string as "host".
        "op": lambda: torch.ops.jagflash.fwd(q, q, q, off, off, 0, -1, -1, 0.0, "sometimes"),
        "pooled_op": lambda: torch.ops.jagflash.pooled_fwd(q[:2], q, q, off, 0, -1, -1, 0.0, "sometimes"),
        "pooled_attention": lambda: jagflash.pooled_attention(q[:2], q, q, off, check_offsets="sometimes"),
        "attention": lambda: jagflash.attention(*[_nested3(q)] * 3, check_offsets="sometimes"),
    }
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=r"^check_offsets: expected \"auto\", \"host\" or \"device\", got 'sometimes'$"):
        calls[entry]()


def test_unknown_check_offsets_is_refused_by_the_backward_op():
    q = torch.randn(8, 2, 64)
    off = torch.tensor([0, 3, 8], dtype=torch.int32)
    out, lse = torch.ops.jagflash.fwd(q, q, q, off, off, 0, -1, -1, 0.0, "host")
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^check_offsets: .*got 'never'$"):
        torch.ops.jagflash.bwd(out, q, q, q, out, lse, off, off, 0, -1, -1, 0.0, "never")


@pytest.mark.parametrize("device", ["bogus", "cpu", -1, True, 1.5, "cuda:x"])
def test_synchronize_refuses_what_is_not_a_cuda_device(device):
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^device: expected None, a CUDA device index or a CUDA "):
        jagflash.synchronize(device)


@pytest.mark.parametrize("device", [None, 0, "cuda", "cuda:0", torch.device("cuda", 0)])
def test_synchronize_takes_a_cuda_device(device):
    jagflash.synchronize(device)  # without CUDA: nothing to wait for or report


@pytest.mark.parametrize("seed,given", [(-1, "-1"), (2**64, str(2**64)), (1.5, "1.5"), ("7", "'7'"), (True, "True"),
                                        (None, "None")])
def test_generate_lengths_checks_its_seed(seed, given):
    with pytest.raises(jagflash.InvalidArgumentError,
                       match=rf"^seed: expected an int in \[0, 2\^64\), got {re.escape(given)}$"):
        jagflash.generate_lengths("short", seed)


def test_generate_lengths_checks_its_name():
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^name: expected one of uniform1k, .*, got 3$"):
        jagflash.generate_lengths(3)
    assert jagflash.generate_lengths("short", 2**64 - 1) and jagflash.generate_lengths("short", 0)

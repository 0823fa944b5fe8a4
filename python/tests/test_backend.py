"""jagflash.backend (which path serves a call) and the SlowPathWarning the oracle gives once."""
import warnings

import pytest
import torch

import jagflash
from jagflash import _backend, _capi, _launch
from conftest import make_batch, needs_cuda


@pytest.fixture
def fresh_warning_state(monkeypatch):
    """A process that has not warned yet and has asked the library about nothing."""
    monkeypatch.setattr(_backend, "_warned", False)
    monkeypatch.setattr(_backend, "_served", {})
    # The binding path's own record of the (direction, dtype, head dim, device) keys it showed
    # _backend: an earlier test's fp32 call would otherwise be skipped here (and the test fail).
    monkeypatch.setattr(_launch, "_noted", set())


def _tensors(device, dtype=torch.bfloat16, head_dim=64):
    q = torch.randn(10, 4, head_dim, dtype=dtype, device=device)
    kv = torch.randn(7, 2, head_dim, dtype=dtype, device=device)
    return q, kv, kv.clone(), torch.tensor([0, 4, 10], dtype=torch.int32, device=device), \
        torch.tensor([0, 7, 7], dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cpu_tensors_are_served_by_the_reference(dtype, head_dim):
    q, k, v, qo, kvo = _tensors("cpu", dtype, head_dim)
    assert jagflash.backend(q, k, v, qo, kvo) == "reference"
    assert jagflash.backend(q, k, v, qo, kvo, backward=True) == "reference"
    assert jagflash.backend(q, k, v, qo.long(), kvo.long()) == "reference"  # int64 offsets too


@pytest.mark.parametrize("head_dim", [8, 80, 192, 256])
def test_backend_names_the_kernel_head_dim_on_the_cpu(head_dim):
    """The answer is a plain str with kernel_head_dim: on CPU tensors the reference, at q's head dim."""
    q, k, v, qo, kvo = _tensors("cpu", torch.bfloat16, head_dim)
    for backward in (False, True):
        got = jagflash.backend(q, k, v, qo, kvo, backward=backward)
        assert isinstance(got, str) and got == "reference" and str(got) == "reference"
        assert got.kernel_head_dim == head_dim
    got = jagflash.backend(q, k, v[..., :8].contiguous(), qo, kvo, backward=True)  # a narrower v
    assert got.kernel_head_dim == head_dim


def test_backend_raises_where_the_call_would():
    q, k, v, qo, kvo = _tensors("cpu", head_dim=64)
    with pytest.raises(jagflash.UnsupportedError, match=r"^q.shape\[-1\]: expected a multiple of 8 from 8 to 256, got 36$"):
        jagflash.backend(q[..., :36], k[..., :36], v[..., :36], qo, kvo)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^k.shape\[1\]: expected a divisor of q.shape\[1\]"):
        jagflash.backend(q, k[:, :1].expand(7, 3, 64), v[:, :1].expand(7, 3, 64), qo, kvo)
    with pytest.raises(jagflash.InvalidArgumentError, match="backward: expected True or False"):
        jagflash.backend(q, k, v, qo, kvo, backward=1)


def test_slow_path_warns_once(fresh_warning_state, monkeypatch):
    """The warning logic on its own (no GPU here): the oracle's first CUDA call warns, later ones
    do not, and the library is asked once per (direction, dtype, head dim, device)."""
    asked = []

    def fake_query(problem, launch, direction):
        asked.append((direction, problem.dtype, problem.q.head_dim))
        return _backend.BACKEND_HOPPER if problem.dtype == _capi.BF16 else _backend.BACKEND_ORACLE

    monkeypatch.setattr(_backend, "query", fake_query)
    monkeypatch.setattr(_backend, "_warning_text", lambda d, p, dev: f"slow {d} {p.dtype}")
    device = torch.device("cuda", 0)
    fast = _capi.FwdArgs(problem=_capi.Problem(dtype=_capi.BF16, q=_capi.Tensor(head_dim=128)))
    slow = _capi.BwdArgs(problem=_capi.Problem(dtype=_capi.FP32, q=_capi.Tensor(head_dim=64)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _backend.note_cuda_call(fast, device)
        assert not caught
        for _ in range(3):
            _backend.note_cuda_call(slow, device)
            _backend.note_cuda_call(fast, device)
    assert [(w.category, str(w.message)) for w in caught] == [(jagflash.SlowPathWarning, "slow 1 2")]
    assert asked == [(0, _capi.BF16, 128), (1, _capi.FP32, 64)]


def _expected(dtype, head_dim, backward, modified=False, blocked=False):
    """The README's table: on a Hopper GPU the Hopper kernels for bf16/fp16, with a score modifier at
    64 and 128 (forward also 256), with a block mask at 64 and 128; the oracle for the rest."""
    hopper_gpu = torch.cuda.get_device_capability() == (9, 0)
    fast = dtype in (torch.bfloat16, torch.float16) and not (head_dim == 256 and (blocked or (modified and backward)))
    return "hopper" if hopper_gpu and fast else "oracle"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_backend_follows_the_readme_table(dtype, head_dim):
    """On an H200 the Hopper kernels serve bf16/fp16 in either direction (the backward at 256 too);
    any other GPU or dtype gets the oracle. A library built with JAGFLASH_PTX_ONLY has no Hopper
    kernels."""
    q, k, v, qo, kvo = _tensors("cuda", dtype, head_dim)
    for backward in (False, True):
        got = jagflash.backend(q, k, v, qo, kvo, backward=backward)
        if got == "oracle" and _expected(dtype, head_dim, backward) == "hopper":
            pytest.skip("this library has no Hopper kernel for the call (a PTX-only or trimmed build)")
        assert got == _expected(dtype, head_dim, backward)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cuda_backend_with_a_modifier_or_a_block_mask(dtype, head_dim):
    """At head dim 256 the Hopper backward takes no score modifier (softcap, ALiBi, relative bias)
    and neither direction a block mask: the oracle serves those; at 128 the Hopper kernels serve
    softcap, ALiBi and a block mask in both directions."""
    q, k, v, qo, kvo = _tensors("cuda", dtype, head_dim)
    if jagflash.backend(q, k, v, qo, kvo, backward=True) != _expected(dtype, head_dim, True):
        pytest.skip("this library has no Hopper kernel for the call (a PTX-only or trimmed build)")
    modifiers = [{"softcap": 5.0}, {"alibi_slopes": torch.rand(4, device="cuda")}]
    if head_dim == 256:
        modifiers.append({"score_mod": "relative_bias", "score_mod_table": torch.randn(4, 7, device="cuda")})
    for kwargs in modifiers:
        for backward in (False, True):
            assert jagflash.backend(q, k, v, qo, kvo, backward=backward, **kwargs) == \
                _expected(dtype, head_dim, backward, modified=True), (kwargs, backward)
    block_mask = jagflash.BlockMask.random(qo, kvo, density=0.5, seed=1)
    for backward in (False, True):
        assert jagflash.backend(q, k, v, qo, kvo, backward=backward, block_mask=block_mask) == \
            _expected(dtype, head_dim, backward, blocked=True), backward


@needs_cuda
def test_cuda_slow_path_warns_once_and_fast_path_never(fresh_warning_state):
    fast = make_batch(3, q_lengths=[5, 40], kv_lengths=[9, 40], heads=4, kv_heads=2, dtype=torch.bfloat16,
                      device="cuda")
    slow = make_batch(4, q_lengths=[5, 40], kv_lengths=[9, 40], heads=4, kv_heads=2, dtype=torch.float32,
                      device="cuda")
    fast_is_fast = jagflash.backend(fast.q, fast.k, fast.v, fast.q_offsets, fast.kv_offsets) == "hopper"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            jagflash.jagged_attention(fast.q, fast.k, fast.v, fast.q_offsets, fast.kv_offsets, causal=True)
        assert not caught or not fast_is_fast
        for _ in range(3):
            jagflash.jagged_attention(slow.q, slow.k, slow.v, slow.q_offsets, slow.kv_offsets, causal=True)
    slow_warnings = [w for w in caught if issubclass(w.category, jagflash.SlowPathWarning)]
    assert len(slow_warnings) == 1, [str(w.message) for w in caught]
    text = str(slow_warnings[0].message)
    assert "slow path" in text and "jagflash.backend" in text
    assert "once" in text


@needs_cuda
@pytest.mark.parametrize("head_dim, dv, forward_kernel, backward_kernel", [
    (64, 64, 64, 64), (80, 80, 96, 96), (96, 96, 96, 96), (112, 112, 128, 128), (160, 160, 192, 192),
    (192, 192, 192, 192),
    (192, 128, 192, 192), (200, 200, 256, 256), (256, 256, 256, 256)])
def test_cuda_backend_names_the_kernel_that_serves(head_dim, dv, forward_kernel, backward_kernel):
    """kernel_head_dim on an H200: the narrowest Hopper kernel at or above the head dim, per
    direction (both have 64/96/128/192/256)."""
    q, k, v, qo, kvo = _tensors("cuda", torch.bfloat16, head_dim)
    v = v[..., :dv].contiguous()
    for backward, want in ((False, forward_kernel), (True, backward_kernel)):
        got = jagflash.backend(q, k, v, qo, kvo, backward=backward)
        if got != "hopper":
            pytest.skip("not an sm_90 GPU or a library without these Hopper kernels")
        assert got.kernel_head_dim == want

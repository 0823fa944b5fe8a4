"""Which path serves a call (jagflash.backend), and the warning the slow path gives once.

The C library chooses per call and says what it chose (jagflash_query_backend in
include/jagflash/jagflash.h; the calls run the same choice):
  "hopper"     the fast kernels: compute capability 9.0 (H100, H200), bf16/fp16, head dim
               64/128/256 (backward: 64/128);
  "oracle"     the slow path: fp32 on CUDA cores, correct on every GPU of compute capability 8.0
               or newer, one to two orders of magnitude slower (head dim 64/128/256);
  "reference"  CPU tensors: the C++ float64 reference (every head dim: any multiple of 8 up to
               256, v's up to q's).
On CUDA no path serves another head dim, or a v head dim of its own, yet: UnsupportedError.
The first CUDA call the oracle serves warns with SlowPathWarning (once per process).
"""
import ctypes
import functools
import threading
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from . import _capi, _errors, _lib

DIRECTION_FORWARD = 0
DIRECTION_BACKWARD = 1
BACKEND_REFERENCE = 1
BACKEND_ORACLE = 2
BACKEND_HOPPER = 3
_NAMES = {BACKEND_REFERENCE: "reference", BACKEND_ORACLE: "oracle", BACKEND_HOPPER: "hopper"}


class SlowPathWarning(UserWarning):
    """A CUDA call was served by the GPU oracle (the slow path). Given once per process; filter it
    with warnings.filterwarnings("ignore", category=jagflash.SlowPathWarning)."""


@functools.lru_cache(maxsize=None)
def _query_fn(lib: ctypes.CDLL) -> Any:
    p = ctypes.POINTER
    fn = lib.jagflash_query_backend
    fn.argtypes = [p(_capi.Problem), p(_capi.Launch), _capi.c_enum, p(_capi.c_enum)]
    fn.restype = _capi.c_enum
    return fn


def query(problem: _capi.Problem, launch: _capi.Launch, direction: int) -> int:
    """jagflash_query_backend: the jf_backend a call of `direction` runs; raises as the call would."""
    lib = _lib.lib()
    served = _capi.c_enum(0)
    _errors.check(_query_fn(lib)(ctypes.byref(problem), ctypes.byref(launch), direction, ctypes.byref(served)), lib)
    return served.value


def backend(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Optional[Tensor] = None, *,
            backward: bool = False, softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None) -> str:
    """Which path serves jagged_attention on these tensors ("hopper", "oracle" or "reference"), or
    its backward with backward=True, on the tensors' device. The mask, scale and the other options
    do not change it. Reads no tensor data and does not sync; raises where the call would raise
    for the tensors' dtype, shapes, device or head dim (UnsupportedError when no path serves the
    head dims on that device: on CUDA anything but 64, 128 or 256 with v's the same; a softcap or
    alibi_slopes, as jagged_attention takes them, on CUDA so far)."""
    if not isinstance(backward, bool):
        raise _errors.invalid_argument("backward", "True or False", repr(backward))
    # Imported here: _launch imports this module (note_cuda_call).
    from . import _launch
    from .functional import _check_tensor, _in_caller_terms, _offsets, _softcap

    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    q_offsets = _offsets("q_offsets", q_offsets)
    kv_offsets = q_offsets if kv_offsets is None else _offsets("kv_offsets", kv_offsets)
    _launch.check_inputs(q, k, v, q_offsets, kv_offsets)
    _launch.check_head_dims(q, k, v)
    cap = _softcap(softcap)
    _launch.check_score_mod(q, cap, alibi_slopes)
    q, k, v = _launch._prepared(q), _launch._prepared(k), _launch._prepared(v)
    problem = _launch._problem(q, k, v, q_offsets, kv_offsets, _capi.MASK_NONE, -1, -1, 0.0)
    if alibi_slopes is not None:
        problem.score_mod, problem.alibi_slopes = _capi.SCORE_MOD_ALIBI, alibi_slopes.data_ptr()
    elif cap:
        problem.score_mod, problem.softcap = _capi.SCORE_MOD_SOFTCAP, cap
    launch = _capi.Launch(backend=_capi.BACKEND_AUTO)
    try:
        with _launch._device_guard(q.device):
            served = query(problem, launch, DIRECTION_BACKWARD if backward else DIRECTION_FORWARD)
    except _errors.JagflashError as error:
        raise _in_caller_terms(error, ()) from None
    return _NAMES.get(served, f"unknown ({served})")


# What served each (direction, dtype, head dim, device, pooled) so far: the choice depends on nothing else
# (launch.backend is always AUTO here), so a call asks the library once per key, not every time.
_served: Dict[Tuple[int, int, int, int, bool], int] = {}
_warned = False
_lock = threading.Lock()


def _warning_text(direction: int, problem: _capi.Problem, device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    dtype = {_capi.BF16: "bf16", _capi.FP16: "fp16", _capi.FP32: "fp32"}.get(problem.dtype, str(problem.dtype))
    what = "backward" if direction == DIRECTION_BACKWARD else "forward"
    if problem.pooled_q_rows > 0:
        what = f"pooled-attention {what}"
    return (
        f"jagflash: the slow path (the GPU oracle: fp32 on CUDA cores, correct but one to two orders of "
        f"magnitude slower) serves this {what} ({dtype}, head dim {problem.q.head_dim}) on "
        f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}). The fast kernels "
        f"need compute capability 9.0 (H100/H200), bf16 or fp16 and head dim 64, 128 or 256 (backward: "
        f"64 or 128). jagflash.backend(...) says which path serves a call; this warning is given once."
    )


def note_cuda_call(args: Any, device: torch.device) -> None:
    """After a successful CUDA call: warns (once per process) if the oracle served it."""
    global _warned
    if _warned:
        return
    direction = DIRECTION_BACKWARD if isinstance(args, _capi.BwdArgs) else DIRECTION_FORWARD
    key = (direction, args.problem.dtype, args.problem.q.head_dim, device.index or 0, args.problem.pooled_q_rows > 0)
    served = _served.get(key)
    if served is None:
        served = _served[key] = query(args.problem, args.launch, direction)
    if served != BACKEND_ORACLE:
        return
    with _lock:
        if _warned:
            return
        _warned = True
    warnings.warn(_warning_text(direction, args.problem, device), SlowPathWarning, stacklevel=2)

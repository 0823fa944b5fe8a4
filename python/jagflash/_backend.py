"""Which path serves a call (the C library's answer), and the warning the slow path gives once.

Imported by _launch, which reports each CUDA call here (note_cuda_call), and by functional.py,
whose jagflash.backend asks query() about the caller's tensors; it imports neither.

The C library chooses per call and says what it chose (jagflash_query_backend in
include/jagflash/jagflash.h; the calls run the same choice):
  "hopper"     the fast kernels: compute capability 9.0 (H100, H200), bf16/fp16, every head dim
               that is a multiple of 8 up to 256 in either direction, v's up to q's (not
               pooled, no score modifier or block mask off 64/128/256; a score modifier at 64, 128
               and, forward only, 256; a block mask at 64 and 128);
  "oracle"     the slow path: fp32 on CUDA cores, correct on every GPU of compute capability 8.0
               or newer, one to two orders of magnitude slower (head dim 64/128/256, v's = q's);
  "reference"  CPU tensors: the C++ float64 reference (every head dim: any multiple of 8 up to
               256, v's up to q's).
What no path serves on CUDA (a head dim off 64/128/256 with fp32, a score modifier or a block mask,
say) is refused: UnsupportedError.
The first CUDA call the oracle serves warns with SlowPathWarning (once per process).
"""
import ctypes
import functools
import threading
import warnings
from typing import Any, Dict, Tuple

import torch

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


def name(served: int) -> str:
    """jagflash.backend's name for a jf_backend that query() returned."""
    return _NAMES.get(served, f"unknown ({served})")


@functools.lru_cache(maxsize=None)
def _query_kernel_fn(lib: ctypes.CDLL) -> Any:
    p = ctypes.POINTER
    fn = lib.jagflash_query_kernel
    fn.argtypes = [p(_capi.Problem), p(_capi.Launch), _capi.c_enum, p(_capi.c_enum), p(ctypes.c_int32)]
    fn.restype = _capi.c_enum
    return fn


def query_kernel(problem: _capi.Problem, launch: _capi.Launch, direction: int) -> Tuple[int, int]:
    """jagflash_query_kernel: (the jf_backend a call of `direction` runs, the head dim of the kernel
    that serves it); raises as the call would."""
    lib = _lib.lib()
    served, kernel = _capi.c_enum(0), ctypes.c_int32(0)
    _errors.check(_query_kernel_fn(lib)(ctypes.byref(problem), ctypes.byref(launch), direction,
                                        ctypes.byref(served), ctypes.byref(kernel)), lib)
    return served.value, kernel.value


class Backend(str):
    """What jagflash.backend returns: the path's name ("hopper", "oracle", "reference"), a plain str
    for every comparison, with the head dim of the kernel that serves the call as kernel_head_dim
    (on the Hopper kernels the narrowest at or above the call's head dim, per direction: 80 runs
    both directions' kernels of 96, 112 those of 128; on the oracle and the reference the call's
    own)."""

    kernel_head_dim: int

    def __new__(cls, name: str, kernel_head_dim: int) -> "Backend":
        self = super().__new__(cls, name)
        self.kernel_head_dim = kernel_head_dim
        return self


# What served each (direction, dtype, head dim, device, pooled, block mask) so far: the choice depends on
# nothing else (launch.backend is always AUTO here), so a call asks the library once per key, not every time.
_served: Dict[Tuple[int, int, int, int, bool, bool], int] = {}
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
        f"need compute capability 9.0 (H100/H200), bf16 or fp16 and a head dim up to 256 (with a score "
        f"modifier 64, 128 or 256, backward 64 or 128; with a block mask 64 or 128). "
        f"jagflash.backend(...) says which "
        f"path serves a call; this warning is given once."
    )


def note_cuda_call(args: Any, device: torch.device) -> None:
    """After a successful CUDA call: warns (once per process) if the oracle served it."""
    global _warned
    if _warned:
        return
    direction = DIRECTION_BACKWARD if isinstance(args, _capi.BwdArgs) else DIRECTION_FORWARD
    key = (direction, args.problem.dtype, args.problem.q.head_dim, device.index or 0, args.problem.pooled_q_rows > 0,
           bool(args.problem.block_mask.blocks))
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

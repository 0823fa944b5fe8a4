"""Finds and loads libjagflash.so once, and declares the C functions' signatures; then the
compiled PyTorch binding next to it (libjagflash_torch.so: torch.ops.jagflash_c.fwd / .bwd).

Search order for the library (the first that exists wins):
  1. $JAGFLASH_LIBRARY, a path to the library (a build carried to another machine): when set, it
     is the only candidate, and a path that is not a file raises;
  2. the copy that `pip install .` ships inside the package;
  3. <repo>/build/libjagflash.so, for a source checkout on PYTHONPATH=python.
The binding is the libjagflash_torch.so in the same folder as the library found: `pip install .`
builds it into the package; in a build folder, `python python/build_backend/jagflash_binding.py
<build-dir>` builds it there (against the torch of the Python running it).
"""
import ctypes
import functools
import os
from pathlib import Path
from typing import List

from . import _capi

_LIBRARY_NAME = "libjagflash.so"
_BINDING_NAME = "libjagflash_torch.so"


def candidate_paths() -> List[Path]:
    """Where the library is looked for, in order: $JAGFLASH_LIBRARY alone when it is set."""
    env = os.environ.get("JAGFLASH_LIBRARY")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    return [here / _LIBRARY_NAME, here.parent.parent / "build" / _LIBRARY_NAME]


def _declare(lib: ctypes.CDLL) -> None:
    p = ctypes.POINTER
    signatures = {
        "jagflash_version": ([], ctypes.c_char_p),
        "jagflash_version_number": ([], ctypes.c_int),
        "jagflash_last_error": ([], ctypes.c_char_p),
        "jagflash_fwd_workspace_size": ([p(_capi.FwdArgs), p(ctypes.c_size_t)], _capi.c_enum),
        "jagflash_fwd": ([p(_capi.FwdArgs)], _capi.c_enum),
        "jagflash_bwd_workspace_size": ([p(_capi.BwdArgs), p(ctypes.c_size_t)], _capi.c_enum),
        "jagflash_bwd": ([p(_capi.BwdArgs)], _capi.c_enum),
        "jagflash_read_device_error": ([ctypes.c_void_p, ctypes.c_void_p], _capi.c_enum),
        "jagflash_synchronize": ([ctypes.c_void_p], _capi.c_enum),
        "jagflash_generate_lengths": (
            [ctypes.c_char_p, ctypes.c_uint64, p(ctypes.c_int32), ctypes.c_int32, p(ctypes.c_int32)],
            _capi.c_enum,
        ),
        "jagflash_visible_pairs": (
            [ctypes.c_int32, ctypes.c_int32, _capi.c_enum, ctypes.c_int32, ctypes.c_int32],
            ctypes.c_int64,
        ),
        "jagflash_cuda_device_count": ([], ctypes.c_int),
        "jagflash_score_mod_by_name": ([ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
        "jagflash_hopper_kernel": (
            [_capi.c_enum, _capi.c_enum, ctypes.c_int32, ctypes.c_int32, _capi.c_enum, ctypes.c_int32,
             p(ctypes.c_int32)],
            _capi.c_enum,
        ),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


def library_path() -> str:
    """Path of the library that lib() loads; OSError naming every place looked in if none."""
    env = os.environ.get("JAGFLASH_LIBRARY")
    if env and not Path(env).is_file():
        # A path the user chose is never replaced by another copy behind their back: that copy
        # may be another build (another version, other kernels) than the one they meant to test.
        raise OSError(f"jagflash: JAGFLASH_LIBRARY={env} is not a file; unset it to use the packaged "
                      "or <repo>/build library")
    paths = candidate_paths()
    for path in paths:
        if path.is_file():
            return str(path)
    raise OSError(
        f"jagflash: {_LIBRARY_NAME} not found; looked in: {', '.join(map(str, paths))}. "
        "Set JAGFLASH_LIBRARY to its path, install the package with `pip install .`, "
        "or build it into <repo>/build."
    )


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    """The loaded library. Loaded on first use, so `import jagflash` works before it is built."""
    handle = ctypes.CDLL(library_path())
    _declare(handle)
    return handle


def binding_path() -> str:
    """Path of the compiled PyTorch binding: libjagflash_torch.so next to the library."""
    path = Path(library_path()).parent / _BINDING_NAME
    if not path.is_file():
        raise OSError(
            f"jagflash: the PyTorch binding {path} is missing (the library is {library_path()}). "
            "`pip install .` builds both; for a build folder run "
            f"`python python/build_backend/jagflash_binding.py {path.parent}`."
        )
    return str(path)


@functools.lru_cache(maxsize=None)
def binding() -> ctypes.CDLL:
    """Loads the binding (registering torch.ops.jagflash_c.*) after the library, whose copy its
    dependency on libjagflash.so then resolves to (by soname): the binding calls the library this
    module chose, $JAGFLASH_LIBRARY included. Returns its ctypes handle (the test hooks)."""
    import torch  # here, not at the top: the ctypes utilities work without torch's import cost

    lib()
    path = binding_path()
    torch.ops.load_library(path)
    handle = ctypes.CDLL(path)
    handle.jagflash_torch_record_fields.argtypes = []
    handle.jagflash_torch_record_fields.restype = ctypes.c_int
    handle.jagflash_torch_set_recording.argtypes = [ctypes.c_int]
    handle.jagflash_torch_set_recording.restype = None
    handle.jagflash_torch_take_records.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    handle.jagflash_torch_take_records.restype = ctypes.c_int64
    handle.jagflash_torch_found_cuda_stream_query.argtypes = []
    handle.jagflash_torch_found_cuda_stream_query.restype = ctypes.c_int
    return handle

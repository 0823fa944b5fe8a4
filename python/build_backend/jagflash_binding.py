"""Builds the compiled PyTorch binding, libjagflash_torch.so (python/binding/jagflash_torch.cpp),
with the C++ compiler alone: it uses torch's stable C ABI (headers only, TORCH_TARGET_VERSION 2.9)
and the C API, so it needs neither the CUDA toolkit nor Python's headers, and one binary serves any
Python and every torch release from 2.9 on that keeps that ABI.

Against which torch: $JAGFLASH_TORCH_DIR (a torch package folder) when set; else the torch this
Python imports; else the one installed in the environment being installed into (under pip's build
isolation the build cannot import it, but it is on disk: sysconfig's purelib/platlib of this
interpreter). The build backend (jagflash_build.py) asks pip for torch as a build requirement only
when none of these has one.

Linked against libjagflash.so (found next to it at run time: $ORIGIN, or the copy jagflash._lib
loaded first, by its soname) and libtorch_cpu.so (loaded by `import torch` before the binding).

    python python/build_backend/jagflash_binding.py BUILD_DIR   # BUILD_DIR/libjagflash_torch.so,
                                                                 # linked to BUILD_DIR/libjagflash.so
"""
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "python" / "binding" / "jagflash_torch.cpp"
BINDING_NAME = "libjagflash_torch.so"
# The oldest torch whose stable ABI the binding is written against (FA3 targets the same).
TORCH_TARGET_VERSION = "0x0209000000000000"
_STABLE_HEADER = Path("include") / "torch" / "csrc" / "stable" / "library.h"


def _is_torch_dir(path: Path) -> bool:
    return (path / _STABLE_HEADER).is_file() and (path / "lib").is_dir()


def find_torch_dir() -> Optional[Path]:
    """The torch package folder to build against, or None (see the module's docstring)."""
    env = os.environ.get("JAGFLASH_TORCH_DIR")
    if env:
        path = Path(env)
        if not _is_torch_dir(path):
            raise SystemExit(f"jagflash: JAGFLASH_TORCH_DIR={env} holds no torch with the stable C ABI headers")
        return path
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0])
        if _is_torch_dir(path):
            return path
    for key in ("purelib", "platlib"):
        path = Path(sysconfig.get_paths()[key]) / "torch"
        if _is_torch_dir(path):
            return path
    return None


def compile_command(out: Path, library_dir: Path, torch_dir: Path, werror: bool = False):
    cxx = os.environ.get("CXX", "g++")
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra"]
    if werror:
        flags.append("-Werror")
    return [
        *shlex.split(cxx), *flags, f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
        f"-I{ROOT / 'include'}", "-isystem", str(torch_dir / "include"),
        str(SOURCE), "-o", str(out),
        f"-L{library_dir}", "-ljagflash", f"-L{torch_dir / 'lib'}", "-ltorch_cpu",
        # libjagflash.so next to the binding (the installed package); every symbol resolved now.
        "-Wl,-rpath,$ORIGIN", "-Wl,--no-undefined",
    ]


def build(out_dir: Path, library_dir: Path, torch_dir: Optional[Path] = None, werror: Optional[bool] = None) -> Path:
    """Compiles out_dir/libjagflash_torch.so against library_dir/libjagflash.so and torch_dir.
    werror None: warnings are errors when $JAGFLASH_BINDING_WERROR is 1 (scripts/test-python.sh
    sets it, as the C++ build has JAGFLASH_WERROR in CI)."""
    if werror is None:
        werror = os.environ.get("JAGFLASH_BINDING_WERROR") == "1"
    torch_dir = torch_dir or find_torch_dir()
    if torch_dir is None:
        raise SystemExit("jagflash: no torch to build the PyTorch binding against (set JAGFLASH_TORCH_DIR, or "
                         "install torch into this environment)")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / BINDING_NAME
    command = compile_command(out, library_dir, torch_dir, werror)
    print("jagflash: building the PyTorch binding:", shlex.join(command), flush=True)
    subprocess.check_call(command)
    return out


def main(argv):
    if len(argv) != 2 or argv[1].startswith("-"):
        print(f"usage: {argv[0]} BUILD_DIR  (a folder holding libjagflash.so; writes BUILD_DIR/{BINDING_NAME})",
              file=sys.stderr)
        return 2
    build_dir = Path(argv[1]).resolve()
    if not (build_dir / "libjagflash.so").is_file():
        print(f"jagflash: {build_dir}/libjagflash.so not found: build the library first", file=sys.stderr)
        return 1
    build(build_dir, build_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

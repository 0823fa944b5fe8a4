"""Builds libjagflash.so with the project's own CMake build, then the compiled PyTorch binding
libjagflash_torch.so against it and the target environment's torch (with g++ alone:
python/build_backend/jagflash_binding.py), and ships both inside the package.

The metadata is in pyproject.toml; this file only adds the native build step. It runs no
installer and downloads nothing: the CUTLASS headers come from .deps/ (scripts/setup.sh) or else
from the nvidia-cutlass package that the build backend (python/build_backend/jagflash_build.py)
asks pip to put in the build environment. Environment:
  JAGFLASH_BUILD_DIR   CMake build directory (default: build/, the one the scripts use, so an
                       existing build is reused, with its settings, and only brought up to date;
                       a new one is configured without the tests, which need GoogleTest and the
                       tools scripts/setup.sh installs)
  JAGFLASH_CMAKE_ARGS  extra CMake arguments (e.g. -DJAGFLASH_DTYPES=bf16 for a quick build)
  CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: one per CPU)
"""
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "python" / "build_backend"))
from jagflash_binding import build as build_binding  # noqa: E402
from jagflash_build import cutlass_headers_dir, pinned_version  # noqa: E402


def ensure_cutlass_headers():
    """.deps/cutlass-<pin>/include, copied from the build environment's nvidia-cutlass (the same
    pinned version) when scripts/setup.sh has not made it. A fixed place, not the build
    environment's own (a new temporary folder every build), so that an existing build tree keeps
    its include path and is not recompiled."""
    dest = cutlass_headers_dir()
    if (dest / "cute" / "tensor.hpp").is_file():
        return
    pin = pinned_version("CUTLASS_PIP_VERSION")
    try:
        found = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        found = None
    spec = importlib.util.find_spec("cutlass_library") if found else None
    if found != pin or spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"jagflash: the CUTLASS headers are neither in {dest} nor in the build environment "
            f"(nvidia-cutlass=={pin} wanted, {found or 'none'} found): build with pip's build "
            f"isolation (the default), install nvidia-cutlass=={pin} into this environment, or run "
            "scripts/setup.sh"
        )
    source = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".include-"))
    shutil.copytree(source, staging / "include")
    os.replace(staging / "include", dest)
    staging.rmdir()


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        build_dir = Path(os.environ.get("JAGFLASH_BUILD_DIR", ROOT / "build"))
        if not build_dir.is_absolute():
            build_dir = ROOT / build_dir
        ensure_cutlass_headers()
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir)]
        if not (build_dir / "CMakeCache.txt").is_file():
            configure.append("-DJAGFLASH_BUILD_TESTS=OFF")
        configure += shlex.split(os.environ.get("JAGFLASH_CMAKE_ARGS", ""))
        subprocess.check_call(configure)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "jagflash", "-j", jobs])
        package_dir = Path(self.build_lib) / "jagflash"
        package_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "libjagflash.so", package_dir / "libjagflash.so")
        binding = build_binding(package_dir, package_dir)
        # A copy next to build/libjagflash.so too: a checkout on PYTHONPATH=python (the bench
        # scripts, which put python/ first on sys.path) loads the library and the binding from
        # build/ (jagflash._lib). A clean-clone CI run failed without it (bench/registry_step.py).
        shutil.copy2(binding, build_dir / binding.name)


class BinaryDistribution(Distribution):
    """The package holds native libraries (libjagflash.so, the binding libjagflash_torch.so): not
    pure, so its wheel is tagged for the platform and its files go to platlib. Neither is a
    CPython extension (ctypes and torch.ops.load_library load them)."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """py3-none-<platform> (e.g. py3-none-linux_x86_64), not py3-none-any: the wheel runs on any
    Python 3 of that platform, as it has no CPython extension (the binding uses torch's stable C
    ABI, not Python's)."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


# setuptools' own staging goes to build-pip/, not into CMake's build/.
setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
    options={"build": {"build_base": str(ROOT / "build-pip")}},
)

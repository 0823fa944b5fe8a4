"""Builds libjagflash.so with the project's own CMake build and ships it inside the package.

The metadata is in pyproject.toml; this file only adds the native build step. Environment:
  JAGFLASH_BUILD_DIR   CMake build directory (default: build/, the one the scripts use, so an
                       existing build is reused and only brought up to date)
  JAGFLASH_CMAKE_ARGS  extra CMake arguments (e.g. -DJAGFLASH_DTYPES=bf16 for a quick build)
"""
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        build_dir = Path(os.environ.get("JAGFLASH_BUILD_DIR", ROOT / "build"))
        if not build_dir.is_absolute():
            build_dir = ROOT / build_dir
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call([str(ROOT / "scripts" / "setup.sh")])
        subprocess.check_call(
            ["cmake", "-S", str(ROOT), "-B", str(build_dir), *shlex.split(os.environ.get("JAGFLASH_CMAKE_ARGS", ""))]
        )
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "jagflash", "-j", jobs])
        package_dir = Path(self.build_lib) / "jagflash"
        package_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "libjagflash.so", package_dir / "libjagflash.so")


class BinaryDistribution(Distribution):
    """The package holds a native libjagflash.so: not pure, so its wheel is tagged for the platform
    and its files go to platlib (the library is loaded through ctypes; there is no extension)."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """py3-none-<platform> (e.g. py3-none-linux_x86_64), not py3-none-any: the wheel runs on any
    Python 3 of that platform, as it has no CPython extension."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


# setuptools' own staging goes to build-pip/, not into CMake's build/.
setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel},
    options={"build": {"build_base": str(ROOT / "build-pip")}},
)

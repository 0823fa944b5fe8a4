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

from setuptools import setup
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


# setuptools' own staging goes to build-pip/, not into CMake's build/.
setup(cmdclass={"build_py": BuildPyWithLibrary}, options={"build": {"build_base": str(ROOT / "build-pip")}})

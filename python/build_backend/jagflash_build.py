"""The PEP 517 build backend of the jagflash package: setuptools', plus the two build requirements
that depend on the build machine, asked of the frontend (pip) through get_requires_for_build_*:

  nvidia-cutlass==<deps.env's CUTLASS_PIP_VERSION>  the CUTLASS/CuTe headers (setup.py copies them
      to .deps/cutlass-<version>/include), unless that folder is already there (scripts/setup.sh
      made it);
  cmake>=3.24  unless a cmake of that version or newer is on PATH (an existing build tree keeps
      the cmake that configured it, instead of being reconfigured by another one);
  torch (the package's own requirement)  unless the environment being installed into already has
      a torch, which the compiled binding is then built against (jagflash_binding.py): pip's
      isolated build environment cannot import it, but it is on disk, and building against it
      saves installing a second torch (gigabytes) into the build environment.

Nothing is downloaded here: pip installs what these hooks return into the isolated build
environment, as it does the static [build-system] requires. The CUDA toolkit (nvcc) and a C++17
compiler are not on PyPI in a form this build uses; the build fails with CMake's message when
they are missing.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks this module does not change)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path too (the tests)
from jagflash_binding import find_torch_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CMAKE_MINIMUM = (3, 24)  # CMakeLists.txt's cmake_minimum_required


def pinned_version(name):
    """A VERSION pinned in deps.env (NAME=VERSION lines)."""
    for line in (ROOT / "deps.env").read_text().splitlines():
        if line.startswith(name + "="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError(f"deps.env has no {name}")


def cutlass_headers_dir():
    """Where CMakeLists.txt looks for the CUTLASS headers by default."""
    return ROOT / ".deps" / f"cutlass-{pinned_version('CUTLASS_PIP_VERSION')}" / "include"


def _cmake_on_path_is_enough():
    cmake = shutil.which("cmake")
    if cmake is None:
        return False
    try:
        text = subprocess.run([cmake, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    found = re.search(r"version (\d+)\.(\d+)", text)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= CMAKE_MINIMUM


def torch_requirement():
    """pyproject.toml's dependency on torch (one place for the range), for a build environment
    that must bring its own torch."""
    found = re.search(r'^dependencies\s*=\s*\[[^\]]*"(torch[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    if found is None:
        raise RuntimeError("pyproject.toml declares no dependency on torch")
    return found.group(1)


def native_build_requires():
    requires = []
    if not (cutlass_headers_dir() / "cute" / "tensor.hpp").is_file():
        requires.append(f"nvidia-cutlass=={pinned_version('CUTLASS_PIP_VERSION')}")
    if not _cmake_on_path_is_enough():
        requires.append("cmake>={}.{}".format(*CMAKE_MINIMUM))
    if find_torch_dir() is None:
        requires.append(torch_requirement())
    return requires


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + native_build_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + native_build_requires()

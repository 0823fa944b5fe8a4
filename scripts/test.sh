#!/usr/bin/env bash
# Sets up, builds (warnings as errors) and runs every test that this machine can run. GPU tests
# are reported as skipped by ctest where there is no CUDA device.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
build="${BUILD_DIR:-build}"
jobs="$(nproc 2>/dev/null || echo 2)"
# Tests ON explicitly: a build/ first configured by `pip install .` has them off.
cmake -S . -B "$build" -DJAGFLASH_WERROR=ON -DJAGFLASH_BUILD_TESTS=ON ${JAGFLASH_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"
# The installed CMake package: cmake --install into a temporary prefix, then examples/cmake_consumer
# (find_package(jagflash CONFIG REQUIRED), a CPU call) built and run against it. CPU only, seconds.
scripts/test-cmake-consumer.sh "$build"
# The Python package: pinned torch from PyPI into .venv/, `pip install .`, pytest (the CUDA tests
# are reported as skipped without a GPU).
scripts/test-python.sh

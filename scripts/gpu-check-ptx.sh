#!/usr/bin/env bash
# On the GPU machine: the path every non-Hopper GPU runs, run on a Hopper GPU. From a build
# configured with -DJAGFLASH_PTX_ONLY=ON (the library's only device code is the oracle's and the
# offsets check's compute_80 PTX, so the driver must compile it, as on an A100 or B200), carried
# here: the GPU tests (the oracle against the CPU reference, jagflash_query_backend, the image the
# oracle runs from) and, when torch is importable, the Python tests of the GPU path and of
# jagflash.backend against that library. Logs in $OUT (or ./gpu-logs); a summary last.
#   usage: scripts/gpu-check-ptx.sh [build-dir]        (default: build-ptx)
#   build it with: cmake -S . -B build-ptx -DJAGFLASH_PTX_ONLY=ON -DJAGFLASH_FUZZ=OFF && cmake --build build-ptx
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:-$root/build-ptx}" && pwd)"
out="${OUT:-$root/gpu-logs}"
mkdir -p "$out"
limit="${STEP_TIMEOUT:-300}"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"

if ! grep -q '^JAGFLASH_PTX_ONLY:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "gpu-check-ptx: $build is not a -DJAGFLASH_PTX_ONLY=ON build" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv >"$out/gpu.txt" 2>&1
# A JIT cache of its own, empty: the first call compiles the PTX here (the cost a new GPU pays once).
export CUDA_CACHE_PATH="$out/cuda-jit-cache"
rm -rf "$CUDA_CACHE_PATH"
step "gpu tests (compute_80 PTX)" gpu_ptx_tests.log "$limit" "$build/tests/jagflash_gpu_tests"
if "${PYTHON:-python3}" -c "import torch" 2>/dev/null; then
  cd "$root" || exit 1
  export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" JAGFLASH_LIBRARY="$build/libjagflash.so"
  step "python (compute_80 PTX)" python_ptx.log "$limit" "${PYTHON:-python3}" -m pytest -rs -q -p no:cacheprovider \
    python/tests/test_backend.py python/tests/test_cuda.py python/tests/test_attention.py
fi

echo "==== logs in $out"
cat "$out/gpu.txt"
grep -h "oracle image on compute capability" "$out/gpu_ptx_tests.log"
grep -hE "^\[  (PASSED|FAILED) |^\[  FAILED" "$out/gpu_ptx_tests.log" | head -20
[ -f "$out/python_ptx.log" ] && tail -n 1 "$out/python_ptx.log"
print_summary
summary_passed

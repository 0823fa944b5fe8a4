#!/usr/bin/env bash
# Installs what a fresh build machine lacks: CUTLASS headers, cuobjdump and nvdisasm, clang-format
# (pinned in deps.env) under .deps/, and GoogleTest from Debian when it is missing. Idempotent; run from anywhere.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$root/deps.env"

cutlass_dir="$root/.deps/cutlass-$CUTLASS_PIP_VERSION"
if [ ! -f "$cutlass_dir/include/cute/tensor.hpp" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --dest "$tmp" "nvidia-cutlass==$CUTLASS_PIP_VERSION"
  python3 - "$tmp" "$cutlass_dir" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "nvidia_cutlass-*.whl"))[0]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(dest, "include", name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
  rm -rf "$tmp"
fi

binutils_dir="$root/.deps/cuda-binutils-$CUDA_BINUTILS_PIP_VERSION"
if [ ! -x "$binutils_dir/bin/cuobjdump" ] || [ ! -x "$binutils_dir/bin/nvdisasm" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --dest "$tmp" "nvidia-cuda-cuobjdump==$CUDA_BINUTILS_PIP_VERSION" \
    "nvidia-cuda-nvdisasm==$CUDA_BINUTILS_PIP_VERSION"
  python3 - "$tmp" "$binutils_dir" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(dest, "bin"), exist_ok=True)
for tool in ("cuobjdump", "nvdisasm"):
    wheel = glob.glob(os.path.join(tmp, f"nvidia_cuda_{tool}-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("/bin/" + tool))
        out = os.path.join(dest, "bin", tool)
        with z.open(name) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(out, 0o755)
PY
  rm -rf "$tmp"
fi

clang_format_dir="$root/.deps/clang-format-$CLANG_FORMAT_PIP_VERSION"
if [ ! -x "$clang_format_dir/bin/clang-format" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --dest "$tmp" "clang-format==$CLANG_FORMAT_PIP_VERSION"
  python3 - "$tmp" "$clang_format_dir" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "clang_format-*.whl"))[0]
os.makedirs(os.path.join(dest, "bin"), exist_ok=True)
out = os.path.join(dest, "bin", "clang-format")
with zipfile.ZipFile(wheel) as z, z.open("clang_format/data/bin/clang-format") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(out, 0o755)
PY
  rm -rf "$tmp"
fi

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

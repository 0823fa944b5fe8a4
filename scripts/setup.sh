#!/usr/bin/env bash
# Installs what a fresh build machine lacks: CUTLASS headers (pinned in deps.env) under .deps/,
# and GoogleTest from Debian when it is missing. Idempotent; run from anywhere.
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
echo "setup: CUTLASS $CUTLASS_PIP_VERSION headers in $cutlass_dir"

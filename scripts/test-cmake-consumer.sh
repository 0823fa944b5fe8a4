#!/usr/bin/env bash
# Installs a built tree (cmake --install BUILD_DIR, nothing is rebuilt) into a temporary prefix,
# then configures, builds and runs examples/cmake_consumer against it: find_package(jagflash
# CONFIG REQUIRED), jagflash::jagflash, a CPU forward through the C API. Needs no GPU.
#   scripts/test-cmake-consumer.sh [BUILD_DIR]   (default: build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build}"
case "$build" in /*) ;; *) build="$root/$build" ;; esac
[ -f "$build/cmake_install.cmake" ] || { echo "test-cmake-consumer: $build is not a configured build" >&2; exit 2; }
tmp="$(mktemp -d "${TMPDIR:-/tmp}/jagflash-consumer.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
t0=$SECONDS
cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" || { cat "$tmp/install.log" >&2; exit 1; }
cmake -S "$root/examples/cmake_consumer" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log" || { cat "$tmp/configure.log" >&2; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" || { cat "$tmp/build.log" >&2; exit 1; }
"$tmp/build/consumer"
echo "test-cmake-consumer: installed package built and ran in $((SECONDS - t0)) s"

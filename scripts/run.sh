#!/usr/bin/env bash
# Sets up, builds and runs the main job: `jagflash run` (GPU when present, else the CPU
# reference on a scaled-down batch). Extra arguments go to `jagflash run`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
build="${BUILD_DIR:-build}"
cmake -S . -B "$build" ${JAGFLASH_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target jagflash_cli
exec "$build/jagflash" run "$@"

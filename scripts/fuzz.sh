#!/usr/bin/env bash
# Runs the C API fuzzer (tests/fuzz) longer than ctest does (ctest: seed 1, a fixed number of
# cases). It builds only the fuzzer, in a build folder of its own: the library's host code with
# AddressSanitizer and UndefinedBehaviorSanitizer, no CUDA kernels (about a minute on 2 cores).
#   usage: scripts/fuzz.sh [SECONDS [SEED]]    defaults: 600 s, a seed from the clock (printed)
#   BUILD_DIR  build folder (default build-fuzz)
#   JOBS       fuzzer processes side by side, seeds SEED, SEED+1, ... (default 1; logs in BUILD_DIR)
# A failing case prints its seed, its index and what was broken; it reruns alone with
#   BUILD_DIR/tests/fuzz/jagflash_fuzz_c_api --seed SEED --case INDEX
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
seconds="${1:-600}"
seed="${2:-$(date +%s)}"
jobs="${JOBS:-1}"
for v in "$seconds" "$seed" "$jobs"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [SECONDS [SEED]] (non-negative integers; JOBS too)" >&2; exit 2; }
done
build="${BUILD_DIR:-build-fuzz}"

scripts/setup.sh >/dev/null
cmake -S . -B "$build" -DJAGFLASH_WERROR=ON -DJAGFLASH_BUILD_TESTS=ON -DJAGFLASH_FUZZ=ON >/dev/null
cmake --build "$build" --target jagflash_fuzz_c_api -j "$(nproc 2>/dev/null || echo 2)"
fuzzer="$build/tests/fuzz/jagflash_fuzz_c_api"

echo "fuzz: seed $seed, $seconds s, $jobs process(es)"
if [ "$jobs" -le 1 ]; then
  exec "$fuzzer" --seed "$seed" --seconds "$seconds" --stats
fi
pids=()
for ((i = 0; i < jobs; ++i)); do
  "$fuzzer" --seed $((seed + i)) --seconds "$seconds" >"$build/fuzz-seed-$((seed + i)).log" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < jobs; ++i)); do
  log="$build/fuzz-seed-$((seed + i)).log"
  if wait "${pids[$i]}"; then
    tail -n 1 "$log"
  else
    status=1
    echo "fuzz: seed $((seed + i)) FAILED ($log):"
    tail -n 40 "$log"
  fi
done
exit "$status"

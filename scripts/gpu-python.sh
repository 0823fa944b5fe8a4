#!/usr/bin/env bash
# On the GPU machine, from a repo copy with the carried build (no pip install, no network): the
# Python tests (CUDA ones included) and bench/compare.py, with jagflash from python/ and the
# library from the build. Logs and results go to $OUT (or ./gpu-logs): pytest.log, compare.log,
# compare.json, compare.md and the chart (5 files). A short table is printed last.
#   usage: scripts/gpu-python.sh [build-dir]
#   SKIP_TESTS=1 / SKIP_COMPARE=1 skip a step; COMPARE_ARGS="..." goes to compare.py;
#   JAGFLASH_COMMIT=<sha> names the commit measured (the copy has no git history).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"

# Both steps fit one 10-minute device call: tests about 2 minutes, compare.py about 4.
[ "${SKIP_TESTS:-0}" = 1 ] || step pytest pytest.log 240 "$python" -m pytest -rs -q -p no:cacheprovider python/tests
if [ "${SKIP_COMPARE:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  step compare compare.log 330 "$python" bench/compare.py --out "$out" ${COMPARE_ARGS:-}
  # Cut short: compare.json holds every finished measurement; render its table and chart.
  [ $? = 124 ] && "$python" bench/compare.py --from "$out" --out "$out" >>"$out/compare.log" 2>&1
fi

echo "==== logs in $out"
[ -f "$out/pytest.log" ] && { echo "---- pytest"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20; tail -n 1 "$out/pytest.log"; }
[ -f "$out/compare.log" ] && { echo "---- compare (TFLOP/s fwd / bwd)"; grep -E "^\||^compare.py:|^FAILED" "$out/compare.log" | tail -n 30; }
echo "==== summary ($("$python" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>/dev/null))"
print_summary
summary_passed

#!/usr/bin/env bash
# On the GPU machine, from a repo copy with the carried build (no pip install, no network): the
# Python tests (CUDA ones included) and bench/compare.py, with jagflash from python/ and the
# library from the build. Logs and results go to $OUT (or ./gpu-logs): pytest.log, compare.log,
# compare.json, compare.md and the chart (5 files). compare.py's short table (the backward against
# FA2 and FA3, and the bars) is printed last.
#   usage: scripts/gpu-python.sh [build-dir]
#   SKIP_TESTS=1 / SKIP_COMPARE=1 skip a step; COMPARE_ARGS="..." goes to compare.py (for a short
#   call: COMPARE_ARGS="--bwd-only"); JAGFLASH_COMMIT=<sha> names the commit measured (the copy has
#   no git history).
# FlashAttention-3, a benchmark peer only (nothing else needs it): compare.py runs it when the call
# carries its prebuilt copy as .fa3/ (`rm -rf .fa3 && cp -r ../shared/peers/fa3 .fa3`, ignored
# through .git/info/exclude; carry [".fa3", ...]), and says it skipped it otherwise.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"
[ -d "$root/.fa3" ] && export PYTHONPATH="$root/.fa3:$PYTHONPATH"

# Both steps fit one 10-minute device call: tests about 2 minutes, compare.py about 5 (with FA3
# and the training steps; --bwd-only about 1).
[ "${SKIP_TESTS:-0}" = 1 ] || step pytest pytest.log 240 "$python" -m pytest -rs -q -p no:cacheprovider python/tests
if [ "${SKIP_COMPARE:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  step compare compare.log 330 "$python" bench/compare.py --out "$out" ${COMPARE_ARGS:-}
  # Cut short: compare.json holds every finished measurement; render its table and chart.
  [ $? = 124 ] && "$python" bench/compare.py --from "$out" --out "$out" >>"$out/compare.log" 2>&1
fi

echo "==== logs in $out"
[ -f "$out/pytest.log" ] && { echo "---- pytest"; grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20; tail -n 1 "$out/pytest.log"; }
# compare.py's duration and skipped peers, then its short table (the backward and the bars) and
# failures; the whole table, forward / backward, is in compare.md.
[ -f "$out/compare.log" ] && {
  echo "---- compare"
  grep -E "^compare.py: ([0-9.]+ s$|.* skipped:)" "$out/compare.log" | sort -u
  sed -n '/^compare.py: backward and training step/,$p' "$out/compare.log"
}
echo "==== summary ($("$python" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>/dev/null))"
print_summary
summary_passed

#!/usr/bin/env bash
# On the GPU machine, from a carried build (with the binding: python python/build_backend/
# jagflash_binding.py build): the backward's GPU tests (default order, deterministic mode, the
# tile-order knobs), then bench/sweep.py (jagflash beside FA3 varlen and FA2 varlen, uniform L =
# 512..16384 and our own batches); logs and sweep.json/sweep.md/chart in $OUT; the sweep's
# table and its bars (sweep.py's bars(): jagflash / FA3 on the uniform points, TFLOP/s at D = 128
# from L = 4096, TFLOP/s as L grows) last.
#   usage: scripts/gpu-sweep.sh [build-dir]
#   SKIP_TESTS=1 skips the tests; SWEEP_ARGS="..." goes to sweep.py (e.g. --head-dims 128
#   --variant plain:JAGFLASH_BWD_L2_GROUP_MB=0,JAGFLASH_BWD_ROTATE=0); JAGFLASH_COMMIT names
#   the commit measured. FA3 runs when carried as .fa3/ (../shared/peers/fa3/README.md).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"
[ -d "$root/.fa3" ] && export PYTHONPATH="$root/.fa3:$PYTHONPATH"
export PYTHONUNBUFFERED=1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step "gpu tests, backward" gpu_bwd.log 240 "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperBackward*:GpuPooled*'
  JAGFLASH_TEST_BWD_DETERMINISTIC=1 step "backward, deterministic" gpu_bwd_det.log 240 "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperBackward*'
fi
# shellcheck disable=SC2086
step "sweep" sweep.log 420 "$python" bench/sweep.py --out "$out" ${SWEEP_ARGS:-}
[ $? = 124 ] && "$python" bench/sweep.py --from "$out" --out "$out" >>"$out/sweep.log" 2>&1
echo "==== logs in $out"
for f in gpu_bwd.log gpu_bwd_det.log; do
  [ -f "$out/$f" ] && { echo "---- $f"; grep -E "^\[  FAILED|FAILED TEST|PASSED" "$out/$f" | head -10; }
done
[ -f "$out/sweep.log" ] && { echo "---- sweep"; sed -n '/^sweep.py: backward TFLOP/,$p' "$out/sweep.log"; grep -E "ERROR|Traceback" "$out/sweep.log" | head -5; }
echo "==== summary"
print_summary
summary_passed

#!/usr/bin/env bash
# On the GPU machine, from a build carried from the build machine (build/): runs the GPU tests,
# `jagflash check` on the five distributions, `jagflash run` and `jagflash bench`; logs go to
# $OUT (or ./gpu-logs), bundled into gpu-check-logs.tar.gz at the end; a short table is printed last.
#   usage: scripts/gpu-check.sh [build-dir]      (set QUICK=1 to skip check/bench)
#   SANITIZE=1 adds compute-sanitizer; BWD_VARIANTS=1 benches the backward's schedules and its
#   deterministic mode; VARIANTS=1 benches schedule x ping-pong (VARIANT_SCHEDULES
#   narrows the schedules, e.g. "dynamic").
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
out="${OUT:-$root/gpu-logs}"
mkdir -p "$out"
cli="$build/jagflash"
limit="${STEP_TIMEOUT:-300}"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$out/gpu.txt" 2>&1
# The binaries run directly (not through ctest): a carried build's CTest files hold the build
# machine's absolute paths.
step "cpu tests" cpu_tests.log "$limit" "$build/tests/jagflash_tests"
step "gpu tests" gpu_tests.log "$limit" "$build/tests/jagflash_gpu_tests"
# The backward's deterministic mode (dq bitwise reproducible) must be as correct as the default:
# every backward test that does not pick a mode itself runs in it.
JAGFLASH_TEST_BWD_DETERMINISTIC=1 step "hopper backward, deterministic" hopper_bwd_deterministic.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperBackward*'
# The backward's schedule knob (JAGFLASH_BWD_SCHEDULE) picks other tile orders: as correct too.
JAGFLASH_BWD_SCHEDULE=zigzag step "hopper backward, zigzag schedule" hopper_bwd_zigzag.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperBackward*'
JAGFLASH_BWD_SCHEDULE=grid step "hopper backward, plain grid" hopper_bwd_grid.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperBackward*'
# The forward's benchmark knobs select other variants: each must be as correct as the default
# (the backward tests would only rerun the same backward under them: not repeated).
JAGFLASH_FWD_SCHEDULE=zigzag step "hopper tests, zigzag schedule" hopper_zigzag.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_SCHEDULE=grid step "hopper tests, plain grid" hopper_grid.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_PINGPONG=1 step "hopper tests, ping-pong" hopper_pingpong.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_BLOCK_N=64 step "hopper tests, 64-key blocks" hopper_block_n64.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_BLOCK_N=160 step "hopper tests, 160-key blocks" hopper_block_n160.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
# 176-key blocks stage O in two halves of the head dim (tile_config.hpp): the epilogue's second path.
JAGFLASH_FWD_BLOCK_N=176 step "hopper tests, 176-key blocks" hopper_block_n176.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_WARPGROUPS=3 step "hopper tests, 3 warpgroups" hopper_wg3.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_WARPGROUPS=2 step "hopper tests, 2 warpgroups" hopper_wg2.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_PAIRS=2 step "hopper tests, 2 pairs" hopper_pairs.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
# The two pairs on the padded kernels (below 64, 96, 128) and at 96's own head dim, every case.
JAGFLASH_FWD_PAIRS=2 step "head dims, 2 pairs" head_dims_pairs.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHeadDims.Padded*:GpuHeadDims.NarrowerVForward'
JAGFLASH_FWD_PAIRS=2 JAGFLASH_FWD_SCHEDULE=grid step "hopper tests, 2 pairs, grid" hopper_pairs_grid.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
# The plan's head order under a mask in L2 groups (64 KB cuts the tests' sequences into groups of
# one to a few heads; 32768 is the candidate default) and the softmax's running max kept within
# 2^8 (the default on the D = 128 and 256 kernels, off on the others: the steps run the softmax
# without it everywhere and the kept max at every head dim;
# GpuHopperForward.RunningMaxKeptOrMovedMatchesReference sets it itself).
JAGFLASH_FWD_L2_GROUP_KB=64 step "hopper tests, small L2 head groups" hopper_l2_small.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*:GpuHeadDims.Padded*'
JAGFLASH_FWD_L2_GROUP_KB=32768 step "hopper tests, 32 MB L2 head groups" hopper_l2_32mb.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*'
JAGFLASH_FWD_KEEP_MAX=-1 step "hopper tests, running max always moved" hopper_keep_max_off.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHopperForward*:GpuHeadDims*:GpuScoreMod*'
JAGFLASH_FWD_KEEP_MAX=8 step "head dims, running max kept" head_dims_keep_max.log "$limit" "$build/tests/jagflash_gpu_tests" --gtest_filter='GpuHeadDims*:GpuPooled*:GpuHopperForward*'
step "jagflash run" run.log "$limit" "$cli" run
step "jagflash run --causal" run_causal.log "$limit" "$cli" run --causal
if [ "${QUICK:-0}" != 1 ]; then
  for d in uniform1k gemskew pareto onegiant short; do
    step "check $d" "check_$d.log" "$limit" "$cli" check --dist "$d"
  done
  step "check gemskew causal" check_gemskew_causal.log "$limit" "$cli" check --dist gemskew --causal
  step "check gemskew D=256" check_gemskew_d256.log "$limit" "$cli" check --dist gemskew --head-dim 256
  step "bench none" bench.log "$limit" "$cli" bench --iters 5 --warmup 1
  step "bench causal" bench_causal.log "$limit" "$cli" bench --iters 5 --warmup 1 --causal
fi

if [ "${SANITIZE:-0}" = 1 ]; then
  # Small cases: the sanitizers slow kernels down by orders of magnitude.
  small='GpuHopperForward.NeverWritesPastTheLastSequence:GpuHopperForward.RefusesWhatItCannotServe:GpuOracle.PaddingBetweenRowsIsNeverWritten:GpuPooled.SmallCaseForSanitizers:GpuScoreMod.SmallCaseForSanitizers:GpuHeadDims.SmallCaseForSanitizers:GpuBlockMask.SmallCaseForSanitizers'
  step "compute-sanitizer memcheck" memcheck.log "$limit" compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small"
  step "compute-sanitizer racecheck" racecheck.log "$limit" compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small"
  # The two-pair forward shares one CTA's shared memory between two independent pipelines.
  JAGFLASH_FWD_PAIRS=2 step "memcheck, 2 pairs" memcheck_pairs.log "$limit" compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small"
  JAGFLASH_FWD_PAIRS=2 step "racecheck, 2 pairs" racecheck_pairs.log "$limit" compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small"
  # The backward (its preprocess, main and postprocess kernels, both modes) on small cases;
  # synccheck for its named barriers and warp-level syncs between producer and consumers.
  small_bwd='GpuHopperBackward.SmallAgainstReference:GpuHopperBackward.NeverWritesPastTheLastSequence:GpuScoreMod.SmallCaseForSanitizers:GpuHeadDims.SmallCaseForSanitizers:GpuBlockMask.SmallCaseForSanitizers'
  step "memcheck, backward" memcheck_bwd.log "$limit" compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small_bwd"
  step "racecheck, backward" racecheck_bwd.log "$limit" compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small_bwd"
  # racecheck reports hazards between a plain bulk copy completing on an mbarrier and the reads
  # after the wait on it, in a minimal correct ring too (fenced or not, every sum right; figures:
  # bench/NOTES.md, "Figures moved out of code comments"): the backward's hazards on its lse/delta
  # stages are of that kind. This step shows the repro's report next to the backward's; it fails
  # only if the repro's sums are wrong.
  step "racecheck repro (bulk copy + mbarrier)" racecheck_repro.log "$limit" compute-sanitizer --tool racecheck "$build/tests/jagflash_racecheck_bulk_copy"
  step "synccheck, backward" synccheck_bwd.log "$limit" compute-sanitizer --tool synccheck --error-exitcode 1 "$build/tests/jagflash_gpu_tests" --gtest_filter="$small_bwd"
fi
if [ "${VARIANTS:-0}" = 1 ]; then
  # Forward variants side by side (bench/NOTES.md): schedule x ping-pong, both masks.
  : >"$out/variants.log"
  for sched in ${VARIANT_SCHEDULES:-dynamic zigzag grid}; do
    for pp in 1 0; do
      for mask in "" --causal; do
        JAGFLASH_FWD_SCHEDULE=$sched JAGFLASH_FWD_PINGPONG=$pp timeout 120 "$cli" bench --fwd-only --iters 10 --warmup 2 $mask \
          | grep '^| [a-z]' | sed "s/^/| $sched | pp=$pp /" >>"$out/variants.log"
      done
    done
  done
  step "variants table" variants_done.log "$limit" cat "$out/variants.log"
fi
if [ "${BWD_VARIANTS:-0}" = 1 ]; then
  # Backward variants side by side (bench/NOTES.md): the three schedules, and the deterministic
  # mode under the default one; both masks, D = 128 and 64. Rows: | variant | dist | mask | ... |
  : >"$out/bwd_variants.log"
  for hd in 128 64; do
    for mask in "" --causal; do
      for v in dynamic zigzag grid deterministic; do
        sched=$v flag=""
        [ "$v" = deterministic ] && { sched=dynamic; flag=--deterministic; }
        JAGFLASH_BWD_SCHEDULE=$sched timeout 120 "$cli" bench --iters 5 --warmup 1 --head-dim "$hd" $mask $flag \
          | grep '^| [a-z]' | sed "s/^/| $v | D=$hd /" >>"$out/bwd_variants.log"
      done
    done
  done
  step "backward variants table" bwd_variants_done.log "$limit" cat "$out/bwd_variants.log"
fi

echo "==== logs in $out"
for f in run.log bench.log bench_causal.log variants.log memcheck.log racecheck.log memcheck_bwd.log racecheck_bwd.log synccheck_bwd.log; do
  [ -f "$out/$f" ] && { echo "---- $f"; tail -n 12 "$out/$f"; }
done
echo "==== summary ($(head -2 "$out/gpu.txt" | tail -1))"
print_summary
# The device tool hands back at most 8 files from $OUT: the ~20 logs travel as one archive, so
# that a later step of the same call (gpu-python.sh's compare.json and chart) still comes back.
# BUNDLE_LOGS=0 leaves them loose.
if [ "${BUNDLE_LOGS:-1}" = 1 ]; then
  (cd "$out" && shopt -s nullglob && logs=(*.log *.txt *.csv) &&
    { [ ${#logs[@]} -eq 0 ] || tar czf gpu-check-logs.tar.gz --remove-files -- "${logs[@]}"; }) ||
    echo "gpu-check: could not bundle the logs in $out" >&2
fi
summary_passed

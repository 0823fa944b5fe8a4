#!/usr/bin/env bash
# On the GPU machine: ncu on the backward's main kernel of jagflash and of FA3 (when carried as
# .fa3/) on one batch (bench/profile_bwd.py), one launch each after warm-up; the reports and their
# text (details, and the SASS lines with the most stall samples) go to $OUT.
#   usage: scripts/gpu-profile.sh [build-dir]   PROFILE_ARGS="--dist uniform1k --head-dim 128"
#   NCU_SET=full (default) or e.g. "detailed"; DIRECTION=fwd profiles the forward kernels instead;
#   IMPLS="fa3" profiles one of the two only (e.g. when the call cannot carry both)
#   (profile_bwd.py runs both directions)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/ncu-env.sh
source "$root/scripts/lib/ncu-env.sh"
args="${PROFILE_ARGS:---dist uniform1k --head-dim 128}"
tag="${DIRECTION:-bwd}_$(echo "$args" | tr -c 'a-zA-Z0-9' '_' | sed 's/__*/_/g; s/^_//; s/_$//')"
# jagflash's main backward kernel, then FA3's (its backward kernel is a cutlass device_kernel
# around FlashAttnBwdSm90): launch 2 of each (the first call warms up).
for impl in ${IMPLS:-jagflash fa3}; do
  case "$impl-${DIRECTION:-bwd}" in
    jagflash-bwd) filter='regex:backward_kernel' ;;
    fa3-bwd) filter='regex:FlashAttnBwdSm90' ;;
    jagflash-fwd) filter='regex:forward_kernel' ;;
    fa3-fwd) filter='regex:FlashAttnFwdSm90' ;;
  esac
  # shellcheck disable=SC2086
  timeout 240 ncu --set "${NCU_SET:-full}" --import-source yes --kernel-name-base demangled \
    --kernel-name "$filter" --launch-skip 1 --launch-count 1 -f -o "$out/${impl}_$tag" \
    python3 "$root/bench/profile_bwd.py" $args --impls "$impl" >"$out/${impl}_${tag}_ncu.log" 2>&1
  echo "$impl: ncu rc=$? ($(tail -n 2 "$out/${impl}_${tag}_ncu.log" | tr '\n' ' '))"
  rep="$out/${impl}_$tag.ncu-rep"
  [ -f "$rep" ] || continue
  ncu -i "$rep" --page details --print-details all >"$out/${impl}_${tag}_details.txt" 2>&1
  ncu -i "$rep" --page source --csv --print-source sass >"$out/${impl}_${tag}_sass.csv" 2>&1
  gzip -f "$out/${impl}_${tag}_sass.csv"
  ncu -i "$rep" --page raw --csv >"$out/${impl}_${tag}_raw.csv" 2>&1
done
# The limits that can bound the kernels, side by side: tensor pipe, L2 reductions and hit rate,
# DRAM, shared-memory conflicts, and the stall reasons per issued instruction.
if [ -n "$(ls "$out"/*_"$tag"_raw.csv 2>/dev/null)" ]; then
  python3 "$root/bench/ncu_metrics.py" "$out"/*_"$tag"_raw.csv | tee "$out/metrics_$tag.txt"
  gzip -f "$out"/*_"$tag"_raw.csv
fi
for f in "$out"/*_"$tag"_details.txt; do
  echo "==== $f"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc Active|Issue Slots Busy|Registers Per|Warp Cycles Per Issued|Achieved Occupancy|L2 Hit Rate|DRAM Throughput|Shared Memory Bank|Stall" "$f" | head -40
done

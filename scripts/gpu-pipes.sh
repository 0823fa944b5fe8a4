#!/usr/bin/env bash
# On the GPU machine: what bounds the forward kernels, from ncu's pipe counters on one launch each
# (after a warm-up call): the special-function (MUFU/XU) pipe, FMA, ALU and issue slots (this
# ncu reports no value for the wgmma pipe metric asked for; left in for one that does), for jagflash's forward with and without a softcap on uniform1k, and jagflash's
# and FA3's (when carried as .fa3/) causal forward at L = 16k (bench/sweep.py's batch). One line
# per case in $OUT/pipes.txt, printed last.
#   usage: scripts/gpu-pipes.sh [build-dir]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# python/ on PYTHONPATH before lib/ncu-env.sh puts FA3's copy in front of it.
export PYTHONPATH="$root/python:${PYTHONPATH:-}"
# shellcheck source=lib/ncu-env.sh
source "$root/scripts/lib/ncu-env.sh"
metrics="gpu__time_duration.sum,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active"
: >"$out/pipes.txt"
run_case() {  # name kernel-regex profile_bwd.py arguments...
  local name="$1" filter="$2"
  shift 2
  timeout 200 ncu --metrics "$metrics" --kernel-name-base demangled --kernel-name "regex:$filter" --launch-skip 1 --launch-count 1 \
    --csv --page raw python3 "$root/bench/profile_bwd.py" --calls 2 "$@" >"$out/pipes_$name.csv" 2>"$out/pipes_$name.log"
  echo "$name: rc=$?" >>"$out/pipes_$name.log"
  python3 - "$name" "$out/pipes_$name.csv" >>"$out/pipes.txt" <<'PY'
import csv, sys
name, path = sys.argv[1], sys.argv[2]
rows = [r for r in csv.reader(open(path)) if r]
at = next((i for i, r in enumerate(rows) if "ID" in r), None)
if at is None or len(rows) < at + 3:
    print(f"{name}: no ncu rows"); sys.exit()
head, data = rows[at], rows[at + 2]
want = {"gpu__time_duration.sum": "ns", "sm__inst_executed_pipe_xu": "MUFU%", "sm__pipe_tensor_op_gmma": "tensor%",
        "sm__inst_executed_pipe_fma": "FMA%", "sm__inst_executed_pipe_alu": "ALU%", "sm__inst_issued": "issue%"}
cells = [f"{label} {data[i]}" for key, label in want.items() for i, h in enumerate(head)
         if h.startswith(key) and (h.endswith(".sum") or h.endswith(".avg.pct_of_peak_sustained_active"))]
print(f"{name}: " + ", ".join(cells))
PY
}
run_case plain_uniform1k forward_kernel --dist uniform1k --impls jagflash
run_case softcap_uniform1k forward_kernel --dist uniform1k --impls jagflash --softcap 30
run_case plain_causal_16k forward_kernel --uniform 16384 --causal --impls jagflash
run_case fa3_causal_16k FlashAttnFwdSm90 --uniform 16384 --causal --impls fa3
echo "==== forward pipes (ncu, one launch each)"
cat "$out/pipes.txt"

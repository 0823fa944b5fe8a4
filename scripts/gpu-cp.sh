#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2; also runs on one GPU), from a repo copy with the carried
# build (no pip install, no network): jagflash under PyTorch's context parallelism, one long
# causal sequence split over the GPUs (examples/context_parallel.py):
#   1. the example in one process on one GPU (a ring of one): the check at 16k tokens against the
#      unsplit model, then training steps at 128k tokens, each for jagflash and for PyTorch's flash
#      kernel (the timed steps in turns);
#   2. the same with torchrun on 2 GPUs (skipped, visibly, when fewer are visible).
# Logs go to $OUT (or ./gpu-logs): cp-1gpu.log, cp-2gpu.log and cp-report.jsonl. Printed last:
# the checks, tokens/s per GPU of each attention, and jagflash's over PyTorch's flash kernel
# (bar: >= 1.3 at 128k tokens on 2 GPUs). About 2-3 minutes.
#   usage: scripts/gpu-cp.sh [build-dir]
#   JAGFLASH_COMMIT=<sha> names the commit measured (the copy has no git history);
#   CP_ARGS="..." goes to both runs (e.g. "--seq-len 262144", "--rotate alltoall", "--check-seq-len 0").
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# NVLink multicast off for NCCL, torch symmetric memory and NVSHMEM (the lent machines do not
# support it); the example sets the same defaults itself (through examples/train_ddp.py).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
report="$out/cp-report.jsonl"
rm -f "$report"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"

gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
# shellcheck disable=SC2086
step cp-1gpu cp-1gpu.log 240 "$python" examples/context_parallel.py --report-json "$report" ${CP_ARGS:-}
if [ "$gpus" -ge 2 ]; then
  # torch.distributed.run is torchrun; --standalone picks a free rendezvous port on this host.
  # shellcheck disable=SC2086
  step cp-2gpu cp-2gpu.log 240 "$python" -m torch.distributed.run --standalone --nproc_per_node=2 \
    examples/context_parallel.py --report-json "$report" ${CP_ARGS:-}
else
  summary+=("$(printf '%-34s %-7s        %s' cp-2gpu SKIPPED "only $gpus GPU(s) visible")")
fi

echo "==== logs in $out"
for log in cp-1gpu.log cp-2gpu.log; do
  [ -f "$out/$log" ] && { echo "---- $log"; grep -E "^(PASS|FAIL|==| {6}\S|Traceback)|Error" "$out/$log" | cut -c1-220 | head -20; }
done
echo "==== jagflash under context parallelism (commit ${JAGFLASH_COMMIT:-unknown})"
[ -f "$report" ] && "$python" - "$report" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
if records:
    r = records[0]
    print(f"{r['device']}, {r['precision']}, H={r['heads']} D={r['head_dim']} dim={r['dim']} layers={r['layers']}, "
          f"causal, ring exchange {r['rotate']}, NVLS env {r['nvls_env']}")
print("| ranks | tokens | attention | check | result | detail or tokens/s per GPU |")
print("|---|---|---|---|---|---|")
rates = {}
for r in records:
    if r["kind"] == "check":
        print(f"| {r['world_size']} | {r['seq_len']} | {r['attention']} | {r['check']} | {'PASS' if r['ok'] else 'FAIL'} "
              f"| {r['detail']} |")
    else:
        rates[(r["world_size"], r["seq_len"], r["attention"])] = r["tokens_per_s_per_rank"]
        print(f"| {r['world_size']} | {r['seq_len']} | {r['attention']} | training step | ran | median step {r['step_s_rank0'] * 1e3:.1f} ms "
              f"(rank 0); {', '.join(f'{rate:,.0f}' for rate in r['tokens_per_s_per_rank'])} |")
for (world, length, impl), per_rank in sorted(rates.items()):
    peer = rates.get((world, length, "pytorch_flash"))
    if impl == "jagflash" and peer:
        print(f"jagflash / pytorch_flash tokens/s per GPU, {world} GPU(s), {length} tokens: "
              f"{min(per_rank) / max(peer):.3f} to {max(per_rank) / min(peer):.3f} over the ranks")
one = {impl: rates[k][0] for k in rates for impl in [k[2]] if k[0] == 1}
two = {impl: min(rates[k]) for k in rates for impl in [k[2]] if k[0] == 2}
for impl in one.keys() & two.keys():
    print(f"{impl}: tokens/s per GPU on 2 GPUs over 1 GPU (the slower rank): {two[impl] / one[impl]:.3f}")
PY
echo "==== summary"
print_summary
summary_passed

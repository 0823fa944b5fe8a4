#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2; also runs on one GPU), from a repo copy with the carried
# build (no pip install, no network): jagflash inside DDP and FSDP2 (issue 5).
#   1. examples/test_train_ddp.py in one process on one GPU;
#   2. the same with torchrun on 2 GPUs (skipped, visibly, when fewer are visible);
#   3. examples/train_ddp.py --mode fsdp2 on 2 GPUs, the example as a user runs it.
# Logs go to $OUT (or ./gpu-logs): test-1gpu.log, test-2gpu.log, example-fsdp2.log and
# ddp-report.jsonl (4 files). A table is printed last: gradient checks, loss first -> last and
# tokens/s per GPU for 1 and 2 GPUs. About 1-2 minutes, mostly process start-up.
#   usage: scripts/gpu-ddp.sh [build-dir]
#   JAGFLASH_COMMIT=<sha> names the commit measured (the copy has no git history);
#   TEST_ARGS="..." goes to both test runs (e.g. "--layers 1 --batch-sequences 16").
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# NVLink multicast off for NCCL, torch symmetric memory and NVSHMEM (the lent machines do not
# support it). Exported here so torchrun's workers inherit them; the Python files set the same
# defaults themselves, and test_train_ddp.py fails if any is not off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
report="$out/ddp-report.jsonl"
rm -f "$report"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"

gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
# shellcheck disable=SC2086
step test-1gpu test-1gpu.log 100 "$python" examples/test_train_ddp.py --report-json "$report" ${TEST_ARGS:-}
if [ "$gpus" -ge 2 ]; then
  # torch.distributed.run is torchrun; --standalone picks a free rendezvous port on this host.
  # shellcheck disable=SC2086
  step test-2gpu test-2gpu.log 130 "$python" -m torch.distributed.run --standalone --nproc_per_node=2 \
    examples/test_train_ddp.py --report-json "$report" ${TEST_ARGS:-}
  step example-fsdp2 example-fsdp2.log 90 "$python" -m torch.distributed.run --standalone --nproc_per_node=2 \
    examples/train_ddp.py --mode fsdp2 --steps 10 --report-json "$report"
else
  summary+=("$(printf '%-14s %-7s        %s' test-2gpu SKIPPED "only $gpus GPU(s) visible")")
fi

echo "==== logs in $out"
for log in test-1gpu.log test-2gpu.log; do
  [ -f "$out/$log" ] && { echo "---- $log"; grep -E "^(PASS|FAIL|==|Traceback)|Error" "$out/$log" | cut -c1-200 | head -20; }
done
echo "==== jagflash under DDP / FSDP2 (commit ${JAGFLASH_COMMIT:-unknown})"
[ -f "$report" ] && "$python" - "$report" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
checks = [r for r in records if r["kind"] == "check"]
if checks:
    r = checks[0]
    print(f"{r['device']}, {r['precision']}, H={r['heads']} D={r['head_dim']} dim={r['dim']} layers={r['layers']}, "
          f"{r['batch_sequences']} gemskew sequences per rank (lengths / {r['length_divisor']}), NVLS env {r['nvls_env']}")
print("| ranks | check | result | detail | tokens/s per GPU (rank: tokens/step) |")
print("|---|---|---|---|---|")
for r in records:
    name = r["check"] if r["kind"] == "check" else f"example {r['mode']}"
    result = ("PASS" if r["ok"] else "FAIL") if "ok" in r else "ran"
    # Rank 0's detail: the gradient checks compare the same averaged gradient on every rank and
    # the losses are averaged over ranks, so the ranks report alike (the logs show each).
    detail = r["detail"] if "detail" in r else f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} in {r['steps']} steps"
    rates = ", ".join(f"{i}: {rate:,.0f} ({tokens})" for i, (rate, tokens) in
                      enumerate(zip(r.get("tokens_per_s_per_rank", []), r.get("tokens_per_rank", []))))
    print(f"| {r['world_size']} | {name} | {result} | {detail} | {rates} |")
EOF
echo "==== summary"
print_summary
summary_passed

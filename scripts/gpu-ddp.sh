#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2; also runs on one GPU), from a repo copy with the carried
# build (no pip install, no network): jagflash inside DDP and FSDP2, with the same model on
# PyTorch's FA2 kernel (varlen_attn) as the peer, each attention in turn:
#   1. examples/test_train_ddp.py in one process on one GPU;
#   2. the same with torchrun on 2 GPUs (skipped, visibly, when fewer are visible);
#   3. examples/train_ddp.py --mode fsdp2 on 2 GPUs, the example as a user runs it.
# Logs go to $OUT (or ./gpu-logs): test-1gpu-<attention>.log, test-2gpu-<attention>.log,
# example-fsdp2-<attention>.log and ddp-report.jsonl. Printed last: gradient checks, loss first ->
# last and tokens/s per GPU for 1 and 2 GPUs, then rank 0's tokens/s on 2 GPUs over 1 GPU (rank
# 0's batch is the same whatever the world size) and jagflash's over varlen_attn's. About 3-5
# minutes, mostly process start-up.
#   usage: scripts/gpu-ddp.sh [build-dir]
#   JAGFLASH_COMMIT=<sha> names the commit measured (the copy has no git history);
#   TEST_ARGS="..." goes to the test runs and the example, so options both take (those of
#   train_ddp.add_arguments and --steps; e.g. "--batch-sequences 256", the kernel-bound batch,
#   default 24 sequences); ATTENTIONS="jagflash" skips the peer.
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
for attention in ${ATTENTIONS:-jagflash varlen_attn}; do
  # shellcheck disable=SC2086
  step "test-1gpu $attention" "test-1gpu-$attention.log" 100 "$python" examples/test_train_ddp.py \
    --attention "$attention" --report-json "$report" ${TEST_ARGS:-}
  if [ "$gpus" -ge 2 ]; then
    # torch.distributed.run is torchrun; --standalone picks a free rendezvous port on this host.
    # shellcheck disable=SC2086
    step "test-2gpu $attention" "test-2gpu-$attention.log" 130 "$python" -m torch.distributed.run --standalone \
      --nproc_per_node=2 examples/test_train_ddp.py --attention "$attention" --report-json "$report" ${TEST_ARGS:-}
    # shellcheck disable=SC2086
    step "example-fsdp2 $attention" "example-fsdp2-$attention.log" 90 "$python" -m torch.distributed.run \
      --standalone --nproc_per_node=2 examples/train_ddp.py --mode fsdp2 --steps 10 --attention "$attention" \
      --report-json "$report" ${TEST_ARGS:-}
  else
    summary+=("$(printf '%-34s %-7s        %s' "test-2gpu $attention" SKIPPED "only $gpus GPU(s) visible")")
  fi
done

echo "==== logs in $out"
for log in "$out"/test-*.log; do
  [ -f "$log" ] && { echo "---- ${log##*/}"; grep -E "^(PASS|FAIL|==|Traceback)|Error" "$log" | cut -c1-200 | head -20; }
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
print("| ranks | attention | check | result | detail | tokens/s per GPU (rank: tokens/step) |")
print("|---|---|---|---|---|---|")
for r in records:
    name = r["check"] if r["kind"] == "check" else f"example {r['mode']}"
    result = ("PASS" if r["ok"] else "FAIL") if "ok" in r else "ran"
    # Rank 0's detail: the gradient checks compare the same averaged gradient on every rank and
    # the losses are averaged over ranks, so the ranks report alike (the logs show each).
    detail = r["detail"] if "detail" in r else f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} in {r['steps']} steps"
    rates = ", ".join(f"{i}: {rate:,.0f} ({tokens})" for i, (rate, tokens) in
                      enumerate(zip(r.get("tokens_per_s_per_rank", []), r.get("tokens_per_rank", []))))
    print(f"| {r['world_size']} | {r['attention']} | {name} | {result} | {detail} | {rates} |")
# The bars: rank 0's tokens/s (its batch is the same at any world size) on 2 GPUs over 1 GPU, and
# jagflash over varlen_attn at the same world size, for the test's ddp and fsdp2 training runs.
rank0 = {(r["attention"].split()[0], r["world_size"], r["check"]): r["tokens_per_s_per_rank"][0]
         for r in checks if r["check"].startswith("train") and r.get("tokens_per_s_per_rank")}
print()
print("| training run | 2 GPUs / 1 GPU, jagflash (bar 0.95) | 2 GPUs / 1 GPU, varlen_attn | jagflash / varlen_attn, 1 GPU | jagflash / varlen_attn, 2 GPUs (bar 1.5) |")
print("|---|---|---|---|---|")
def ratio(a, b):
    return f"{rank0[a] / rank0[b]:.3f}" if a in rank0 and b in rank0 else "-"
for check in ("train ddp", "train fsdp2"):
    print(f"| {check} | {ratio(('jagflash', 2, check), ('jagflash', 1, check))} | "
          f"{ratio(('varlen_attn', 2, check), ('varlen_attn', 1, check))} | "
          f"{ratio(('jagflash', 1, check), ('varlen_attn', 1, check))} | "
          f"{ratio(('jagflash', 2, check), ('varlen_attn', 2, check))} |")
EOF
echo "==== summary"
print_summary
summary_passed

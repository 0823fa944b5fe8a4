#!/usr/bin/env bash
# On the GPU machine, from a carried build (with the binding: python python/build_backend/
# jagflash_binding.py build): bench/models.py, one attention layer of each model (Llama-3-8B,
# Qwen2.5-7B, gpt-oss, Gemma-2-9B, DeepSeek-V3 MLA, a recsys history model) beside every peer;
# models.json, models.md and the chart in $OUT, the table and its notes last.
#   usage: scripts/gpu-models.sh [build-dir]
#   MODELS_ARGS="..." goes to models.py: FlexAttention compiles every layer (tens of seconds each),
#   so one device call holds about half the models (--models llama3-8b qwen2.5-7b gpt-oss, then
#   --models gemma2-9b deepseek-v3 recsys; `models.py --from A B` renders both as one table; a call
#   cut short leaves the layers it finished in models.json: run the others in another call).
#   JAGFLASH_COMMIT names the commit measured. FA3 runs when carried as .fa3/
#   (../shared/peers/fa3/README.md), FA4 when installed in /tmp/site (../shared/peers/fa4/README.md).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"
[ -d "$root/.fa3" ] && export PYTHONPATH="$root/.fa3:$PYTHONPATH"
[ -d /tmp/site/flash_attn ] && export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
export PYTHONUNBUFFERED=1
# shellcheck disable=SC2086
step models models.log 540 "$python" bench/models.py --out "$out" ${MODELS_ARGS:-}
# Cut short: models.json holds every finished layer; render its table and chart.
[ $? = 124 ] && "$python" bench/models.py --from "$out" --out "$out" >>"$out/models.log" 2>&1
echo "==== logs in $out"
if [ -f "$out/models.log" ]; then
  sed -n '/^models.py: one layer/,$p' "$out/models.log"
  grep -E "Traceback" -A 3 "$out/models.log" | head -8
fi
echo "==== summary"
print_summary
summary_passed

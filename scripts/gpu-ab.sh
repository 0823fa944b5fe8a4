#!/usr/bin/env bash
# On the GPU machine: the forward (or, with DIRECTION=bwd, the backward) of two builds side by side on one machine start (A, B, B, A
# order, so drift in clocks shows up as A's two runs disagreeing), with the SM clock, power and
# throttle reasons sampled while they run. Prints one table (fwd TFLOP/s per case) last; the raw
# bench output and the clock log go to $OUT/ab.log and $OUT/clocks.csv.
#   usage: scripts/gpu-ab.sh BUILD_A BUILD_B ["bench args" ...]
#   A build may carry its own environment, VAR=value[,VAR=value]@DIR: the same build with and
#   without a knob is then an A/B pair (e.g. build JAGFLASH_FWD_BLOCK_N=64@build).
#   Each extra argument is one bench configuration, run for both builds, e.g.
#     scripts/gpu-ab.sh build-base build "" "--causal" "--head-dim 64"
#   A configuration may start with VAR=value words (environment for that run, e.g.
#   "JAGFLASH_FWD_PINGPONG=1 --causal").
#   DIRECTION=bwd times forward and backward and tabulates the backward's TFLOP/s.
set -uo pipefail
direction="${DIRECTION:-fwd}"
case "$direction" in
  fwd) bench_mode=(--fwd-only) column=7 ;;
  bwd) bench_mode=() column=9 ;;
  *) echo "gpu-ab.sh: DIRECTION: expected fwd or bwd, got $direction" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
a="$1"
b="$2"
shift 2
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=("" "--causal")
out="${OUT:-$root/gpu-logs}"
mkdir -p "$out"
log="$out/ab.log"
: >"$log"

nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 250 >"$out/clocks.csv" 2>/dev/null &
sampler=$!

run_one() {  # label build config
  local label="$1" build="$2" config="$3" envs=() args=()
  if [[ "$build" == *@* ]]; then
    IFS=',' read -r -a envs <<<"${build%@*}"
    build="${build#*@}"
  fi
  for w in $config; do
    if [[ "$w" == *=* && ${#args[@]} -eq 0 ]]; then envs+=("$w"); else args+=("$w"); fi
  done
  env "${envs[@]}" timeout 120 "$build/jagflash" bench "${bench_mode[@]}" --iters 10 --warmup 2 "${args[@]}" 2>&1 \
    | grep '^| [a-z]' | sed "s/^/| $label | $config /" >>"$log"
}

for config in "${configs[@]}"; do
  run_one A "$a" "$config"
  run_one B "$b" "$config"
  run_one B2 "$b" "$config"
  run_one A2 "$a" "$config"
done
kill "$sampler" 2>/dev/null

# One row per (config, dist, mask): TFLOP/s (of the direction timed) of A, A2, B, B2 and B/A (means of the two runs).
python3 - "$log" "$column" <<'EOF'
import collections, sys
column = int(sys.argv[2])
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    label, config, dist, mask, tflops = cells[0], cells[1], cells[2], cells[3], cells[column]
    if dist == "dist":
        continue
    rows.setdefault((config, dist, mask), {})[label] = float(tflops)
print("| config | dist | mask | A | A2 | B | B2 | B/A |")
print("|---|---|---|---|---|---|---|---|")
for (config, dist, mask), r in rows.items():
    get = lambda k: r.get(k, float("nan"))
    ratio = (get("B") + get("B2")) / (get("A") + get("A2"))
    print(f"| {config or '-'} | {dist} | {mask} | {get('A'):.1f} | {get('A2'):.1f} | {get('B'):.1f} | {get('B2'):.1f} | {ratio:.3f} |")
EOF
# Clock summary while the benches ran (MHz, W): median and minimum.
python3 - "$out/clocks.csv" <<'EOF'
import statistics, sys
clk, pw, reasons = [], [], {}
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 5:
        continue
    try:
        c, p = float(f[1].split()[0]), float(f[2].split()[0])
    except ValueError:
        continue
    if c > 1000:  # samples while a kernel ran
        clk.append(c); pw.append(p); reasons[f[4]] = reasons.get(f[4], 0) + 1
if clk:
    print(f"clocks while busy: SM median {statistics.median(clk):.0f} MHz (min {min(clk):.0f}), "
          f"power median {statistics.median(pw):.0f} W (max {max(pw):.0f}); throttle reasons {reasons}")
EOF

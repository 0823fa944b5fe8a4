# Shared by the GPU scripts (sourced): `step` runs a command under a time limit, logs it to
# $out/LOGFILE and records a line (PASS / FAIL / TIMEOUT, seconds, log) in the array `summary`.
declare -a summary

step() {  # step NAME LOGFILE TIMEOUT COMMAND...
  local name="$1" log="$2" limit="$3"; shift 3
  local t0=$SECONDS
  # A hung kernel or worker must not eat the whole device lease.
  timeout "$limit" "$@" >"$out/$log" 2>&1
  local rc=$?
  local state=FAIL
  [ $rc = 0 ] && state=PASS
  [ $rc = 124 ] && state=TIMEOUT
  summary+=("$(printf '%-34s %-7s %5ss  %s' "$name" "$state" "$((SECONDS - t0))" "$log")")
  return $rc
}

print_summary() { printf '%s\n' "${summary[@]}"; }

# Exit status for the script: 0 when no step failed or timed out.
summary_passed() { ! printf '%s\n' "${summary[@]}" | grep -qE ' (FAIL|TIMEOUT) '; }

#!/usr/bin/env bash
# Benchmark (not a test): how the replay simulator scales with the fleet. Replays the whole
# Mooncake conversation trace (12,031 requests over an hour) once per policy on ENGINES
# simulated engines, the arrival rate scaled with the fleet (RATE, e.g. 128 for 1,024
# engines, 1250 for 10,000), one policy at a time on one thread, and prints each run's wall
# time and peak resident memory (GNU time) beside the replay's own result row, so two
# binaries' rows can be checked for identical results.
#
# usage: scripts/replay-scale.sh KVROUTE_BINARY ENGINES RATE [POLICY,...]   (needs GNU time)
# The trace is data/traces/mooncake_conversation_trace.jsonl (vendored), or $KVROUTE_TRACE.
set -euo pipefail
bin=${1:?usage: $0 KVROUTE_BINARY ENGINES RATE [POLICY,...]}
engines=${2:?engines}
rate=${3:?rate scale}
policies=${4:-round_robin,random,least_load,power_of_two,consistent_hash,cache_aware,prefix_affinity,kv_score,lmetric,load_only,sticky,unified,capped,prefill_cost,least_ttft}
here=$(cd "$(dirname "$0")/.." && pwd)
trace=${KVROUTE_TRACE:-$here/data/traces/mooncake_conversation_trace.jsonl}
[ -x /usr/bin/time ] || { echo "GNU time is missing (Debian package time)" >&2; exit 2; }
[ -f "$trace" ] || { echo "no trace at $trace (set KVROUTE_TRACE)" >&2; exit 2; }
out=$(mktemp)
trap 'rm -f "$out" "$out.t"' EXIT
printf '%-16s %7s %9s %9s  %s\n' policy engines wall_s peak_mib row
for p in ${policies//,/ }; do
  /usr/bin/time -f '%e %M' -o "$out.t" "$bin" replay --trace "$trace" --policy "$p" \
    --engines "$engines" --rate-scale "$rate" --jobs 1 >"$out" 2>/dev/null
  read -r wall kib <"$out.t"
  row=$(grep -E "^$p +[0-9]" "$out" | tr -s ' ' || true)
  printf '%-16s %7s %9s %9d  %s\n' "$p" "$engines" "$wall" $((kib / 1024)) "$row"
done

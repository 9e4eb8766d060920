#!/usr/bin/env bash
# Benchmark (not a test): a deterministic cost of a decision, for comparing builds on a VM
# whose timings drift. Counts the instructions executed inside kvroute_core::policy::decide
# (valgrind callgrind, collection toggled on that function) while `kvroute bench decision`
# warms each policy with the Mooncake trace (12,031 decisions, each committed) and times
# 500 probe decisions, and prints the mean per decision (12,531) per policy and binary.
# Instructions are not time (cache misses and divisions cost more than they count), so
# read it beside decision-compare.py's timings.
#
# With --probes first, the probe decisions alone: the difference between runs of 5,500 and
# 500 probes, over 5,000 (the warm-up's decisions are made without a fleet digest, so the
# mean over all of them hides what a digest saves).
#
# With --probe-at SECS, the probes are decided then (`kvroute bench decision --probe-at`;
# every binary needs the flag): 13 probes kv_score's index while its entries live.
#
# usage: scripts/decision-instructions.sh [--probes] [--probe-at SECS] WORKERS BINARY... [-- POLICY,...]   (needs valgrind)
set -euo pipefail
probes=0
at=()
while [ "${1:-}" = "--probes" ] || [ "${1:-}" = "--probe-at" ]; do
  if [ "$1" = "--probes" ]; then probes=1; shift; else at=(--probe-at "$2"); shift 2; fi
done
workers=${1:?usage: $0 [--probes] [--probe-at SECS] WORKERS BINARY... [-- POLICY,...]}
shift
bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do bins+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
policies=${1:-round_robin,random,least_load,power_of_two,consistent_hash,cache_aware,prefix_affinity,kv_score,lmetric,load_only,sticky,unified,capped,prefill_cost,least_ttft}
command -v valgrind >/dev/null || { echo "valgrind is missing (Debian package valgrind)" >&2; exit 2; }
err=$(mktemp)
trap 'rm -f "$err"' EXIT
printf '%-16s' policy; for b in "${bins[@]}"; do printf ' %14s' "$(basename "$(dirname "$(dirname "$b")")")"; done; echo
for p in ${policies//,/ }; do
  printf '%-16s' "$p"
  for b in "${bins[@]}"; do
    count() {
      valgrind --tool=callgrind --callgrind-out-file=/dev/null --toggle-collect='kvroute_core::policy::decide*' \
        "$b" bench decision --workers "$workers" --policy "$p" --decisions "$1" "${at[@]}" >/dev/null 2>"$err"
      grep -o 'Collected : [0-9]*' "$err" | awk '{print $3}'
    }
    if [ "$probes" = 1 ]; then
      printf ' %14d' $((($(count 5500) - $(count 500)) / 5000))
    else
      printf ' %14d' $(($(count 500) / 12531))
    fi
  done
  echo
done

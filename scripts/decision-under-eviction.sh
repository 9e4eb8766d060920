#!/usr/bin/env bash
# Benchmark (not a test): routing decision time under concurrent load while the prefix tree
# is being evicted. cache_aware with a 2 M-char tree budget evicted every second, two
# instant engine-sim workers, wrk (1 thread, 32 connections) sending distinct ~4 KB prompts
# for DURATION seconds. Prints the router's kvroute_decision_seconds p50/p99/max bucket
# (upper bounds of its power-of-two buckets), the same for the deciding thread's CPU time
# (kvroute_decision_cpu_seconds: the decision's own work, without waits and preemption), its
# wait for the model router's lock (kvroute_decision_lock_wait_seconds), and the requests served.
#
# usage: scripts/decision-under-eviction.sh KVROUTE_BINARY [DURATION_SECS [SERVE_FLAGS...]]   (needs wrk)
# e.g. `... 20 --policy-copies 1` to compare one copy of the policy state with the default two.
# Also prints the router's peak resident memory (VmHWM).
# 127.0.0.1 only; every process started here is stopped on exit.
set -euo pipefail
bin=${1:?usage: $0 KVROUTE_BINARY [DURATION_SECS]}
dur=${2:-20}
extra=("${@:3}")
command -v wrk >/dev/null || { echo "wrk is missing (Debian package wrk)" >&2; exit 2; }
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 1 200); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.05; done; echo "$1 did not come up" >&2; exit 1; }
urls=()
for _ in 1 2; do
  p=$(free_port)
  "$bin" engine-sim --port "$p" --instant >"$tmp/w$p.log" 2>&1 & pids+=($!)
  urls+=("http://127.0.0.1:$p")
done
for u in "${urls[@]}"; do wait_up "$u"; done
rp=$(free_port)
"$bin" serve --port "$rp" --policy cache_aware \
  --policy-knobs '{"max_tree_size": 2000000, "eviction_interval_secs": 1}' \
  --worker-urls "$(IFS=,; echo "${urls[*]}")" "${extra[@]}" >"$tmp/router.log" 2>&1 & pids+=($!)
router_pid=$!
router="http://127.0.0.1:$rp"
wait_up "$router"
cat >"$tmp/distinct.lua" <<'LUA'
local n = 0
local pad = string.rep("routing under eviction, a distinct prompt line. ", 80)
request = function()
  n = n + 1
  local body = '{"model":"sim-llama-3-8b","max_tokens":1,"messages":[{"role":"user","content":"' ..
    n .. ' ' .. math.random(1, 1e9) .. ' ' .. pad .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
end
LUA
wrk -t1 -c32 -d"${dur}s" -s "$tmp/distinct.lua" "$router" >"$tmp/wrk.txt"
curl -s "$router/metrics" >"$tmp/metrics.txt"
python3 - "$tmp/metrics.txt" "$tmp/wrk.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
rps = re.search(r'Requests/sec:\s+([\d.]+)', open(sys.argv[2]).read())
fmt = lambda s: "inf" if s == float('inf') else f"{s*1e6:.1f} us"
def report(metric, label):
    buckets = [(float('inf') if m.group(1) == '+Inf' else float(m.group(1)), int(m.group(2)))
               for m in re.finditer(metric + r'_bucket\{le="([^"]+)"\} (\d+)', text)]
    total = buckets[-1][1] if buckets else 0
    def q(p):
        for le, c in buckets:
            if c >= p * total:
                return le
    prev, top = 0, None
    for le, c in buckets:
        if c > prev:
            top = le
        prev = c
    def above(t):
        return total - max((c for le, c in buckets if le <= t), default=0)
    # Bucket bounds are 1.6 us x 2^n: "> 819 us" counts every decision above the 819.2 us bound.
    print(f"{label}: decisions {total}  p50 <= {fmt(q(0.5))}  p99 <= {fmt(q(0.99))}  p99.9 <= {fmt(q(0.999))}  "
          f"p99.99 <= {fmt(q(0.9999))}  max <= {fmt(top)}  > 819 us: {above(8.2e-4)}  > 52 ms: {above(5.3e-2)}")
report("kvroute_decision_seconds", "wall")
report("kvroute_decision_cpu_seconds", "cpu ")
report("kvroute_decision_lock_wait_seconds", "lock")
print(f"req/s {rps.group(1) if rps else '?'}")
PY
echo "index size after: $(grep '^kvroute_index_size ' "$tmp/metrics.txt" | awk '{print $2}')"
echo "router peak memory: $(awk '/VmHWM/ {printf "%.0f MiB", $2/1024}' "/proc/$router_pid/status")"

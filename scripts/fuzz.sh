#!/usr/bin/env bash
# Fuzzes kvroute's parsers with cargo-fuzz (libFuzzer), one target after another, each for a
# bounded time, and prints one line per target: executions, executions per second,
# coverage (libFuzzer's `cov`, `ft`), corpus size and crashes.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default 300 s, every target)
# Targets (fuzz/fuzz_targets/): request_parse (chat, completions, /generate bodies),
# sse_tap (the load generator's SSE parser), trace_read (Mooncake, session and Azure
# traces), config_toml (the gateway's configuration file), api_keys (the API-key file),
# kv_events_decode (the KV-event decoder). Not part of CI; results in docs/lab/2026-11-26-benchmark-runs.md.
# Needs the machine's nightly toolchain and cargo-fuzz (installed from crates.io on first
# use). Corpora and crash files stay under $KVROUTE_CACHE/fuzz, builds under
# $KVROUTE_CACHE/fuzz-target, so the repository stays clean.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-300}"
shift || true
cache="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
export CARGO_TARGET_DIR="$cache/fuzz-target"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(request_parse sse_tap trace_read config_toml api_keys kv_events_decode)
fi

# Seeds from the repository's own examples, when a corpus is new.
seed() {
  local t=$1 dir=$2
  case "$t" in
    request_parse)
      printf '\x00\x00\x10{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}' >"$dir/chat"
      printf '\x01\x00\x10{"model":"m","prompt":[1,2,3],"max_tokens":4}' >"$dir/completions"
      printf '\x02\x00\x10{"input_ids":[5,6],"sampling_params":{"max_new_tokens":3}}' >"$dir/generate" ;;
    sse_tap)
      printf '\x07data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n' >"$dir/stream" ;;
    trace_read)
      { printf '\x00'; head -c 2000 data/traces/mooncake_conversation_trace.jsonl 2>/dev/null \
          || echo '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]}'; } >"$dir/mooncake"
      printf '\x01{"timestamp": 0, "input_length": 10, "output_length": 2, "session_id": "s", "turn_id": 1}\n' >"$dir/session"
      printf '\x02TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n' >"$dir/azure" ;;
    config_toml) cp kvroute.example.toml "$dir/example.toml" ;;
    api_keys) printf '# keys\nsk-a team-a rpm=3\nsk-b team-b tpm=50\nsk-c\n' >"$dir/keys" ;;
    kv_events_decode) cp -n crates/kvroute-gateway/tests/data/kv_events/*.bin "$dir"/ 2>/dev/null || true ;;
  esac
}

printf '%-18s %14s %10s %8s %8s %8s %8s\n' target execs exec/s cov ft corpus crashes
for t in "${targets[@]}"; do
  corpus="$cache/fuzz/$t"
  artifacts="$cache/fuzz/artifacts/$t/"
  mkdir -p "$corpus" "$artifacts"
  [ -n "$(ls -A "$corpus")" ] || seed "$t" "$corpus"
  log="$cache/fuzz/$t.log"
  # -a: debug assertions on (integer overflow panics count as crashes).
  status=0
  cargo +nightly fuzz run -a --fuzz-dir fuzz "$t" "$corpus" -- \
    -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$artifacts" >"$log" 2>&1 || status=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  last=$(grep -E '#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE)' "$log" | tail -1 || true)
  cov=$(printf '%s' "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*' || echo '?')
  ft=$(printf '%s' "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*' || echo '?')
  crashes=$(find "$artifacts" -type f | wc -l)
  printf '%-18s %14s %10s %8s %8s %8s %8s\n' "$t" "$execs" "$rate" "$cov" "$ft" "$(ls "$corpus" | wc -l)" "$crashes"
  if [ "$status" -ne 0 ]; then
    echo "  $t stopped with status $status: see $log and $artifacts" >&2
  fi
done

#!/usr/bin/env bash
# Fuzzes the KV-event decoder with cargo-fuzz (libFuzzer) for a bounded time.
#   scripts/fuzz.sh [SECONDS]      (default 300)
# Needs the machine's nightly toolchain (rustup toolchain list) and cargo-fuzz, which is
# installed from crates.io on first use. The corpus is kept under ~/.cache/kvroute/fuzz.
set -euo pipefail
secs="${1:-300}"
cd "$(dirname "$0")/.."
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
corpus="${KVROUTE_CACHE:-$HOME/.cache/kvroute}/fuzz/kv_events_decode"
mkdir -p "$corpus"
# Seeds: the golden frames of the codec tests, when present.
cp -n crates/kvroute-gateway/tests/data/kv_events/*.bin "$corpus"/ 2>/dev/null || true
exec cargo +nightly fuzz run --fuzz-dir fuzz kv_events_decode "$corpus" -- \
  -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -timeout=10

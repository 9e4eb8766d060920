#!/usr/bin/env bash
# The project's test command (README: "Test"). Runs:
#   1. the purity check: kvroute-core must not depend on an async runtime or do I/O;
#   2. every unit, property and integration test with cargo-nextest;
#   3. doctests (nextest skips them).
# Optional inputs: KVROUTE_PYTHON (a python with the `openai` SDK) enables the SDK client
# test; KVROUTE_REQUIRE_PYTHON=1 makes its absence a failure (CI sets both).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== purity: kvroute-core's dependency tree"
tree=$(cargo tree -p kvroute-core -e normal,build --prefix none --format '{p}')
bad=$(printf '%s\n' "$tree" | grep -E '^(tokio|async-std|smol|mio|hyper|reqwest|axum) ' || true)
if [ -n "$bad" ]; then
  echo "kvroute-core must stay pure (no async runtime, no I/O crates), but depends on:" >&2
  printf '%s\n' "$bad" >&2
  exit 1
fi
echo "ok: no async runtime or I/O crate in kvroute-core"

echo "== tests (cargo nextest)"
cargo nextest run --workspace --no-fail-fast

echo "== doctests"
cargo test --workspace --doc --quiet

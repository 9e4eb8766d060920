#!/usr/bin/env bash
# The project's test command (README: "Test"). Runs:
#   1. the purity check: kvroute-core and kvroute-protocol must not depend on an async
#      runtime or do I/O; the gateway must not depend on the simulators;
#   2. every unit, property and integration test with cargo-nextest;
#   3. doctests (nextest skips them).
# Optional inputs: KVROUTE_PYTHON (a python with the `openai` SDK) enables the SDK client
# test; KVROUTE_REQUIRE_PYTHON=1 makes its absence a failure (CI sets both).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== purity: kvroute-core's and kvroute-protocol's dependency trees"
for crate in kvroute-core kvroute-protocol; do
  tree=$(cargo tree -p "$crate" -e normal,build --prefix none --format '{p}')
  bad=$(printf '%s\n' "$tree" | grep -E '^(tokio|async-std|smol|mio|hyper|reqwest|axum) ' || true)
  if [ -n "$bad" ]; then
    echo "$crate must stay pure (no async runtime, no I/O crates), but depends on:" >&2
    printf '%s\n' "$bad" >&2
    exit 1
  fi
done
echo "ok: no async runtime or I/O crate in kvroute-core or kvroute-protocol"

echo "== layering: the gateway does not depend on the simulators"
if cargo tree -p kvroute-gateway -e normal --prefix none --format '{p}' | grep -qE '^kvroute-(sim|engine-sim) '; then
  echo "kvroute-gateway depends on kvroute-sim or kvroute-engine-sim (only its tests may)" >&2
  exit 1
fi
echo "ok"

echo "== tests (cargo nextest)"
cargo nextest run --workspace --no-fail-fast

echo "== doctests"
cargo test --workspace --doc --quiet

#!/usr/bin/env bash
# The project's test command (README: "Test"). Runs:
#   1. the purity check: kvroute-core and kvroute-protocol must not depend on an async
#      runtime or do I/O; the gateway must not depend on the simulators; nothing in code,
#      scripts or docs names a path beside the checkout (the sibling shared directory); the
#      gateway's modules import only downward and no crate has an import circle
#      (scripts/layers.py); no function over 80 lines in the gateway and the binary
#      (scripts/long-fns.py);
#   2. every unit, property and integration test with cargo-nextest (installed with
#      `cargo install --locked` when missing);
#   3. doctests (nextest skips them).
#   4. the tests that need outside pieces (marked #[ignore] with the reason), each group when
#      its piece is given, and a closing list of what was skipped and why:
#        KVROUTE_PYTHON (a python with the `openai` SDK): the SDK client test;
#        KVROUTE_EPP_PYTHON (a python with envoy-data-plane): the endpoint picker's
#        independent ext_proc client (crates/kvroute/tests/epp_client.py);
#        KVROUTE_LLAMA_SERVER + KVROUTE_LLAMA_MODEL (scripts/llama-workers.sh): llama.cpp e2e;
#        KVROUTE_PEERS_DIR (scripts/compare-peers.sh): peers in the compare test;
#        KVROUTE_ETCD_BIN (the etcd binary, Debian etcd-server): the cluster registry and
#        live-policy tests and `kvroute register`;
#        KVROUTE_NATS_BIN (the nats-server binary, Debian nats-server): the replica-sync
#        tests (prefix state and load shared, snapshots, NATS or a replica dying);
#        both KVROUTE_NATS_BIN and KVROUTE_ETCD_BIN: SIGTERM with both servers stopped;
#        KVROUTE_PROMETHEUS (the prometheus binary, Debian prometheus): the scrape and
#        Grafana-dashboard test;
#        KVROUTE_NGINX_BIN (the nginx binary, Debian nginx-light): the admin API behind a
#        same-host reverse proxy.
#      KVROUTE_REQUIRE_PYTHON / _EPP_PYTHON / _LLAMA / _PEERS / _ETCD / _PROMETHEUS / _NGINX = 1 make a missing piece a failure
#      (CI sets them).
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

echo "== self-contained: no path beside the checkout in code, scripts or docs"
# A spec or source system is cited by its public origin (repository and path, paper, page),
# data lives in data/. docs/results/ is left out: it records the commands that ran.
outside=$(git grep -nE '\.\./(\.\./)*shared/|(^|[^A-Za-z0-9_./-])shared/(specs|tools|data)/' -- \
  crates scripts docs README.md .ci kvroute.example.toml fuzz data ':!docs/results' || true)
if [ -n "$outside" ]; then
  echo "references outside the repository (cite the public origin, or vendor the data):" >&2
  printf '%s\n' "$outside" >&2
  exit 1
fi
echo "ok"

echo "== layering: the gateway does not depend on the simulators"
if cargo tree -p kvroute-gateway -e normal --prefix none --format '{p}' | grep -qE '^kvroute-(sim|engine-sim) '; then
  echo "kvroute-gateway depends on kvroute-sim or kvroute-engine-sim (only its tests may)" >&2
  exit 1
fi
echo "ok"

echo "== floors: the gateway's modules import only downward; no crate's modules import each other in a circle"
python3 scripts/layers.py
echo "ok"

echo "== short functions: none over 80 lines outside tests in the gateway and the binary"
python3 scripts/long-fns.py 80 crates/kvroute-gateway/src crates/kvroute/src
echo "ok"

# cargo-nextest runs the tests: each test in its own process (tests that start servers, set
# signals or change the environment cannot disturb each other), and its filtersets
# (`-E 'binary(etcd) | test(...)'`) select the ignored groups below, which `cargo test` has
# no way to express across binaries. A machine without it gets it once (pinned version,
# Cargo.lock of its release), in CARGO_HOME/bin where cargo finds its subcommands.
NEXTEST_VERSION=0.9.143
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "== cargo-nextest is missing: installing cargo-nextest $NEXTEST_VERSION (cargo install --locked, a few minutes, once)"
  cargo install cargo-nextest --version "$NEXTEST_VERSION" --locked
fi
cargo nextest --version | head -1

echo "== tests (cargo nextest; the ignored ones need outside pieces, run below)"
cargo nextest run --workspace --no-fail-fast

echo "== doctests"
cargo test --workspace --doc --quiet

skipped=()
# run_ignored NAME FILTERSET AVAILABLE REQUIRE WHY: runs the ignored tests matching FILTERSET
# when AVAILABLE is 1; otherwise fails when REQUIRE is 1, else records the skip.
run_ignored() {
  local name=$1 filter=$2 available=$3 require=$4 why=$5
  if [ "$available" = 1 ]; then
    echo "== $name (ignored by default: needs $why)"
    cargo nextest run --workspace --no-fail-fast --run-ignored only -E "$filter"
  elif [ "$require" = 1 ]; then
    echo "$name is required here but $why is missing" >&2
    exit 1
  else
    skipped+=("$name: needs $why")
  fi
}
have_python=0; [ -n "${KVROUTE_PYTHON:-}" ] && [ -x "${KVROUTE_PYTHON}" ] && have_python=1
have_llama=0
[ -n "${KVROUTE_LLAMA_SERVER:-}" ] && [ -f "${KVROUTE_LLAMA_SERVER}" ] \
  && [ -n "${KVROUTE_LLAMA_MODEL:-}" ] && [ -f "${KVROUTE_LLAMA_MODEL}" ] && have_llama=1
run_ignored "openai SDK client test" 'test(=openai_python_sdk_as_client)' "$have_python" \
  "${KVROUTE_REQUIRE_PYTHON:-0}" "KVROUTE_PYTHON, a python with the openai package"
have_epp_python=0; [ -n "${KVROUTE_EPP_PYTHON:-}" ] && [ -x "${KVROUTE_EPP_PYTHON}" ] && have_epp_python=1
run_ignored "endpoint picker's independent client test" 'test(=epp_python_client)' "$have_epp_python" \
  "${KVROUTE_REQUIRE_EPP_PYTHON:-0}" "KVROUTE_EPP_PYTHON, a python with envoy-data-plane and grpcio-health-checking"
run_ignored "llama.cpp end-to-end tests" 'binary(llama_e2e)' "$have_llama" \
  "${KVROUTE_REQUIRE_LLAMA:-0}" "KVROUTE_LLAMA_SERVER and KVROUTE_LLAMA_MODEL (bash scripts/llama-workers.sh install)"
have_etcd=0; [ -n "${KVROUTE_ETCD_BIN:-}" ] && [ -x "${KVROUTE_ETCD_BIN}" ] && have_etcd=1
run_ignored "etcd cluster tests" 'binary(etcd) | test(the_sidecar_registers) | test(registered_in_etcd)' "$have_etcd" \
  "${KVROUTE_REQUIRE_ETCD:-0}" "KVROUTE_ETCD_BIN, the etcd binary (Debian etcd-server)"
have_nats=0; [ -n "${KVROUTE_NATS_BIN:-}" ] && [ -x "${KVROUTE_NATS_BIN}" ] && have_nats=1
run_ignored "NATS cluster-sync tests" 'binary(nats) | binary(cluster_cli)' "$have_nats" \
  "${KVROUTE_REQUIRE_NATS:-0}" "KVROUTE_NATS_BIN, the nats-server binary (Debian nats-server)"
have_both=0; [ "$have_etcd" = 1 ] && [ "$have_nats" = 1 ] && have_both=1
require_both=0; { [ "${KVROUTE_REQUIRE_ETCD:-0}" = 1 ] || [ "${KVROUTE_REQUIRE_NATS:-0}" = 1 ]; } && require_both=1
run_ignored "shutdown with NATS and etcd stopped" 'binary(drain_cli)' "$have_both" \
  "$require_both" "KVROUTE_NATS_BIN and KVROUTE_ETCD_BIN (Debian nats-server, etcd-server)"
have_prometheus=0; [ -n "${KVROUTE_PROMETHEUS:-}" ] && [ -x "${KVROUTE_PROMETHEUS}" ] && have_prometheus=1
run_ignored "Prometheus scrape test" 'binary(prometheus)' "$have_prometheus" \
  "${KVROUTE_REQUIRE_PROMETHEUS:-0}" "KVROUTE_PROMETHEUS, the prometheus binary (Debian prometheus)"
have_nginx=0; [ -n "${KVROUTE_NGINX_BIN:-}" ] && [ -x "${KVROUTE_NGINX_BIN}" ] && have_nginx=1
run_ignored "admin API behind nginx test" 'test(=add_worker_through_nginx_on_the_same_host_needs_the_token)' \
  "$have_nginx" "${KVROUTE_REQUIRE_NGINX:-0}" "KVROUTE_NGINX_BIN, the nginx binary (Debian nginx-light)"
# The deploy artefacts: manifests rendered and validated offline, the Dockerfile linted,
# each overlay's configuration started with the kvroute just built (scripts/check-deploy.py).
if [ -n "${KVROUTE_DEPLOY_PYTHON:-}" ] && [ -x "${KVROUTE_DEPLOY_PYTHON}" ]; then
  echo "== deploy artefacts (scripts/check-deploy.py)"
  "$KVROUTE_DEPLOY_PYTHON" scripts/check-deploy.py --kvroute "${CARGO_TARGET_DIR:-target}/debug/kvroute"
else
  skipped+=("deploy artefact checks: needs KVROUTE_DEPLOY_PYTHON, a python with PyYAML, jsonschema, kubernetes-validate (.ci/run installs one)")
fi
if [ -z "${KVROUTE_PEERS_DIR:-}" ]; then
  # compare_runs_to_completion itself fails when KVROUTE_REQUIRE_PEERS=1.
  skipped+=("peer routers in compare_runs_to_completion (it ran kvroute alone): needs KVROUTE_PEERS_DIR (bash scripts/compare-peers.sh install)")
fi

echo "== skipped"
if [ ${#skipped[@]} -eq 0 ]; then
  echo "nothing: every test ran"
else
  printf '  %s\n' "${skipped[@]}"
fi

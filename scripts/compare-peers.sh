#!/usr/bin/env bash
# One command for the side-by-side comparison of kvroute with the peer routers
# (docs/benchmarks.md): installs sglang-router, vllm-router and SMG from PyPI into venvs
# outside the repo (cached), builds kvroute, and runs `kvroute bench compare`.
#
#   bash scripts/compare-peers.sh [kvroute bench compare flags…]
#   bash scripts/compare-peers.sh install   # only install the peers; prints their directory
#
# Versions are pinned as ../shared/specs/peers.md gives them. SMG gets its own venv because
# it installs an `smg` script of its own. KVROUTE_PEERS_DIR overrides the cache directory.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_ROUTER=0.3.2
VLLM_ROUTER=0.1.17
SMG=1.13.0
PEERS_DIR="${KVROUTE_PEERS_DIR:-${KVROUTE_CACHE:-$HOME/.cache/kvroute}/peers-$SGLANG_ROUTER-$VLLM_ROUTER-$SMG}"

install_peers() {
  mkdir -p "$PEERS_DIR"
  if [ ! -x "$PEERS_DIR/peers/bin/vllm-router" ] || ! "$PEERS_DIR/peers/bin/python" -c "import sglang_router" 2>/dev/null; then
    echo "== installing sglang-router==$SGLANG_ROUTER vllm-router==$VLLM_ROUTER into $PEERS_DIR/peers" >&2
    rm -rf "$PEERS_DIR/peers"
    python3 -m venv "$PEERS_DIR/peers"
    "$PEERS_DIR/peers/bin/pip" install --quiet --disable-pip-version-check \
      "sglang-router==$SGLANG_ROUTER" "vllm-router==$VLLM_ROUTER"
  fi
  if [ ! -x "$PEERS_DIR/smg/bin/smg" ]; then
    echo "== installing smg==$SMG into $PEERS_DIR/smg" >&2
    rm -rf "$PEERS_DIR/smg"
    python3 -m venv "$PEERS_DIR/smg"
    "$PEERS_DIR/smg/bin/pip" install --quiet --disable-pip-version-check "smg==$SMG"
  fi
}

if [ "${1:-}" = "install" ]; then
  install_peers
  echo "$PEERS_DIR"
  exit 0
fi

install_peers
cargo build --release --locked -p kvroute
target_dir="${CARGO_TARGET_DIR:-target}"
exec "$target_dir/release/kvroute" bench compare --peers-dir "$PEERS_DIR" "$@"

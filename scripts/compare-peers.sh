#!/usr/bin/env bash
# One command for the side-by-side comparison of kvroute with the peer routers
# (docs/benchmarks.md): installs sglang-router, vllm-router and SMG from PyPI into venvs
# outside the repo (cached), NVIDIA Dynamo's selection service into a venv of its own
# (`dynamo/`, driven by scripts/dynamo-shim.py), builds kvroute, and runs
# `kvroute bench compare`.
#
#   bash scripts/compare-peers.sh [kvroute bench compare flags…]
#   bash scripts/compare-peers.sh install   # only install the peers; prints their directory
#
# Versions are pinned (PyPI: sglang-router, vllm-router, smg, ai-dynamo). SMG gets its own venv
# because it installs an `smg` script of its own. Dynamo (github.com/ai-dynamo/dynamo) is
# installed by hand: `pip install ai-dynamo` fails offline (its `aisimulate` dependency fetches a wheel
# from NVIDIA's own index, and it pins a certifi newer than PyPI has), so its two wheels go in
# with --no-deps and the dependencies the selection service needs are listed by hand.
# KVROUTE_PEERS_DIR overrides the cache directory.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_ROUTER=0.3.2
VLLM_ROUTER=0.1.17
SMG=1.13.0
DYNAMO=1.6.1
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
  local dyn="$PEERS_DIR/dynamo"
  if ! "$dyn/bin/python" -c "import dynamo.select_service, aiohttp" 2>/dev/null \
    || [ "$("$dyn/bin/python" -c 'import importlib.metadata as m; print(m.version("ai-dynamo"))' 2>/dev/null)" != "$DYNAMO" ]; then
    echo "== installing ai-dynamo==$DYNAMO (selection service, no GPU) into $dyn" >&2
    rm -rf "$dyn"
    python3 -m venv "$dyn"
    local pip=("$dyn/bin/pip" --quiet --disable-pip-version-check)
    "${pip[@]}" download --no-deps "ai-dynamo==$DYNAMO" "ai-dynamo-runtime==$DYNAMO" -d "$dyn/wheels"
    # The dependencies first: installed after them with --no-deps, the two wheels do not make
    # pip report the missing aisimulate as a conflict.
    "${pip[@]}" install 'aiohttp<4.0,>=3.14.3' certifi 'kubernetes<33.0.0,>=32.0.1' 'msgspec>=0.19.0' \
      'prometheus-client<1.0,>=0.23.1' 'pyzmq>=26.0.0' 'redis<9.0.0,>=6.2.0' 'tqdm>=4.0.0' \
      'transformers>=4.56.0' 'typing-extensions>=4.10.0' 'zstandard<1.0,>=0.23.0' \
      'pydantic>=2.10.6,<=2.13.5' 'uvloop>=0.21.0' jinja2 gguf
    "${pip[@]}" install --no-deps "$dyn"/wheels/ai_dynamo-"$DYNAMO"-*.whl "$dyn"/wheels/ai_dynamo_runtime-"$DYNAMO"-*.whl
    rm -rf "$dyn/wheels"
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

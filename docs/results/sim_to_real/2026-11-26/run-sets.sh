#!/bin/bash
# Sim-to-real sets, as run: `run-sets.sh set8 set9 set10`, then `set11 set12`, then
# `set13 set14`. Each run is preceded by a one-worker-alone + contention calibration.
cd /work/main
K=/root/.cache/kvroute/target/release/kvroute
L=/root/.cache/kvroute/llama/0.3.36-nativeON-noamx-59f87250905f
export KVROUTE_LLAMA_SERVER=$L/bin/llama-server KVROUTE_LLAMA_MODEL=$L/models/SmolLM2-135M-Instruct.Q4_1.gguf
export KVROUTE_LOG=warn,kvroute::decision=debug
declare -A ORDER=(
  [set8]="round_robin least_ttft least_ttft/slots" [set9]="least_ttft/slots least_ttft round_robin"
  [set10]="least_ttft least_ttft/slots round_robin" [set11]="least_ttft round_robin least_ttft/slots"
  [set12]="least_ttft/slots round_robin least_ttft" [set13]="round_robin least_ttft/slots least_ttft"
  [set14]="least_ttft round_robin least_ttft/slots" )
for S in "$@"; do
  mkdir -p /tmp/s2r/$S
  for p in ${ORDER[$S]}; do n=${p//\//-}
    echo "$(date +%T) $S $p calibrate"
    python3 scripts/llama-calibrate.py --workers 4 --levels 1,2,3,4 --rounds 4 --json /tmp/s2r/$S/calibration-$n.json > /tmp/s2r/$S/calibration-$n.log 2>&1
    echo "$(date +%T) $S $p bench"
    KVROUTE_RECORD=/tmp/s2r/$S/$n.jsonl $K bench compare --engine llama --workers 4 --policies $p --peers "" \
      --workload mtbench --output-tokens 64 --document-tokens 250 --documents 8 --conversations 40 \
      --conversation-concurrency 8 --log-dir /tmp/s2r/$S/logs-$n --json /tmp/s2r/$S/$n.json > /tmp/s2r/$S/$n.log 2>&1
  done
done
echo "$(date +%T) ALLDONE"

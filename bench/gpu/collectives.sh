#!/usr/bin/env bash
# Device-side collectives (issue #44): every collective of the device kernels checked against
# NCCL and all-reduce latency per size, as threads and as processes, beside torch's NCCL; then
# the training step's tp strong scaling with the device kernels and with NCCL behind host waits.
# Usage: VERL=/path/to/verl N=4 [PARTS=nccl,scaling] [PRESETS="qwen2-0.5b llama3.2-3b"]
# bash bench/gpu/collectives.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
N=${N:-$(nvidia-smi -L | wc -l)}
OUT=${OUT:-/tmp}/verl-collectives
mkdir -p "$OUT"
PARTS=${PARTS:-nccl,scaling}
if [[ $PARTS == *nccl* ]]; then
  echo "== verl bench nccl, $N threads"
  timeout 200 "$VERL" bench nccl --gpus "$N" --repeat 50 2>&1 | grep -v "communicator ready" | tail -12
  echo "== verl bench nccl, $N processes"
  for r in $(seq 0 $((N - 1))); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
      timeout 200 "$VERL" bench nccl --repeat 50 > "$OUT/nccl-$r.log" 2>&1 &
  done
  wait; tail -12 "$OUT/nccl-0.log"
  echo "== torch peer, $N processes"
  timeout 120 torchrun --nproc-per-node "$N" --master-port 29544 \
    "$(dirname "$0")/../peers/allreduce.py" 4k 64k 256k 1m 16m 256m 2>&1 | grep -v Warning | tail -8
fi
if [[ $PARTS == *scaling* ]]; then
  for p in ${PRESETS:-qwen2-0.5b llama3.2-3b}; do
    echo "== verl bench tp-scaling --preset $p"
    batch=4; [[ $p == llama3.2-3b ]] && batch=2
    timeout ${T:-300} "$VERL" bench tp-scaling --preset "$p" --batch $batch --seq 512 --steps 5 --tp 2,4 2>&1 \
      | grep -v "communicator ready" | tail -12
  done
fi

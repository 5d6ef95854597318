#!/usr/bin/env bash
# Tensor-parallel strong scaling of the training step with ranks as processes (one per GPU, as
# the job runs them): tp = 1 in one process, then each size in TPS as that many rank
# processes (torchrun's variables), efficiency t(1) / (tp · t(tp)) at one global batch.
# `verl bench tp-scaling` alone runs its ranks as threads of one process, which queue for
# burn's autodiff graph lock (docs/PERFORMANCE.md).
# Usage: VERL=/path/to/verl [PRESET=llama3.2-3b] [BATCH=4] [SEQ=1024] [STEPS=3] [TPS="2 4"]
#        [COLLECTIVES=device] [ARGS="--host-profile"] [OUT=/tmp] bash bench/gpu/tp_scaling.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
OUT=${OUT:-/tmp}/verl-tp-scaling
mkdir -p "$OUT"
args=(bench tp-scaling --preset "${PRESET:-llama3.2-3b}" --batch "${BATCH:-4}" --seq "${SEQ:-1024}"
      --steps "${STEPS:-3}" --collectives "${COLLECTIVES:-device}" ${ARGS:-})
timeout ${T:-300} "$VERL" "${args[@]}" --tp 1 > "$OUT/tp1.log" 2>&1
grep -v "NCCL communicator" "$OUT/tp1.log" | tail -4
one=$(awk -F'|' '/\| tp=1 \|/ {gsub(/ /, "", $4); print $4}' "$OUT/tp1.log")
[ -n "$one" ] || { echo "the tp=1 run gave no step time:"; tail -5 "$OUT/tp1.log"; exit 1; }
for tp in ${TPS:-2 4}; do
  pids=()
  for r in $(seq 0 $((tp - 1))); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$tp MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29600 + tp)) \
      timeout ${T:-300} "$VERL" "${args[@]}" --tp1-ms "$one" > "$OUT/tp$tp-$r.log" 2>&1 &
    pids+=($!)
  done
  failed=0
  for r in "${!pids[@]}"; do
    wait "${pids[$r]}" || { failed=1; echo "tp=$tp rank $r failed:"; tail -3 "$OUT/tp$tp-$r.log"; }
  done
  (( failed )) || grep "processes" "$OUT/tp$tp-0.log"
done

#!/usr/bin/env bash
# Issue #16's GPU figures: the rollout engine's kernel checks, then decode and prefill throughput
# of `verl bench rollout` beside transformers' `generate` (bench/peers/decode.py) in one
# invocation, with each lever switched off once. Usage: bash bench/gpu/rollout.sh [checks|speed|levers|all]
# (needs gpu-bin/verl, a stripped `cargo build --release --features cuda` binary).
set -u
source "$(dirname "$0")/env.sh"
what=${1:-all}
log=${OUT:-/tmp}/rollout.log
run() { { echo; echo "\$ $*"; timeout "$T" "$@" 2>&1; echo "(exit $?)"; } | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
if [ "$what" = checks ] || [ "$what" = all ]; then
  T=300 run $VERL bench kernels --repeat 3 --no-timing
fi
if [ "$what" = speed ] || [ "$what" = all ]; then
  T=200 run $VERL bench rollout --preset qwen2-0.5b --dtype bfloat16 --batch 1,16,64,256
  T=200 run python3 bench/peers/decode.py --preset qwen2-0.5b --dtype bf16 --batch 1 16 64 256
  T=200 run $VERL bench rollout --preset qwen2-1.5b --dtype bfloat16 --batch 1,64,256
  T=200 run python3 bench/peers/decode.py --preset qwen2-1.5b --dtype bf16 --batch 1 64 256
  # GRPO-style groups: 8 samples per prompt share one prefill.
  T=150 run $VERL bench rollout --preset qwen2-0.5b --dtype bfloat16 --batch 64,256 --n 8
fi
if [ "$what" = levers ] || [ "$what" = all ]; then
  # Each lever off in turn (the kernels fall back to the plain path).
  VERL_SAMPLING=decomposed T=150 run $VERL bench rollout --preset qwen2-0.5b --dtype bfloat16 --batch 1,64
  VERL_DECODE_ATTENTION=decomposed T=150 run $VERL bench rollout --preset qwen2-0.5b --dtype bfloat16 --batch 1,64
  VERL_FUSED_DECODE=off T=150 run $VERL bench rollout --preset qwen2-0.5b --dtype bfloat16 --batch 1,64,256
fi

#!/usr/bin/env bash
# Issue #28's figures: our kernels against their fallbacks, the cubek strategy table, and the
# training step with each lever on and off, side by side with PyTorch eager, in one invocation.
# Usage: bash bench/gpu/step_levers.sh [check|step|big|all]  (needs gpu-bin/verl, a stripped
# `cargo build --release --features cuda` binary).
set -u
source "$(dirname "$0")/env.sh"
what=${1:-all}
log=${OUT:-/tmp}/levers.log
run() { { echo; echo "\$ $*"; timeout "$T" "$@" 2>&1; echo "(exit $?)"; } | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$log"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$log"
step="$VERL bench train-step --preset qwen2-0.5b --batch 4 --seq 512 --dtype bfloat16 --steps 5"
if [ "$what" = check ] || [ "$what" = all ]; then
  T=300 run $VERL bench kernels --repeat 10 ${KERNELS_ARGS:-}
fi
if [ "$what" = step ] || [ "$what" = all ]; then
  T=120 run $step --gemm burn --adamw chain
  T=120 run $step --gemm burn --adamw fused
  T=120 run $step --gemm cubek --adamw chain
  T=120 run $step --gemm cubek --adamw fused
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
fi
if [ "$what" = big ] || [ "$what" = all ]; then
  # burn's attention keeps the [batch, heads, seq, seq] scores and probabilities of every layer:
  # batch 8 x 1024 ran out of the H100's memory (74 GiB in use), so batch 2 is measured beside
  # torch at both sizes.
  T=180 run $VERL bench train-step --preset qwen2-1.5b --batch 2 --seq 1024 --dtype bfloat16 --steps 3
  T=120 run python3 bench/peers/train_step.py --preset qwen2-1.5b --batch 2 --seq 1024 --dtype bf16 --steps 3
  T=120 run python3 bench/peers/train_step.py --preset qwen2-1.5b --batch 8 --seq 1024 --dtype bf16 --steps 3
fi

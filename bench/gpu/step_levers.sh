#!/usr/bin/env bash
# Issue #28's figures: our kernels against their fallbacks, the cubek strategy table, and the
# training step with each lever on and off, side by side with PyTorch eager, in one invocation.
# Usage: bash bench/gpu/step_levers.sh [check|step|attention|gemm|wgmma|bias|vocab|fused|big|all]  (needs gpu-bin/verl, a stripped
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
if [ "$what" = attention ] || [ "$what" = all ]; then
  T=150 run $step --attention decomposed
  T=150 run $step --attention fused
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
fi
if [ "$what" = gemm ] || [ "$what" = all ]; then
  T=150 run $step --gemm cubek
  T=150 run $step --gemm own
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
fi
if [ "$what" = wgmma ] || [ "$what" = all ]; then
  # Our wmma GEMM against the wgmma one (the default on Hopper) and torch, twice over.
  for _ in 1 2; do
    T=150 run $step --gemm wmma
    T=150 run $step --gemm own
    T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
  done
fi
if [ "$what" = bias ] || [ "$what" = all ]; then
  # The bias and RMSNorm weight gradients by our column sum against burn's reduction, at 1.5B.
  big="$VERL bench train-step --preset qwen2-1.5b --batch 8 --seq 1024 --dtype bfloat16 --steps 3"
  T=240 run env VERL_BIAS=decomposed $big
  T=240 run $big
  T=150 run $step
fi
if [ "$what" = vocab ] || [ "$what" = all ]; then
  T=150 run $step --vocab decomposed
  T=150 run $step --vocab fused
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
fi
if [ "$what" = fused ] || [ "$what" = all ]; then
  # Each element-wise kernel off in turn, then every lever off (plain burn), beside torch.
  T=150 run $step
  T=150 run env VERL_NORM=decomposed $step
  T=150 run env VERL_SWIGLU=decomposed $step
  T=150 run env VERL_ROPE=decomposed $step
  T=200 run env VERL_NORM=decomposed VERL_SWIGLU=decomposed VERL_ROPE=decomposed $step \
    --gemm burn --adamw chain --attention decomposed --vocab decomposed
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
fi
if [ "$what" = big ] || [ "$what" = all ]; then
  # Batch 8 x 1024 fits since the fused attention and log-probs (53.6 GiB in use).
  T=240 run $VERL bench train-step --preset qwen2-1.5b --batch 8 --seq 1024 --dtype bfloat16 --steps 3
  T=150 run python3 bench/peers/train_step.py --preset qwen2-1.5b --batch 8 --seq 1024 --dtype bf16 --steps 3
fi

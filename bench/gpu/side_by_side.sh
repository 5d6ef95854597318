#!/usr/bin/env bash
# Issue #8's GPU figures, verl-rs and its PyTorch peers side by side on the same GPU(s), in one
# invocation. Part 1: GEMM, training step, NCCL bandwidth, tp=2 vs tp=1. Part 2: decode and the
# Qwen2.5-0.5B-shaped main job. Part 3: the training step with cuBLASLt linear layers.
# Usage: bash bench/gpu/side_by_side.sh 1|2|3 (needs gpu-bin/verl,
# a stripped `cargo build --release --features cuda` binary).
set -u
source "$(dirname "$0")/env.sh"
part=${1:-1}
gpus=$(nvidia-smi -L | wc -l)
log=${OUT:-/tmp}/part$part.log
# Each command echoed with its output and exit code, to the terminal and to $OUT/part<N>.log.
run() { { echo; echo "\$ $*"; timeout "$T" "$@" 2>&1; echo "(exit $?)"; } | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if [ "$part" = 1 ]; then
  if [ "$gpus" -ge 2 ]; then
    NCCL_DEBUG=WARN T=150 run $VERL bench tp-check --preset small --batch 4 --seq 128
    T=60  run $VERL bench nccl --gpus "$gpus" --sizes 1,16,256,1024,4096
    # The same over processes, from torchrun's environment (ids through the rendezvous).
    echo "\$ (one process per GPU) $VERL bench nccl" | tee -a "$log"
    for r in $(seq 0 $((gpus - 1))); do
      RANK=$r LOCAL_RANK=$r WORLD_SIZE=$gpus MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
        timeout 60 $VERL bench nccl --sizes 1,16,256,1024,4096 2>&1 | tee -a "$log" &
    done
    wait
  fi
  T=120 run $VERL bench gemm --sizes 4096,8192
  T=90  run python3 bench/peers/gemm.py --sizes 4096 8192
  for d in float32 bfloat16; do
    T=150 run $VERL bench train-step --preset qwen2-0.5b --batch 4 --seq 512 --dtype $d --steps 5
  done
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype f32 --steps 5
  T=120 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
elif [ "$part" = 3 ]; then
  # The cuBLASLt prototype in a training step: the same bf16 step with burn's products and with
  # the linear layers routed to cuBLASLt (VERL_CUBLASLT=1), and PyTorch's, back to back.
  T=120 run $VERL bench gemm --sizes 4096 --repeat 10
  T=120 run $VERL bench train-step --preset qwen2-0.5b --batch 4 --seq 512 --dtype bfloat16 --steps 5
  VERL_CUBLASLT=1 T=120 run $VERL bench train-step --preset qwen2-0.5b --batch 4 --seq 512 --dtype bfloat16 --steps 5
  T=100 run python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16 --steps 5
else
  for d in float32 bfloat16; do
    T=120 run $VERL bench rollout --preset small --dtype $d
  done
  T=120 run python3 bench/peers/decode.py --preset small --dtype f32
  T=120 run python3 bench/peers/decode.py --preset small --dtype bf16
  T=150 run $VERL bench rollout --preset qwen2-0.5b --dtype bfloat16
  T=150 run python3 bench/peers/decode.py --preset qwen2-0.5b --dtype bf16
  # The main job with Qwen2.5-0.5B's layers (hidden 896, 24 layers, 14/2 heads, MLP 4864) on the
  # arithmetic task's own 17-token vocabulary; bf16 products (the cuda build's auto dtype).
  T=240 run $VERL train trainer.default_local_dir=${OUT:-/tmp}/qwen05 trainer.save_freq=-1 \
    actor_rollout_ref.model.override_config.hidden_size=896 \
    actor_rollout_ref.model.override_config.intermediate_size=4864 \
    actor_rollout_ref.model.override_config.num_hidden_layers=24 \
    actor_rollout_ref.model.override_config.num_attention_heads=14 \
    actor_rollout_ref.model.override_config.num_key_value_heads=2 \
    trainer.sft_warmup_steps=100 trainer.total_training_steps=40 trainer.test_freq=20 \
    actor_rollout_ref.actor.optim.lr=3e-5 trainer.sft_warmup_lr=3e-4
  tail -2 ${OUT:-/tmp}/qwen05/metrics.jsonl | cut -c1-900 | tee -a "$log"
fi

#!/usr/bin/env bash
# Rollout-training mismatch on a GPU: the main job for 40 GRPO steps with rollout correction
# on (token IS, seq_mean_k3 rejection at 0.01), the rollout sampling with bf16 products while
# the actor recomputes the old log-probs with bf16 or with f32 products. Prints the mean of each
# rollout_corr/ metric over the steps, and the run's last line.
# Usage: VERL=/path/to/verl bench/gpu/rollout_correction.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
OUT=${OUT:-/tmp}
# The main job's tiny model (bf16 and f32 recompute), then the Qwen2.5-0.5B shape (f32
# recompute; 100 warm-up steps, 20 GRPO steps: the mismatch, not the score, is measured).
for run in tiny:bfloat16 tiny:float32 qwen05b:float32; do
  model=${run%%:*} actor=${run##*:}
  dir=$OUT/rollout_corr_${model}_$actor
  extra=(trainer.total_training_steps=40)
  [ "$model" = qwen05b ] && extra=("${QWEN05B[@]}" trainer.sft_warmup_steps=100 trainer.total_training_steps=20 trainer.test_freq=-1 trainer.val_before_train=false)
  echo "== $model: rollout bfloat16, actor $actor"
  timeout 280 "$VERL" train trainer.default_local_dir="$dir" trainer.save_freq=-1 "${extra[@]}" \
    actor_rollout_ref.rollout.dtype=bfloat16 actor_rollout_ref.actor.megatron.dtype="$actor" \
    algorithm.rollout_correction.rollout_is=token \
    algorithm.rollout_correction.rollout_rs=seq_mean_k3 \
    algorithm.rollout_correction.rollout_rs_threshold=0.01 2>&1 | tail -1
  python3 - "$dir/metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if "rollout_corr/kl" in l]
keys = sorted(k for k in steps[0] if k.startswith("rollout_corr/"))
for k in keys:
    v = [l[k] for l in steps if k in l]
    print(f"{k:55s} mean {sum(v)/len(v):.3e}  max {max(v):.3e}")
PY
done

#!/usr/bin/env bash
# The torch-style profiler on one GPU: the Qwen2.5-0.5B-shaped job (actor, reference with a KL
# loss, critic) as a rank process, steps 3-4 captured for every role, then each capture
# summarized. Usage: VERL=/path/to/verl bench/gpu/profile.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
OUT=${OUT:-/tmp}/verl-profile
rm -rf "$OUT"; mkdir -p "$OUT"
"$VERL" train data.train_files=builtin:addition:1 trainer.test_freq=-1 trainer.val_before_train=false \
  trainer.save_freq=-1 trainer.sft_warmup_steps=0 trainer.total_training_steps=4 \
  trainer.launcher=processes algorithm.adv_estimator=gae critic.enable=true \
  critic.ppo_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
  "${QWEN05B[@]}" \
  global_profiler.tool=torch 'global_profiler.steps=[3,4]' global_profiler.profile_continuous_steps=true \
  global_profiler.save_path="$OUT/profile" \
  actor_rollout_ref.actor.profiler.enable=true actor_rollout_ref.actor.profiler.all_ranks=true \
  actor_rollout_ref.ref.profiler.enable=true actor_rollout_ref.ref.profiler.all_ranks=true \
  critic.profiler.enable=true critic.profiler.all_ranks=true \
  ${EXTRA:-} trainer.default_local_dir="$OUT/run" > "$OUT/train.log" 2>&1
echo "train rc=$?"; tail -3 "$OUT/train.log"
for f in $(find "$OUT/profile" -name '*.json.gz' | sort); do
  "$VERL" profile summarize "$f" --top 12; echo
done
python3 - "$OUT/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
for r in rows[2:]:
    print("step", r["step"], "phase ms:", ", ".join(f"{k[9:]} {1e3*v:.0f}" for k, v in sorted(r.items()) if k.startswith("timing_s/") and "offload" not in k))
PY

#!/usr/bin/env bash
# `verl train` on one GPU as threads and through a rank process (NCCL groups of one), the
# same short PPO job with a critic: the metrics must agree, and the per-step times say what the
# driver <-> worker round trips cost. Usage: VERL=/path/to/verl bench/gpu/processes.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
job=(data.train_files=builtin:addition:1 trainer.test_freq=-1 algorithm.adv_estimator=gae
     critic.enable=true critic.ppo_micro_batch_size_per_gpu=16 trainer.sft_warmup_steps=8
     trainer.val_before_train=false trainer.total_training_steps=${STEPS:-6} trainer.n_gpus_per_node=1)
for mode in threads processes; do
  rm -rf /tmp/verl-proc/$mode
  start=$(date +%s%N)
  "$VERL" train "${job[@]}" trainer.launcher=$mode trainer.default_local_dir=/tmp/verl-proc/$mode \
    > /tmp/verl-proc-$mode.log 2>&1
  rc=$?
  echo "$mode: rc=$rc wall $(( ($(date +%s%N) - start) / 1000000 )) ms"
  tail -2 /tmp/verl-proc-$mode.log
done
python3 - <<'PY'
import json
def steps(mode):
    return [json.loads(l) for l in open(f"/tmp/verl-proc/{mode}/metrics.jsonl") if '"step"' in l]
a, b = steps("threads"), steps("processes")
worst, n = 0.0, 0
for x, y in zip(a, b):
    for k, v in x.items():
        if not isinstance(v, (int, float)) or k.startswith(("timing_s/", "perf/", "rollout/")):
            continue
        n += 1
        worst = max(worst, abs(v - y[k]) / max(abs(v), 1e-2))
print(f"{len(a)} vs {len(b)} steps; {n} metrics compared; largest relative difference {worst:.2e}")
for key in ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_critic"):
    ta = [s[key] for s in a[1:] if key in s]
    tb = [s[key] for s in b[1:] if key in s]
    if ta and tb:
        print(f"{key}: threads {1e3*sum(ta)/len(ta):.1f} ms, processes {1e3*sum(tb)/len(tb):.1f} ms (mean of steps 2..)")
PY

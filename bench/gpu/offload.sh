#!/usr/bin/env bash
# Offload on one GPU: the Qwen2.5-0.5B-shaped main job (Qwen2.5-0.5B's layers and vocabulary
# size on the addition task) with actor, reference (KL loss) and critic (GAE), as a rank
# process, with each offload switch off and on. Prints per mode: peak device memory (the pool's
# figures from metrics.jsonl, and nvidia-smi's device-wide peak), step time, offload seconds
# and GiB per step, host memory held for offload and the processes' peak resident set; then
# how far the all-on run's metrics are from the all-off run's.
# Usage: VERL=/path/to/verl STEPS=5 [EXTRA="key=value ..."] bench/gpu/offload.sh [mode ...]
# (EXTRA: more overrides for every mode, e.g. a larger batch for a longer step.)
set -uo pipefail
source "$(dirname "$0")/env.sh"
OUT=${OUT:-/tmp}/verl-offload
mkdir -p "$OUT"
job=(data.train_files=builtin:addition:1 trainer.test_freq=-1 trainer.val_before_train=false
     trainer.save_freq=-1 trainer.sft_warmup_steps=0 trainer.total_training_steps=${STEPS:-5}
     trainer.launcher=processes algorithm.adv_estimator=gae critic.enable=true
     critic.ppo_micro_batch_size_per_gpu=64
     actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01
     "${QWEN05B[@]}")
A=actor_rollout_ref.actor.megatron
declare -A modes=(
  [off]=""
  [off_again]=""
  [actor_param]="$A.param_offload=true"
  [actor_optimizer]="$A.optimizer_offload=true"
  [ref_param]="actor_rollout_ref.ref.megatron.param_offload=true"
  [critic_all]="critic.megatron.param_offload=true critic.megatron.grad_offload=true critic.megatron.optimizer_offload=true"
  [all]="$A.param_offload=true $A.grad_offload=true $A.optimizer_offload=true actor_rollout_ref.ref.megatron.param_offload=true critic.megatron.param_offload=true critic.megatron.grad_offload=true critic.megatron.optimizer_offload=true"
)
order=("$@")
[ ${#order[@]} -eq 0 ] && order=(off all actor_param actor_optimizer ref_param critic_all)
for mode in "${order[@]}"; do
  rm -rf "$OUT/$mode"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/$mode.smi" &
  smi=$!
  ( while sleep 0.2; do ps -C verl -o rss= | awk '{s+=$1} END {print s+0}'; done ) > "$OUT/$mode.rss" &
  rss=$!
  start=$(date +%s%N)
  timeout ${T:-150} "$VERL" train "${job[@]}" ${EXTRA:-} ${modes[$mode]} trainer.default_local_dir="$OUT/$mode" \
    > "$OUT/$mode.log" 2>&1
  rc=$?
  kill $smi $rss 2>/dev/null; wait $smi $rss 2>/dev/null
  echo "$mode: rc=$rc wall $(( ($(date +%s%N) - start) / 1000000 )) ms"
  [ $rc -ne 0 ] && tail -5 "$OUT/$mode.log"
done
OUT="$OUT" python3 - "${order[@]}" <<'PY'
import json, os, sys
out = os.environ["OUT"]
def steps(mode):
    try:
        return [json.loads(l) for l in open(f"{out}/{mode}/metrics.jsonl") if '"step"' in l]
    except OSError:
        return []
def peak(path, scale):
    try:
        return max(float(x) for x in open(path) if x.strip()) * scale
    except (OSError, ValueError):
        return float("nan")
print("| mode | peak allocated GiB (pool) | peak reserved GiB (pool) | device peak GiB (nvidia-smi) "
      "| step ms (mean of 2..) | offload s/step (out) | offload GiB/step | host GiB held | peak RSS GiB |")
print("|---|---|---|---|---|---|---|---|---|")
for mode in sys.argv[1:]:
    s = steps(mode)
    if not s:
        print(f"| {mode} | (no steps) |"); continue
    later = s[1:] or s
    mx = lambda k: max(x.get(k, 0.0) for x in s)
    mean = lambda f: sum(f(x) for x in later) / len(later)
    off_s = mean(lambda x: sum(v for k, v in x.items() if k.startswith("timing_s/offload/")))
    out_s = mean(lambda x: sum(v for k, v in x.items() if k.startswith("timing_s/offload_out/")))
    off_gb = mean(lambda x: sum(v for k, v in x.items() if k.startswith("perf/offload_gb/")))
    host = max(sum(v for k, v in x.items() if k.startswith("perf/offload_host_gb/")) for x in s)
    print(f"| {mode} | {mx('perf/max_memory_allocated_gb'):.2f} | {mx('perf/max_memory_reserved_gb'):.2f} "
          f"| {peak(f'{out}/{mode}.smi', 1/1024):.2f} | {1e3*mean(lambda x: x['timing_s/step']):.0f} "
          f"| {off_s:.3f} ({out_s:.3f}) | {off_gb:.2f} | {host:.2f} | {peak(f'{out}/{mode}.rss', 1/2**20):.2f} |")
for mode in sys.argv[1:]:
    s = steps(mode)
    if s:
        phases = sorted({k.split("/")[-1] for k in s[-1] if k.startswith("perf/max_memory_allocated_gb/")})
        print(mode, "peak allocated GiB by phase (last step):",
              ", ".join(f"{p} {s[-1]['perf/max_memory_allocated_gb/' + p]:.2f}" for p in phases))
        t = {k: v for k, v in s[-1].items() if k.startswith("timing_s/") and not k.startswith("timing_s/offload")}
        print(mode, "phase ms (last step):", ", ".join(f"{k[9:]} {1e3*v:.0f}" for k, v in sorted(t.items())))
a = steps("off")
for other in ("off_again", "all"):
    b = steps(other)
    if not (a and b):
        continue
    worst, n, same = 0.0, 0, 0
    for x, y in zip(a, b):
        for k, v in x.items():
            if not isinstance(v, (int, float)) or k.startswith(("timing_s/", "perf/")) or "seconds" in k or "per_s" in k:
                continue
            n += 1
            same += v == y.get(k)
            worst = max(worst, abs(v - y.get(k, float("nan"))) / max(abs(v), 1e-2))
    print(f"off vs {other}: {n} metrics over {len(a)} steps, {same} bit-equal, largest relative difference {worst:.2e}")
PY

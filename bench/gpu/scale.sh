#!/usr/bin/env bash
# Scale (issue #44): the Qwen2.5-7B-shaped GRPO job a verl user runs, from an HF checkpoint made
# here by transformers (random init, bf16, sharded safetensors; bench/gpu/make_job.py), 16
# prompts x 8 samples, 256-token responses, KL loss against the reference, on N GPUs in the
# layouts named, and one table: step, gen / old_log_prob / ref / update seconds, tokens/s per
# GPU, the update's MFU, peak memory, weight-sync time.
# Usage: VERL=/path/to/verl [STEPS=2] [LAYOUTS="tp4 tp2dp2 pp2tp2"] [PRESET=qwen2.5-7b]
#        [PEAK_TFLOPS=989] [BATCH=16] [N=8] [RESPONSE=256] [CONTEXT=0] [MICRO=4] [EXTRA=overrides]
#        bash bench/gpu/scale.sh
# CONTEXT=N puts a passage of about N tokens before each prompt (a long-context job; prompts
# may be up to 2N + 256 tokens: the tokenizer verl-rs applies may count more than the fixture's).
# Layout names: tpT (tp=T over T GPUs), tpTdpD (tp x dp, distributed optimizer), ppPtpT,
# dpD (distributed optimizer), and any of them with _rR for a rollout tp of R (default: the
# actor's tp), _off for optimizer offload, _rc for full activation recompute (Megatron's
# uniform method, every layer), on as many GPUs as the layout needs.
set -uo pipefail
source "$(dirname "$0")/env.sh"
OUT=${OUT:-/tmp}/verl-scale
JOB=${JOB:-/tmp/verl-scale-job}
mkdir -p "$OUT"
PRESET=${PRESET:-qwen2.5-7b}
CONTEXT=${CONTEXT:-0}
python3 "$(dirname "$0")/make_job.py" "$JOB" --preset "$PRESET" --context-tokens "$CONTEXT" 2>&1 \
  | grep -v Warning | tail -2
A=actor_rollout_ref
job=(actor_rollout_ref.model.path=$JOB/model data.train_files=$JOB/train.jsonl
     algorithm.adv_estimator=grpo data.train_batch_size=${BATCH:-16} $A.rollout.n=${N:-8}
     data.max_prompt_length=$((CONTEXT * 2 + 256)) data.max_response_length=${RESPONSE:-256}
     data.filter_overlong_prompts=true
     $A.actor.ppo_mini_batch_size=${BATCH:-16} $A.actor.ppo_micro_batch_size_per_gpu=${MICRO:-4}
     $A.rollout.log_prob_micro_batch_size_per_gpu=${MICRO:-4}
     $A.ref.log_prob_micro_batch_size_per_gpu=${MICRO:-4}
     $A.actor.use_kl_loss=true $A.actor.kl_loss_coef=0.001 $A.actor.kl_loss_type=low_var_kl
     $A.actor.entropy_coeff=0 $A.actor.optim.lr=1e-6 $A.rollout.gpu_memory_utilization=0.5
     trainer.logger=[console] trainer.test_freq=-1 trainer.val_before_train=false
     trainer.save_freq=-1 trainer.total_training_steps=${STEPS:-2} trainer.launcher=processes)
# The overrides of one layout name.
layout() {
  local name=$1 tp=1 pp=1 dp=1 rtp="" extra=""
  [[ $name =~ tp([0-9]+) ]] && tp=${BASH_REMATCH[1]}
  [[ $name =~ pp([0-9]+) ]] && pp=${BASH_REMATCH[1]}
  [[ $name =~ dp([0-9]+) ]] && dp=${BASH_REMATCH[1]}
  [[ $name =~ _r([0-9]+) ]] && rtp=${BASH_REMATCH[1]}
  (( dp > 1 )) && extra="$extra $A.actor.megatron.use_distributed_optimizer=true"
  [[ $name == *_off* ]] && extra="$extra $A.actor.megatron.optimizer_offload=true"
  local otc=$A.actor.megatron.override_transformer_config
  [[ $name == *_rc* ]] && extra="$extra +$otc.recompute_granularity=full +$otc.recompute_method=uniform +$otc.recompute_num_layers=1"
  # The reference runs in the actor's layout.
  extra="$extra $A.actor.megatron.tensor_model_parallel_size=$tp $A.actor.megatron.pipeline_model_parallel_size=$pp"
  echo "trainer.n_gpus_per_node=$((tp * pp * dp)) $A.rollout.tensor_model_parallel_size=${rtp:-$tp} $extra"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
order=(${LAYOUTS:-tp4 tp2dp2 pp2tp2})
for l in "${order[@]}"; do
  start=$(date +%s%N)
  rm -rf "$OUT/$l"
  timeout ${T:-400} "$VERL" train "${job[@]}" $(layout "$l") ${EXTRA:-} trainer.default_local_dir="$OUT/$l" \
    > "$OUT/$l.log" 2>&1
  echo "$l: rc=$? wall $(( ($(date +%s%N) - start) / 1000000 )) ms"
  grep -iE "error|panick" "$OUT/$l.log" | tail -3
  grep -E "loaded|ready" "$OUT/$l.log" | head -4
done
OUT="$OUT" PRESET="$PRESET" PEAK=${PEAK_TFLOPS:-989} HERE="$(dirname "$0")" python3 - "${order[@]}" <<'PY'
import json, os, re, sys
sys.path.insert(0, os.environ["HERE"])
from make_job import PRESETS  # the shapes the checkpoint was made with
out, peak = os.environ["OUT"], float(os.environ["PEAK"])
# Parameters that multiply per token (every product, the head included; not the input embedding).
v, h, i, L, H, kv, _ = PRESETS[os.environ["PRESET"]]
d = h // H
matmul_params = L * (h * H * d + 2 * h * kv * d + H * d * h + 3 * h * i) + v * h
print("| layout | GPUs | step s | gen s | old_log_prob s | ref s | update s | weight sync s | tokens/s per GPU | update MFU | peak GiB (rank 0) | pg_loss, grad_norm (step 1) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for l in sys.argv[1:]:
    try:
        s = [json.loads(x) for x in open(f"{out}/{l}/metrics.jsonl") if '"step"' in x]
    except OSError:
        s = []
    if not s:
        print(f"| {l} | (no steps) |"); continue
    later = s[1:] or s
    m = lambda k: sum(x.get(k, 0.0) for x in later) / len(later)
    g = 1
    for part in re.findall(r"(?:tp|pp|dp)(\d+)", l.split("_")[0]):
        g *= int(part)
    tokens = m("perf/total_num_tokens")
    update = m("timing_s/update_actor")
    mfu = 6 * matmul_params * tokens / max(update, 1e-9) / g / (peak * 1e12) if update else float("nan")
    ref = m("timing_s/ref")
    print(f"| {l} | {g} | {m('timing_s/step'):.1f} | {m('timing_s/gen'):.1f} | {m('timing_s/old_log_prob'):.1f} | {ref:.1f} | "
          f"{update:.1f} | {m('perf/weight_sync_s'):.2f} | {tokens / m('timing_s/step') / g:.0f} | {100 * mfu:.1f} % | "
          f"{m('perf/max_memory_allocated_gb'):.1f} | {s[0].get('actor/pg_loss', float('nan')):.5f}, {s[0].get('actor/grad_norm', float('nan')):.4f} |")
PY

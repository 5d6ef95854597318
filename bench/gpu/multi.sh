#!/usr/bin/env bash
# Multi-GPU on one node (issue #18): the link, NCCL all-reduce (ours as threads and as processes,
# torch's as the peer), `verl train` of the Qwen2.5-0.5B-shaped main job on one GPU and on N
# with tp=N, pp=N and dp=N (the same global batch: strong scaling) and dp=N with N times the
# batch (weak scaling), each run's first steps compared with the one-GPU run; then a rank
# process killed with SIGKILL mid-run. Usage: VERL=/path/to/verl N=2 STEPS=3 [PARTS=nccl,train,kill]
# [BATCH=16 MICRO=64] [LAYOUTS="gpu1 tp2"] bench/gpu/multi.sh. The job adds an entropy bonus (entropy_coeff=0.01) so that the first steps
# have non-zero losses and gradients to compare (a random-init model earns no reward yet).
set -uo pipefail
source "$(dirname "$0")/env.sh"
N=${N:-2}
OUT=${OUT:-/tmp}/verl-multi
rm -rf "$OUT"; mkdir -p "$OUT"
PARTS=${PARTS:-nccl,train,kill}
nvidia-smi topo -m
if [[ $PARTS == *nccl* ]]; then
echo "== verl bench nccl, threads"
"$VERL" bench nccl --gpus "$N" --repeat 20 2>&1 | tail -10
echo "== verl bench nccl, processes"
for r in $(seq 0 $((N - 1))); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 \
    "$VERL" bench nccl --repeat 20 > "$OUT/nccl-$r.log" 2>&1 &
done
wait; tail -10 "$OUT/nccl-0.log"
echo "== torch peer"
timeout 120 torchrun --nproc-per-node "$N" --master-port 29544 "$(dirname "$0")/../peers/allreduce.py" 2>&1 | grep -v Warning | tail -8
fi
# BATCH prompts a step (8 samples each), MICRO samples a micro-batch per GPU.
BATCH=${BATCH:-16}
# At most the per-rank share of the mini-batch (BATCH x 8 samples over N data-parallel ranks).
MICRO=${MICRO:-$(( BATCH * 8 / N < 64 ? BATCH * 8 / N : 64 ))}
job=(data.train_files=builtin:addition:1 trainer.test_freq=-1 trainer.val_before_train=false
     trainer.save_freq=-1 trainer.sft_warmup_steps=0 trainer.total_training_steps=${STEPS:-3}
     trainer.launcher=processes actor_rollout_ref.actor.entropy_coeff=0.01
     actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO
     "${QWEN05B[@]}")
M=actor_rollout_ref.actor.megatron
# The tensor-parallel layout: tp=N where the 0.5B shape's 14 heads divide, else tp=2 x dp=N/2.
if (( 14 % N == 0 )); then TPL=tp$N; TPARGS="$M.tensor_model_parallel_size=$N"; else TPL=tp2dp$((N / 2)); TPARGS="$M.tensor_model_parallel_size=2"; fi
batch() { echo "data.train_batch_size=$1 actor_rollout_ref.actor.ppo_mini_batch_size=$1"; }
declare -A layouts=(
  [gpu1]="trainer.n_gpus_per_node=1 $(batch $BATCH)"
  [$TPL]="trainer.n_gpus_per_node=$N $TPARGS $(batch $BATCH)"
  [pp$N]="trainer.n_gpus_per_node=$N $M.pipeline_model_parallel_size=$N $(batch $BATCH)"
  [dp$N]="trainer.n_gpus_per_node=$N $(batch $BATCH)"
  [dp${N}_weak]="trainer.n_gpus_per_node=$N $(batch $((BATCH * N)))"
)
order=(${LAYOUTS:-gpu1 $TPL pp$N dp$N dp${N}_weak})
if [[ $PARTS == *train* ]]; then
for l in "${order[@]}"; do
  start=$(date +%s%N)
  timeout ${T:-110} "$VERL" train "${job[@]}" ${layouts[$l]} trainer.default_local_dir="$OUT/$l" > "$OUT/$l.log" 2>&1
  echo "$l: rc=$? wall $(( ($(date +%s%N) - start) / 1000000 )) ms"; grep -i "error" "$OUT/$l.log" | tail -2
done
OUT="$OUT" N="$N" python3 - "${order[@]}" <<'PY'
import json, os, sys
out = os.environ["OUT"]
def steps(l):
    try:
        return [json.loads(x) for x in open(f"{out}/{l}/metrics.jsonl") if '"step"' in x]
    except OSError:
        return []
base = steps("gpu1")
print("| layout | GPUs | step 1..3 actor/pg_loss | actor/grad_norm | largest rel. diff vs 1 GPU (losses, grad norms) | step ms (mean of 2..) | tokens/s per GPU | gen / update_actor ms |")
print("|---|---|---|---|---|---|---|---|")
for l in sys.argv[1:]:
    s = steps(l)
    if not s:
        print(f"| {l} | (no steps) |"); continue
    later = s[1:] or s
    mean = lambda k: sum(x.get(k, 0.0) for x in later) / len(later)
    diff = 0.0
    if not l.endswith("weak"):
        for x, y in zip(base, s):
            for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/entropy_loss"):
                if k in x and k in y:
                    diff = max(diff, abs(x[k] - y[k]) / max(abs(x[k]), 1e-3))
    gpus = 1 if l == "gpu1" else int(os.environ["N"])
    losses = ", ".join("%.5f" % x.get("actor/pg_loss", float("nan")) for x in s)
    norms = ", ".join("%.4f" % x.get("actor/grad_norm", float("nan")) for x in s)
    d = "-" if l.endswith("weak") else "%.2e" % diff
    print(f"| {l} | {gpus} | {losses} | {norms} | {d} | {1e3*mean('timing_s/step'):.0f} "
          f"| {mean('perf/throughput'):.0f} | {1e3*mean('timing_s/gen'):.0f} / {1e3*mean('timing_s/update_actor'):.0f} |")
PY
fi
[[ $PARTS == *kill* ]] || exit 0
echo "== SIGKILL of rank 1 mid-run"
"$VERL" train "${job[@]}" trainer.n_gpus_per_node=$N trainer.total_training_steps=50 trainer.default_local_dir="$OUT/kill" > "$OUT/kill.log" 2>&1 &
driver=$!
for i in $(seq 1 120); do
  [ -f "$OUT/kill/metrics.jsonl" ] && grep -q '"step"' "$OUT/kill/metrics.jsonl" && break
  sleep 1
done
victim=$(pgrep -f "verl worker" | tail -1)
ps -o pid,args -p "$victim" | tail -1
killed=$(date +%s%N)
kill -9 "$victim"
timeout 60 tail --pid=$driver -f /dev/null
echo "driver ended $(( ($(date +%s%N) - killed) / 1000000 )) ms after the kill"; wait $driver; echo "driver rc=$?"
tail -4 "$OUT/kill.log"
pgrep -fa "verl worker" || echo "no rank process left"

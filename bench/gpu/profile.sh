#!/usr/bin/env bash
# The profiler on one GPU, the Qwen2.5-0.5B-shaped job (actor, reference with a KL loss,
# critic). Parts (PARTS=trace,memory,nvtx,nsys; default all):
#  trace   the torch tool, steps 3-4 in one capture per role, CONTENTS (default
#          [cpu,cuda,memory]: host spans, device spans, memory track), each capture summarized
#  memory  the torch_memory tool on step 3: timelines (JSON + PNG) for the actor and critic
#  nvtx    the nsys tool with bench/gpu/nvtx_probe.c standing in for Nsight's injection library
#          (NVTX_INJECTION64_PATH): which ranges verl hands over
#  nsys    the nsys tool under `nsys profile --capture-range=cudaProfilerApi` (NSYS=path)
# Usage: VERL=/path/to/verl bench/gpu/profile.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
OUT=${OUT:-/tmp}
W=/tmp/verl-profile
PARTS=${PARTS:-trace,memory,nvtx,nsys}
CONTENTS=${CONTENTS:-[cpu,cuda,memory]}
rm -rf "$W"; mkdir -p "$W"
job() { # the job, then any overrides
  "$VERL" train data.train_files=builtin:addition:1 trainer.test_freq=-1 trainer.val_before_train=false \
    trainer.save_freq=-1 trainer.sft_warmup_steps=0 trainer.total_training_steps=4 \
    algorithm.adv_estimator=gae critic.enable=true critic.ppo_micro_batch_size_per_gpu=64 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.01 \
    "${QWEN05B[@]}" ${EXTRA:-} "$@"
}
timings() { python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step"' in l]
for r in rows[1:]:
    print("step", r["step"], "phase ms:", ", ".join(f"{k[9:]} {1e3*v:.0f}" for k, v in sorted(r.items()) if k.startswith("timing_s/") and "offload" not in k))
PY
}
roles_on() { echo actor_rollout_ref.actor.profiler.enable=true actor_rollout_ref.actor.profiler.all_ranks=true \
  actor_rollout_ref.ref.profiler.enable=true actor_rollout_ref.ref.profiler.all_ranks=true \
  critic.profiler.enable=true critic.profiler.all_ranks=true; }

if [[ $PARTS == *trace* ]]; then
  echo "== trace: torch tool, contents $CONTENTS, steps 3-4"
  job trainer.launcher=processes global_profiler.tool=torch 'global_profiler.steps=[3,4]' \
    global_profiler.profile_continuous_steps=true "global_profiler.global_tool_config.torch.contents=$CONTENTS" \
    global_profiler.save_path="$W/trace" $(roles_on) trainer.default_local_dir="$W/trace-run" > "$W/trace.log" 2>&1
  echo "train rc=$?"; tail -2 "$W/trace.log"
  timings "$W/trace-run/metrics.jsonl"
  for f in $(find "$W/trace" -name '*.json.gz' | sort); do
    "$VERL" profile summarize "$f" --top 16; echo
  done
  cp "$W/trace/actor/"*.json.gz "$OUT/" 2>/dev/null
fi

if [[ $PARTS == *memory* ]]; then
  echo "== memory: torch_memory tool, step 3"
  job trainer.launcher=processes global_profiler.tool=torch_memory 'global_profiler.steps=[3]' \
    global_profiler.save_path="$W/memory" $(roles_on) trainer.default_local_dir="$W/memory-run" > "$W/memory.log" 2>&1
  echo "train rc=$?"; tail -2 "$W/memory.log"
  find "$W/memory" -type f | sort
  for f in $(find "$W/memory" -name '*.json' | sort); do
    python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].split("/memory/")[1], len(d["samples"]), "samples,", d["dropped"], "dropped")
for p in d["phases"]:
    print(f"  {p['phase']:<22} {(p['end_us']-p['start_us'])/1e3:8.1f} ms {p['samples']:5d} samples  peak allocated {p['peak_allocated']/2**30:6.2f} GiB  reserved {p['peak_reserved']/2**30:6.2f} GiB")
PY
  done
  cp "$W/memory/actor/"*.png "$W/memory/critic/"*.png "$OUT/" 2>/dev/null
fi

if [[ $PARTS == *nvtx* ]]; then
  echo "== nvtx: the nsys tool with a stand-in injection library, step 3, actor"
  gcc -shared -fPIC -O2 -o "$W/nvtx_probe.so" "$(dirname "$0")/nvtx_probe.c" -lpthread
  NVTX_INJECTION64_PATH="$W/nvtx_probe.so" job global_profiler.tool=nsys 'global_profiler.steps=[3]' \
    global_profiler.save_path="$W/nvtx" actor_rollout_ref.actor.profiler.enable=true \
    actor_rollout_ref.actor.profiler.all_ranks=true trainer.default_local_dir="$W/nvtx-run" > "$W/nvtx.log" 2>&1
  echo "train rc=$?"; grep -E "nvtx-probe|WARN|nsys" "$W/nvtx.log" | head -40
fi

if [[ $PARTS == *nsys* ]]; then
  NSYS=${NSYS:-$(command -v nsys || ls /opt/nvidia/nsight-*/*/host/target-linux-x64/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)}
  echo "== nsys: $NSYS"
  if [ -n "$NSYS" ]; then
    "$NSYS" --version
    BIN=$(realpath "$VERL")
    ( cd "$W" && timeout 300 "$NSYS" profile -t cuda,nvtx -s none --cpuctxsw=none \
        --capture-range=cudaProfilerApi --capture-range-end=stop -o "$W/nsys_report" -f true \
        "$BIN" train data.train_files=builtin:addition:1 trainer.test_freq=-1 \
        trainer.val_before_train=false trainer.save_freq=-1 trainer.sft_warmup_steps=0 \
        trainer.total_training_steps=4 "${QWEN05B[@]}" global_profiler.tool=nsys 'global_profiler.steps=[3]' \
        global_profiler.save_path="$W/nsys" actor_rollout_ref.actor.profiler.enable=true \
        actor_rollout_ref.actor.profiler.all_ranks=true trainer.default_local_dir="$W/nsys-run" ) > "$W/nsys.log" 2>&1
    echo "nsys rc=$?"; grep -v "^\s*$" "$W/nsys.log" | grep -iv "step:" | tail -12
    ls -la "$W"/nsys_report* 2>/dev/null
    # Without an importer (QdstrmImporter) nsys leaves a .qdstrm; its NVTX strings show the
    # ranges arrived.
    for f in "$W"/nsys_report*.qdstrm; do
      [ -f "$f" ] && for n in update_actor generate_sequences micro_batch attention mlp backward optimizer_step; do
        printf "%s in %s: %s\n" "$n" "$(basename "$f")" "$(grep -c -a "$n" "$f")"; done
    done
    if [ -f "$W/nsys_report.nsys-rep" ]; then
      "$NSYS" stats --report nvtx_sum,cuda_gpu_kern_sum --format csv "$W/nsys_report.nsys-rep" 2>&1 | head -60
    fi
  fi
fi

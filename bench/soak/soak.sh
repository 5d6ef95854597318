#!/usr/bin/env bash
# Soak test of checkpoint/resume (not in CI: it runs for hours on small machines).
#
# The main job for STEPS RL steps with a checkpoint every SAVE_FREQ steps, twice side by side:
# once uninterrupted, once SIGKILLed at random points (uniform in [MIN_DELAY, MAX_DELAY]
# seconds after each start) and restarted with the same command until it finishes. Passes
# when both runs logged the same metrics for every step (wall-clock figures aside) and
# their final checkpoints are byte-identical.
#
#   VERL=target/release/verl STEPS=2000 bash bench/soak/soak.sh
set -euo pipefail
VERL=${VERL:-target/release/verl}
STEPS=${STEPS:-2000}
SAVE_FREQ=${SAVE_FREQ:-50}
MIN_DELAY=${MIN_DELAY:-20}
MAX_DELAY=${MAX_DELAY:-120}
OUT=${OUT:-/tmp/verl-soak}
RANDOM=${SEED:-1}
job=(trainer.total_training_steps="$STEPS" trainer.save_freq="$SAVE_FREQ")
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
"$VERL" train "${job[@]}" trainer.default_local_dir="$OUT/straight" >"$OUT/straight.log" 2>&1 &
straight=$!
kills=0
while true; do
  "$VERL" train "${job[@]}" trainer.default_local_dir="$OUT/killed" >>"$OUT/killed.log" 2>&1 &
  pid=$!
  delay=$((MIN_DELAY + RANDOM % (MAX_DELAY - MIN_DELAY + 1)))
  for _ in $(seq "$delay"); do
    sleep 1
    kill -0 "$pid" 2>/dev/null || break
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid"
    wait "$pid" || true
    kills=$((kills + 1))
    echo "kill $kills after ${delay}s: marker $(cat "$OUT/killed/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)"
  else
    wait "$pid"
    break
  fi
done
wait "$straight"
echo "both runs done in $(($(date +%s) - start))s; $kills kills"
python3 - "$OUT" "$STEPS" <<'PY'
import json, pathlib, sys, filecmp
out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def lines(run):
    rows = {}
    for l in (out / run / "metrics.jsonl").read_text().splitlines():
        v = json.loads(l)
        if "step" in v:
            rows[v["step"]] = {k: x for k, x in v.items()
                               if not k.startswith(("timing_s/", "perf/"))
                               and k not in ("rollout/seconds", "rollout/decode_tokens_per_s")}
    return rows
a, b = lines("straight"), lines("killed")
assert sorted(a) == sorted(b) == list(range(0, steps + 1)), (len(a), len(b))
bad = [s for s in a if a[s] != b[s]]
assert not bad, f"metrics differ at steps {bad[:5]}"
final = f"global_step_{steps}"
def files(run):
    root = out / run / final
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
fa, fb = files("straight"), files("killed")
assert fa == fb, (fa, fb)
same = [f for f in fa if filecmp.cmp(out / "straight" / final / f, out / "killed" / final / f, shallow=False)]
assert same == fa, f"files differ: {sorted(set(fa) - set(same))}"
print(f"soak passed: {steps} steps, metrics of every step identical, {len(fa)} checkpoint files byte-identical")
PY

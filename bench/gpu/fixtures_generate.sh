#!/usr/bin/env bash
# Every architecture and rope type on the GPU: `verl generate` on each transformers fixture
# (verl-megatron/tests/fixtures) against transformers' chat greedy tokens (its reference.json).
# Usage (device): VERL=<binary> bash bench/gpu/fixtures_generate.sh
set -uo pipefail
source bench/gpu/env.sh >/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
for f in qwen2 llama3 qwen3 qwen2_moe qwen3_moe mixtral mistral llama_rope_linear qwen3_yarn mistral_sliding qwen2_sliding gemma2 gemma3 deepseek_v3 deepseek_v3_no_q_lora; do
  d=verl-megatron/tests/fixtures/$f
  out=$(timeout 120 $VERL generate --model $d --prompt "What is 12 + 7?" --max-new-tokens 8 --json 2>/tmp/err_$f | tail -1)
  python3 - "$d" "$out" "$f" <<'PY'
import json, sys
d, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    v = json.loads(out)
except Exception:
    print(name, "FAILED:", open(f"/tmp/err_{name}").read()[-600:]); sys.exit()
ref = json.load(open(f"{d}/reference.json"))
n = len(v["prompt_ids"])
exp = [t for t in ref["chat_greedy_output"][n:]]
got = v["response_ids"]
k = 0
while k < min(len(exp), len(got)) and exp[k] == got[k]: k += 1
print(f"{name}: {k}/{len(got)} greedy tokens equal to transformers' (got {got}, expected {exp[:len(got)]})")
PY
done

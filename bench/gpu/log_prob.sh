#!/usr/bin/env bash
# The actor's log-prob pass and PPO update at the Qwen2.5-0.5B shape on mixed prompt and
# response lengths (1..512 tokens after 96- or 128-token prompts), plain logits or the fused
# head, fixed or dynamic micro-batches, padded or packed sequences: time, peak GPU memory and
# each variant's log-probs against the plain padded pass's.
# Usage: VERL=/path/to/verl bench/gpu/log_prob.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
"$VERL" bench log-prob --preset qwen2-0.5b --rows 16 --prompt 128 --response 512 --micro 4 \
  --max-tokens 4096 --dtype bfloat16 --repeat 2

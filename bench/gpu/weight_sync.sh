#!/usr/bin/env bash
# Weight sync on one GPU: verl's actor (f32) → rollout (bf16) for the 0.5B and 1.5B shapes,
# shards as they are and in 512 MiB buckets, against the f32 → bf16 cast bound; then the
# PyTorch peer (per-tensor copy_) on the same shapes.
# Usage: VERL=/path/to/verl bench/gpu/weight_sync.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
for preset in qwen2-0.5b qwen2-1.5b; do
  "$VERL" bench weight-sync --preset "$preset" --bucket-mb 0,512,64 --repeat 5
  python "$(dirname "$0")/../peers/weight_sync.py" "$preset" 5
done

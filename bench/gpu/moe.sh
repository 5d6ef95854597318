#!/usr/bin/env bash
# The MoE expert block on one GPU: verl's token dispatch against its dense every-expert form at
# 8 and 64 experts (Qwen1.5-MoE-A2.7B's block shape, 4096 tokens), then transformers' own block
# (the PyTorch peer) on the same shapes.
# Usage: VERL=/path/to/verl bench/gpu/moe.sh
set -uo pipefail
source "$(dirname "$0")/env.sh"
"$VERL" bench moe --experts 8,64 --dtype bf16 --repeat 5
"$VERL" bench moe --experts 8,64 --dtype f32 --repeat 3
python "$(dirname "$0")/../peers/moe.py" 8,64 4096 2048 1408 5632 4 5

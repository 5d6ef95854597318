#!/usr/bin/env bash
# Decode attention variants built alone with nvcc (bench/gpu/decode_attention_harness.cu) on the
# device: the scalar kernel against the tensor-core path at 128 and 256 threads, unsplit and in
# splits of 128 keys, for heads of 128 (7B) and 64 (0.5B), then each variant's outputs against
# the scalar kernel's (max error relative to the largest output).
# Usage (device): bash bench/gpu/decode_attention_variants.sh
set -uo pipefail
K=verl-megatron/src/cuda/kernels
H=bench/gpu/decode_attention_harness.cu
nvidia-smi --query-gpu=name --format=csv,noheader
for shape in "128 7" "64 7"; do
  set -- $shape
  D="-DHEAD_DIM=$1 -DREP=$2 -DROUND_BF16=1 -DHAS_BIAS=1 -DOUT_BF16=1 -DCACHE_BF16=1"
  for v in "0 0 128" "1 0 128" "1 0 256" "0 128 128" "1 128 128" "1 128 256"; do
    set -- $v
    nvcc -O3 -arch=sm_90 -std=c++17 $D -DMMA=$1 -DSPLIT_LEN=$2 -DTHREADS=$3 -I$K -o /tmp/attn_h $H || exit 1
    echo "== $D mma $1 split $2 threads $3"
    /tmp/attn_h "m$1s$2t$3" | sed 's/ out [0-9a-f]*//; s/ sum .*//'
  done
  python3 - <<'PY'
import glob
import numpy as np
def load(n):
    return (np.fromfile(n, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
for g in sorted(glob.glob("/tmp/attn_m1*.bin")):
    tag, shape = g.split("_", 2)[1], g.split("_", 2)[2]
    a, b = load(f"/tmp/attn_m0s0t128_{shape}"), load(g)
    print(f"{tag} {shape[:-4]}: max error {np.abs(a - b).max() / max(np.abs(a).max(), 1e-30):.2e}, NaN {int(np.isnan(b).sum())}")
PY
  rm -f /tmp/attn_*.bin
done

#!/usr/bin/env bash
# Decode products built alone with nvcc (bench/gpu/decode_gemm_harness.cu) on the device: the
# weight stream as configured for each batch against the shared-stage kernel's variants and
# cuBLAS, on the 7B layer's shapes. PROBE="WT WG WSTAGES" adds the wgmma probe
# (decode_gemm_wgmma_probe.cu) so configured.
# Usage (device): [PROBE="3 1 6"] bash bench/gpu/decode_gemm_variants.sh ["NB BS RT STAGE_A ROW_WARPS STAGES" ...]
set -uo pipefail
K=verl-megatron/src/cuda/kernels
H=bench/gpu/decode_gemm_harness.cu
nvidia-smi --query-gpu=name --format=csv,noheader
variants=("$@")
ARCH="-arch=sm_90"
if [ -n "${PROBE:-}" ]; then
  read -r wt wg ws <<< "$PROBE"
  ARCH="-gencode arch=compute_90a,code=sm_90a -DWGMMA_PROBE -DWT=$wt -DWG=$wg -DWSTAGES=$ws"
fi
[ ${#variants[@]} -eq 0 ] && variants=("8 1 2 1 4 4" "4 1 2 1 3 4" "4 1 2 1 4 4" "2 1 1 0 4 4" "1 1 1 0 4 4")
for v in "${variants[@]}"; do
  set -- $v
  nvcc -O3 $ARCH -std=c++17 -DV_NB=$1 -DV_BS=$2 -DV_RT=$3 -DV_WARPS=8 -DV_U=2 -DV_STAGE_A=$4 \
    -DV_ROW_WARPS=$5 -DV_STAGES=$6 -Xptxas -warn-spills -I$K -o /tmp/dg_h $H -lcublas || exit 1
  /tmp/dg_h
done

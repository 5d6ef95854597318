#!/usr/bin/env bash
# Builds bench/gpu/gemm_check.cu with nvcc for each tile configuration and operand layout and runs
# them (GPU machine only): our GEMMs against cuBLAS on the training step's product shapes.
# Usage: bash bench/gpu/gemm_sweep.sh ["BM BN BK STAGES WARPS_M WARPS_N" ...]   (gemm.cu, wmma)
#        WGMMA=1 bash bench/gpu/gemm_sweep.sh ["BN STAGES SPECIALIZED MIN_BLOCKS [TMA WIDE REGS PERSISTENT OUT_F32]" ...]   (gemm_wgmma.cu)
set -u
cd "$(dirname "$0")"
out=${OUT:-/tmp}/gemm_sweep${WGMMA:+_wgmma}
# A warm machine keeps /tmp between calls: start from no binaries, so only these run.
rm -rf /tmp/gemm_bins && mkdir -p /tmp/gemm_bins
configs=("$@")
if [ -n "${WGMMA:-}" ]; then
  [ ${#configs[@]} -eq 0 ] && configs=("128 4 1 1")
  for c in "${configs[@]}"; do
    read -r bn st sp mb tma wide regs pers f32 <<<"$c"
    tma=${tma:-0} wide=${wide:-0} regs=${regs:-$tma} pers=${pers:-0} f32=${f32:-0}
    for l in "0 1" "0 0" "1 0"; do
      read -r at bt <<<"$l"
      name=/tmp/gemm_bins/w_${bn}_${st}_${sp}_${mb}_${tma}${wide}${regs}${pers}${f32}_${at}${bt}
      echo "nvcc -O3 -std=c++17 -arch=sm_90a -DWGMMA -DBN=$bn -DSTAGES=$st -DSPECIALIZED=$sp -DMIN_BLOCKS=$mb -DTMA=$tma -DWIDE=$wide -DREGS=$regs -DPERSISTENT=$pers -DOUT_F32=$f32 -DA_T=$at -DB_T=$bt -o $name gemm_check.cu -lcublas -lcuda"
    done
  done
else
  [ ${#configs[@]} -eq 0 ] && configs=("128 128 32 4 2 2")
  for c in "${configs[@]}"; do
    read -r bm bn bk st wm wn <<<"$c"
    for l in "0 1" "0 0" "1 0"; do
      read -r at bt <<<"$l"
      name=/tmp/gemm_bins/g_${bm}_${bn}_${bk}_${st}_${wm}_${wn}_${at}${bt}
      echo "nvcc -O3 -std=c++17 -arch=sm_90a -DBM=$bm -DBN=$bn -DBK=$bk -DSTAGES=$st -DWARPS_M=$wm -DWARPS_N=$wn -DA_T=$at -DB_T=$bt -o $name gemm_check.cu -lcublas"
    done
  done
fi | xargs -P 16 -I{} sh -c '{} 2>&1 | grep -v "^$" | head -5'
for b in /tmp/gemm_bins/*; do timeout 60 "$b"; done | tee "$out.log"
python3 gemm_summary.py "$out.log"

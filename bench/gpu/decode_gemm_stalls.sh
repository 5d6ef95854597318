#!/usr/bin/env bash
# Why the decode products are slow at 64 rows (issue #45): ncu stall reasons, tensor-pipe use and
# occupancy of the shared-stage kernel and the stream on the 7B gate/up at 64 rows, built alone
# (bench/gpu/decode_gemm_harness.cu), and which kernels cuBLAS runs. Usage (device):
#   bash bench/gpu/decode_gemm_stalls.sh
set -uo pipefail
K=verl-megatron/src/cuda/kernels
H=bench/gpu/decode_gemm_harness.cu
nvcc -O3 -arch=sm_90 -std=c++17 -DV_NB=8 -DV_BS=1 -DV_RT=2 -DV_WARPS=8 -DV_U=2 -DV_STAGE_A=1 \
    -DV_ROW_WARPS=4 -DV_STAGES=4 -lineinfo -I$K -o /tmp/dg_h $H -lcublas || exit 1
# Per shape: cublas 33 launches (3 + 30), stream 33, shared 33, split 66, then 4 (+1 split) checks.
# gate_up is the third shape: skip 2 shapes' launches.
for ks in "verl_decode_gemm_shared 146" "verl_decode_gemm 78"; do
  set -- $ks; k=$1
  echo "=== $k"
  timeout 200 ncu --clock-control none -k regex:"^${k}\$" --launch-skip $2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    /tmp/dg_h 2>&1 | grep -vE "^==PROF==|^\s*$|----" | grep -E "gate|Duration|Throughput|Stall|stall|Warp Cycles|Issued|Occupancy|Registers|Shared Memory|Block Limit|Eligible|Active Warps|Memory \[%\]|L2|DRAM|Bank" | head -45
  M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.sum
  for r in barrier long_scoreboard math_pipe_throttle mio_throttle short_scoreboard wait dispatch_stall not_selected selected lg_throttle no_instruction; do
    M=$M,smsp__warp_issue_stalled_${r}_per_warp_active.pct
  done
  timeout 200 ncu --clock-control none -k regex:"^${k}\$" --launch-skip $2 --launch-count 1 --metrics $M /tmp/dg_h 2>&1 | grep -E "hmma|stalled|ERROR" | head -20
done
echo "=== cublas kernels"
timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --launch-count 400 /tmp/dg_h 2>&1 | grep "Context" | grep -v "verl_\|fill\|touch" | sed 's/, Context.*//' | sort | uniq -c | sort -rn | head -12

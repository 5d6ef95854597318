#!/usr/bin/env bash
# First GPU run: the main job and the rollout bench on burn-cuda.
set -x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export NCCL_NVLS_ENABLE=0
cd gpu-bin  # the stripped release binary built with --features cuda, carried to the device
timeout 120 ./verl bench rollout --preset tiny 2>&1 | tail -15
timeout 150 ./verl bench rollout --preset small 2>&1 | tail -15
time timeout 280 ./verl train trainer.default_local_dir=$OUT/mainjob trainer.save_freq=-1 2>&1 | tail -8
tail -3 $OUT/mainjob/metrics.jsonl | cut -c1-600

#!/usr/bin/env bash
# Two builds of verl side by side on one GPU, in one invocation: the kernels' check against their
# fallbacks, the 0.5B bf16 training step (its loss and gradient norm must match digit for digit
# when the change is a refactor) and the 0.5B bf16 decode, each build alternating so drift in
# the machine shows up in both. For refactors that must change neither numerics nor speed.
# Usage: [PART=check|step|decode] bash bench/gpu/ab.sh A B   (A, B: stripped `cargo build
# --release --features cuda` binaries, plain or .xz; all parts by default).
set -u
source "$(dirname "$0")/env.sh"
log=${OUT:-/tmp}/ab.log
run() { { echo; echo "\$ $*"; timeout "$T" "$@" 2>&1; echo "(exit $?)"; } | tee -a "$log"; }
unpack() {
  case "$1" in
    *.xz) local out=/tmp/$(basename "$1" .xz); xz -dc "$1" > "$out"; chmod +x "$out"; echo "$out" ;;
    *) echo "$1" ;;
  esac
}
a=$(unpack "$1"); b=$(unpack "$2")
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$log"
part=${PART:-all}
if [ "$part" = check ] || [ "$part" = all ]; then
  for bin in "$a" "$b"; do
    T=400 run "$bin" bench kernels --repeat 5 --no-timing
  done
fi
if [ "$part" = step ] || [ "$part" = all ]; then
  step=(bench train-step --preset qwen2-0.5b --batch 4 --seq 512 --dtype bfloat16 --steps 5)
  for bin in "$a" "$b" "$a" "$b"; do
    T=150 run "$bin" "${step[@]}"
  done
fi
if [ "$part" = decode ] || [ "$part" = all ]; then
  decode=(bench rollout --preset qwen2-0.5b --dtype bfloat16 --batch 1,64)
  for bin in "$a" "$b"; do
    T=150 run "$bin" "${decode[@]}"
  done
fi

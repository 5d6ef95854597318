#!/usr/bin/env bash
# The wgmma decode product (decode_gemm_wgmma.cu) swept over its configurations on the device:
# every (tiles, warpgroups, stages) in CONFIGS at every batch in BATCHES, each k split, on a
# model's products (SET: 7b, 1.5b or 0.5b), beside cuBLAS in the same process; the best
# configuration per product and batch printed last, and whether batch row 0's bits depend on
# anything but the k split (they must not). Full logs under $OUT (or /tmp).
# Usage (device): [SET=7b] [BATCHES="1 8 16 32 48 64 128"] bash bench/gpu/decode_wgmma_sweep.sh
set -uo pipefail
K=verl-megatron/src/cuda/kernels
H=bench/gpu/decode_wgmma_harness.cu
SET=${SET:-7b}
BATCHES=${BATCHES:-"1 8 16 32 48 64 128"}
# tiles,groups[,stages]: stages default to the most that fit 226 KiB (at most 8); an explicit
# count lets two blocks share a multiprocessor.
CONFIGS=${CONFIGS:-"1,1 2,1 3,1 4,1 5,1 1,2 2,2 3,2 1,1,4 2,1,3 1,2,2"}
LOG=${OUT:-/tmp}/wgmma_sweep_$SET
BINS=/tmp/wgmma_bins
mkdir -p "$BINS" "$LOG/rows"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
nb_of() { local m=$1; local nb=$(( (m + 7) / 8 )); [ $nb -gt 16 ] && nb=16; echo $nb; }
declare -A NBS
for m in $BATCHES; do NBS[$(nb_of $m)]=1; done
jobs_list=()
for cfg in $CONFIGS; do
  IFS=, read -r t g st <<< "$cfg"
  for nb in "${!NBS[@]}"; do
    stage=$(( 8192 * t * g + 1024 * nb ))
    s=${st:-$(( (231424 - 1024) / stage ))}
    [ "$s" -gt 8 ] && s=8
    [ "$s" -lt 2 ] && continue
    [ $(( t * nb * 4 )) -gt 160 ] && continue  # accumulators past what a thread holds
    name="t${t}g${g}s${s}_nb${nb}"
    jobs_list+=("$name")
    [ -x "$BINS/$name" ] && continue
    nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -DWG_NB=$nb -DWG_TILES=$t -DWG_GROUPS=$g \
      -DWG_STAGES=$s -Xptxas -v -I$K -o "$BINS/$name" $H -lcublas > "$BINS/$name.log" 2>&1 &
    while [ "$(jobs -rp | wc -l)" -ge 16 ]; do sleep 0.2; done
  done
done
wait
for name in "${jobs_list[@]}"; do
  [ -x "$BINS/$name" ] || { echo "build failed: $name"; head -20 "$BINS/$name.log"; }
  grep -i "error" "$BINS/$name.log" | head -3
  grep -A4 "verl_decode_gemm_wgmma'" "$BINS/$name.log" | grep -o "Used [0-9]* registers\|[0-9]* bytes spill stores" | tr '\n' ' ' | sed "s/^/$name: /"; echo
done
: > "$LOG/all.txt"
for m in $BATCHES; do
  nb=$(nb_of $m)
  for name in "${jobs_list[@]}"; do
    case $name in *_nb$nb) ;; *) continue ;; esac
    [ -x "$BINS/$name" ] || continue
    WG_RESIDENT="${RESIDENT:-0 1 2}" WG_DIR="$LOG/rows" "$BINS/$name" "$m" "$SET" 1 2 4 8 >> "$LOG/all.txt" 2>&1
  done
done
echo "== batch invariance: distinct row-0 results per product and split (1 = invariant)"
for f in "$LOG"/rows/*.bin; do b=$(basename "$f"); echo "${b%%_m*} $(md5sum < "$f" | cut -c1-12)"; done |
  sort -u | awk '{n[$1]++} END {for (k in n) printf "%s:%d ", k, n[k]; print ""}'
grep -c unwritten "$LOG/all.txt"
awk '$0 ~ /unwritten/ && $15 != 0 {print "UNWRITTEN:", $0}' "$LOG/all.txt" | head
echo "== best per product and batch (us; cublas in the same process)"
python3 - "$LOG/all.txt" <<'EOF'
import sys, collections
best, cub, err = {}, collections.defaultdict(list), {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 5 or f[1] != "m": continue
    cfg, m, prod = f[0], int(f[2]), f[3]
    if "cublas" in f:
        cub[(prod, m)].append(float(f[f.index("cublas") + 1]))
    elif "wgmma" in f:
        t = float(f[f.index("wgmma") + 1]); split = int(f[f.index("split") + 1])
        e = float(f[f.index("err") + 1])
        key = (prod, m)
        err[key] = max(err.get(key, 0), e)
        if key not in best or t < best[key][0]: best[key] = (t, f"{cfg}/k{split}")
prods = sorted({p for p, _ in best}, key=lambda p: ["qkv", "o", "gate_up", "down", "lm_head"].index(p))
ms = sorted({m for _, m in best})
print("product m   best_us  config        cublas_us  ratio  max_err")
for p in prods:
    for m in ms:
        if (p, m) not in best: continue
        t, c = best[(p, m)]; cb = min(cub[(p, m)])
        print(f"{p:8s} {m:3d} {t:8.1f}  {c:13s} {cb:8.1f}  {t/cb:5.2f}  {err[(p,m)]:.1e}")
EOF

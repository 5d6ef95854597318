# Kernel time of a GPU program by kernel name, from ncu (issue #46: where a training step goes).
# Usage: ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
#          verl bench train-step --preset qwen2-1.5b --batch 8 --seq 1024 --steps 2 --dtype bfloat16 > k.csv
#        python3 bench/gpu/kernel_times.py k.csv
# Sums over the last third of the launches (the last steps of a bench run, past the first step's
# autotune launches), by kernel name, largest first.
import csv, sys, collections
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    try:
        rows.append((int(r["ID"]), r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
    except (KeyError, ValueError):
        pass
rows.sort()
tail = rows[len(rows) * 2 // 3:]
total = sum(t for _, _, t in tail)
by = collections.defaultdict(lambda: [0, 0.0])
for _, name, t in tail:
    k = name.split("(")[0][:90]
    by[k][0] += 1
    by[k][1] += t
print(f"{len(rows)} launches profiled; last third: {len(tail)} launches, {total/1e6:.1f} ms of kernel time")
for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"{100*t/total:5.1f}%  {t/1e6:8.2f} ms  {n:6d}x  {k}")

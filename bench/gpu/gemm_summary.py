"""Sums gemm_sweep.sh's per-shape times per configuration and layout (the step's large shapes
only: at least 1 GFLOP), as a share of cuBLAS's time on the same shapes."""
import collections
import re
import sys

rows = collections.defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path):
        m = re.match(r"(.*?) (NN|NT|TN) \(\s*(\d+),\s*(\d+),\s*(\d+)\): ours ([\d.]+) ms.*cublas ([\d.]+) ms.*rel err (\S+)", line)
        if not m:
            continue
        cfg, layout, mm, kk, nn, ours, cublas, err = m.groups()
        if float(err) > 1e-2 or err in ("inf", "nan"):
            print(f"WRONG: {line.strip()}")
        if 2 * int(mm) * int(nn) * int(kk) >= 1e9:
            rows[(cfg, layout)].append((float(ours), float(cublas)))
for (cfg, layout), v in sorted(rows.items()):
    ours, cublas = sum(x for x, _ in v), sum(y for _, y in v)
    print(f"{cfg:34s} {layout}: ours {ours:.3f} ms, cuBLAS {cublas:.3f} ms, {100 * cublas / ours:.0f}% of cuBLAS")

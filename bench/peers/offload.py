"""PyTorch peer of `verl bench offload`: the same state (GiB of f32 in N tensors) to pinned host
buffers allocated once and back, with `copy_(non_blocking=True)` and one synchronisation per
direction (what verl's Megatron offload helpers do). Prints the medians in GB/s.
Usage: python3 bench/peers/offload.py [GiB] [tensors] [repeat]"""
import statistics
import sys
import time

import torch

gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
parts = int(sys.argv[2]) if len(sys.argv) > 2 else 290
repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 5
elems = int(gib * 2**30 / 4) // parts
dev = [torch.randn(elems, device="cuda") for _ in range(parts)]
want = [t.clone() for t in dev]
t0 = time.perf_counter()
host = [torch.empty(elems, pin_memory=True) for _ in range(parts)]
alloc = time.perf_counter() - t0
nbytes = sum(t.numel() * 4 for t in dev)
outs, backs = [], []
for i in range(repeat + 1):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for h, d in zip(host, dev):
        h.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    out = time.perf_counter() - t0
    dev = None
    t0 = time.perf_counter()
    dev = [torch.empty(elems, device="cuda") for _ in range(parts)]
    for h, d in zip(host, dev):
        d.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    back = time.perf_counter() - t0
    if i:
        outs.append(out)
        backs.append(back)
assert all(torch.equal(a, b) for a, b in zip(dev, want)), "round trip changed the tensors"
o, b = statistics.median(outs), statistics.median(backs)
print(f"torch peer: {nbytes / 2**30:.2f} GiB in {parts} tensors; pinned allocation {alloc:.3f} s; "
      f"offload {o:.3f} s ({nbytes / o / 1e9:.1f} GB/s); reload {b:.3f} s ({nbytes / b / 1e9:.1f} GB/s)")

"""PyTorch peer of `verl bench nccl`: NCCL all-reduce bus bandwidth (algbw x 2(n-1)/n) of f32
buffers through torch.distributed, one process per GPU.
Usage: torchrun --nproc-per-node N bench/peers/allreduce.py [SIZE ...] (bytes with a k, m or g
suffix, or MiB; the same sizes as `verl bench nccl --sizes`)."""
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))


def size(s):
    unit = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1].lower())
    return int(s[:-1]) * unit if unit else int(s) << 20


sizes = [size(s) for s in sys.argv[1:]] or [4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 256 << 20]
if rank == 0:
    print(f"torch all-reduce over {world} GPUs\n{'bytes':>10} {'us':>10} {'algbw GB/s':>12} {'busbw GB/s':>12}")
for nbytes in sizes:
    x = torch.ones(max(nbytes // 4, 1), device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 20 * 1e3
    alg = nbytes / (ms / 1e3) / 1e9
    if rank == 0:
        print(f"{nbytes:>10} {ms * 1e3:>10.1f} {alg:>12.1f} {alg * 2 * (world - 1) / world:>12.1f}")
dist.destroy_process_group()

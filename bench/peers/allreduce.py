"""PyTorch peer of `verl bench nccl`: NCCL all-reduce bus bandwidth (algbw x 2(n-1)/n) of f32
buffers through torch.distributed, one process per GPU.
Usage: torchrun --nproc-per-node N bench/peers/allreduce.py [MiB ...]"""
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
sizes = [int(s) for s in sys.argv[1:]] or [1, 16, 256, 1024]
if rank == 0:
    print(f"torch all-reduce over {world} GPUs\n{'MiB':>9} {'ms':>10} {'algbw GB/s':>12} {'busbw GB/s':>12}")
for mib in sizes:
    x = torch.ones(mib * (1 << 20) // 4, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 10 * 1e3
    alg = mib * (1 << 20) / (ms / 1e3) / 1e9
    if rank == 0:
        print(f"{mib:>9} {ms:>10.3f} {alg:>12.1f} {alg * 2 * (world - 1) / world:>12.1f}")
dist.destroy_process_group()

"""Peer of `verl bench kernels --only decode_gemm`: torch's `F.linear` (cuBLAS) on the
Qwen2.5-7B decode step's products, a few batch rows against a bf16 weight stored [n, k], in
microseconds per product and the weight bandwidth reached. Weights are rotated so that one
product never finds its weight in L2, as in the verl-rs table.

    python3 bench/peers/decode_gemm.py
"""
import torch
import torch.nn.functional as F

from common import time_cuda

SHAPES = [("qkv", 3584, 4608), ("o", 3584, 3584), ("gate_up", 3584, 37_888),
          ("down", 18_944, 3584), ("lm_head", 3584, 152_064)]
BATCHES = [1, 8, 16, 32, 64]

print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
print(f"{'shape':<8} {'batch':>5} {'torch us':>9} {'GB/s':>7}")
for label, k, n in SHAPES:
    nbytes = k * n * 2
    copies = max(1, -(-200_000_000 // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        i = [0]

        def run():
            i[0] += 1
            return F.linear(x, weights[i[0] % copies])

        ms, _ = time_cuda(run, warmup=5, repeat=40)
        print(f"{label:<8} {m:>5} {ms * 1e3:>9.1f} {nbytes / (ms * 1e-3) / 1e9:>7.0f}")
    del weights

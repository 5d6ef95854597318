"""Peer of `verl bench gemm`: torch.matmul (cuBLAS) TFLOP/s on random square matrices, and the
device-to-device copy bandwidth that bounds decode.

    python3 bench/peers/gemm.py --sizes 4096 8192
"""
import argparse

import torch

from common import copy_bandwidth_gbs, time_cuda

p = argparse.ArgumentParser()
p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
args = p.parse_args()

print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
print(f"{'dtype':>6} {'n':>6} {'ms':>9} {'TFLOP/s':>9}")
for dtype, name in [(torch.bfloat16, "bf16"), (torch.float32, "f32"), (torch.float32, "tf32")]:
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    for n in args.sizes:
        # Three input sets, rotated, so repeats do not run out of L2.
        sets = [(torch.randn(n, n, device="cuda", dtype=dtype),
                 torch.randn(n, n, device="cuda", dtype=dtype)) for _ in range(3)]
        i = [0]

        def run():
            a, b = sets[i[0] % 3]
            i[0] += 1
            return a @ b

        ms, _ = time_cuda(run, warmup=5, repeat=20)
        print(f"{name:>6} {n:>6} {ms:>9.3f} {2 * n**3 / ms / 1e9:>9.1f}")
torch.backends.cuda.matmul.allow_tf32 = False

print(f"copy bandwidth: {copy_bandwidth_gbs():.0f} GB/s (read + write, 4 GiB)")

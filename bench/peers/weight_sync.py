"""PyTorch peer of `verl bench weight-sync`: an f32 actor's weights copied into a bf16 rollout
copy, tensor by tensor (`copy_` casts in the same kernel), as a colocated hybrid engine does on
one GPU when the layouts match. Prints seconds per sync and the f32 → bf16 cast bound.

Usage: python bench/peers/weight_sync.py qwen2-0.5b [repeat]
"""
import sys

import torch

from common import qwen2_model, time_cuda


def main():
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    actor = qwen2_model(preset, torch.float32, seed=1)
    rollout = qwen2_model(preset, torch.bfloat16, seed=2)
    pairs = list(zip(actor.parameters(), rollout.parameters()))
    elements = sum(p.numel() for p, _ in pairs)

    def sync():
        with torch.no_grad():
            for src, dst in pairs:
                dst.copy_(src)

    ms, _ = time_cuda(sync, warmup=1, repeat=repeat)
    x = torch.ones(elements, device="cuda", dtype=torch.float32)
    cast_ms, _ = time_cuda(lambda: x.to(torch.bfloat16), warmup=1, repeat=3)
    print(f"torch weight sync, {preset}: {len(pairs)} tensors, {elements * 4 / 1e9:.3f} GB f32 in")
    print(f"  per-tensor copy_: {ms / 1e3:.4f} s ({elements * 6 / (ms / 1e3) / 1e9:.0f} GB/s)")
    print(f"  copy bound: one f32 -> bf16 cast {cast_ms / 1e3:.4f} s ({elements * 6 / (cast_ms / 1e3) / 1e9:.0f} GB/s)")


if __name__ == "__main__":
    main()

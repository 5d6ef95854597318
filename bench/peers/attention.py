"""Peer of `verl bench kernels --only attention`: torch's scaled_dot_product_attention (causal,
grouped-query heads, bf16; FlashAttention-2 inside torch on Hopper) at the same shapes, forward
and backward timed apart, with the rate over the causal half of the products (2 forward, 5
backward), as verl-rs prints it.

    python3 bench/peers/attention.py
"""
import torch
import torch.nn.functional as F

from common import time_cuda

# (batch, seq, heads, kv_heads, head_dim): keep in step with src/bench/kernels.rs.
SHAPES = [(4, 511, 14, 2, 64), (8, 1024, 12, 2, 128), (4, 2048, 12, 2, 128)]

print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
for b, t, h, kv, d in SHAPES:
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, kv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, kv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = fwd()
    bwd = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    f, _ = time_cuda(fwd)
    w, _ = time_cuda(bwd)
    flops = b * h * t * t * d  # one product over the causal half of the scores
    print(f"attention, {b} x {t}, {h}/{kv} heads, dim {d}: torch sdpa forward {f:.3f} ms "
          f"({2 * flops / f / 1e9:.1f} TFLOP/s), backward {w:.3f} ms ({5 * flops / w / 1e9:.1f} TFLOP/s)")

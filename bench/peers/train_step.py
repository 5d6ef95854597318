"""Peer of `verl bench train-step`: one training step (forward, causal-LM loss, backward, AdamW)
of transformers' Qwen2ForCausalLM with sdpa attention, randomly initialised, in PyTorch eager.

    python3 bench/peers/train_step.py --preset qwen2-0.5b --batch 4 --seq 512 --dtype bf16

`--dtype f32` is plain fp32 (TF32 off, PyTorch's default); `--dtype bf16` is mixed precision:
fp32 master weights and AdamW state, bf16 autocast compute, as verl's Megatron actor runs.
"""
import argparse
import time

import torch

from common import PEAK_TFLOPS, qwen2_model, train_flops_per_token

p = argparse.ArgumentParser()
p.add_argument("--preset", default="qwen2-0.5b")
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
p.add_argument("--steps", type=int, default=10)
args = p.parse_args()

model = qwen2_model(args.preset, torch.float32)
model.train()
params = sum(t.numel() for t in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.01)
vocab = model.config.vocab_size
g = torch.Generator(device="cuda").manual_seed(0)
ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda", generator=g)
autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.dtype == "bf16")


def phases():
    """One step, synchronising between phases to split its time."""
    t = [time.perf_counter()]
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize(); t.append(time.perf_counter())
    loss.backward()
    torch.cuda.synchronize(); t.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])], loss.item()


for _ in range(3):
    phases()
torch.cuda.reset_peak_memory_stats()
runs = [phases() for _ in range(args.steps)]
step = sorted(sum(r[0]) for r in runs)[len(runs) // 2]
fwd, bwd, optim = (sorted(r[0][i] for r in runs)[len(runs) // 2] for i in range(3))
tokens = args.batch * args.seq
tps = tokens / step
mfu = tps * train_flops_per_token(args.preset, args.seq) / (PEAK_TFLOPS[args.dtype] * 1e12)
print(f"peer torch {torch.__version__} {args.preset} {params / 1e6:.1f}M params, "
      f"batch {args.batch} x seq {args.seq}, {args.dtype}")
print(f"step {step * 1e3:.1f} ms (forward {fwd * 1e3:.1f}, backward {bwd * 1e3:.1f}, "
      f"optimizer {optim * 1e3:.1f}); {tps:.0f} tokens/s; MFU {100 * mfu:.1f}% of "
      f"{PEAK_TFLOPS[args.dtype]:.0f} TFLOP/s; loss {runs[-1][1]:.4f}; "
      f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

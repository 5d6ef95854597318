"""Peer of `verl bench rollout`: transformers' `generate` decode tokens/s at each batch size, on a
randomly initialised Qwen2 of a preset's dimensions, with the same prompt length, new tokens and
sampling (temperature 1, no early stop), plus the HBM bound.

    python3 bench/peers/decode.py --preset small --batch 1 16 64 --dtype f32

Decode tokens/s counts the tokens after each sequence's first (which comes from the prefill)
over the time after the prefill, as verl's engine reports it: the prefill time is measured
separately as a generate call of one new token.
"""
import argparse
import time

import torch

from common import PRESETS, copy_bandwidth_gbs, qwen2_model

p = argparse.ArgumentParser()
p.add_argument("--preset", default="small")
p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
p.add_argument("--prompt-len", type=int, default=32)
p.add_argument("--new-tokens", type=int, default=64)
p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
p.add_argument("--hbm-gbs", type=float, default=0.0,
               help="device memory bandwidth for the bound; 0 measures it with a copy")
args = p.parse_args()

hbm_gbs = args.hbm_gbs or copy_bandwidth_gbs()
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
model = qwen2_model(args.preset, dtype).eval()
params = sum(t.numel() for t in model.parameters())
vocab, hidden, inter, layers, heads, kv = PRESETS[args.preset]
elem = 2 if args.dtype == "bf16" else 4
print(f"peer transformers generate, {args.preset} {params / 1e6:.1f}M params, {args.dtype}, "
      f"prompt {args.prompt_len}, {args.new_tokens} new tokens; HBM {hbm_gbs:.0f} GB/s")
print(f"{'batch':>6} {'prefill_s':>10} {'prefill_tok/s':>14} {'decode_tok/s':>13} "
      f"{'step_ms':>8} {'hbm_bound_tok/s':>16}")


def gen(ids, new):
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                       top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                       pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t


for b in args.batch:
    ids = torch.randint(0, vocab, (b, args.prompt_len), device="cuda")
    gen(ids, args.new_tokens)  # warm-up
    prefill = min(gen(ids, 1) for _ in range(3))
    total = gen(ids, args.new_tokens)
    decode = b * (args.new_tokens - 1) / max(total - prefill, 1e-9)
    # Each decode step reads every weight once plus the sequences' KV cache (mean length).
    kv_bytes = b * layers * 2 * kv * (hidden // heads) * (args.prompt_len + args.new_tokens / 2) * elem
    step_bytes = params * elem + kv_bytes
    bound = b * hbm_gbs * 1e9 / step_bytes
    step_ms = (total - prefill) * 1e3 / max(args.new_tokens - 1, 1)
    print(f"{b:>6} {prefill:>10.3f} {b * args.prompt_len / prefill:>14.0f} {decode:>13.1f} "
          f"{step_ms:>8.2f} {bound:>16.0f}")

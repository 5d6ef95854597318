"""PyTorch peer of `verl bench moe`: transformers' own Qwen2-MoE expert block
(Qwen2MoeSparseMoeBlock, bf16 weights) on the same shapes, forward and forward + backward.

Usage: python bench/peers/moe.py EXPERTS[,EXPERTS...] [TOKENS HIDDEN MOE_FFN SHARED_FFN TOP_K REPEAT]
"""
import statistics
import sys

import torch
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock


def timed(fn, repeat):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    experts = [int(e) for e in sys.argv[1].split(",")]
    tokens, hidden, moe_ffn, shared_ffn, top_k, repeat = (
        [int(a) for a in sys.argv[2:8]] if len(sys.argv) > 2 else [4096, 2048, 1408, 5632, 4, 5]
    )
    print(f"transformers Qwen2MoeSparseMoeBlock: {tokens} tokens, hidden {hidden}, expert ffn "
          f"{moe_ffn}, shared ffn {shared_ffn}, top-{top_k}, bf16 weights, torch {torch.__version__}")
    print("experts | forward ms | fwd+bwd ms")
    for e in experts:
        cfg = Qwen2MoeConfig(hidden_size=hidden, moe_intermediate_size=moe_ffn,
                             shared_expert_intermediate_size=shared_ffn, num_experts=e,
                             num_experts_per_tok=top_k, norm_topk_prob=False)
        block = Qwen2MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16)
        x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)

        def forward():
            with torch.no_grad():
                block(x)

        def both():
            out = block(x.requires_grad_(True))
            out = out[0] if isinstance(out, tuple) else out
            out.float().pow(2).mean().backward()

        print(f"{e:>7} | {timed(forward, repeat):>10.2f} | {timed(both, repeat):>10.2f}")


if __name__ == "__main__":
    main()

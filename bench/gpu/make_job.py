"""A user's 7B job, made on the device machine with nothing downloaded (issue #44's scale bench):

- `<out>/model`: a Qwen2.5-7B-shaped `Qwen2ForCausalLM`, randomly initialised on the GPU in
  bf16 and written by transformers' `save_pretrained` (sharded safetensors, as a hub checkpoint
  is), with the small byte-level BPE tokenizer of verl-rs's test fixture beside it (its ids fit
  the 152 064-token vocabulary; the weights are random either way).
- `<out>/train.jsonl`: GSM8K-shaped rows in verl's format (chat prompt, `openai/gsm8k` data
  source, `reward_model.ground_truth`), so the job's reward is verl's GSM8K rule.

With `--context-tokens N` each prompt first carries a passage of about N tokens (random words,
counted with the fixture's tokenizer): a long-context job, for training at long sequences.

Usage: python3 bench/gpu/make_job.py OUT [--preset qwen2.5-7b|qwen2.5-3b|qwen2-0.5b] [--rows 4096]
       [--context-tokens N]
"""
import argparse
import json
import os
import random
import shutil
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# name -> (vocab, hidden, intermediate, layers, heads, kv_heads, tied); keep in step with
# src/bench.rs's presets.
PRESETS = {
    "qwen2-0.5b": (151_936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-3b": (151_936, 2048, 11_008, 36, 16, 2, True),
    "qwen2.5-7b": (152_064, 3584, 18_944, 28, 28, 4, False),
}
FIXTURE = os.path.join(os.path.dirname(__file__), "../../verl-megatron/tests/fixtures/qwen2")


def make_model(out, preset):
    vocab, hidden, inter, layers, heads, kv, tied = PRESETS[preset]
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=32_768,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=tied,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    start = time.time()
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        shutil.copy(os.path.join(FIXTURE, f), os.path.join(out, f))
    n = sum(p.numel() for p in model.parameters())
    print(f"{preset}: {n / 1e9:.2f}B parameters written to {out} in {time.time() - start:.1f}s")


def make_passage(context_tokens):
    """A passage of random words of at most `context_tokens` fixture tokens ("" for 0), the
    same for every row (one long document the questions follow)."""
    if not context_tokens:
        return ""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(FIXTURE, "tokenizer.json"))
    rng = random.Random(1)
    words = [rng.choice(WORDS) for _ in range(context_tokens)]
    count = lambda ws: len(tok(" ".join(ws))["input_ids"])
    lo, hi = 0, len(words)  # the most words whose passage fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(words[:mid]) <= context_tokens else (lo, mid - 1)
    passage = " ".join(words[:lo])
    print(f"passage: {lo} words, {count(words[:lo])} tokens")
    return passage


WORDS = ["river", "stone", "market", "winter", "copper", "garden", "signal", "harbor", "lantern",
         "meadow", "engine", "ledger", "orchard", "cabinet", "thunder", "velvet", "compass",
         "tunnel", "biscuit", "glacier", "parcel", "saddle", "quarry", "whistle"]


def make_rows(path, rows, context_tokens=0):
    rng = random.Random(0)
    passage = make_passage(context_tokens)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis"]
    things = ["clips", "books", "apples", "stickers", "marbles", "pencils"]
    with open(path, "w") as f:
        for i in range(rows):
            a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
            who, what = rng.choice(names), rng.choice(things)
            question = (f"{who} had {a} {what} in April. In May {who} got {b} more, then gave "
                        f"away a {c}th of them, rounded down. How many {what} does {who} have "
                        f"left?")
            total = a + b
            answer = total - total // c
            if passage:
                question = f"Read this first: {passage}\n\n{question}"
            f.write(json.dumps({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question +
                            " Let's think step by step and output the final answer after \"####\"."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": "train", "index": i},
            }) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--preset", default="qwen2.5-7b", choices=sorted(PRESETS))
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--context-tokens", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if not os.path.exists(os.path.join(a.out, "model", "config.json")):
        make_model(os.path.join(a.out, "model"), a.preset)
    make_rows(os.path.join(a.out, "train.jsonl"), a.rows, a.context_tokens)

#!/usr/bin/env python3
"""Writes the tiny Hugging Face checkpoints that verl-megatron's model tests compare against.

For each architecture (Qwen2, Llama with Llama-3 rope scaling, Qwen3, Qwen2-MoE, Qwen3-MoE,
Mixtral, Mistral, Llama / Qwen3 with linear and YaRN rope scaling, Mistral / Qwen2 with sliding
windows, Gemma 2, Gemma 3 and DeepSeek-V3) it creates a
randomly initialised model with `transformers`, saves it in HF layout (config.json,
model.safetensors or shards + index, generation_config.json, a tiny BPE tokenizer with a
Qwen-style chat template), and records reference outputs in `reference.safetensors`
(`input_ids`, f32 `logits`) and `reference.json` (greedy continuation token ids).

The outputs are committed under verl-megatron/tests/fixtures/, so CI needs no Python.
Regenerate with:

    python3 -m venv /tmp/fixtures-venv && /tmp/fixtures-venv/bin/pip install torch transformers
    /tmp/fixtures-venv/bin/python tools/make_fixtures.py verl-megatron/tests/fixtures [name ...]

Names after the directory write only those fixtures (e.g. `qwen3_moe`); the others are built
but not written, so adding an architecture leaves the committed ones as they are.
"""

import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Fixture names to write (all when empty): set from the command line.
ONLY = set()

# Byte-level BPE starts from 256 byte tokens: the models' vocabulary covers the tokenizer's.
VOCAB = 320
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "What is 12 + 7? The answer is 19.",
    "Compute 3 * 4 and explain the steps.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "system user assistant think answer #### = + - * / ( )",
]


def tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= VOCAB, f"tokenizer has {len(fast)} tokens, more than VOCAB={VOCAB}"
    return fast


def randomize(model, scale):
    # transformers initialises with std 0.02 and zero biases: logits would be nearly uniform and
    # greedy decoding decided by noise. Larger random weights give decisive, checkable outputs.
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def write(model, name, out, tok, shard=None, tf4_config=False):
    if ONLY and name not in ONLY:
        return
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    model.eval()
    kwargs = {"safe_serialization": True}
    if shard:
        kwargs["max_shard_size"] = shard
    model.save_pretrained(path, **kwargs)
    tok.save_pretrained(path)
    if tf4_config:
        # Rewrite config.json with transformers-4 key names, so both dialects are exercised.
        cfg_path = os.path.join(path, "config.json")
        cfg = json.load(open(cfg_path))
        rope = cfg.pop("rope_parameters", None) or {}
        if "rope_theta" in rope:
            cfg["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.get("rope_type", "default")
        cfg["rope_scaling"] = None if rope_type == "default" else rope
        if "dtype" in cfg:
            cfg["torch_dtype"] = cfg.pop("dtype")
        json.dump(cfg, open(cfg_path, "w"), indent=2)
    ids = torch.tensor([[1, 17, 33, 5, 90, 64, 7, 12], [3, 3, 120, 44, 8, 2, 99, 31]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        greedy = model.generate(ids[:1, :5], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    save_file({"input_ids": ids.to(torch.int64), "logits": logits.contiguous()}, os.path.join(path, "reference.safetensors"))
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True, tokenize=False)
    chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        chat_greedy = model.generate(torch.tensor([chat_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "greedy_prompt": ids[0, :5].tolist(),
        "greedy_output": greedy[0].tolist(),
        "chat_prompt_text": chat,
        "chat_prompt_ids": chat_ids,
        "chat_greedy_output": chat_greedy[0].tolist(),
        "chat_greedy_text": tok.decode(chat_greedy[0][len(chat_ids):].tolist()),
    }
    json.dump(ref, open(os.path.join(path, "reference.json"), "w"), indent=2)
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters -> {path}")


def write_head(model, name, out, tok):
    """A value model (token classification) or reward model (sequence classification):
    per-token scores, and for sequence classification the score transformers pools."""
    if ONLY and name not in ONLY:
        return
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    ids = torch.tensor([[1, 17, 33, 5, 90, 64, 7, 12], [3, 3, 120, 44, 8, 2, 99, 31]])
    with torch.no_grad():
        scores = model(input_ids=ids).logits.float()
    save_file({"input_ids": ids.to(torch.int64), "scores": scores.contiguous()}, os.path.join(path, "reference.safetensors"))
    print(f"{name}: scores {list(scores.shape)} -> {path}")


def guarded(name, make):
    """Builds one fixture; a failure is printed (with the config transformers made) and the
    others still run."""
    if ONLY and name not in ONLY:
        return
    try:
        make()
    except Exception as e:  # noqa: BLE001 - report and go on
        import traceback

        print(f"{name}: FAILED {type(e).__name__}: {e}")
        traceback.print_exc()


def randomize_buffers(model, scale):
    # DeepSeek's selection bias is a buffer or a zero parameter: random values make it matter.
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, b in list(model.named_buffers()) + list(model.named_parameters()):
            if "e_score_correction_bias" in name:
                b.copy_(scale * torch.randn(b.shape, generator=g))


def mistral_sliding(out, tok):
    m = MistralForCausalLM(MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=4, tie_word_embeddings=False, attn_implementation="eager"))
    randomize(m, 0.2)
    write(m, "mistral_sliding", out, tok)


def qwen2_sliding(out, tok):
    cfg = Qwen2Config(
        **COMMON, rope_theta=10000.0, use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=True, attn_implementation="eager"
    )
    print("qwen2_sliding layer_types:", getattr(cfg, "layer_types", None))
    m = Qwen2ForCausalLM(cfg)
    randomize(m, 0.2)
    write(m, "qwen2_sliding", out, tok)


def gemma2(out, tok):
    cfg = Gemma2Config(
        **COMMON,
        head_dim=16,
        query_pre_attn_scalar=12,
        sliding_window=4,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
        hidden_activation="gelu_pytorch_tanh",
        rope_theta=10000.0,
        pad_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    print("gemma2 layer_types:", getattr(cfg, "layer_types", None))
    m = Gemma2ForCausalLM(cfg)
    randomize(m, 0.2)
    write(m, "gemma2", out, tok)


def gemma3(out, tok):
    cfg = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3},
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        hidden_activation="gelu_pytorch_tanh",
        pad_token_id=0,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    print("gemma3 config:", json.dumps(cfg.to_dict(), default=str)[:1500])
    m = Gemma3ForCausalLM(cfg)
    randomize(m, 0.2)
    write(m, "gemma3", out, tok)


def deepseek_v3(out, tok, q_lora_rank):
    name = "deepseek_v3" if q_lora_rank else "deepseek_v3_no_q_lora"
    cfg = DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    print(name, "config:", json.dumps(cfg.to_dict(), default=str)[:1500])
    m = DeepseekV3ForCausalLM(cfg)
    randomize(m, 0.2)
    randomize_buffers(m, 0.1)
    write(m, name, out, tok)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "verl-megatron/tests/fixtures"
    ONLY.update(sys.argv[2:])
    torch.manual_seed(0)
    tok = tokenizer()

    qwen2 = Qwen2ForCausalLM(Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=True, attn_implementation="eager"))
    randomize(qwen2, 0.2)
    write(qwen2, "qwen2", out, tok)
    # The same architecture, sharded and with transformers-4 config keys.
    write(qwen2, "qwen2_sharded_tf4", out, tok, shard="40KB", tf4_config=True)

    llama_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    llama = LlamaForCausalLM(LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=llama_rope, tie_word_embeddings=False, attn_implementation="eager"))
    randomize(llama, 0.2)
    write(llama, "llama3", out, tok)

    qwen3 = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True, attn_implementation="eager"))
    randomize(qwen3, 0.2)
    write(qwen3, "qwen3", out, tok)

    moe = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    )
    randomize(moe, 0.2)
    write(moe, "qwen2_moe", out, tok)

    # The same MoE with renormalised top-k routing weights.
    moe_norm = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**moe.config.to_dict(), "norm_topk_prob": True}))
    moe_norm.load_state_dict(moe.state_dict())
    write(moe_norm, "qwen2_moe_norm_topk", out, tok)

    # Qwen3-MoE: Qwen3's q/k norms, routed experts with renormalised weights and no shared
    # expert; layer 1 is a dense MLP (mlp_only_layers). Its own seed, so it does not depend on
    # the fixtures written before it.
    torch.manual_seed(3)
    qwen3_moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            rope_theta=1000000.0,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    )
    randomize(qwen3_moe, 0.2)
    write(qwen3_moe, "qwen3_moe", out, tok)

    # Mixtral: Llama's attention, 4 experts of intermediate_size in every layer, top-2 weights
    # renormalised, stored as block_sparse_moe.experts.{e}.w1/w3/w2.
    torch.manual_seed(4)
    mixtral = MixtralForCausalLM(
        MixtralConfig(
            **COMMON,
            rope_theta=1000000.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    )
    randomize(mixtral, 0.2)
    write(mixtral, "mixtral", out, tok)

    # Mistral (v0.2 on: no sliding window), with a head_dim other than hidden / heads as
    # Mistral-Nemo has.
    torch.manual_seed(5)
    mistral = MistralForCausalLM(
        MistralConfig(**COMMON, head_dim=16, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, attn_implementation="eager")
    )
    randomize(mistral, 0.2)
    write(mistral, "mistral", out, tok)

    # Rope scaling beyond Llama 3's: linear (positions divided by the factor) on Llama, and
    # YaRN (frequency blend and attention factor) on Qwen3, both past a short original context
    # so that the scaling moves the logits.
    torch.manual_seed(6)
    linear = LlamaForCausalLM(
        LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=False, attn_implementation="eager")
    )
    randomize(linear, 0.2)
    write(linear, "llama_rope_linear", out, tok)
    torch.manual_seed(7)
    yarn = Qwen3ForCausalLM(
        Qwen3Config(
            **COMMON,
            head_dim=16,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            tie_word_embeddings=True,
            attn_implementation="eager",
        )
    )
    randomize(yarn, 0.2)
    write(yarn, "qwen3_yarn", out, tok)

    # Sliding-window attention on Mistral (every layer) and Qwen2 (layers from max_window_layers
    # on), with a window shorter than the test sequences so that it cuts keys.
    torch.manual_seed(8)
    guarded("mistral_sliding", lambda: mistral_sliding(out, tok))
    torch.manual_seed(9)
    guarded("qwen2_sliding", lambda: qwen2_sliding(out, tok))
    # Gemma 2 and Gemma 3 (text): alternating local/global attention, Gemma's norms and GeGLU,
    # soft-capping (Gemma 2), q/k norms and a rope base of their own for local layers (Gemma 3).
    torch.manual_seed(10)
    guarded("gemma2", lambda: gemma2(out, tok))
    torch.manual_seed(11)
    guarded("gemma3", lambda: gemma3(out, tok))
    # DeepSeek-V3: multi-head latent attention with YaRN, sigmoid group-limited routing with the
    # selection bias, shared experts, a first dense layer; and the same without q's low rank.
    torch.manual_seed(12)
    guarded("deepseek_v3", lambda: deepseek_v3(out, tok, q_lora_rank=16))
    torch.manual_seed(13)
    guarded("deepseek_v3_no_q_lora", lambda: deepseek_v3(out, tok, q_lora_rank=None))
    # Critic (value head) and reward model (score head) on the Qwen2 backbone. pad_token_id = 0
    # makes transformers pool the last token that is not 0 (every token here).
    head_cfg = dict(COMMON, rope_theta=10000.0, num_labels=1, pad_token_id=0, attn_implementation="eager")
    critic = Qwen2ForTokenClassification(Qwen2Config(**head_cfg))
    randomize(critic, 0.2)
    write_head(critic, "qwen2_value", out, tok)
    rm = Qwen2ForSequenceClassification(Qwen2Config(**head_cfg))
    randomize(rm, 0.2)
    write_head(rm, "qwen2_reward", out, tok)


if __name__ == "__main__":
    main()

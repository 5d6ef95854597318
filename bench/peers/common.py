"""Shared pieces of the PyTorch peer benchmarks: the model presets (the same dimensions as
`verl bench --preset`, see src/bench.rs) and a CUDA-event timer.

Everything here runs on the device machine's own PyTorch and transformers; nothing is
downloaded: models are randomly initialised from a config.
"""
import statistics

import torch

# name -> (vocab, hidden, intermediate, layers, heads, kv_heads); keep in step with src/bench.rs.
PRESETS = {
    "tiny": (64, 128, 384, 4, 4, 2),
    "small": (32_000, 512, 1408, 8, 8, 2),
    "qwen2-0.5b": (151_936, 896, 4864, 24, 14, 2),
    "qwen2-1.5b": (151_936, 1536, 8960, 28, 12, 2),
    "qwen2.5-7b": (152_064, 3584, 18_944, 28, 28, 4),
}

# Presets whose real model has its own LM head (src/bench.rs `preset_config`).
UNTIED = {"qwen2.5-7b"}

# H100 SXM dense peaks (NVIDIA datasheet), used for MFU: bf16 tensor cores and plain fp32.
PEAK_TFLOPS = {"bf16": 989.0, "f32": 67.0}


def qwen2_config(preset):
    from transformers import Qwen2Config

    vocab, hidden, inter, layers, heads, kv = PRESETS[preset]
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=preset not in UNTIED,
        attn_implementation="sdpa",
    )


def qwen2_model(preset, dtype=torch.float32, seed=0):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = qwen2_config(preset)
    # Built on the GPU in its dtype: a 7B model made in f32 on the host takes minutes.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model


def train_flops_per_token(preset, seq):
    """6 x (parameters that multiply per token, lm head included) + causal attention
    (QK^T and PV: 2 matmuls of seq/2 average length, x3 for forward + backward)."""
    vocab, hidden, inter, layers, heads, kv = PRESETS[preset]
    head_dim = hidden // heads
    per_layer = hidden * (heads * head_dim) + 2 * hidden * (kv * head_dim) \
        + (heads * head_dim) * hidden + 3 * hidden * inter
    matmul_params = layers * per_layer + vocab * hidden
    attention = layers * 2 * 2 * heads * head_dim * (seq / 2) * 3
    return 6 * matmul_params + attention


def time_cuda(fn, warmup=3, repeat=10):
    """Median milliseconds of `fn()` timed with CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def copy_bandwidth_gbs(gib=4):
    """Measured HBM bandwidth: a large device-to-device copy, counting bytes read and written."""
    src = torch.randn(gib << 28, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = time_cuda(lambda: dst.copy_(src), warmup=3, repeat=10)
    gbs = 2 * src.numel() * 4 / (ms / 1e3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbs

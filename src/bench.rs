//! `verl bench`: throughput figures measured on this machine (never asserted in tests).

use std::time::Instant;

use verl::backend::DefaultBackend;
use verl::megatron::hf::{HfModelConfig, Qwen2Dims};
use verl::megatron::models::CausalLm;
use verl::rollout::{EngineConfig, KvBudget, NativeRollout, Request, Sampler, SamplingParams};

/// Model sizes the benchmarks use.
pub fn preset(name: &str) -> Result<Qwen2Dims, String> {
    let d = |vocab, hidden, inter, layers, heads, kv| Qwen2Dims {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        max_position_embeddings: 4096,
    };
    Ok(match name {
        // The size `verl train` trains from scratch by default.
        "tiny" => d(64, 128, 384, 4, 4, 2),
        // A small dense model: 8 layers of width 512 over a 32k vocabulary (~37M parameters).
        "small" => d(32_000, 512, 1408, 8, 8, 2),
        // Qwen2.5-0.5B's dimensions (~494M parameters), randomly initialised.
        "qwen2-0.5b" => d(151_936, 896, 4864, 24, 14, 2),
        other => {
            return Err(format!(
                "unknown --preset `{other}`; use tiny, small or qwen2-0.5b"
            ))
        }
    })
}

/// Decode throughput of the native rollout engine at each batch size.
pub fn rollout(
    preset_name: &str,
    batches: &[usize],
    prompt_len: usize,
    new_tokens: usize,
) -> Result<(), String> {
    let dims = preset(preset_name)?;
    let cfg = HfModelConfig::qwen2(dims);
    let device = Default::default();
    let start = Instant::now();
    let model = CausalLm::<DefaultBackend>::init(&cfg, 0.02, 0, &device);
    let params: usize = model.export_weights().iter().map(|t| t.numel()).sum();
    println!(
        "preset {preset_name}: {:.1}M parameters, prompt {prompt_len}, {new_tokens} new tokens, \
         init {:.1}s, {} threads",
        params as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let engine_cfg = EngineConfig {
        max_num_seqs: max_batch,
        max_num_batched_tokens: max_batch * prompt_len,
        prompt_length: prompt_len,
        response_length: new_tokens,
        kv_budget: KvBudget::Tokens(max_batch * (prompt_len + new_tokens)),
        sampling: SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
        ignore_eos: true,
        ..Default::default()
    };
    let mut engine =
        NativeRollout::new(cfg.clone(), model, engine_cfg, device).map_err(|e| e.to_string())?;
    println!(
        "{:>6} {:>12} {:>14} {:>12}",
        "batch", "prefill_s", "decode_tok/s", "total_s"
    );
    for &batch in batches {
        let make = |seed: u64| -> Vec<Request> {
            (0..batch)
                .map(|i| Request {
                    prompt: (0..prompt_len)
                        .map(|j| ((i * 31 + j * 7) % dims.vocab_size) as u32)
                        .collect(),
                    sampler: Sampler::new(
                        SamplingParams {
                            temperature: 1.0,
                            seed,
                            ..Default::default()
                        },
                        i as u64,
                    )
                    .expect("valid sampling"),
                    max_new_tokens: new_tokens,
                })
                .collect()
        };
        // One warm-up run (allocates the cache), then the measured one.
        engine.generate(make(1)).map_err(|e| e.to_string())?;
        engine.generate(make(2)).map_err(|e| e.to_string())?;
        let s = engine.last_stats();
        println!(
            "{:>6} {:>12.3} {:>14.1} {:>12.3}",
            batch,
            s.prefill_seconds,
            s.decode_tokens_per_second(),
            s.seconds
        );
    }
    Ok(())
}

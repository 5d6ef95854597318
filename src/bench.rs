//! `verl bench`: throughput figures measured on this machine (never asserted in tests).

use std::time::Instant;

#[cfg(feature = "cuda")]
mod agreement;
#[cfg(feature = "cuda")]
pub(crate) mod decode_products;
#[cfg(feature = "host-profile")]
pub(crate) mod host_profile;
#[cfg(feature = "cuda")]
pub(crate) mod kernels;
pub(crate) mod log_prob;
pub(crate) mod moe;
#[cfg(feature = "cuda")]
pub(crate) mod offload;
#[cfg(feature = "cuda")]
pub(crate) mod rollout_kernels;
pub(crate) mod weight_sync;

use verl::backend::DefaultBackend;
use verl::megatron::hf::{HfModelConfig, Qwen2Dims};
use verl::megatron::layers::precision::ComputeDtype;
use verl::megatron::models::CausalLm;
use verl::rollout::{EngineConfig, KvBudget, NativeRollout, Request, Sampler, SamplingParams};

/// Model sizes the benchmarks use.
pub(crate) fn preset(name: &str) -> Result<Qwen2Dims, String> {
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
        // Qwen2.5-1.5B's dimensions (~1.54B parameters).
        "qwen2-1.5b" => d(151_936, 1536, 8960, 28, 12, 2),
        // Llama-3.2-3B's dimensions (~3.2B parameters; 24 heads and 8 KV heads, so tp 2 and 4
        // divide) in Qwen2's layout (q/k/v biases).
        "llama3.2-3b" => d(128_256, 3072, 8192, 28, 24, 8),
        // Qwen2.5-3B's dimensions (~3.1B parameters, tied embeddings).
        "qwen2.5-3b" => d(151_936, 2048, 11_008, 36, 16, 2),
        // Qwen2.5-7B's dimensions (~7.6B parameters; its head is untied, see `preset_config`).
        "qwen2.5-7b" => d(152_064, 3584, 18_944, 28, 28, 4),
        other => {
            return Err(format!(
                "unknown --preset `{other}`; use tiny, small, qwen2-0.5b, qwen2-1.5b, \
                 llama3.2-3b, qwen2.5-3b or qwen2.5-7b"
            ))
        }
    })
}

/// The model config of a preset: Qwen2's layout, with the head untied where the real model's
/// is (Qwen2.5-7B).
pub(crate) fn preset_config(name: &str) -> Result<HfModelConfig, String> {
    let mut cfg = HfModelConfig::qwen2(preset(name)?);
    if name == "qwen2.5-7b" {
        cfg.tie_word_embeddings = false;
    }
    Ok(cfg)
}

/// Decode throughput of the native rollout engine at each batch size.
/// `samples` requests per prompt (the GRPO group size: with prefix caching they share one
/// prefill).
/// What [`rollout`] measures: the model (a preset drawn at random, or an HF checkpoint
/// directory), the batch sizes and lengths, and the HBM bandwidth its memory-bound fraction is
/// counted against.
pub(crate) struct RolloutBench<'a> {
    pub preset: &'a str,
    pub model_dir: Option<&'a std::path::Path>,
    pub batches: &'a [usize],
    pub prompt_len: usize,
    pub new_tokens: usize,
    pub dtype: &'a str,
    pub samples: usize,
    pub hbm_tbs: f64,
    /// Turns of a multi-turn conversation ([`rollout_turns`]); 1 for the decode table.
    pub turns: usize,
}

/// The bytes a decode step at `batch` must read at the least: every weight once (at the
/// products' width) and every cached key and value of the batch's contexts (bf16 / f32 as
/// the products).
fn decode_step_bytes(
    cfg: &HfModelConfig,
    params: usize,
    width: usize,
    batch: usize,
    context: usize,
) -> f64 {
    let head_dim = cfg.hidden_size / cfg.num_attention_heads;
    let kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim;
    (params * width + batch * context * kv * width) as f64
}

pub(crate) fn rollout(b: RolloutBench<'_>) -> Result<(), String> {
    let RolloutBench {
        preset: preset_name,
        batches,
        prompt_len,
        new_tokens,
        ..
    } = b;
    let samples = b.samples.max(1);
    let device = Default::default();
    let start = Instant::now();
    let compute: ComputeDtype = b
        .dtype
        .parse()
        .map_err(|e: verl::megatron::MegatronError| e.to_string())?;
    let (cfg, model, what) = match b.model_dir {
        None => {
            let cfg = preset_config(preset_name)?;
            let model = CausalLm::<DefaultBackend>::init(&cfg, 0.02, 0, &device);
            (cfg, model, format!("preset {preset_name}"))
        }
        Some(dir) => {
            use verl::megatron::hf::HfCheckpoint;
            let cfg = HfModelConfig::from_dir(dir).map_err(|e| e.to_string())?;
            let ckpt = HfCheckpoint::open(dir).map_err(|e| e.to_string())?;
            let model = CausalLm::<DefaultBackend>::from_checkpoint(&cfg, &ckpt, &device)
                .map_err(|e| e.to_string())?;
            (cfg, model, dir.display().to_string())
        }
    };
    let model = model.with_compute_dtype(compute);
    let vocab = cfg.vocab_size;
    let params: usize = model.export_weights().iter().map(|t| t.numel()).sum();
    let width = match compute {
        ComputeDtype::Bf16 => 2,
        _ => 4,
    };
    println!(
        "{what}: {:.1}M parameters, {compute} products, prompt {prompt_len}, \
         {new_tokens} new tokens, {samples} samples per prompt, {} {:.1}s, {} threads; \
         hbm_% counts the weights and KV cache a step reads against {} TB/s",
        params as f64 / 1e6,
        if b.model_dir.is_some() {
            "load"
        } else {
            "init"
        },
        synced_ms::<DefaultBackend>(start, &device) / 1e3,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        b.hbm_tbs
    );
    if b.turns > 1 {
        return rollout_turns(cfg, model, &b);
    }
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
        "{:>6} {:>10} {:>14} {:>9} {:>13} {:>8} {:>6} {:>10} {:>9} {:>8}",
        "batch",
        "prefill_s",
        "prefill_tok/s",
        "ttft_ms",
        "decode_tok/s",
        "step_ms",
        "hbm_%",
        "enqueue_ms",
        "total_s",
        "sampling"
    );
    for &batch in batches {
        let make = |seed: u64| -> Vec<Request> {
            (0..batch)
                .map(|i| {
                    let prompt = (0..prompt_len)
                        .map(|j| ((i / samples * 31 + j * 7) % vocab) as u32)
                        .collect();
                    bench_request(prompt, (seed, i as u64), new_tokens)
                })
                .collect()
        };
        // One warm-up run (allocates the cache), then the measured one.
        engine.generate(make(1)).map_err(|e| e.to_string())?;
        engine.generate(make(2)).map_err(|e| e.to_string())?;
        let s = engine.last_stats();
        let decode_seconds = s.seconds - s.prefill_seconds;
        // Prefill throughput counts every request's prompt tokens (shared ones included: what
        // the caller got prefilled).
        let step_ms = decode_seconds * 1e3 / s.decode_steps.max(1) as f64;
        // The mean context over the decode: the prompt and half the new tokens.
        let context = prompt_len + new_tokens / 2;
        let bound_ms =
            decode_step_bytes(&cfg, params, width, batch, context) / (b.hbm_tbs * 1e12) * 1e3;
        println!(
            "{:>6} {:>10.3} {:>14.0} {:>9.1} {:>13.1} {:>8.2} {:>6.1} {:>10.2} {:>9.3} {:>8}",
            batch,
            s.prefill_seconds,
            s.prompt_tokens as f64 / s.prefill_seconds.max(1e-9),
            s.first_token_seconds * 1e3,
            s.decode_tokens_per_second(),
            step_ms,
            100.0 * bound_ms / step_ms.max(1e-9),
            s.decode_enqueue_seconds * 1e3 / s.decode_steps.max(1) as f64,
            s.seconds,
            if s.sampled_on_device {
                "device"
            } else {
                "host"
            }
        );
    }
    Ok(())
}

/// A bench request: `prompt` sampled at temperature 1 with `seed`, request stream `stream`,
/// up to `new_tokens` tokens.
fn bench_request(prompt: Vec<u32>, (seed, stream): (u64, u64), new_tokens: usize) -> Request {
    let params = SamplingParams {
        temperature: 1.0,
        seed,
        ..Default::default()
    };
    Request {
        prompt,
        sampler: Sampler::new(params, stream).expect("temperature 1 is valid"),
        max_new_tokens: new_tokens,
    }
}

/// Tokens a bench conversation's next user turn adds after the response (a tool's output).
const TURN_TOKENS: usize = 4;

/// `verl bench rollout --turns T`: conversations of `T` turns, each turn's prompt the last
/// turn's prompt and response plus [`TURN_TOKENS`] more, generated by an engine that keeps
/// finished requests' prefixes across calls (`retain_prefixes`) and by one without prefix
/// caching: per turn, the prompt tokens prefilled and reused, and the prefill and call time.
fn rollout_turns(
    cfg: HfModelConfig,
    model: CausalLm<DefaultBackend>,
    b: &RolloutBench<'_>,
) -> Result<(), String> {
    let longest = b.prompt_len + (b.turns - 1) * (b.new_tokens + TURN_TOKENS);
    println!(
        "{:>6} {:>8} {:>5} {:>13} {:>10} {:>9} {:>10} {:>9}",
        "batch", "caching", "turn", "prompt_tokens", "prefilled", "reused", "prefill_s", "total_s"
    );
    for &batch in b.batches {
        for caching in [false, true] {
            let engine_cfg = EngineConfig {
                max_num_seqs: batch,
                max_num_batched_tokens: batch * longest,
                prompt_length: longest,
                response_length: b.new_tokens,
                kv_budget: KvBudget::Tokens(batch * (longest + b.new_tokens)),
                ignore_eos: true,
                enable_prefix_caching: caching,
                retain_prefixes: caching,
                ..Default::default()
            };
            let mut engine =
                NativeRollout::new(cfg.clone(), model.clone(), engine_cfg, Default::default())
                    .map_err(|e| e.to_string())?;
            let mut prompts: Vec<Vec<u32>> = (0..batch)
                .map(|i| {
                    (0..b.prompt_len)
                        .map(|j| ((i * 31 + j * 7) % cfg.vocab_size) as u32)
                        .collect()
                })
                .collect();
            for turn in 1..=b.turns {
                let requests: Vec<Request> = prompts
                    .iter()
                    .enumerate()
                    .map(|(i, p)| bench_request(p.clone(), (0, i as u64), b.new_tokens))
                    .collect();
                let out = engine.generate(requests).map_err(|e| e.to_string())?;
                let s = engine.last_stats();
                println!(
                    "{batch:>6} {:>8} {turn:>5} {:>13} {:>10} {:>9} {:>10.3} {:>9.3}",
                    if caching { "on" } else { "off" },
                    s.prompt_tokens,
                    s.prefilled_tokens,
                    s.reused_prefix_tokens,
                    s.prefill_seconds,
                    s.seconds
                );
                for (i, (p, c)) in prompts.iter_mut().zip(&out).enumerate() {
                    p.extend(&c.tokens);
                    p.extend(
                        (0..TURN_TOKENS).map(|j| ((i + 13 * j + turn) % cfg.vocab_size) as u32),
                    );
                }
            }
        }
    }
    Ok(())
}

/// Milliseconds since `t`, after the device has finished its queued work.
fn synced_ms<B: burn::tensor::backend::Backend>(t: Instant, device: &B::Device) -> f64 {
    let _ = B::sync(device);
    t.elapsed().as_secs_f64() * 1e3
}

/// `(enqueued, synced)` milliseconds since `t`: the first is the host's time to issue the work
/// (read before waiting), the second includes the device finishing it. When the two are close,
/// the phase is bound by the host (launch and bookkeeping cost), not by the GPU.
fn enqueued_and_synced_ms<B: burn::tensor::backend::Backend>(
    t: Instant,
    device: &B::Device,
) -> (f64, f64) {
    let enqueued = t.elapsed().as_secs_f64() * 1e3;
    (enqueued, synced_ms::<B>(t, device))
}

/// Median of a non-empty list.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Training FLOPs per token: 6 × the weights each token multiplies (the LM head included) plus
/// causal attention's two products at the mean length, ×3 for forward and backward (the same
/// count as `bench/peers/common.py`).
pub(crate) fn train_flops_per_token(d: &Qwen2Dims, seq: usize) -> f64 {
    let head_dim = d.hidden_size / d.num_attention_heads;
    let q = d.num_attention_heads * head_dim;
    let kv = d.num_key_value_heads * head_dim;
    let per_layer = d.hidden_size * q
        + 2 * d.hidden_size * kv
        + q * d.hidden_size
        + 3 * d.hidden_size * d.intermediate_size;
    let matmul_params = (d.num_hidden_layers * per_layer + d.vocab_size * d.hidden_size) as f64;
    let attention = (d.num_hidden_layers * 2 * 2 * q) as f64 * (seq as f64 / 2.0) * 3.0;
    6.0 * matmul_params + attention
}

/// One training step (forward, next-token loss, backward, clipped AdamW) of a random-init
/// Qwen2 at `batch × seq` tokens, timed per phase with the device synchronised in between.
/// The GPU levers a training-step run uses: `gemm` is `own` (our CUDA kernel, the default),
/// `cubek` (fixed strategies per shape) or `burn` (burn's own product); `adamw` is `fused` (one kernel per tensor, the
/// default) or `chain` (burn's tensor operations); `attention` is `fused` (our kernel, the
/// default) or `decomposed` (burn's operations); `vocab` is `fused` (our log-prob kernel, the
/// default) or `decomposed` (burn's log_softmax + gather chain). All only act on burn-cuda.
#[derive(Debug, Clone)]
pub(crate) struct StepLevers {
    pub gemm: String,
    pub adamw: String,
    pub attention: String,
    pub vocab: String,
    /// Sample the host threads over the timed steps and print where their time goes (needs
    /// the `host-profile` feature).
    pub host_profile: bool,
    /// `--recompute`: none, uniform:N or block:N.
    pub recompute: String,
}

impl StepLevers {
    fn recompute(&self) -> Result<Option<verl::megatron::models::Recompute>, String> {
        use verl::megatron::models::{Recompute, RecomputeMethod};
        if self.recompute == "none" {
            return Ok(None);
        }
        let refuse = || {
            format!(
                "--recompute `{}`: use none, uniform:N or block:N (N layers, at least 1)",
                self.recompute
            )
        };
        let (method, n) = self.recompute.split_once(':').ok_or_else(refuse)?;
        let method = match method {
            "uniform" => RecomputeMethod::Uniform,
            "block" => RecomputeMethod::Block,
            _ => return Err(refuse()),
        };
        match n.parse::<usize>() {
            Ok(num_layers) if num_layers > 0 => Ok(Some(Recompute { method, num_layers })),
            _ => Err(refuse()),
        }
    }

    fn fused_adamw(&self) -> Result<bool, String> {
        match self.adamw.as_str() {
            "fused" => Ok(true),
            "chain" => Ok(false),
            other => Err(format!("--adamw `{other}`: use fused or chain")),
        }
    }

    /// Applies the product and attention choices to the process (burn-cuda builds).
    fn apply_gemm(&self) -> Result<(), String> {
        let fused_attention = match self.attention.as_str() {
            "fused" => true,
            "decomposed" => false,
            other => return Err(format!("--attention `{other}`: use fused or decomposed")),
        };
        let fused_vocab = match self.vocab.as_str() {
            "fused" => true,
            "decomposed" => false,
            other => return Err(format!("--vocab `{other}`: use fused or decomposed")),
        };
        #[cfg(not(feature = "cuda"))]
        let _ = (fused_attention, fused_vocab);
        #[cfg(feature = "cuda")]
        {
            verl::megatron::cuda::kernels::attention::SWITCH.set(fused_attention);
            verl::megatron::cuda::kernels::vocab::SWITCH.set(fused_vocab);
            use verl::megatron::cuda::kernels::gemm::{set_kind, GemmKind};
            set_kind(match self.gemm.as_str() {
                "cubek" => GemmKind::Cubek,
                "burn" => GemmKind::Burn,
                "own" => GemmKind::Own,
                "wmma" => GemmKind::Wmma,
                other => return Err(format!("--gemm `{other}`: use own, wmma, cubek or burn")),
            });
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn train_step(
    preset_name: &str,
    batch: usize,
    seq: usize,
    steps: usize,
    peak_tflops: f64,
    dtype: &str,
    levers: &StepLevers,
) -> Result<(), String> {
    use burn::prelude::*;
    use verl::backend::DefaultAutodiff;
    use verl::config::OptimConfig;
    use verl::megatron::workers::optim::ModelOptimizer;

    type B = DefaultAutodiff;
    let mut dims = preset(preset_name)?;
    if seq < 2 || batch == 0 || steps == 0 {
        return Err("--seq must be at least 2, --batch and --steps at least 1".into());
    }
    // Long-sequence runs (activation recompute) go past the presets' 4 096 positions.
    dims.max_position_embeddings = dims.max_position_embeddings.max(seq);
    let cfg = HfModelConfig::qwen2(dims);
    let device = Default::default();
    let compute: ComputeDtype = dtype
        .parse()
        .map_err(|e: verl::megatron::MegatronError| e.to_string())?;
    let recompute = levers.recompute()?;
    let mut model = CausalLm::<B>::init(&cfg, 0.02, 0, &device)
        .with_compute_dtype(compute)
        .with_recompute(recompute);
    let params: usize = model.export_weights().iter().map(|t| t.numel()).sum();
    let mut optim = ModelOptimizer::<B, CausalLm<B>>::new(
        &OptimConfig {
            lr: 1e-5,
            ..Default::default()
        },
        (steps + 3) as u64,
    )
    .map_err(|e| e.to_string())?
    .with_fused_adamw(levers.fused_adamw()?);
    levers.apply_gemm()?;
    let ids: Vec<i64> = (0..batch * seq)
        .map(|i| ((i * 7919 + 13) % dims.vocab_size) as i64)
        .collect();
    let ids = Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &device).reshape([batch, seq]);
    #[cfg(feature = "cuda")]
    let routed = if verl::megatron::cuda::linear::enabled() && compute == ComputeDtype::Bf16 {
        ", linear layers through cuBLASLt"
    } else {
        ""
    };
    #[cfg(not(feature = "cuda"))]
    let routed = "";
    println!(
        "verl {preset_name}: {:.1}M parameters, batch {batch} x seq {seq}, {compute} products \
         (f32 master weights and AdamW state{routed}); products {}, AdamW {}, attention {}, log-probs {}, \
         recompute {}",
        params as f64 / 1e6,
        levers.gemm,
        levers.adamw,
        levers.attention,
        levers.vocab,
        levers.recompute
    );
    let mut timed = TimedSteps::new();
    #[cfg(feature = "host-profile")]
    let mut profile = None;
    #[cfg(not(feature = "host-profile"))]
    if levers.host_profile {
        return Err("--host-profile needs a build with the host-profile feature".into());
    }
    for step in 0..steps + 3 {
        #[cfg(feature = "host-profile")]
        if step == 3 && levers.host_profile {
            profile = Some(host_profile::start(997)?);
        }
        let (next, figures) = measured_step(model, &mut optim, &ids, &device)?;
        model = next;
        timed.peak_in_use = timed.peak_in_use.max(figures.peak_in_use);
        if step >= 3 {
            timed.push(&figures);
        }
        // Every step's loss and gradient norm, to compare the levers' numerics.
        figures.print(step);
        timed.last_loss = figures.loss;
        if !figures.loss.is_finite() {
            return Err(format!(
                "step {step}: the loss is {} (out of GPU memory? see the messages above)",
                figures.loss
            ));
        }
    }
    #[cfg(feature = "host-profile")]
    if let Some(profile) = profile {
        println!("host profile of the timed steps:{}", profile.report(30)?);
    }
    timed.print(batch * seq, train_flops_per_token(&dims, seq), peak_tflops);
    Ok(())
}

/// One `verl bench train-step` step: forward and log-probabilities, backward, optimizer; each
/// phase timed to the device's end.
fn measured_step(
    model: CausalLm<verl::backend::DefaultAutodiff>,
    optim: &mut verl::megatron::workers::optim::ModelOptimizer<
        verl::backend::DefaultAutodiff,
        CausalLm<verl::backend::DefaultAutodiff>,
    >,
    ids: &burn::tensor::Tensor<verl::backend::DefaultAutodiff, 2, burn::tensor::Int>,
    device: &burn::tensor::Device<verl::backend::DefaultAutodiff>,
) -> Result<(CausalLm<verl::backend::DefaultAutodiff>, StepFigures), String> {
    use burn::optim::GradientsParams;
    use burn::prelude::*;
    use verl::megatron::models::causal_lm::record_recompute;
    use verl::megatron::models::vocab_parallel_log_probs;
    type B = verl::backend::DefaultAutodiff;

    let [batch, seq] = ids.dims();
    // The step's peak: sampled after the forward, after each recomputed chunk's forward in the
    // backward, and after the backward.
    let peak = verl_core::memory::PhasePeak::start();
    let t = Instant::now();
    let reads_before = verl::megatron::host_reads::count();
    let (logits, tape) =
        record_recompute::<B, _>(|| model.forward_window(ids.clone(), None, None, 0, seq - 1));
    let labels = ids.clone().slice([0..batch, 1..seq]);
    let (log_probs, _) =
        vocab_parallel_log_probs(logits, labels, &model.tp, model.vocab_start(), false);
    let loss = log_probs.mean().neg();
    let (forward_host, forward) = enqueued_and_synced_ms::<B>(t, device);
    verl::megatron::parallel::sample_memory::<B>(device);
    let t = Instant::now();
    let grads = loss.clone().backward();
    let grads = match tape {
        None => GradientsParams::from_grads(grads, &model),
        Some(tape) => {
            tape.backward(&model, grads, 0.0)
                .map_err(|e| e.to_string())?
                .0
        }
    };
    let (backward_host, backward) = enqueued_and_synced_ms::<B>(t, device);
    verl::megatron::parallel::sample_memory::<B>(device);
    let peak_in_use = peak.finish().map_or(0, |u| u.allocated);
    let t = Instant::now();
    let (model, report) = optim.step(model, grads);
    let report = report.map_err(|e| e.to_string())?;
    let optimizer = synced_ms::<B>(t, device);
    let figures = StepFigures {
        phases: [forward, backward, optimizer],
        enqueued: [forward_host, backward_host],
        host_reads: verl::megatron::host_reads::count() - reads_before,
        peak_in_use,
        loss: loss.into_scalar().elem::<f32>(),
        grad_norm: report.grad_norm,
    };
    Ok((model, figures))
}

/// What one `verl bench train-step` step measured.
struct StepFigures {
    /// Forward, backward and optimizer milliseconds.
    phases: [f64; 3],
    /// The host's issue time of forward and backward (ms).
    enqueued: [f64; 2],
    host_reads: usize,
    peak_in_use: u64,
    loss: f32,
    grad_norm: f64,
}

impl StepFigures {
    fn print(&self, step: usize) {
        let [forward, backward, optimizer] = self.phases;
        let [forward_host, backward_host] = self.enqueued;
        println!(
            "  step {step}: loss {:.6} grad_norm {:.6} ({:.1} ms; host issued the forward in \
             {forward_host:.1} of {forward:.1} ms, the backward in {backward_host:.1} of \
             {backward:.1} ms; {} host reads of device memory)",
            self.loss,
            self.grad_norm,
            forward + backward + optimizer,
            self.host_reads
        );
    }
}

/// The timed steps of `verl bench train-step`: per step the forward, backward and optimizer
/// milliseconds, the host's issue time of forward and backward, and the host reads.
struct TimedSteps {
    phases: Vec<[f64; 3]>,
    enqueued: Vec<[f64; 2]>,
    host_reads: Vec<f64>,
    peak_in_use: u64,
    last_loss: f32,
}

impl TimedSteps {
    fn new() -> Self {
        Self {
            phases: Vec::new(),
            enqueued: Vec::new(),
            host_reads: Vec::new(),
            peak_in_use: 0,
            last_loss: f32::NAN,
        }
    }

    fn push(&mut self, step: &StepFigures) {
        self.phases.push(step.phases);
        self.enqueued.push(step.enqueued);
        self.host_reads.push(step.host_reads as f64);
    }

    /// The medians, tokens per second and MFU of steps of `tokens` tokens.
    fn print(self, tokens: usize, flops_per_token: f64, peak_tflops: f64) {
        let TimedSteps {
            phases,
            enqueued,
            host_reads,
            peak_in_use,
            last_loss,
        } = self;
        let step_ms = median(phases.iter().map(|p| p.iter().sum()).collect());
        let part = |i: usize| median(phases.iter().map(|p| p[i]).collect());
        let tokens_per_s = tokens as f64 / (step_ms / 1e3);
        let mfu = tokens_per_s * flops_per_token / (peak_tflops * 1e12);
        // MFU is counted against a GPU's peak; on the CPU backend that figure means nothing.
        let mfu = if cfg!(feature = "cuda") {
            format!("MFU {:.1}% of {peak_tflops:.0} TFLOP/s", 100.0 * mfu)
        } else {
            "no MFU on the CPU backend".to_string()
        };
        println!(
            "step {step_ms:.1} ms (forward {:.1}, backward {:.1}, optimizer {:.1}); {tokens_per_s:.0} \
             tokens/s; {mfu}; loss {last_loss:.4}; peak memory in \
             use {:.2} GiB (sampled after forward, recomputed chunks and backward); host issue time: forward {:.1}, \
             backward {:.1} ms; host reads of device memory per step {}",
            part(0),
            part(1),
            part(2),
            peak_in_use as f64 / (1u64 << 30) as f64,
            median(enqueued.iter().map(|p| p[0]).collect()),
            median(enqueued.iter().map(|p| p[1]).collect()),
            median(host_reads),
        );
    }
}

/// Square matrix-product TFLOP/s of backend `B` on random inputs (three input sets rotated so
/// repeats do not measure a warm cache), the median of `repeat` timed products.
fn gemm_on<B: burn::tensor::backend::Backend>(n: usize, repeat: usize) -> f64 {
    use burn::prelude::*;
    use burn::tensor::Distribution;
    let device = Default::default();
    let sets: Vec<_> = (0..3)
        .map(|_| {
            let r = || Tensor::<B, 2>::random([n, n], Distribution::Normal(0.0, 1.0), &device);
            (r(), r())
        })
        .collect();
    let mut times = Vec::new();
    for i in 0..repeat + 3 {
        let (a, b) = &sets[i % 3];
        let _ = B::sync(&device);
        let t = Instant::now();
        let c = a.clone().matmul(b.clone());
        let ms = synced_ms::<B>(t, &device);
        drop(c);
        if i >= 3 {
            times.push(ms);
        }
    }
    2.0 * (n as f64).powi(3) / (median(times) / 1e3) / 1e12
}

/// `verl bench gemm`: burn's matrix product TFLOP/s per size, f32 on the default backend and,
/// on burn-cuda, bf16 too.
pub(crate) fn gemm(sizes: &[usize], repeat: usize) -> Result<(), String> {
    println!("{:>6} {:>6} {:>9}", "dtype", "n", "TFLOP/s");
    for &n in sizes {
        println!(
            "{:>6} {n:>6} {:>9.1}",
            "f32",
            gemm_on::<DefaultBackend>(n, repeat)
        );
        #[cfg(feature = "cuda")]
        println!(
            "{:>6} {n:>6} {:>9.1}",
            "bf16",
            gemm_on::<burn::backend::Cuda<burn::tensor::bf16, i32>>(n, repeat)
        );
    }
    #[cfg(feature = "cuda")]
    {
        gpu::cublaslt_vs_burn(sizes, repeat)?;
        gpu::cublaslt_linear_grads()?;
    }
    Ok(())
}

/// Multi-GPU figures (the `cuda` build): NCCL bus bandwidth, tensor parallel on two GPUs
/// against one, and cuBLASLt against burn's own product.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use std::sync::Arc;
    use std::time::Instant;

    use burn::optim::GradientsParams;
    use burn::prelude::*;
    use burn::tensor::{DType, Distribution, FloatDType};
    use verl::backend::{CudaAutodiff, CudaBackend};
    use verl::config::OptimConfig;
    use verl::megatron::cuda::{rank_device, CublasLt, NcclCommunicator, NcclId, NcclIdExchange};
    use verl::megatron::hf::HfModelConfig;
    use verl::megatron::models::{vocab_parallel_log_probs, CausalLm};
    use verl::megatron::parallel::TpGroup;
    use verl::megatron::workers::optim::{ModelOptimizer, TensorParallelGrads};
    use verl::traits::{Communicator, ReduceOp};

    use super::{median, preset, synced_ms};

    /// One NCCL communicator per GPU, each on its own thread, running `f(rank, comm)`.
    fn on_gpus<T: Send>(
        gpus: usize,
        f: impl Fn(usize, Arc<NcclCommunicator>) -> Result<T, String> + Sync,
    ) -> Result<Vec<T>, String> {
        let id = NcclId::new().map_err(|e| e.to_string())?;
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..gpus)
                .map(|r| {
                    let f = &f;
                    s.spawn(move || {
                        let comm = NcclCommunicator::new(&id, r, gpus, rank_device(r))
                            .map_err(|e| e.to_string())?;
                        eprintln!("[rank {r}] NCCL communicator ready");
                        f(r, Arc::new(comm))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().map_err(|_| "a GPU thread panicked".to_string())?)
                .collect()
        })
    }

    /// One size's figures: per all-reduce, the milliseconds of the device kernels (calls queued
    /// back to back, then one wait, as torch's peer times NCCL) and of NCCL behind a host wait
    /// (each call waits), and the largest relative difference between the two results.
    struct CollectiveRow {
        /// `all-reduce`, `all-gather` or `reduce-scatter`.
        kind: &'static str,
        /// The whole message: the all-reduce's input, the all-gather's output, the
        /// reduce-scatter's input (NCCL's size convention).
        bytes: usize,
        device_ms: f64,
        host_ms: f64,
        deviation: f32,
    }

    /// Max |a − b| / max |b|.
    fn deviation(a: Tensor<CudaBackend, 1>, b: Tensor<CudaBackend, 1>) -> f32 {
        let scale: f32 = b.clone().abs().max().into_scalar();
        let diff: f32 = (a - b).abs().max().into_scalar();
        diff / scale.max(1e-30)
    }

    /// Milliseconds per call of `repeat` calls of `f` after one, the device waited for after.
    fn per_call_ms(
        device: &burn::backend::cuda::CudaDevice,
        repeat: usize,
        mut f: impl FnMut() -> Result<Tensor<CudaBackend, 1>, String>,
    ) -> Result<f64, String> {
        let _ = f()?;
        let _ = <CudaBackend as burn::tensor::backend::Backend>::sync(device);
        let t = Instant::now();
        let mut last = None;
        for _ in 0..repeat.max(1) {
            last = Some(f()?);
        }
        drop(last);
        let _ = <CudaBackend as burn::tensor::backend::Backend>::sync(device);
        Ok(t.elapsed().as_secs_f64() * 1e3 / repeat.max(1) as f64)
    }

    /// Every collective of the device kernels against NCCL (f32 sum, avg and max all-reduce,
    /// bf16 sum, all-gather, reduce-scatter, broadcast) on lengths that do and do not fill the
    /// kernels' vectors; a failure names the collective and length.
    /// One tensor per rank, as a collective returns them.
    type Shards = Vec<Tensor<CudaBackend, 1>>;

    fn check_device_collectives(comm: &NcclCommunicator) -> Result<Vec<String>, String> {
        let device = comm.device().clone();
        let world = comm.world_size();
        let mut report = Vec::new();
        for len in [
            1usize,
            7,
            15 * world,
            1024 * world + world,
            300_000 * world,
            24_000 * world,
        ] {
            let x =
                Tensor::<CudaBackend, 1>::random([len], Distribution::Normal(0.0, 1.0), &device)
                    + (comm.rank() as f32);
            let both = |f: &dyn Fn() -> Result<Shards, verl::core::error::CommError>|
             -> Result<(Shards, Shards), String> {
                comm.set_device_collectives(false);
                let host = f().map_err(|e| e.to_string())?;
                comm.set_device_collectives(true);
                let dev = f().map_err(|e| e.to_string())?;
                Ok((dev, host))
            };
            let mut worst =
                |name: &str, bound: f32, (dev, host): (Shards, Shards)| -> Result<(), String> {
                    let e = dev
                        .into_iter()
                        .zip(host)
                        .map(|(d, h)| deviation(d.cast(FloatDType::F32), h.cast(FloatDType::F32)))
                        .fold(0f32, f32::max);
                    report.push(format!("{name} of {len}: {e:.1e}"));
                    if e.is_finite() && e <= bound {
                        Ok(())
                    } else {
                        Err(format!(
                            "device {name} of {len} elements differs from NCCL's by {e:.2e}"
                        ))
                    }
                };
            for (name, op, bound) in [
                ("all-reduce sum", ReduceOp::Sum, 1e-6),
                ("all-reduce avg", ReduceOp::Avg, 1e-6),
                ("all-reduce max", ReduceOp::Max, 0.0),
            ] {
                worst(
                    name,
                    bound,
                    both(&|| comm.all_reduce(x.clone(), op).map(|t| vec![t]))?,
                )?;
            }
            let xb = x.clone().cast(FloatDType::BF16);
            worst(
                "bf16 all-reduce sum",
                1e-2,
                both(&|| comm.all_reduce(xb.clone(), ReduceOp::Sum).map(|t| vec![t]))?,
            )?;
            worst("all-gather", 0.0, both(&|| comm.all_gather(x.clone()))?)?;
            worst(
                "bf16 all-gather",
                0.0,
                both(&|| comm.all_gather(xb.clone()))?,
            )?;
            if len % world == 0 {
                worst(
                    "reduce-scatter sum",
                    1e-6,
                    both(&|| {
                        comm.reduce_scatter(x.clone(), ReduceOp::Sum)
                            .map(|t| vec![t])
                    })?,
                )?;
            }
            // Along a middle dimension (sequence parallel's [batch, seq, hidden]): outer 1 and
            // a split into 3 (when the length allows), against NCCL followed by the copy.
            for outer in [1usize, 3] {
                if len % outer == 0 {
                    worst(
                        &format!("all-gather, outer {outer}"),
                        0.0,
                        both(&|| {
                            comm.all_gather_interleaved(x.clone(), outer)
                                .map(|t| vec![t])
                        })?,
                    )?;
                }
                if len % (outer * world) == 0 {
                    worst(
                        &format!("reduce-scatter, outer {outer}"),
                        1e-6,
                        both(&|| {
                            comm.reduce_scatter_interleaved(x.clone(), ReduceOp::Sum, outer)
                                .map(|t| vec![t])
                        })?,
                    )?;
                }
            }
            worst(
                "broadcast from the last rank",
                0.0,
                both(&|| comm.broadcast(x.clone(), world - 1).map(|t| vec![t]))?,
            )?;
        }
        Ok(report)
    }

    /// One rank's figures per collective and size (bytes of f32), both paths: all-reduce,
    /// all-gather and reduce-scatter (the sequence-parallel pair).
    fn collective_rows(
        comm: &NcclCommunicator,
        sizes: &[usize],
        repeat: usize,
    ) -> Result<Vec<CollectiveRow>, String> {
        let device = comm.device().clone();
        let world = comm.world_size();
        let mut rows = Vec::new();
        for kind in ["all-reduce", "all-gather", "reduce-scatter"] {
            for &bytes in sizes {
                // Whole f32 elements, a multiple of the group so every rank's part is whole.
                let len = (bytes / 4).div_ceil(world).max(1) * world;
                let input = if kind == "all-gather" {
                    len / world
                } else {
                    len
                };
                let x = Tensor::<CudaBackend, 1>::random([input], Distribution::Default, &device);
                let call = || -> Result<Tensor<CudaBackend, 1>, String> {
                    let out = match kind {
                        "all-reduce" => comm.all_reduce(x.clone(), ReduceOp::Sum),
                        // The whole gathered tensor, as sequence parallelism takes it.
                        "all-gather" => comm.all_gather_interleaved(x.clone(), 1),
                        _ => comm.reduce_scatter(x.clone(), ReduceOp::Sum),
                    };
                    out.map_err(|e| e.to_string())
                };
                comm.set_device_collectives(false);
                let host = call()?;
                let host_ms = per_call_ms(&device, repeat, call)?;
                comm.set_device_collectives(true);
                let dev = call()?;
                let device_ms = per_call_ms(&device, repeat, call)?;
                rows.push(CollectiveRow {
                    kind,
                    bytes: len * 4,
                    device_ms,
                    host_ms,
                    deviation: deviation(dev, host),
                });
            }
        }
        Ok(rows)
    }

    fn print_bandwidth(rows: &[CollectiveRow], ranks: usize) {
        println!(
            "{:>14} {:>10} {:>14} {:>12} {:>16} {:>12} {:>10}",
            "collective",
            "bytes",
            "device us",
            "busbw GB/s",
            "NCCL+wait us",
            "busbw GB/s",
            "max rel diff"
        );
        for r in rows {
            // NCCL's bus bandwidth: the all-reduce moves 2(n-1)/n of the message per rank,
            // the all-gather and reduce-scatter (n-1)/n.
            let factor = match r.kind {
                "all-reduce" => 2.0,
                _ => 1.0,
            } * (ranks - 1) as f64
                / ranks as f64;
            let bus = |ms: f64| r.bytes as f64 / (ms / 1e3) / 1e9 * factor;
            println!(
                "{:>14} {:>10} {:>14.1} {:>12.1} {:>16.1} {:>12.1} {:>10.1e}",
                r.kind,
                r.bytes,
                r.device_ms * 1e3,
                bus(r.device_ms),
                r.host_ms * 1e3,
                bus(r.host_ms),
                r.deviation
            );
        }
    }

    /// `12k`, `1m`, `1g` or a bare number (MiB) as bytes.
    pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
        let s = s.trim().to_ascii_lowercase();
        let (digits, unit) = match s.chars().last() {
            Some('k') => (&s[..s.len() - 1], 1usize << 10),
            Some('m') => (&s[..s.len() - 1], 1 << 20),
            Some('g') => (&s[..s.len() - 1], 1 << 30),
            _ => (&s[..], 1 << 20),
        };
        digits
            .parse::<usize>()
            .map(|n| n * unit)
            .map_err(|_| format!("--sizes: `{s}` is not a size (e.g. 4k, 1m, 256m)"))
    }

    /// `verl bench nccl`: the collectives of one node, the device kernels against NCCL behind
    /// a host wait: each collective checked against NCCL, then all-reduce time and bus bandwidth
    /// (NCCL's definition: algorithm bandwidth × 2(n−1)/n) of f32 buffers per size. With
    /// torchrun's `RANK` and `WORLD_SIZE` set, this process is one rank of a multi-process job
    /// (GPU `LOCAL_RANK`; the NCCL id comes from rank 0 over `MASTER_ADDR:MASTER_PORT`) and
    /// rank 0 prints; otherwise `gpus` GPUs of this node, one thread each.
    pub(crate) fn nccl_bandwidth(
        gpus: usize,
        sizes: &[String],
        repeat: usize,
    ) -> Result<(), String> {
        let sizes = sizes
            .iter()
            .map(|s| parse_size(s))
            .collect::<Result<Vec<_>, _>>()?;
        let run = |comm: &NcclCommunicator| -> Result<(Vec<String>, Vec<CollectiveRow>), String> {
            let checks = check_device_collectives(comm)?;
            Ok((checks, collective_rows(comm, &sizes, repeat)?))
        };
        let print =
            |(checks, rows): &(Vec<String>, Vec<CollectiveRow>), world: usize, how: &str| {
                println!(
                    "{world} {how}, one GPU each; device collectives equal NCCL's (max rel diff):"
                );
                println!("  {}", checks.join("; "));
                print_bandwidth(rows, world);
            };
        if std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some() {
            let exchange = NcclIdExchange::from_env().map_err(|e| e.to_string())?;
            let r = &exchange.rendezvous;
            let (rank, world) = (r.rank, r.world_size);
            let id = exchange
                .id("bench-nccl", rank == 0)
                .map_err(|e| e.to_string())?;
            let comm = NcclCommunicator::new(&id, rank, world, rank_device(r.local_rank))
                .map_err(|e| e.to_string())?;
            let out = run(&comm)?;
            if rank == 0 {
                print(&out, world, "processes");
            }
            return Ok(());
        }
        let found = verl::megatron::cuda::device_count();
        if gpus < 2 || gpus > found {
            return Err(format!(
                "--gpus {gpus}: this node has {found} GPUs; use 2..={found}"
            ));
        }
        let outs = on_gpus(gpus, |_, comm| run(&comm))?;
        print(&outs[0], gpus, "threads of one process");
        Ok(())
    }

    /// The loss, gradient norm and loss after one AdamW step of one training step.
    fn first_step(
        cfg: &HfModelConfig,
        tp: &TpGroup,
        device: &burn::backend::cuda::CudaDevice,
        ids: &[i64],
        batch: usize,
        seq: usize,
    ) -> Result<[f64; 3], String> {
        type B = CudaAutodiff;
        let mut model =
            CausalLm::<B>::init_sharded(cfg, 0.02, 7, device, tp).map_err(|e| e.to_string())?;
        let ids = Tensor::<B, 1, Int>::from_ints(ids, device).reshape([batch, seq]);
        let loss_of = |m: &CausalLm<B>| {
            let logits = m.forward_window(ids.clone(), None, None, 0, seq - 1);
            let labels = ids.clone().slice([0..batch, 1..seq]);
            let (lp, _) = vocab_parallel_log_probs(logits, labels, tp, m.vocab_start(), false);
            lp.mean().neg()
        };
        let mut optim = ModelOptimizer::<B, CausalLm<B>>::new(
            &OptimConfig {
                lr: 1e-3,
                ..Default::default()
            },
            1,
        )
        .map_err(|e| e.to_string())?;
        if let Some(comm) = tp.comm::<CudaBackend>() {
            let (sharded, partial) = model.tp_param_sets();
            optim = optim.with_tensor_parallel(TensorParallelGrads {
                comm,
                sharded,
                partial,
            });
        }
        let say = |what: &str| eprintln!("[{:?} {:?}] {what}", device, tp);
        say("model and optimizer ready");
        let loss = loss_of(&model);
        say("forward done");
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        say("backward done");
        let (next, report) = optim.step(model, grads);
        say("optimizer step done");
        model = next;
        let report = report.map_err(|e| e.to_string())?;
        let after = loss_of(&model);
        let scalar = |t: Tensor<B, 1>| t.into_scalar().elem::<f32>() as f64;
        Ok([scalar(loss), report.grad_norm, scalar(after)])
    }

    /// `verl bench tp-check`: one training step of a random-init Qwen2 with tensor parallel
    /// over two GPUs (NCCL) and on one GPU: loss, gradient norm and the loss after the update.
    pub(crate) fn tp_check(preset_name: &str, batch: usize, seq: usize) -> Result<(), String> {
        let dims = preset(preset_name)?;
        let cfg = HfModelConfig::qwen2(dims);
        cfg.check_tensor_parallel(2).map_err(|e| e.to_string())?;
        let ids: Vec<i64> = (0..batch * seq)
            .map(|i| ((i * 7919 + 13) % dims.vocab_size) as i64)
            .collect();
        let one = first_step(&cfg, &TpGroup::none(), &rank_device(0), &ids, batch, seq)?;
        let two = on_gpus(2, |rank, comm| {
            let tp = TpGroup::new(comm as Arc<dyn Communicator<CudaBackend>>, false);
            first_step(&cfg, &tp, &rank_device(rank), &ids, batch, seq)
        })?;
        println!(
            "{:>14} {:>14} {:>14} {:>14}",
            "", "loss", "grad_norm", "loss_after"
        );
        println!(
            "{:>14} {:>14.7} {:>14.7} {:>14.7}",
            "tp=1 (1 GPU)", one[0], one[1], one[2]
        );
        for (r, v) in two.iter().enumerate() {
            println!(
                "{:>14} {:>14.7} {:>14.7} {:>14.7}",
                format!("tp=2 rank {r}"),
                v[0],
                v[1],
                v[2]
            );
        }
        let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(1e-12);
        let worst = two
            .iter()
            .flat_map(|v| (0..3).map(move |i| rel(one[i], v[i])))
            .fold(0.0, f64::max);
        println!("worst relative difference tp=2 vs tp=1: {worst:.2e}");
        // Sharded products sum in another order (and burn-cuda's tuned kernels may use tf32
        // tensor cores), so equal means equal to well under a percent, not bit for bit.
        if worst.is_finite() && worst < 5e-3 {
            Ok(())
        } else {
            Err(format!(
                "tp=2 differs from tp=1 by {worst:.2e} (relative), more than 5e-3"
            ))
        }
    }

    /// What one rank measured over timed training steps.
    struct RankSteps {
        ms: f64,
        host_round_trips: f64,
        first_loss: f64,
        /// The host's time to issue forward and backward (before the optimizer's first read).
        issue_ms: f64,
        /// One more step with a device sync after each phase: forward (with the loss),
        /// backward, optimizer.
        phases_ms: [f64; 3],
        /// Collectives per step, of them on the device, and their megabytes.
        collectives: (f64, f64, f64),
    }

    impl RankSteps {
        /// The diagnostic columns: where a rank's step goes.
        fn detail(&self) -> String {
            let [f, b, o] = self.phases_ms;
            let (calls, on_device, mb) = self.collectives;
            format!(
                "{:.1} | {f:.1} / {b:.1} / {o:.1} | {calls} ({on_device} on device), {mb:.0} MB",
                self.issue_ms
            )
        }
    }

    /// `steps` training steps (forward, log-probs, backward, AdamW) of `cfg` sharded over `tp`
    /// after two warm-up steps: the median milliseconds, host round trips per step, and the
    /// first step's loss.
    fn timed_tp_steps(
        cfg: &HfModelConfig,
        tp: &TpGroup,
        device: &burn::backend::cuda::CudaDevice,
        (batch, seq, steps): (usize, usize, usize),
        compute: verl::megatron::layers::precision::ComputeDtype,
        host_profile: bool,
    ) -> Result<RankSteps, String> {
        type B = CudaAutodiff;
        #[cfg(feature = "host-profile")]
        let mut profile = None;
        #[cfg(not(feature = "host-profile"))]
        let _ = host_profile;
        let mut model = CausalLm::<B>::init_sharded(cfg, 0.02, 7, device, tp)
            .map_err(|e| e.to_string())?
            .with_compute_dtype(compute);
        let ids: Vec<i64> = (0..batch * seq)
            .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as i64)
            .collect();
        let ids = Tensor::<B, 1, Int>::from_ints(ids.as_slice(), device).reshape([batch, seq]);
        let mut optim = ModelOptimizer::<B, CausalLm<B>>::new(
            &OptimConfig {
                lr: 1e-5,
                ..Default::default()
            },
            (steps + 2) as u64,
        )
        .map_err(|e| e.to_string())?;
        if let Some(comm) = tp.comm::<CudaBackend>() {
            let (sharded, partial) = model.tp_param_sets();
            optim = optim.with_tensor_parallel(TensorParallelGrads {
                comm,
                sharded,
                partial,
            });
        }
        let (mut times, mut trips, mut first_loss) = (Vec::new(), Vec::new(), f64::NAN);
        let (mut issued, mut traffic) = (Vec::new(), Vec::new());
        let mut phases_ms = [0.0; 3];
        let sync = || {
            let _ = <B as burn::tensor::backend::Backend>::sync(device);
        };
        // The warm-up steps, the timed ones, then one with a sync after each phase.
        for step in 0..steps + 3 {
            let phased = step == steps + 2;
            #[cfg(feature = "host-profile")]
            if host_profile && step == 2 {
                profile = Some(crate::bench::host_profile::start(997)?);
            }
            #[cfg(feature = "host-profile")]
            if phased {
                if let Some(profile) = profile.take() {
                    println!("host profile of the timed steps:{}", profile.report(30)?);
                }
            }
            sync();
            let before = verl::megatron::host_reads::count();
            let moved = verl::megatron::cuda::nccl::collective_traffic();
            let t = Instant::now();
            let logits = model.forward_window(ids.clone(), None, None, 0, seq - 1);
            let labels = ids.clone().slice([0..batch, 1..seq]);
            let (lp, _) = vocab_parallel_log_probs(logits, labels, tp, model.vocab_start(), false);
            let loss = lp.mean().neg();
            if phased {
                phases_ms[0] = synced_ms::<B>(t, device);
            }
            let t_backward = Instant::now();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let issue_ms = t.elapsed().as_secs_f64() * 1e3;
            if phased {
                phases_ms[1] = synced_ms::<B>(t_backward, device);
            }
            let t_optim = Instant::now();
            let (next, report) = optim.step(model, grads);
            model = next;
            report.map_err(|e| e.to_string())?;
            let ms = synced_ms::<B>(t, device);
            if phased {
                phases_ms[2] = synced_ms::<B>(t_optim, device);
                continue;
            }
            let reads = verl::megatron::host_reads::count() - before;
            let now = verl::megatron::cuda::nccl::collective_traffic();
            if step == 0 {
                first_loss = loss.into_scalar().elem::<f32>() as f64;
            } else if step >= 2 {
                times.push(ms);
                trips.push(reads as f64);
                issued.push(issue_ms);
                traffic.push((
                    (now.calls - moved.calls) as f64,
                    (now.on_device - moved.on_device) as f64,
                    (now.bytes - moved.bytes) as f64 / 1e6,
                ));
            }
        }
        let pick = |f: fn(&(f64, f64, f64)) -> f64| median(traffic.iter().map(f).collect());
        Ok(RankSteps {
            ms: median(times),
            host_round_trips: median(trips),
            first_loss,
            issue_ms: median(issued),
            phases_ms,
            collectives: (pick(|t| t.0), pick(|t| t.1), pick(|t| t.2)),
        })
    }

    /// `verl bench tp-scaling`: the training step's strong scaling under tensor parallelism at
    /// one global batch (every tp rank sees the whole batch): tp = 1, then each size in `tps`
    /// (ranks as threads) with each of `collectives`. Efficiency is t(tp=1) / (tp · t(tp)).
    /// With torchrun's `RANK` / `WORLD_SIZE` set, this process is instead one rank of a tp
    /// group of `WORLD_SIZE` (`tps` unused; `tp1_ms` the baseline; rank 0 prints).
    pub(crate) fn tp_scaling(
        preset_name: &str,
        (batch, seq, steps): (usize, usize, usize),
        dtype: &str,
        tps: &[usize],
        sequence_parallel: bool,
        collectives: &[String],
        (tp1_ms, host_profile): (Option<f64>, bool),
    ) -> Result<(), String> {
        #[cfg(not(feature = "host-profile"))]
        if host_profile {
            return Err("--host-profile needs a build with the host-profile feature".into());
        }
        let mut kinds = Vec::new();
        for c in collectives {
            match c.as_str() {
                "device" => kinds.push(true),
                "nccl" => kinds.push(false),
                other => {
                    return Err(format!(
                        "--collectives: `{other}` is neither `device` nor `nccl`"
                    ))
                }
            }
        }
        let dims = preset(preset_name)?;
        let cfg = HfModelConfig::qwen2(dims);
        let compute: verl::megatron::layers::precision::ComputeDtype = dtype
            .parse()
            .map_err(|e: verl::megatron::MegatronError| e.to_string())?;
        let shape = (batch, seq, steps.max(1));
        let kind_name = |device: bool| match device {
            true => "device kernels",
            false => "NCCL + host wait",
        };
        let per_gpu = |ms: f64, gpus: usize| (batch * seq) as f64 / (ms * 1e-3) / gpus as f64;
        let header = || {
            println!(
                "tp scaling, {preset_name}: batch {batch} x seq {seq}, {compute} products, \
                 sequence parallel {sequence_parallel}; median of {} steps",
                shape.2
            );
            println!(
                "| layout | collectives | step ms | efficiency | tokens/s per GPU | host round \
                 trips / step | first loss | host issue ms (fwd+bwd) | synced fwd / bwd / optim \
                 ms | collectives / step |"
            );
            println!("|---|---|---|---|---|---|---|---|---|---|");
        };
        // One rank of a process group (torchrun's variables): the job's layout, where rank
        // threads of one process would queue for burn's autodiff graph lock.
        if std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some() {
            let exchange = NcclIdExchange::from_env().map_err(|e| e.to_string())?;
            let r = &exchange.rendezvous;
            let (rank, world, local) = (r.rank, r.world_size, r.local_rank);
            let id = exchange
                .id("bench-tp-scaling", rank == 0)
                .map_err(|e| e.to_string())?;
            let comm = Arc::new(
                NcclCommunicator::new(&id, rank, world, rank_device(local))
                    .map_err(|e| e.to_string())?,
            );
            if rank == 0 {
                header();
            }
            for &device_collectives in &kinds {
                comm.set_device_collectives(device_collectives);
                let group = TpGroup::new(
                    comm.clone() as Arc<dyn Communicator<CudaBackend>>,
                    sequence_parallel,
                );
                let profile = host_profile && rank == 0;
                let r = timed_tp_steps(&cfg, &group, &rank_device(local), shape, compute, profile)?;
                if rank == 0 {
                    let efficiency = tp1_ms.map_or("-".to_string(), |one| {
                        format!("{:.0}%", 100.0 * one / (world as f64 * r.ms))
                    });
                    println!(
                        "| tp={world} (processes) | {} | {:.1} | {efficiency} | {:.0} | {} | {:.6} \
                         | {} |",
                        kind_name(device_collectives),
                        r.ms,
                        per_gpu(r.ms, world),
                        r.host_round_trips,
                        r.first_loss,
                        r.detail()
                    );
                }
            }
            return Ok(());
        }
        header();
        if tps.iter().any(|&tp| tp > 1) {
            eprintln!(
                "note: the tp ranks run as threads of this process, which queue for burn's \
                 autodiff graph lock; bench/gpu/tp_scaling.sh runs them as processes, as the job \
                 does"
            );
        }
        // The profiler samples the whole process: only the one-rank run here.
        let one = timed_tp_steps(
            &cfg,
            &TpGroup::none(),
            &rank_device(0),
            shape,
            compute,
            host_profile,
        )?;
        println!(
            "| tp=1 | - | {:.1} | 100% | {:.0} | {} | {:.6} | {} |",
            one.ms,
            per_gpu(one.ms, 1),
            one.host_round_trips,
            one.first_loss,
            one.detail()
        );
        let found = verl::megatron::cuda::device_count();
        for &tp in tps.iter().filter(|&&tp| tp > 1) {
            if tp > found {
                println!("| tp={tp} | skipped: this node has {found} GPUs |");
                continue;
            }
            if let Err(e) = cfg.check_tensor_parallel(tp) {
                println!("| tp={tp} | skipped: {e} |");
                continue;
            }
            for &device_collectives in &kinds {
                let ranks = on_gpus(tp, |rank, comm| {
                    comm.set_device_collectives(device_collectives);
                    let group = TpGroup::new(
                        comm as Arc<dyn Communicator<CudaBackend>>,
                        sequence_parallel,
                    );
                    timed_tp_steps(&cfg, &group, &rank_device(rank), shape, compute, false)
                })?;
                let r = &ranks[0];
                println!(
                    "| tp={tp} | {} | {:.1} | {:.0}% | {:.0} | {} | {:.6} | {} |",
                    kind_name(device_collectives),
                    r.ms,
                    100.0 * one.ms / (tp as f64 * r.ms),
                    per_gpu(r.ms, tp),
                    r.host_round_trips,
                    r.first_loss,
                    r.detail()
                );
            }
        }
        Ok(())
    }

    /// ‖a − b‖ / ‖b‖.
    fn relative_error(a: Tensor<CudaBackend, 2>, b: Tensor<CudaBackend, 2>) -> f32 {
        let norm = |t: Tensor<CudaBackend, 2>| t.powf_scalar(2.0).sum().sqrt().into_scalar();
        norm(a - b.clone()) / norm(b)
    }

    /// The linear layer's bf16 product and both of its gradients through cuBLASLt
    /// (`verl_megatron::cuda::linear`) against burn's own, on the shapes of a Qwen2-0.5B MLP.
    pub(crate) fn cublaslt_linear_grads() -> Result<(), String> {
        use verl::megatron::cuda::linear::{enabled, set_enabled};
        use verl::megatron::layers::precision::{self, ComputeDtype};
        let device = rank_device(0);
        let was = enabled();
        let run = |on: bool| {
            set_enabled(on);
            let _bf16 = precision::enter(ComputeDtype::Bf16);
            let r = |shape: [usize; 2], seed: u64| {
                <CudaBackend as burn::tensor::backend::Backend>::seed(&device, seed);
                Tensor::<CudaAutodiff, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device)
            };
            let x = r([2048, 896], 1).require_grad();
            let w = r([4864, 896], 2).require_grad();
            let probe = r([2048, 4864], 3);
            let y = precision::linear(x.clone(), w.clone());
            let grads = (y.clone() * probe).sum().backward();
            let grad = |t: &Tensor<CudaAutodiff, 2>| t.grad(&grads).expect("a gradient");
            (y.inner(), grad(&x), grad(&w))
        };
        let (y0, dx0, dw0) = run(false);
        let (y1, dx1, dw1) = run(true);
        set_enabled(was);
        let (ey, ex, ew) = (
            relative_error(y1, y0),
            relative_error(dx1, dx0),
            relative_error(dw1, dw0),
        );
        println!(
            "cuBLASLt linear vs burn (bf16, x [2048, 896], w [4864, 896]): relative difference \
             y {ey:.2e}, dx {ex:.2e}, dw {ew:.2e}"
        );
        // Both are bf16 products of the same bf16 operands: they differ by rounding only.
        if [ey, ex, ew].iter().all(|e| e.is_finite() && *e < 2e-2) {
            Ok(())
        } else {
            Err("cuBLASLt linear differs from burn's product beyond bf16 rounding".into())
        }
    }

    /// cuBLASLt's bf16 `x · wᵀ` on burn-cuda buffers against burn's own (cast) product: the
    /// time of one product among back-to-back ones, and the difference from an f32 product.
    pub(crate) fn cublaslt_vs_burn(sizes: &[usize], repeat: usize) -> Result<(), String> {
        let device = rank_device(0);
        let blas = CublasLt::new(device.clone())?;
        println!(
            "{:>6} {:>14} {:>16} {:>12}",
            "n", "burn_TFLOP/s", "cublaslt_TFLOP/s", "rel_err"
        );
        for &n in sizes {
            let r = || {
                Tensor::<CudaBackend, 2>::random([n, n], Distribution::Normal(0.0, 1.0), &device)
            };
            let sets: Vec<_> = (0..3)
                .map(|_| (r().cast(FloatDType::BF16), r().cast(FloatDType::BF16)))
                .collect();
            // Correctness first: both against the f32 product of the same bf16 values.
            let (x, w) = &sets[0];
            let exact = x
                .clone()
                .cast(FloatDType::F32)
                .matmul(w.clone().cast(FloatDType::F32).transpose());
            let lt = blas.linear_bf16(x.clone(), w.clone(), true)?;
            assert_eq!(lt.dtype(), DType::BF16);
            let err = relative_error(lt.cast(FloatDType::F32), exact);
            let flops = 2.0 * (n as f64).powi(3);
            let time = |f: &dyn Fn(usize) -> Result<(), String>| -> Result<f64, String> {
                f(0)?;
                let mut times = Vec::new();
                for _ in 0..3 {
                    let t = Instant::now();
                    for i in 0..repeat {
                        f(i)?;
                    }
                    times.push(synced_ms::<CudaBackend>(t, &device) / repeat as f64);
                }
                Ok(flops / (median(times) / 1e3) / 1e12)
            };
            let burn = time(&|i| {
                let (x, w) = &sets[i % 3];
                let _ = x.clone().matmul(w.clone().transpose());
                Ok(())
            })?;
            let lt = time(&|i| {
                let (x, w) = &sets[i % 3];
                blas.linear_bf16(x.clone(), w.clone(), i + 1 == repeat)
                    .map(|_| ())
            })?;
            println!("{n:>6} {burn:>14.1} {lt:>16.1} {err:>12.2e}");
        }
        Ok(())
    }
}

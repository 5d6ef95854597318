//! `verl bench kernels`' checks of the rollout engine's kernels (the `cuda` build): device
//! sampling against its host reference and the host sampler's distribution, the decode-step
//! attention and the in-place cache writes against the plain path, and greedy generation
//! through the whole engine against the cache-less model.

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType, TensorData};
use verl::backend::CudaBackend;
use verl::megatron::cuda::kernels::{decode_attention, norm, sampling as sampling_kernel, swiglu};
use verl::megatron::hf::{HfModelConfig, Qwen2Dims};
use verl::megatron::layers::precision::ComputeDtype;
use verl::megatron::models::generate::{generate, GenerateOptions};
use verl::megatron::models::{CausalLm, SlotKvCache};
use verl::megatron::ops::FusedOps;
use verl::megatron::sampling::{
    combine_shard_draws, reference_sample, reference_shard_draw, sample_rows, RowSampling,
    ShardDraw,
};
use verl::rollout::{EngineConfig, KvBudget, NativeRollout, Request, Sampler, SamplingParams};

type Device = burn::backend::cuda::CudaDevice;

/// The sampling settings every check runs: greedy, plain, and each filter.
fn settings() -> Vec<(&'static str, RowSampling)> {
    let base = RowSampling::default();
    vec![
        (
            "greedy",
            RowSampling {
                temperature: 0.0,
                ..base
            },
        ),
        ("T=1", base),
        (
            "T=0.7 top-k 50",
            RowSampling {
                temperature: 0.7,
                top_k: 50,
                ..base
            },
        ),
        ("top-p 0.9", RowSampling { top_p: 0.9, ..base }),
        (
            "T=0.8 min-p .1",
            RowSampling {
                temperature: 0.8,
                min_p: 0.1,
                ..base
            },
        ),
        (
            "T=1.2 min-p .05 top-k 20 top-p .95",
            RowSampling {
                temperature: 1.2,
                min_p: 0.05,
                top_k: 20,
                top_p: 0.95,
                ..base
            },
        ),
    ]
}

/// `rows` copies of `base`, row `i` with seed `seed + i` at draw `step · i` (every row its own
/// stream and step).
fn per_row(base: RowSampling, rows: usize, seed: u64, step: u32) -> Vec<RowSampling> {
    (0..rows)
        .map(|i| RowSampling {
            seed: seed + i as u64,
            step: step * i as u32,
            ..base
        })
        .collect()
}

/// The kernel against [`reference_sample`] row by row (same draw, so the same token unless
/// two candidates' noisy scores tie within rounding), and the time of one decode step's
/// sampling both ways.
pub(crate) fn check_sampling(device: &Device, failures: &mut Vec<String>) {
    println!("\nsampling kernel vs its host reference (token, log-prob, entropy, kept set):");
    for (rows, vocab) in [(1usize, 151_936usize), (64, 151_936), (7, 1000), (3, 33)] {
        CudaBackend::seed(device, rows as u64 * 31 + vocab as u64);
        let logits: Tensor<CudaBackend, 2> =
            Tensor::random([rows, vocab], Distribution::Normal(0.0, 3.0), device);
        let host: Vec<f32> = logits.to_data().to_vec().expect("f32 logits");
        for (name, base) in settings() {
            let params = per_row(base, rows, 1000, 3);
            let Ok(got) = sample_rows(logits.clone(), &params) else {
                failures.push(format!("sampling {rows}x{vocab} {name}: kernel not taken"));
                continue;
            };
            let (mut tokens, mut kept, mut lp, mut ent) = (0, 0, 0f64, 0f64);
            for (i, g) in got.iter().enumerate() {
                let want = reference_sample(&host[i * vocab..(i + 1) * vocab], &params[i]);
                tokens += (g.token != want.token) as usize;
                kept += (g.kept != want.kept) as usize;
                lp = lp.max((g.log_prob - want.log_prob).abs() as f64);
                ent = ent.max((g.entropy - want.entropy).abs() as f64);
            }
            println!(
                "  {rows:>3} x {vocab:>6} {name:<36} tokens differ {tokens}/{rows}, kept sets \
                 differ {kept}, max |dlogp| {lp:.2e}, |dH| {ent:.2e}"
            );
            let exact = name == "greedy";
            if (exact && tokens > 0) || tokens * 20 > rows.max(20) || lp > 1e-3 || ent > 1e-3 {
                failures.push(format!(
                    "sampling {rows}x{vocab} {name}: {tokens} tokens differ, dlogp {lp}, dH {ent}"
                ));
            }
        }
    }
    check_shard_sampling(device, failures);
    check_sampling_distribution(device, failures);
    time_sampling(device);
    time_shard_sampling(device);
}

/// A rollout tp = 4 decode step's sampling of 128 rows over Qwen2.5's padded vocabulary: the
/// whole-row kernel on the gathered logits against one rank's part (its row maxima, then its
/// shard's draws), collectives left out.
fn time_shard_sampling(device: &Device) {
    let (rows, vocab, tp) = (128, 152_064, 4);
    let width = vocab / tp;
    let logits: Tensor<CudaBackend, 2> =
        Tensor::random([rows, vocab], Distribution::Normal(0.0, 3.0), device);
    let shard = logits.clone().narrow(1, 0, width);
    let params = per_row(RowSampling::default(), rows, 0, 0);
    let reps = 20;
    let time = |f: &dyn Fn()| {
        f();
        CudaBackend::sync(device).expect("sync");
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        CudaBackend::sync(device).expect("sync");
        t.elapsed().as_secs_f64() * 1e6 / reps as f64
    };
    let whole = time(&|| {
        let _ = sample_rows(logits.clone(), &params);
    });
    let max_only = time(&|| {
        let _ = CudaBackend::row_max(shard.clone(), width);
    });
    let part = time(&|| {
        let m = CudaBackend::row_max(shard.clone(), width);
        let _ = CudaBackend::sample_shard(shard.clone(), m, &params, (0, width));
    });
    println!(
        "  128 x 152064 at tp 4, T=1: whole-row kernel {whole:.1} us (ids read back); one rank's \
         shard: row maxima {max_only:.1} us, maxima + draws {part:.1} us (queued, synced once)"
    );
}

/// Sampling from vocabulary shards (rollout tp > 1, no top-k or top-p) as tp ranks would: each
/// shard's kernel against its host reference, and the combined draw against the whole-row
/// kernel token for token. One GPU: the shards are column ranges, and the row maximum the
/// group would agree on is taken from the whole row.
fn check_shard_sampling(device: &Device, failures: &mut Vec<String>) {
    println!("  vocabulary shards (tp ranks simulated on one GPU) vs the whole-row kernel:");
    for (rows, vocab, tp) in [
        (64usize, 151_936usize, 4usize),
        (128, 152_064, 4),
        (5, 1001, 3),
    ] {
        CudaBackend::seed(device, (rows * tp) as u64 + vocab as u64);
        let width = vocab.div_ceil(tp);
        let logits: Tensor<CudaBackend, 2> =
            Tensor::random([rows, vocab], Distribution::Normal(0.0, 3.0), device);
        let mut host: Vec<f32> = logits.to_data().to_vec().expect("f32 logits");
        if rows < 8 {
            // Degenerate rows: an infinite logit in the second shard, a row of -inf, and a NaN
            // at the front of the first shard.
            host[vocab / 2] = f32::INFINITY;
            host[vocab..2 * vocab].fill(f32::NEG_INFINITY);
            host[2 * vocab] = f32::NAN;
        }
        let logits = Tensor::<CudaBackend, 2>::from_data(
            TensorData::new(host.clone(), [rows, vocab]),
            device,
        );
        // The last shard padded as the vocabulary-parallel head pads it (large values the
        // draw must ignore).
        let padded = match width * tp - vocab {
            0 => logits.clone(),
            pad => Tensor::cat(
                vec![logits.clone(), Tensor::full([rows, pad], 50.0, device)],
                1,
            ),
        };
        // The group's maximum from the shards' (the kernel; NaN ignored, as the whole-row
        // kernel does), exactly burn's on rows without NaN.
        let from_shards: Vec<Vec<f32>> = (0..tp)
            .map(|rank| {
                let valid = vocab.saturating_sub(rank * width).min(width);
                let shard = padded.clone().narrow(1, rank * width, width);
                CudaBackend::row_max(shard, valid)
                    .to_data()
                    .to_vec()
                    .expect("f32")
            })
            .collect();
        let m: Vec<f32> = (0..rows)
            .map(|r| {
                from_shards
                    .iter()
                    .map(|s| s[r])
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect();
        let burn_max: Vec<f32> = logits
            .clone()
            .max_dim(1)
            .reshape([rows])
            .to_data()
            .to_vec()
            .expect("f32");
        // Rows with a non-finite logit are left out: burn's reduction does not give the
        // whole-row kernel's maximum there (one of the degenerate rows differed), and the
        // tokens below are checked against that kernel instead.
        let max_gaps: Vec<String> = (0..rows)
            .filter(|&r| {
                let finite = host[r * vocab..(r + 1) * vocab]
                    .iter()
                    .all(|v| v.is_finite());
                finite && m[r] != burn_max[r]
            })
            .map(|r| format!("row {r}: {} vs {}", m[r], burn_max[r]))
            .collect();
        if !max_gaps.is_empty() {
            failures.push(format!(
                "shard sampling {rows}x{vocab}/{tp}: row maxima differ from burn's: {max_gaps:?}"
            ));
        }
        let row_max =
            Tensor::<CudaBackend, 1>::from_data(TensorData::new(m.clone(), [rows]), device);
        for (name, base) in settings() {
            let params = per_row(base, rows, 500, 7);
            if !params[0].draws_from_shards(vocab) {
                continue;
            }
            let Ok(whole) = sample_rows(logits.clone(), &params) else {
                failures.push(format!(
                    "shard sampling {rows}x{vocab}: whole-row kernel not taken"
                ));
                continue;
            };
            let mut parts = vec![Vec::new(); rows];
            let mut reference_gaps = 0usize;
            for rank in 0..tp {
                let start = rank * width;
                let valid = vocab.saturating_sub(start).min(width);
                let shard = padded.clone().narrow(1, start, width);
                let words: Vec<f32> =
                    CudaBackend::sample_shard(shard, row_max.clone(), &params, (start, valid))
                        .to_data()
                        .to_vec()
                        .expect("f32 words");
                for (r, w) in words.chunks(ShardDraw::WORDS).enumerate() {
                    let got = ShardDraw::from_words(w);
                    let x = &host[r * vocab + start..r * vocab + start + valid];
                    let want = reference_shard_draw(x, start as u32, m[r], &params[r]);
                    reference_gaps += (got.token != want.token || got.kept != want.kept) as usize;
                    parts[r].push(got);
                }
            }
            let (mut tokens, mut lp) = (0usize, 0f64);
            for (r, p) in parts.iter().enumerate() {
                let got = combine_shard_draws(p, &params[r]);
                tokens += (got.token != whole[r].token || got.kept != whole[r].kept) as usize;
                lp = lp.max((got.log_prob - whole[r].log_prob).abs() as f64);
                lp = lp.max((got.entropy - whole[r].entropy).abs() as f64);
            }
            println!(
                "    {rows:>3} x {vocab:>6} over {tp} shards {name:<36} tokens differ from the \
                 whole row {tokens}/{rows}, shards from their reference {reference_gaps}, max \
                 |dlogp|, |dH| {lp:.2e}"
            );
            if tokens > 0 || reference_gaps * 20 > (rows * tp).max(20) || lp > 1e-3 {
                failures.push(format!(
                    "shard sampling {rows}x{vocab}/{tp} {name}: {tokens} tokens differ, \
                     {reference_gaps} shard gaps, dlogp {lp}"
                ));
            }
        }
    }
}

/// 8 192 draws of one 12-token row on the GPU (one launch, one row per draw) against the host
/// sampler's distribution for the same settings (chi-square).
fn check_sampling_distribution(device: &Device, failures: &mut Vec<String>) {
    // Distinct logits: with ties, top-k keeps all tied tokens here and the first by index there.
    let row: Vec<f32> = (0..12).map(|i| ((i * 7) % 12) as f32 * 0.3 - 1.5).collect();
    let draws = 8192;
    for (t, k, p, min_p) in [(1.0, -1, 1.0, 0.0), (0.8, 6, 0.9, 0.02), (1.5, 4, 1.0, 0.1)] {
        let host = SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            min_p,
            seed: 0,
        };
        let want = host.distribution(&row);
        let logits = Tensor::<CudaBackend, 2>::from_data(
            TensorData::new(row.repeat(draws), [draws, row.len()]),
            device,
        );
        let params: Vec<RowSampling> = (0..draws)
            .map(|i| RowSampling {
                temperature: t as f32,
                top_k: k as i32,
                top_p: p as f32,
                min_p: min_p as f32,
                seed: 77,
                step: i as u32,
            })
            .collect();
        let Ok(got) = sample_rows(logits, &params) else {
            failures.push("sampling distribution: kernel not taken".into());
            continue;
        };
        let mut counts = vec![0usize; row.len()];
        got.iter().for_each(|g| counts[g.token as usize] += 1);
        let (mut chi2, mut cells, mut outside) = (0.0, 0, 0);
        for (c, q) in counts.iter().zip(&want) {
            if *q == 0.0 {
                outside += c;
                continue;
            }
            let e = q * draws as f64;
            chi2 += (*c as f64 - e).powi(2) / e;
            cells += 1;
        }
        println!(
            "  distribution T={t} top-k {k} top-p {p} min-p {min_p}: chi2 {chi2:.1} over {cells} \
             tokens, {outside} draws of filtered-out tokens"
        );
        // The 99.9 % quantile of chi-square with 11 degrees of freedom is 31.3.
        if chi2 > 40.0 || outside > 0 {
            failures.push(format!(
                "sampling distribution T={t} k={k} p={p}: chi2 {chi2}, {outside} outside"
            ));
        }
    }
}

/// One decode step's sampling of 64 rows over Qwen2's vocabulary: the kernel (ids and
/// log-probs read back) against reading the logits back and sampling on the host.
fn time_sampling(device: &Device) {
    let (rows, vocab) = (64, 151_936);
    let logits: Tensor<CudaBackend, 2> =
        Tensor::random([rows, vocab], Distribution::Normal(0.0, 3.0), device);
    let params = per_row(RowSampling::default(), rows, 0, 0);
    let reps = 20;
    let _ = sample_rows(logits.clone(), &params);
    let t = Instant::now();
    for _ in 0..reps {
        let _ = sample_rows(logits.clone(), &params);
    }
    let kernel_ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
    sampling_kernel::SWITCH.set(false);
    let t = Instant::now();
    let mut sampler = Sampler::new(SamplingParams::default(), 0).expect("valid");
    for _ in 0..3 {
        let host: Vec<f32> = logits.to_data().to_vec().expect("f32");
        for r in 0..rows {
            let _ = sampler.sample(&host[r * vocab..(r + 1) * vocab]);
        }
    }
    let host_ms = t.elapsed().as_secs_f64() * 1e3 / 3.0;
    sampling_kernel::SWITCH.set(true);
    println!(
        "  64 x 151936, T=1: kernel {kernel_ms:.3} ms per step (ids read back), host {host_ms:.1} \
         ms (logits read back, sampled on the CPU)"
    );
}

fn model_dims(hidden: usize, heads: usize, kv: usize) -> Qwen2Dims {
    Qwen2Dims {
        vocab_size: 1000,
        hidden_size: hidden,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        max_position_embeddings: 4096,
    }
}

/// Sets the decode step's kernels (decode attention and cache writes, fused add + norm, fused
/// SwiGLU) on or off.
fn decode_kernels(on: bool) {
    decode_attention::SWITCH.set(on);
    norm::SWITCH.set(on);
    swiglu::SWITCH.set(on);
}

/// Which decode path [`prefill_and_decode_on`] runs: the decode kernels (attention, norm,
/// SwiGLU) on or off, the attention split over keys, and its tensor-core path.
#[derive(Clone, Copy)]
struct DecodePath {
    kernels: bool,
    split: bool,
    mma: bool,
}

/// [`prefill_and_decode`] over a 1 600-position cache on `path`, every switch back on after.
fn prefill_and_decode_on(
    path: DecodePath,
    model: &CausalLm<CudaBackend>,
    prompts: &[Vec<u32>],
    dtype: FloatDType,
    device: &Device,
) -> Vec<Tensor<CudaBackend, 2>> {
    decode_kernels(path.kernels);
    decode_attention::SPLIT.set(path.split);
    decode_attention::MMA.set(path.mma);
    let out = prefill_and_decode(model, prompts, 1600, dtype, device);
    decode_kernels(true);
    decode_attention::SPLIT.set(true);
    decode_attention::MMA.set(true);
    out
}

/// Three prompts prefilled into slots 0, 1, 2 of a cache of `capacity` positions stored as
/// `dtype`, then 4 decode steps reading it: the logits of the prefill and of each step.
fn prefill_and_decode(
    model: &CausalLm<CudaBackend>,
    prompts: &[Vec<u32>],
    capacity: usize,
    dtype: FloatDType,
    device: &Device,
) -> Vec<Tensor<CudaBackend, 2>> {
    let cfg = &model.config;
    let (layers, kv, hd) = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim);
    let mut cache = SlotKvCache::new_with_dtype(layers, kv, hd, 3, capacity, dtype, device);
    let mut out = vec![model.prefill_slots(prompts, &[0, 1, 2], &mut cache)];
    let mut positions: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let mut tokens: Vec<u32> = vec![3, 4, 5];
    for step in 0..4 {
        let window = positions.iter().max().copied().unwrap_or(0) + 1;
        out.push(model.decode_slots(&tokens, &positions, window, &mut cache));
        tokens = tokens.iter().map(|t| (t * 17 + step) % 1000).collect();
        positions.iter_mut().for_each(|p| *p += 1);
    }
    out
}

/// The relative error of each step's logits, `a` against `b`.
fn step_errors(a: &[Tensor<CudaBackend, 2>], b: &[Tensor<CudaBackend, 2>]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(a, b)| super::agreement::relative_error(a.clone(), b.clone()))
        .collect()
}

/// How far a decode kernel's logits may be from the plain path's: burn's f32 products round
/// their operands to TF32 on Hopper (cubek's blueprint picks tf32 stages for f32), ~5e-4
/// relative, where the kernel's products are f32; bf16 products round more.
fn logits_bound(compute: ComputeDtype) -> f64 {
    if compute == ComputeDtype::F32 {
        2e-3
    } else {
        3e-2
    }
}

/// Prefill and six decode steps of three slots (prompts of 5, 11 and 1 tokens, so positions
/// differ) with the decode kernels and with the plain path (scatter writes, decomposed
/// attention, separate add / norm / cast and SwiGLU), logits compared step by step; head sizes
/// 64 (7 query heads per kv head) and 128 (6 per kv head), f32 and bf16 products. With bf16
/// products the model has fused generation weights (stacked q/k/v and gate/up), and the
/// fused step with kernels is also compared with the layer-by-layer step of the same model
/// without them.
pub(crate) fn check_decode(device: &Device, failures: &mut Vec<String>) {
    println!("\ndecode-attention kernel + in-place cache writes vs the plain path (logits):");
    for (hidden, heads, kv) in [(448, 7, 1), (768, 6, 1), (896, 14, 2)] {
        for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
            let cfg = HfModelConfig::qwen2(model_dims(hidden, heads, kv));
            let unfused =
                CausalLm::<CudaBackend>::init(&cfg, 0.02, 5, device).with_compute_dtype(compute);
            let model = unfused.clone().with_generation_matrices();
            let hd = cfg.head_dim;
            let prompts: Vec<Vec<u32>> = [5usize, 11, 1]
                .iter()
                .map(|&n| (0..n).map(|j| ((j * 37 + n * 11) % 1000) as u32).collect())
                .collect();
            let run = |model: &CausalLm<CudaBackend>, kernel: bool| {
                decode_kernels(kernel);
                let mut cache = SlotKvCache::new(2, kv, hd, 3, 40, device);
                let logits = model.prefill_slots(&prompts, &[2, 0, 1], &mut cache);
                // Slots 2, 0, 1 hold prompts 0, 1, 2.
                let mut positions = vec![11usize, 1, 5];
                let mut tokens: Vec<u32> = vec![7, 8, 9];
                let mut out = vec![logits];
                for step in 0..6 {
                    let window = positions.iter().max().copied().unwrap_or(0) + 1;
                    let l = model.decode_slots(&tokens, &positions, window, &mut cache);
                    out.push(l);
                    tokens = tokens.iter().map(|t| (t * 13 + step) % 1000).collect();
                    positions.iter_mut().for_each(|p| *p += 1);
                }
                decode_kernels(true);
                out
            };
            let (with, without) = (run(&model, true), run(&model, false));
            let errors = step_errors(&with, &without);
            let worst = errors.iter().copied().fold(0.0, f64::max);
            println!(
                "  heads {heads}/{kv} of {hd}, {compute} (fused weights: {}): max relative \
                 error over prefill + 6 steps {worst:.2e}",
                model.generation().is_some()
            );
            if model.generation().is_some() {
                let layered = step_errors(&with, &run(&unfused, true));
                let worst = layered.iter().copied().fold(0.0, f64::max);
                println!("    fused step vs layer-by-layer step (kernels on): {worst:.2e}");
                super::agreement::require_below(
                    failures,
                    format!("fused decode step {heads}/{kv}x{hd}"),
                    &layered,
                    1e-5,
                );
            }
            let bound = logits_bound(compute);
            super::agreement::require_below(
                failures,
                format!("decode attention {heads}/{kv}x{hd} {compute}"),
                &errors,
                bound,
            );
        }
    }
    check_decode_split(device, failures);
    check_decode_scores(device, failures);
    check_bf16_cache(device, failures);
    check_decode_mma(device, failures);
    check_greedy_engine(device, ComputeDtype::F32, failures);
    check_greedy_engine(device, ComputeDtype::Bf16, failures);
    check_prefill(device, failures);
}

/// The bf16 KV cache the engine allocates with bf16 products, against an f32 cache: bf16
/// products round keys and values to bf16 before every product, so the logits must be the same
/// to the bit, with the split decode kernel, with one block per slot and on the plain path
/// (prompts of 1 500, 700 and 3 tokens, prefill and 4 decode steps).
fn check_bf16_cache(device: &Device, failures: &mut Vec<String>) {
    println!("\nbf16 KV cache vs f32 KV cache with bf16 products (logits, equal to the bit):");
    for (hidden, heads, kv) in [(896, 14, 2), (768, 6, 1)] {
        let (model, prompts) = long_context_setup((hidden, heads, kv), ComputeDtype::Bf16, device);
        for (path, kernels, split) in [
            ("split kernel", true, true),
            ("one block per slot", true, false),
            ("plain path", false, false),
        ] {
            // The scalar kernel on both caches (the tensor-core path takes bf16 caches only,
            // and rounds the softmax's weights: check_decode_mma compares it).
            let on = DecodePath {
                kernels,
                split,
                mma: false,
            };
            let run = |dtype| prefill_and_decode_on(on, &model, &prompts, dtype, device);
            let errors = step_errors(&run(FloatDType::BF16), &run(FloatDType::F32));
            let worst = errors.iter().copied().fold(0.0, f64::max);
            println!("  heads {heads}/{kv}, {path}: max relative difference {worst:.2e}");
            super::agreement::require_below(
                failures,
                format!("bf16 cache vs f32 cache {heads}/{kv} {path}"),
                &errors,
                1e-7,
            );
        }
    }
}

/// The tensor-core decode attention (bf16 cache, heads of 64) against the scalar kernel and the
/// plain path, with and without the split over keys: three slots holding prompts of 1 500, 700
/// and 3 tokens, prefill and 4 decode steps, logits compared (bf16 products' bound: the
/// tensor-core path rounds the softmax's weights to bf16 as the plain path's product does).
fn check_decode_mma(device: &Device, failures: &mut Vec<String>) {
    println!("\ndecode attention on tensor cores vs the scalar kernel vs plain (bf16 cache):");
    // Heads of 64 (the 0.5B's groups of 7) and of 128 (the 7B's groups of 7).
    for (hidden, heads, kv) in [(896, 14, 2), (896, 7, 1)] {
        let head_dim = hidden / heads;
        let (model, prompts) = long_context_setup((hidden, heads, kv), ComputeDtype::Bf16, device);
        let run = |kernels: bool, split: bool, mma: bool| {
            let path = DecodePath {
                kernels,
                split,
                mma,
            };
            prefill_and_decode_on(path, &model, &prompts, FloatDType::BF16, device)
        };
        let plain = run(false, false, false);
        let bound = logits_bound(ComputeDtype::Bf16);
        for split in [false, true] {
            let (mma, scalar) = (run(true, split, true), run(true, split, false));
            let (vs_scalar, vs_plain) = (step_errors(&mma, &scalar), step_errors(&mma, &plain));
            let worst = |e: &[f64]| e.iter().copied().fold(0.0, f64::max);
            println!(
                "  heads {heads}/{kv} of {head_dim}, split {split}: tensor cores vs scalar {:.2e}, vs plain {:.2e}",
                worst(&vs_scalar),
                worst(&vs_plain)
            );
            for (what, errors) in [("scalar kernel", &vs_scalar), ("plain path", &vs_plain)] {
                super::agreement::require_below(
                    failures,
                    format!(
                        "tensor-core decode attention (head {head_dim}) vs {what}, split {split}"
                    ),
                    errors,
                    bound,
                );
            }
        }
    }
}

/// The long-context checks' model (`hidden`, `heads` over `kv` heads, 2 048 positions) in
/// `compute`, and their three prompts of 1 500, 700 and 3 tokens.
fn long_context_setup(
    (hidden, heads, kv): (usize, usize, usize),
    compute: ComputeDtype,
    device: &Device,
) -> (CausalLm<CudaBackend>, Vec<Vec<u32>>) {
    let mut dims = model_dims(hidden, heads, kv);
    dims.max_position_embeddings = 2048;
    let cfg = HfModelConfig::qwen2(dims);
    let model = CausalLm::<CudaBackend>::init(&cfg, 0.02, 9, device)
        .with_compute_dtype(compute)
        .with_generation_matrices();
    let prompts = [1500usize, 700, 3]
        .iter()
        .map(|&n| (0..n).map(|j| ((j * 29 + n * 7) % 1000) as u32).collect())
        .collect();
    (model, prompts)
}

/// Gemma's and Mistral's scores in the decode kernel: a sliding window of 300 keys on layer 0
/// (cutting the 1 500- and 700-token prompts, so the split's early blocks hold no keys), a scale
/// of `query_pre_attn_scalar` 100 (not head_dim) and a soft-cap of 20 on both layers; prefill
/// and 4 decode steps with the split kernel, one block per slot, the tensor-core path and the
/// plain path (which windows and caps with the mask and burn's ops), logits compared.
fn check_decode_scores(device: &Device, failures: &mut Vec<String>) {
    println!(
        "\ndecode attention with a sliding window, a scale of its own and a soft-cap vs plain:"
    );
    let mut dims = model_dims(896, 14, 2);
    dims.max_position_embeddings = 2048;
    let mut cfg = HfModelConfig::qwen2(dims);
    cfg.variants.sliding_window = Some(300);
    cfg.variants.sliding_layers = vec![true, false];
    cfg.variants.query_pre_attn_scalar = Some(100.0);
    cfg.variants.attn_logit_softcapping = Some(20.0);
    let prompts: Vec<Vec<u32>> = [1500usize, 700, 3]
        .iter()
        .map(|&n| (0..n).map(|j| ((j * 29 + n * 7) % 1000) as u32).collect())
        .collect();
    for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
        let model = CausalLm::<CudaBackend>::init(&cfg, 0.02, 9, device)
            .with_compute_dtype(compute)
            .with_generation_matrices();
        let cache = match compute {
            ComputeDtype::Bf16 => FloatDType::BF16,
            _ => FloatDType::F32,
        };
        let run = |kernels: bool, split: bool, mma: bool| {
            let path = DecodePath {
                kernels,
                split,
                mma,
            };
            prefill_and_decode_on(path, &model, &prompts, cache, device)
        };
        let plain = run(false, false, false);
        for (path, split, mma) in [
            ("split", true, false),
            ("one block per slot", false, false),
            ("tensor cores, split", true, true),
        ] {
            let errors = step_errors(&run(true, split, mma), &plain);
            let worst = errors.iter().copied().fold(0.0, f64::max);
            println!("  {compute}, {path}: max relative error vs plain {worst:.2e}");
            super::agreement::require_below(
                failures,
                format!("decode attention with window and cap ({path}) {compute}"),
                &errors,
                logits_bound(compute),
            );
        }
    }
}

/// Long contexts split their keys over several blocks (flash-decoding): three slots holding
/// prompts of 1 500, 700 and 3 tokens, prefill and 4 decode steps, with the split, without it
/// (one block per kv head and slot) and on the plain path; logits compared.
fn check_decode_split(device: &Device, failures: &mut Vec<String>) {
    println!(
        "
decode attention split over keys (flash-decoding) vs one block per slot vs plain:"
    );
    for (hidden, heads, kv) in [(896, 14, 2), (768, 6, 1)] {
        for compute in [ComputeDtype::F32, ComputeDtype::Bf16] {
            let (model, prompts) = long_context_setup((hidden, heads, kv), compute, device);
            let run = |kernels: bool, split: bool| {
                // The tensor-core path as it stands (it takes bf16 caches only).
                let mma = decode_attention::MMA.enabled();
                let path = DecodePath {
                    kernels,
                    split,
                    mma,
                };
                prefill_and_decode_on(path, &model, &prompts, FloatDType::F32, device)
            };
            let (split, whole, plain) = (run(true, true), run(true, false), run(false, false));
            let (vs_whole, vs_plain) = (step_errors(&split, &whole), step_errors(&split, &plain));
            let worst = |e: &[f64]| e.iter().copied().fold(0.0, f64::max);
            println!(
                "  heads {heads}/{kv}, {compute}: split vs one block {:.2e}, split vs plain {:.2e}",
                worst(&vs_whole),
                worst(&vs_plain)
            );
            // The split reorders only the softmax's sums (~1e-7 in the attention output); the
            // products after it round their operands, so the logits get the plain path's bound.
            let bound = logits_bound(compute);
            super::agreement::require_below(
                failures,
                format!("split decode vs one block {heads}/{kv} {compute}"),
                &vs_whole,
                bound,
            );
            super::agreement::require_below(
                failures,
                format!("split decode vs plain {heads}/{kv} {compute}"),
                &vs_plain,
                bound,
            );
        }
    }
}

/// A prefill into an empty cache through the fused attention kernel (bf16: keys and values
/// kept after RoPE, no prompt × prompt scores) against the decomposed prefill: the last-token
/// logits and those of 4 decode steps, which read the keys and values the prefill cached;
/// ragged prompts (one of a single token) in one right-padded batch.
fn check_prefill(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::attention;
    println!("\nprefill into an empty cache: fused attention vs decomposed (logits):");
    for (hidden, heads, kv) in [(896, 14, 2), (1024, 8, 2)] {
        let cfg = HfModelConfig::qwen2(model_dims(hidden, heads, kv));
        let model = CausalLm::<CudaBackend>::init(&cfg, 0.02, 9, device)
            .with_compute_dtype(ComputeDtype::Bf16)
            .with_generation_matrices();
        let hd = cfg.head_dim;
        let prompts: Vec<Vec<u32>> = [300usize, 77, 1]
            .iter()
            .map(|&n| (0..n).map(|j| ((j * 53 + n * 7) % 1000) as u32).collect())
            .collect();
        let run = |fused: bool| {
            attention::SWITCH.set(fused);
            let out = prefill_and_decode(&model, &prompts, 320, FloatDType::F32, device);
            attention::SWITCH.set(true);
            out
        };
        let (fused, plain) = (run(true), run(false));
        let errors: Vec<f64> = fused
            .iter()
            .zip(&plain)
            .map(|(a, b)| super::agreement::relative_error(a.clone(), b.clone()))
            .collect();
        let worst = errors.iter().copied().fold(0.0, f64::max);
        println!(
            "  heads {heads}/{kv} of {hd}: max relative error over prefill + 4 steps {worst:.2e}"
        );
        super::agreement::require_below(
            failures,
            format!("fused prefill {heads}/{kv}x{hd}"),
            &errors,
            3e-2,
        );
    }
}

/// Greedy generation through the engine (device sampling, decode kernel, continuous batching
/// over 2 slots; each of 3 prompts asked twice, the two copies sharing one prefill) equals the
/// cache-less model's, token for token, with whole prefills and with prefills chunked by 5
/// tokens: required with f32 products; with bf16 products (the engine's fused decode step
/// against the cache-less pass's fused attention, different roundings of the same sums) the
/// count is reported.
fn check_greedy_engine(device: &Device, compute: ComputeDtype, failures: &mut Vec<String>) {
    let cfg = HfModelConfig::qwen2(model_dims(896, 14, 2));
    let model = CausalLm::<CudaBackend>::init(&cfg, 0.5, 3, device).with_compute_dtype(compute);
    let prompts: Vec<Vec<u32>> = [3usize, 9, 14]
        .iter()
        .map(|&n| (0..n).map(|j| ((j * 53 + n) % 1000) as u32).collect())
        .collect();
    let options = GenerateOptions {
        max_new_tokens: 24,
        temperature: 0.0,
        seed: 0,
        eos_token_ids: Vec::new(),
    };
    let wants: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| generate(&model, p, &options, device))
        .collect();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    for (label, budget) in [("whole prefills", 64), ("prefills chunked by 5", 5)] {
        let engine_cfg = EngineConfig {
            max_num_seqs: 2,
            max_num_batched_tokens: budget,
            prompt_length: 16,
            response_length: 24,
            kv_budget: KvBudget::Tokens(2 * 40),
            sampling: greedy,
            ignore_eos: true,
            ..Default::default()
        };
        let mut engine =
            match NativeRollout::new(cfg.clone(), model.clone(), engine_cfg, device.clone()) {
                Ok(e) => e,
                Err(e) => {
                    failures.push(format!("greedy engine: {e}"));
                    return;
                }
            };
        let requests = prompts
            .iter()
            .flat_map(|p| [p, p])
            .enumerate()
            .map(|(i, p)| Request {
                prompt: p.clone(),
                sampler: Sampler::new(greedy, i as u64).expect("valid"),
                max_new_tokens: 24,
            })
            .collect();
        let out = match engine.generate(requests) {
            Ok(o) => o,
            Err(e) => {
                failures.push(format!("greedy engine: {e}"));
                return;
            }
        };
        let mut equal = 0;
        for (i, c) in out.iter().enumerate() {
            let want = &wants[i / 2];
            if *want == c.tokens {
                equal += 1;
            } else if compute == ComputeDtype::F32 {
                failures.push(format!(
                    "greedy engine ({label}) vs cache-less: {:?} vs {:?}",
                    c.tokens, want
                ));
            }
        }
        let s = engine.last_stats();
        println!(
            "  greedy engine ({compute}, {label}, device sampling: {}, fused weights: {}) vs \
             cache-less model: {equal}/6 sequences equal token for token (24 tokens each; \
             {} of {} prompt tokens prefilled, {} prefill steps)",
            s.sampled_on_device,
            engine.model().is_some_and(|m| m.generation().is_some()),
            s.prefilled_tokens,
            s.prompt_tokens,
            s.prefill_steps,
        );
    }
}

//! `verl bench log-prob`: the actor's log-prob pass and PPO update on a batch of mixed prompt
//! and response lengths, with and without the fused head (`model.use_fused_kernels`), dynamic
//! batch size (`use_dynamic_bsz`) and sequence packing (`use_remove_padding`): time and peak
//! memory of each, and how far each variant's log-probs are from the plain padded ones.

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl::backend::{DefaultAutodiff, DefaultBackend};
use verl::config::OptimConfig;
use verl::megatron::hf::HfModelConfig;
use verl::megatron::layers::precision::ComputeDtype;
use verl::megatron::models::CausalLm;
use verl::megatron::parallel::ParallelBackend;
use verl::megatron::workers::TrainingRole;
use verl::megatron::workers::{ActorSettings, DynamicBatch, MegatronActor, ModelOptimizer};
use verl::traits::Actor;
use verl::DataProto;

use super::{median, preset};

/// A PPO batch of `rows` rows: prompts of `prompt` tokens (every other one a quarter shorter,
/// left-padded), responses of 1..=`response` tokens spread evenly (the mixed lengths of RL),
/// right-padded.
fn batch(rows: usize, prompt: usize, response: usize, vocab: usize) -> DataProto<DefaultBackend> {
    let device = Default::default();
    let t = prompt + response;
    let (mut ids, mut mask, mut pos, mut resp, mut resp_mask) =
        (vec![], vec![], vec![], vec![], vec![]);
    for r in 0..rows {
        let len = 1 + (r * 7919) % response;
        let left = (r % 2) * prompt / 4;
        for j in 0..t {
            let id = ((r * 31 + j * 17) % (vocab - 1)) as i64;
            ids.push(id);
            let live = left <= j && j < prompt + len;
            mask.push(live as i64);
            pos.push(j.saturating_sub(left) as i64);
            if j >= prompt {
                resp.push(id);
                resp_mask.push(live as i64);
            }
        }
    }
    let int = |v: Vec<i64>, w: usize| {
        Tensor::<DefaultBackend, 2, Int>::from_data(TensorData::new(v, [rows, w]), &device)
    };
    let mut d = DataProto::new();
    d.insert_int("input_ids", int(ids, t)).expect("fresh key");
    d.insert_int("attention_mask", int(mask, t))
        .expect("fresh key");
    d.insert_int("position_ids", int(pos, t))
        .expect("fresh key");
    d.insert_int("responses", int(resp, response))
        .expect("fresh key");
    d.insert_int("response_mask", int(resp_mask, response))
        .expect("fresh key");
    let zeros = Tensor::<DefaultBackend, 2>::zeros([rows, response], &device);
    d.insert_float("old_log_probs", zeros.clone() - 3.0)
        .expect("fresh key");
    d.insert_float("advantages", zeros + 0.5)
        .expect("fresh key");
    d
}

/// The device's peak while `f` runs: burn-cuda's pool (sampled where the actor samples), or on
/// the CPU backend the counting allocator's high-water mark.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let phase = verl::core::memory::PhasePeak::start();
    let base = verl::core::memory::CountingAllocator::reset_peak();
    let out = f();
    let host = verl::core::memory::CountingAllocator::peak().saturating_sub(base);
    let sampled = phase.finish().map(|u| u.allocated).unwrap_or(0);
    let gpu = DefaultBackend::memory_usage(&Default::default()).is_some() && cfg!(feature = "cuda");
    (
        out,
        if gpu { sampled } else { host } as f64 / (1u64 << 30) as f64,
    )
}

/// Times the log-prob pass and one PPO update per variant (plain / fused head × fixed /
/// dynamic micro-batches × padded / packed sequences).
#[allow(clippy::too_many_arguments)]
pub(crate) fn log_prob(
    preset_name: &str,
    rows: usize,
    prompt: usize,
    response: usize,
    micro: usize,
    max_tokens: usize,
    dtype: &str,
    repeat: usize,
) -> Result<(), String> {
    let dims = preset(preset_name)?;
    let cfg = HfModelConfig::qwen2(dims);
    let compute: ComputeDtype = dtype
        .parse()
        .map_err(|e: verl::megatron::MegatronError| e.to_string())?;
    let data = batch(rows, prompt, response, dims.vocab_size);
    let tokens: f64 = data
        .to_data("attention_mask")
        .map_err(|e| e.to_string())?
        .convert::<f32>()
        .iter::<f32>()
        .map(f64::from)
        .sum();
    println!(
        "{preset_name}: {rows} rows, prompt {prompt}, responses 1..={response} ({tokens} real of {} padded tokens), {compute} products, fixed micro-batches of {micro} rows or dynamic ≤ {max_tokens} tokens",
        rows * (prompt + response)
    );
    println!(
        "variant               | log-prob s | log-prob peak GiB | update s | update peak GiB | max |Δ log-prob|"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let response_mask: Vec<f32> = data
        .to_data("response_mask")
        .map_err(|e| e.to_string())?
        .convert::<f32>()
        .to_vec()
        .map_err(|e| format!("{e:?}"))?;
    // The plain padded pass's log-probs (the first variant's), which the others are compared to.
    let mut reference: Option<Vec<f32>> = None;
    for (fused, dynamic, packed) in [
        (false, false, false),
        (true, false, false),
        (false, true, false),
        (true, true, false),
        (false, false, true),
        (false, true, true),
        (true, true, true),
    ] {
        let device = Default::default();
        let mut actor = variant_actor(
            &cfg,
            compute,
            (fused, dynamic, packed),
            (rows, micro, max_tokens),
            &device,
        )?;
        let timed = time_variant(&mut actor, &data, &runtime, repeat, &device)?;
        // Before any update every variant's model is the same: the log-probs must agree.
        let deviation = match &reference {
            None => {
                reference = Some(timed.first_log_probs);
                0.0
            }
            Some(r) => max_deviation(r, &timed.first_log_probs, &response_mask),
        };
        let name = format!(
            "{} {}{}",
            if fused { "fused" } else { "plain" },
            if dynamic { "dynamic" } else { "fixed" },
            if packed { " packed" } else { "" }
        );
        println!(
            "{name:<21} | {:>10.3} | {:>17.2} | {:>8.3} | {:>15.2} | {deviation:>16.2e}",
            median(timed.log_prob_s),
            timed.log_prob_peak,
            median(timed.update_s),
            timed.update_peak
        );
    }
    Ok(())
}

/// What [`time_variant`] measured of one variant: the seconds of each timed log-prob pass and
/// update, their peaks (GiB), and the log-probs of the first pass (before any update).
struct VariantTimes {
    log_prob_s: Vec<f64>,
    update_s: Vec<f64>,
    log_prob_peak: f64,
    update_peak: f64,
    first_log_probs: Vec<f32>,
}

/// `repeat` timed log-prob passes and updates of `actor` on `data` after one warm-up of each.
fn time_variant(
    actor: &mut MegatronActor<DefaultAutodiff>,
    data: &DataProto<DefaultBackend>,
    runtime: &tokio::runtime::Runtime,
    repeat: usize,
    device: &<DefaultBackend as burn::tensor::backend::BackendTypes>::Device,
) -> Result<VariantTimes, String> {
    let mut times = VariantTimes {
        log_prob_s: vec![],
        update_s: vec![],
        log_prob_peak: 0.0,
        update_peak: 0.0,
        first_log_probs: vec![],
    };
    for i in 0..=repeat {
        let _ = DefaultBackend::sync(device);
        let t = Instant::now();
        let (r, peak) = peak_of(|| runtime.block_on(actor.compute_log_prob(data, true)));
        let out = r.map_err(|e| e.to_string())?;
        if i == 0 {
            times.first_log_probs = out
                .log_probs
                .into_data()
                .convert::<f32>()
                .to_vec()
                .map_err(|e| format!("{e:?}"))?;
        }
        let _ = DefaultBackend::sync(device);
        let lp = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (r, update_peak) = peak_of(|| runtime.block_on(actor.update_policy(data)));
        r.map_err(|e| e.to_string())?;
        let _ = DefaultBackend::sync(device);
        if i > 0 {
            times.log_prob_s.push(lp);
            times.update_s.push(t.elapsed().as_secs_f64());
        }
        times.log_prob_peak = times.log_prob_peak.max(peak);
        times.update_peak = times.update_peak.max(update_peak);
    }
    Ok(times)
}

/// The actor of one variant: the preset's model (fused head, packed sequences as asked) with
/// fixed micro-batches of `micro` rows or dynamic ones of at most `max_tokens` tokens.
fn variant_actor(
    cfg: &HfModelConfig,
    compute: ComputeDtype,
    (fused, dynamic, packed): (bool, bool, bool),
    (rows, micro, max_tokens): (usize, usize, usize),
    device: &<DefaultAutodiff as burn::tensor::backend::BackendTypes>::Device,
) -> Result<MegatronActor<DefaultAutodiff>, String> {
    let mut model = CausalLm::<DefaultAutodiff>::init(cfg, 0.02, 1, device)
        .with_compute_dtype(compute)
        .with_packed_sequences(packed);
    if fused {
        model = model.with_fused_log_probs(256);
    }
    let optim = ModelOptimizer::new(
        &OptimConfig {
            lr: 1e-6,
            ..Default::default()
        },
        10,
    )
    .map_err(|e| e.to_string())?;
    let settings = ActorSettings {
        mini_batch_rows: rows,
        micro_batch_rows: micro,
        log_prob_micro_batch_rows: micro,
        ..super::weight_sync::settings()
    };
    let budget = dynamic.then_some(max_tokens);
    Ok(
        MegatronActor::new(model, optim, settings).with_dynamic_batch(DynamicBatch {
            update_max_tokens: budget,
            forward_max_tokens: budget,
            reference_max_tokens: budget,
        }),
    )
}

/// The largest |a − b| over the response tokens (`mask` > 0.5).
fn max_deviation(a: &[f32], b: &[f32], mask: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .zip(mask)
        .filter(|(_, m)| **m > 0.5)
        .map(|((a, b), _)| (a - b).abs())
        .fold(0f32, f32::max)
}

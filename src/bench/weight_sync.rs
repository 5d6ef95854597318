//! `verl bench weight-sync`: the hybrid engine's actor → rollout weight sync on one device,
//! against the device's copy bound (peer: bench/peers/weight_sync.py).
//!
//! The actor holds f32 master weights, the rollout its own bf16 copy (as verl's rollout engine
//! does): a sync reads every f32 weight once and writes its bf16 value (6 bytes an element) and
//! the rollout's fused generation matrices. The bound is those 6 bytes an element at the
//! bandwidth of one large f32 → bf16 cast on the same device.

use std::time::Instant;

use burn::prelude::*;
use verl::backend::{DefaultAutodiff, DefaultBackend};
use verl::config::OptimConfig;
use verl::megatron::hf::HfModelConfig;
use verl::megatron::layers::precision::ComputeDtype;
use verl::megatron::models::CausalLm;
use verl::megatron::workers::{
    ActorSettings, HybridShardingManager, MegatronActor, ModelOptimizer,
};
use verl::rollout::{EngineConfig, KvBudget, NativeRollout};
use verl::traits::{ShardingManager, WeightSyncPlan};

use super::{median, preset};

pub(crate) fn settings() -> ActorSettings {
    ActorSettings {
        mini_batch_rows: 1,
        micro_batch_rows: 1,
        log_prob_micro_batch_rows: 1,
        ppo_epochs: 1,
        shuffle: false,
        seed: 0,
        policy_loss: "vanilla".into(),
        loss_params: Default::default(),
        loss_agg_mode: verl::core::algorithms::aggregation::LossAggMode::TokenMean,
        loss_scale_factor: None,
        entropy_coeff: 0.0,
        use_kl_loss: false,
        kl_loss_coef: 0.0,
        kl_loss_type: "low_var_kl".parse().expect("a known KL type"),
        temperature: 1.0,
        bypass: None,
    }
}

/// Seconds of one synced f32 → bf16 cast of `elements` values (the copy bound's probe).
fn cast_seconds(elements: usize, device: &burn::tensor::Device<DefaultBackend>) -> f64 {
    let x = Tensor::<DefaultBackend, 1>::ones([elements], device);
    let mut times = Vec::new();
    for _ in 0..4 {
        let _ = DefaultBackend::sync(device);
        let t = Instant::now();
        let y = x.clone().cast(burn::tensor::FloatDType::BF16);
        let _ = DefaultBackend::sync(device);
        times.push(t.elapsed().as_secs_f64());
        drop(y);
    }
    median(times[1..].to_vec())
}

/// Times `repeat` syncs (after one warm-up) per bucket size in MiB (0: shards as they are).
pub(crate) fn weight_sync(
    preset_name: &str,
    buckets_mib: &[usize],
    repeat: usize,
) -> Result<(), String> {
    let dims = preset(preset_name)?;
    let cfg = HfModelConfig::qwen2(dims);
    let device = Default::default();
    let model = CausalLm::<DefaultAutodiff>::init(&cfg, 0.02, 1, &device);
    let optim = ModelOptimizer::new(
        &OptimConfig {
            lr: 1e-5,
            ..Default::default()
        },
        1,
    )
    .map_err(|e| e.to_string())?;
    let actor = MegatronActor::new(model, optim, settings());
    let rollout_model = CausalLm::<DefaultBackend>::init(&cfg, 0.02, 2, &device)
        .with_compute_dtype(ComputeDtype::Bf16);
    let engine = EngineConfig {
        max_num_seqs: 1,
        prompt_length: 16,
        response_length: 16,
        kv_budget: KvBudget::Tokens(64),
        ..Default::default()
    };
    let mut rollout = NativeRollout::new(cfg.clone(), rollout_model, engine, Default::default())
        .map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let (mut elements, mut tensors) = (0usize, 0usize);
    println!("weight sync, {preset_name}: actor f32 → rollout bf16 on one device");
    for &mib in buckets_mib {
        let mut manager = HybridShardingManager {
            plan: WeightSyncPlan {
                bucket_bytes: mib.max(1) << 20,
                shards_fit: mib == 0,
            },
            ..Default::default()
        };
        let mut times = Vec::new();
        for i in 0..=repeat {
            let _ = DefaultBackend::sync(&device);
            let t = Instant::now();
            let report = runtime
                .block_on(manager.enter(&actor, &mut rollout))
                .map_err(|e| e.to_string())?;
            let _ = DefaultBackend::sync(&device);
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
            (elements, tensors) = (report.elements, report.tensors);
        }
        let s = median(times);
        let label = match mib {
            0 => "shards as they are".to_string(),
            m => format!("{m} MiB buckets"),
        };
        println!(
            "  {label:>20}: {:.4} s  ({} tensors' {:.3} GB f32 in, {:.0} GB/s of f32+bf16 traffic)",
            s,
            tensors,
            elements as f64 * 4.0 / 1e9,
            elements as f64 * 6.0 / s / 1e9
        );
    }
    let cast = cast_seconds(elements, &device);
    println!(
        "  copy bound: one {:.3} G-element f32 → bf16 cast takes {:.4} s ({:.0} GB/s)",
        elements as f64 / 1e9,
        cast,
        elements as f64 * 6.0 / cast / 1e9
    );
    Ok(())
}

//! An advantage estimator of your own, registered by name and selected from the config like
//! verl's: a group-median baseline (each response's score minus its prompt group's median
//! score), `algorithm.adv_estimator=grpo_median`.
//!
//! `cargo run --release --example custom_advantage`

use std::collections::HashMap;

use burn::prelude::*;
use burn::tensor::TensorData;
use verl::algorithms::advantage::{AdvantageInput, AdvantageOutput};
use verl::backend::DefaultBackend;
use verl::error::AlgorithmError;
use verl::trainer::{PpoTrainer, MAIN_JOB};

type B = DefaultBackend;

/// Score (the reward summed over the response) minus the group's median score, on every
/// response token; returns equal advantages, as GRPO's do.
fn grpo_median(x: &AdvantageInput<'_, B>) -> Result<AdvantageOutput<B>, AlgorithmError> {
    let index = x.index.ok_or_else(|| AlgorithmError::MissingInput {
        algorithm: "grpo_median".into(),
        input: "index (the prompt uid of each response)",
    })?;
    let mask = x.response_mask.clone();
    let scores: Vec<f32> = (x.token_level_rewards.clone() * mask.clone())
        .sum_dim(1)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| AlgorithmError::Invalid {
            algorithm: "grpo_median".into(),
            message: format!("{e:?}"),
        })?;
    let mut groups: HashMap<&str, Vec<f32>> = HashMap::new();
    for (uid, s) in index.iter().zip(&scores) {
        groups.entry(uid.as_str()).or_default().push(*s);
    }
    let median = |v: &[f32]| {
        let mut v = v.to_vec();
        v.sort_by(f32::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    };
    let adv: Vec<f32> = index
        .iter()
        .zip(&scores)
        .map(|(uid, s)| s - median(&groups[uid.as_str()]))
        .collect();
    let rows = adv.len();
    let adv = Tensor::<B, 2>::from_data(TensorData::new(adv, [rows, 1]), &mask.device()) * mask;
    Ok((adv.clone(), adv))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::temp_dir().join("verl-example-custom-advantage");
    let _ = std::fs::remove_dir_all(&out);
    let cfg = verl::ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .set("algorithm.adv_estimator", "grpo_median")
        .set("trainer.total_training_steps", 2)
        .set("trainer.sft_warmup_steps", 20)
        .set("trainer.val_before_train", false)
        .set("trainer.default_local_dir", out.display())
        .resolve()?;
    // Without the registration the config is refused, naming the key.
    let refused = PpoTrainer::builder(cfg.clone())
        .build()
        .err()
        .map(|e| e.to_string());
    assert!(refused.is_some_and(|e| e.contains("algorithm.adv_estimator")));
    let mut trainer = PpoTrainer::builder(cfg)
        .advantage("grpo_median", grpo_median)
        .build()?;
    let summary = trainer.fit().await?;
    println!(
        "grpo_median: {} steps, val score {:.3}",
        summary.steps,
        summary.val_score_after.unwrap_or_default()
    );
    Ok(())
}

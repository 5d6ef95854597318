//! A reward function of your own: partial credit for each correct digit of the built-in
//! addition task's answer, plus 1 for the exact answer, plugged in through
//! `PpoTrainer::builder(..).reward(..)` (any `Fn(&RewardInput) -> f64` is a `RewardFn`).
//!
//! `cargo run --release --example custom_reward`

use verl::trainer::{PpoTrainer, MAIN_JOB};
use verl::traits::RewardInput;

/// Digits in the right place, as a fraction of the answer's digits, plus 1 when exact.
fn digit_credit(x: &RewardInput) -> f64 {
    let (got, want) = (x.solution_str.trim(), x.ground_truth.trim());
    if got == want {
        return 2.0;
    }
    let right = got
        .chars()
        .zip(want.chars())
        .filter(|(a, b)| a == b)
        .count();
    right as f64 / want.len().max(1) as f64
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::temp_dir().join("verl-example-custom-reward");
    let _ = std::fs::remove_dir_all(&out);
    let cfg = verl::ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .set("trainer.total_training_steps", 2)
        .set("trainer.sft_warmup_steps", 20)
        .set("trainer.val_before_train", false)
        .set("trainer.default_local_dir", out.display())
        .resolve()?;
    let mut trainer = PpoTrainer::builder(cfg).reward(digit_credit).build()?;
    let summary = trainer.fit().await?;
    // Validation scores with the same reward: between 0 and 2.
    let after = summary
        .val_score_after
        .expect("validated after the last step (test_freq > 0)");
    assert!((0.0..=2.0).contains(&after), "{after}");
    println!(
        "custom reward: {} steps, val score {after:.3}",
        summary.steps
    );
    Ok(())
}

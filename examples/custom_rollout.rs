//! A rollout engine of your own, swapped in through the builder: it wraps each rank's native
//! engine (so the hybrid engine still streams the actor's weights into it) and keeps a
//! per-prompt cache of how many responses each prompt has been given, a curriculum's input.
//! Any `RolloutEngine` works; returning one that ignores the native engine replaces it.
//!
//! `cargo run --release --example custom_rollout`

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use verl::backend::DefaultBackend;
use verl::core::WeightStream;
use verl::trainer::{PpoTrainer, MAIN_JOB};
use verl::traits::{RolloutEngine, SleepLevel};
use verl::DataProto;

type B = DefaultBackend;

/// Responses given so far per prompt (its token ids).
type SampleCounts = Arc<Mutex<HashMap<Vec<i64>, usize>>>;

struct CountingRollout {
    inner: Box<dyn RolloutEngine<B>>,
    counts: SampleCounts,
}

#[async_trait::async_trait(?Send)]
impl RolloutEngine<B> for CountingRollout {
    async fn generate_sequences(&mut self, prompts: DataProto<B>) -> verl::Result<DataProto<B>> {
        let out = self.inner.generate_sequences(prompts).await?;
        // One output row per response, its prompt in verl's `prompts` column.
        let ids = out.to_data("prompts")?;
        let width = ids.shape[1];
        let ids: Vec<i64> = ids.convert::<i64>().iter::<i64>().collect();
        let mut counts = self.counts.lock().expect("counts");
        for row in ids.chunks(width.max(1)) {
            *counts.entry(row.to_vec()).or_default() += 1;
        }
        Ok(out)
    }

    async fn update_weights(&mut self, weights: WeightStream<'_, B>) -> verl::Result<()> {
        self.inner.update_weights(weights).await
    }

    async fn sleep(&mut self, level: SleepLevel) -> verl::Result<()> {
        self.inner.sleep(level).await
    }

    async fn wake_up(&mut self) -> verl::Result<()> {
        self.inner.wake_up().await
    }

    fn is_sleeping(&self) -> bool {
        self.inner.is_sleeping()
    }

    fn state(&self) -> serde_json::Value {
        self.inner.state()
    }

    fn load_state(&mut self, state: &serde_json::Value) -> verl::Result<()> {
        self.inner.load_state(state)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::temp_dir().join("verl-example-custom-rollout");
    let _ = std::fs::remove_dir_all(&out);
    let cfg = verl::ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .set("trainer.total_training_steps", 2)
        .set("trainer.sft_warmup_steps", 20)
        .set("trainer.val_before_train", false)
        .set("trainer.test_freq", 0)
        .set("trainer.default_local_dir", out.display())
        .resolve()?;
    let (prompts, n) = (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n);
    let counts = SampleCounts::default();
    let shared = counts.clone();
    let mut trainer = PpoTrainer::builder(cfg)
        .rollout(move |native| {
            Box::new(CountingRollout {
                inner: native,
                counts: shared.clone(),
            })
        })
        .build()?;
    trainer.fit().await?;
    let counts = counts.lock().expect("counts");
    let total: usize = counts.values().sum();
    // Two steps of `prompts` prompts, each sampled n times, plus the final validation.
    assert!(total >= 2 * prompts * n, "{total} responses");
    println!(
        "custom rollout: {} distinct prompts, {total} responses",
        counts.len()
    );
    Ok(())
}

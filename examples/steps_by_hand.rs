//! Driving the loop yourself: the trainer's phases called one by one, with a phase of your
//! own between them (here: a curriculum that skips the actor update when a batch has no
//! learning signal, every response scoring alike), metrics logged as `fit()` logs them.
//!
//! `cargo run --release --example steps_by_hand`

use verl::trainer::{PpoTrainer, MAIN_JOB};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::temp_dir().join("verl-example-steps-by-hand");
    let _ = std::fs::remove_dir_all(&out);
    let cfg = verl::ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .set("trainer.sft_warmup_steps", 20)
        .set("trainer.total_training_steps", 3)
        .set("trainer.default_local_dir", out.display())
        .resolve()?;
    let batch_size = cfg.data.train_batch_size;
    let mut trainer = PpoTrainer::builder(cfg).build()?;
    trainer.warm_up().await?;
    let rows = trainer.train_rows().to_vec();
    let mut skipped = 0;
    for step in 1..=3u64 {
        let start = (step as usize - 1) * batch_size;
        let batch: Vec<_> = rows[start..start + batch_size].iter().collect();
        let mut b = trainer.generate(step, &batch).await?;
        trainer.score(&mut b).await?;
        trainer.compute_ref_log_prob(&mut b).await?;
        trainer.compute_values(&mut b).await?;
        trainer.compute_advantages(&mut b)?;
        // Our own phase: no signal when every response of the batch scored the same.
        let first = b.scores[0];
        let signal = b.scores.iter().any(|s| (s - first).abs() > 1e-9);
        b.metrics
            .push("curriculum/has_signal", f64::from(u8::from(signal)));
        trainer.update_critic(&mut b).await?;
        if signal {
            trainer.update_actor(&mut b).await?;
        } else {
            skipped += 1;
        }
        let metrics = trainer.finish_step(b)?;
        trainer.record(step, &metrics)?;
    }
    let score = trainer.validate().await?;
    let saved = trainer.save(3).await?;
    // What the loop did: a score a reward of 0 or 1 can average to, a checkpoint on disk, and
    // each step's line in the metrics with our phase's value.
    assert!((0.0..=1.0).contains(&score), "{score}");
    assert!(saved.join("trainer.json").exists(), "{}", saved.display());
    assert!(skipped <= 3);
    let lines = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let ours = lines
        .lines()
        .filter(|l| l.contains("\"curriculum/has_signal\""))
        .count();
    assert_eq!(ours, 3, "{lines}");
    println!(
        "3 steps by hand ({skipped} actor updates skipped), val score {score:.3}, saved {}",
        saved.display()
    );
    Ok(())
}

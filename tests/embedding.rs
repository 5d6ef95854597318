//! The embedding API: `PpoTrainer::builder` with parts of the program's own, and what
//! `build()` refuses before any model exists.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use verl::config::VerlConfig;
use verl::trainer::data::PromptRow;
use verl::trainer::{PpoTrainer, MAIN_JOB};
use verl::traits::RewardInput;
use verl::ConfigBuilder;

fn config(dir: &std::path::Path, extra: &[&str]) -> VerlConfig {
    ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides([
            "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=2",
        ])
        .overrides(extra.iter().copied())
        .set("trainer.default_local_dir", dir.display())
        .resolve()
        .unwrap()
}

fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// The builder's reward scores every response (the logged score is its constant), and its
/// estimator, registered by name, is the one the config selects.
#[test]
fn the_builders_reward_and_estimator_are_the_ones_used() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &["algorithm.adv_estimator=zero"]);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let mut trainer = PpoTrainer::builder(cfg)
        .reward(|_: &RewardInput| 0.25)
        .advantage("zero", move |x| {
            seen.fetch_add(1, Ordering::SeqCst);
            let zeros = x.response_mask.clone().zeros_like();
            Ok((zeros.clone(), zeros))
        })
        .build()
        .unwrap();
    let summary = block_on(trainer.fit()).unwrap();
    let lines = common::step_lines(&summary.metrics_path);
    // The step lines (the first line is the validation before training).
    let steps: Vec<_> = lines
        .iter()
        .filter(|l| l.contains_key("critic/score/mean"))
        .collect();
    assert_eq!(steps.len(), 2);
    for line in steps {
        assert_eq!(line["critic/score/mean"], 0.25, "{line:?}");
        assert_eq!(line["critic/advantages/mean"], 0.0, "{line:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one estimate per step");
}

/// Rows given as text are tokenised by the run's tokenizer and trained on.
#[test]
fn text_rows_train() {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<PromptRow> = (0..64)
        .map(|i| {
            PromptRow::new(
                format!("{i}+1="),
                "verl_rs/arithmetic",
                &(i + 1).to_string(),
            )
        })
        .collect();
    let mut trainer = PpoTrainer::builder(config(dir.path(), &[]))
        .data(rows)
        .build()
        .unwrap();
    assert!(trainer
        .train_rows()
        .iter()
        .all(|r| !r.prompt_ids.is_empty()));
    let summary = block_on(trainer.fit()).unwrap();
    assert_eq!(summary.steps, 2);
}

/// What `build()` refuses, naming the part or the key: an estimator name nobody registered,
/// a rollout engine with rank processes, no rows.
#[test]
fn build_refuses_missing_or_incompatible_parts() {
    let dir = tempfile::tempdir().unwrap();
    let err = PpoTrainer::builder(config(dir.path(), &["algorithm.adv_estimator=mine"]))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("algorithm.adv_estimator"), "{err}");
    let err = PpoTrainer::builder(config(dir.path(), &["trainer.launcher=processes"]))
        .rollout(|native| native)
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("trainer.launcher=threads"), "{err}");
    let err = PpoTrainer::builder(config(dir.path(), &[]))
        .data(Vec::new())
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no rows"), "{err}");
}

/// Typed settings through the builder change the run: offload switches put the actor's state
/// in host memory between phases (its size is logged).
#[test]
fn the_builders_offload_switches_are_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let switches = verl::traits::OffloadSwitches {
        param: true,
        grad: true,
        optimizer: true,
    };
    let mut trainer = PpoTrainer::builder(config(dir.path(), &[]))
        .offload(switches)
        .build()
        .unwrap();
    let summary = block_on(trainer.fit()).unwrap();
    let lines = common::step_lines(&summary.metrics_path);
    let host = lines
        .iter()
        .filter_map(|l| l.get("perf/offload_host_gb/actor_rollout_ref"))
        .copied()
        .fold(0.0, f64::max);
    assert!(host > 0.0, "offloaded state is logged: {lines:?}");
}

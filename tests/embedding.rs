//! The embedding API: `PpoTrainer::builder` with parts of the program's own, and what
//! `build()` refuses before any model exists.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use verl::config::VerlConfig;
use verl::trainer::data::PromptRow;
use verl::trainer::PpoTrainer;
use verl::traits::RewardInput;

fn config(dir: &std::path::Path, extra: &[&str]) -> VerlConfig {
    common::tiny_config(dir, extra)
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

/// Every float in the safetensors files under `dir` is finite (F32 and BF16 tensors).
fn saved_weights_are_finite(dir: &std::path::Path) -> usize {
    let mut checked = 0;
    for file in common::files_under(dir) {
        if file.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let values: Vec<f32> = match view.dtype() {
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                safetensors::Dtype::BF16 => view
                    .data()
                    .chunks_exact(2)
                    .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                    .collect(),
                _ => continue,
            };
            assert!(
                values.iter().all(|v| v.is_finite()),
                "{}: `{name}` holds a non-finite value",
                file.display()
            );
            checked += 1;
        }
    }
    checked
}

/// A NaN loss (one micro-batch of one step) skips that optimizer step, counted as
/// `actor/skipped_steps`, and leaves every weight as it was; training goes on and every saved
/// weight stays finite.
#[test]
fn a_nan_loss_skips_the_step_and_no_non_finite_weight_is_saved() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        &[
            "trainer.total_training_steps=3",
            "trainer.save_freq=1",
            "actor_rollout_ref.actor.policy_loss.loss_mode=nan_once",
            // One micro-batch (and one mini-batch) per update: one loss call per step.
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
        ],
    );
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let mut trainer = PpoTrainer::builder(cfg)
        .policy_loss("nan_once", move |x| {
            let mut out = verl::core::algorithms::policy_loss::vanilla(x)?;
            // The second step's update.
            if seen.fetch_add(1, Ordering::SeqCst) == 1 {
                out.loss = out.loss * f32::NAN;
            }
            Ok(out)
        })
        .build()
        .unwrap();
    let summary = block_on(trainer.fit()).unwrap();
    let lines = common::step_lines(&summary.metrics_path);
    let skipped: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.get("actor/skipped_steps").copied())
        .collect();
    assert_eq!(skipped, vec![0.0, 1.0, 0.0], "{lines:?}");
    // The step after the skipped one updates again, with a finite gradient norm.
    assert!(lines.last().unwrap()["actor/grad_norm"].is_finite());
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    for step in 1..=3 {
        let n = saved_weights_are_finite(&dir.path().join(format!("global_step_{step}/actor")));
        assert!(n > 0, "step {step}: no tensor checked");
    }
    // The skipped step left every weight as it was; the next one moved them.
    let weights = |step: u32| {
        let file = dir.path().join(format!(
            "global_step_{step}/actor/dist_ckpt/rank_00000/model.safetensors"
        ));
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut all: Vec<(String, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.data().to_vec()))
            .collect();
        all.sort();
        all
    };
    let (one, two, three) = (weights(1), weights(2), weights(3));
    assert!(!one.is_empty());
    assert!(one == two, "the skipped step changed a weight");
    assert!(
        two != three,
        "the step after the skipped one changed nothing"
    );
}

/// One tensor-parallel rank failing inside the update (its policy loss errs) aborts its peers'
/// collectives at once: the run ends with that rank's own error, not a peer's timeout after
/// `VERL_COMM_TIMEOUT_S` (600 s by default).
#[test]
fn a_rank_failing_mid_update_ends_the_run_with_its_own_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        &[
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.policy_loss.loss_mode=fails_once",
        ],
    );
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let mut trainer = PpoTrainer::builder(cfg)
        .policy_loss("fails_once", move |x| {
            // The first rank to get here fails; its peer goes on into the backward's
            // collectives and would wait there for the failed rank.
            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(verl::core::error::AlgorithmError::Invalid {
                    algorithm: "fails_once".into(),
                    message: "injected failure".into(),
                });
            }
            verl::core::algorithms::policy_loss::vanilla(x)
        })
        .build()
        .unwrap();
    let started = std::time::Instant::now();
    let err = block_on(trainer.fit()).unwrap_err().to_string();
    assert!(err.contains("injected failure"), "{err}");
    assert!(err.contains("update_actor"), "names the method: {err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(120),
        "the peer waited out its timeout: {err}"
    );
}

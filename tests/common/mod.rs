//! Helpers shared by the end-to-end tests: a run's metric lines, and the check that two runs
//! logged the same metrics.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

pub(crate) mod verl_rows;

use std::collections::BTreeMap;
use std::path::Path;

use verl::config::ValidatedConfig;
use verl::trainer::{PpoTrainer, RunSummary};

/// The built-in task on a tiny model (2 layers, hidden 64), no validation runs: what the
/// end-to-end tests start from.
pub(crate) const TINY_JOB: &[&str] = &[
    "data.train_files=builtin:addition:1",
    "trainer.test_freq=-1",
    "+actor_rollout_ref.model.override_config.hidden_size=64",
    "+actor_rollout_ref.model.override_config.intermediate_size=192",
    "+actor_rollout_ref.model.override_config.num_hidden_layers=2",
];

/// The tiny built-in job for two steps after two warm-up steps, writing under `dir`, with
/// `extra` overrides on top: what the builder and bad-input tests start from.
pub(crate) fn tiny_config(dir: &Path, extra: &[&str]) -> verl::config::VerlConfig {
    verl::ConfigBuilder::new()
        .overrides(verl::trainer::MAIN_JOB)
        .overrides(TINY_JOB.iter().copied())
        .overrides([
            "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=2",
        ])
        .overrides(extra.iter().copied())
        .set("trainer.default_local_dir", dir.display())
        .resolve()
        .unwrap()
}

/// Every file under `dir` (none when it does not exist), in no particular order.
pub(crate) fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Runs the trainer's whole job in this thread, as `verl train` does.
pub(crate) fn fit(validated: ValidatedConfig) -> RunSummary {
    fit_trainer(&mut PpoTrainer::new(validated).unwrap())
}

/// Runs a built trainer to its end on a current-thread runtime.
pub(crate) fn fit_trainer(trainer: &mut PpoTrainer) -> RunSummary {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(trainer.fit()).unwrap()
}

/// The step lines of a `metrics.jsonl` (numeric values only).
pub(crate) fn step_lines(path: &Path) -> Vec<BTreeMap<String, f64>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object()
                .unwrap()
                .iter()
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect()
        })
        .filter(|m: &BTreeMap<String, f64>| m.contains_key("step"))
        .collect()
}

/// Every metric but timings, throughput and rollout statistics agrees within 1e-3 relative
/// (f32 rounding over a few steps of another layout); more than 40 are compared.
pub(crate) fn assert_same_metrics(
    one: &[BTreeMap<String, f64>],
    other: &[BTreeMap<String, f64>],
    what: &str,
) {
    assert_eq!(one.len(), other.len(), "{what}: step lines");
    let mut compared = 0;
    for (a, b) in one.iter().zip(other) {
        for (key, x) in a {
            // Timings differ by nature; of the rollout's figures only its counts, summed over
            // rollout groups, are the single rank's.
            if key.starts_with("timing_s/")
                || key.starts_with("timing_per_token_ms/")
                || key.starts_with("perf/")
                || (key.starts_with("rollout/")
                    && !verl_core::metrics::SUMMED.contains(&key.as_str()))
            {
                continue;
            }
            let y = b[key];
            assert!(
                (x - y).abs() <= 1e-3 * x.abs().max(1e-2),
                "step {}: {key} one rank {x} vs {what} {y}",
                a["step"]
            );
            compared += 1;
        }
    }
    assert!(compared > 40, "{what}: {compared} metrics compared");
}

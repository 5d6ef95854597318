//! Helpers shared by the end-to-end tests: a run's metric lines, and the check that two runs
//! logged the same metrics.

// Each test binary includes this module and uses a part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use verl::config::ValidatedConfig;
use verl::trainer::{PpoTrainer, RunSummary};

/// Runs the trainer's whole job in this thread, as `verl train` does.
pub fn fit(validated: ValidatedConfig) -> RunSummary {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async { PpoTrainer::new(validated).unwrap().fit().await })
        .unwrap()
}

/// The step lines of a `metrics.jsonl` (numeric values only).
pub fn step_lines(path: &Path) -> Vec<BTreeMap<String, f64>> {
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
pub fn assert_same_metrics(
    one: &[BTreeMap<String, f64>],
    other: &[BTreeMap<String, f64>],
    what: &str,
) {
    assert_eq!(one.len(), other.len(), "{what}: step lines");
    let mut compared = 0;
    for (a, b) in one.iter().zip(other) {
        for (key, x) in a {
            if key.starts_with("timing_s/")
                || key.starts_with("perf/")
                || key.starts_with("rollout/")
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

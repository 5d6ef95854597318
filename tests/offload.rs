//! Offload is exact: a PPO job (actor, reference, critic) with every offload switch on logs the
//! same metrics, bit for bit, and saves the same weights and optimizer state, byte for byte, as
//! the job with them off. On the CPU default the moves are real: each phase's state is read
//! into host buffers, the tensors are dropped, and new tensors are built from the buffers.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod common;

use verl::trainer::MAIN_JOB;
use verl::ConfigBuilder;

fn run(extra: &[&str]) -> (Vec<BTreeMap<String, f64>>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let validated = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides([
            "trainer.val_before_train=false",
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            "critic.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "trainer.sft_warmup_steps=4",
            "trainer.total_training_steps=3",
            "trainer.save_freq=3",
        ])
        .overrides(extra.iter().copied())
        .set("trainer.default_local_dir", dir.path().display())
        .build()
        .unwrap();
    let summary = common::fit(validated);
    (common::step_lines(&summary.metrics_path), dir)
}

/// Every file under `dir`, by path relative to it.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    common::files_under(dir)
        .into_iter()
        .map(|p| {
            (
                p.strip_prefix(dir).unwrap().to_path_buf(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

#[test]
fn every_offload_switch_on_changes_no_bit() {
    let (off, off_dir) = run(&[]);
    let (on, on_dir) = run(&[
        "actor_rollout_ref.actor.megatron.param_offload=true",
        "actor_rollout_ref.actor.megatron.grad_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true",
        "actor_rollout_ref.ref.megatron.param_offload=true",
        "critic.megatron.param_offload=true",
        "critic.megatron.grad_offload=true",
        "critic.megatron.optimizer_offload=true",
    ]);
    assert_eq!(off.len(), on.len());
    let mut compared = 0;
    let mut differ = Vec::new();
    for (a, b) in off.iter().zip(&on) {
        for (key, x) in a {
            if key.starts_with("timing_s/")
                || key.starts_with("timing_per_token_ms/")
                || key.starts_with("perf/")
                || key.contains("seconds")
                || key.contains("per_s")
            {
                continue;
            }
            if x.to_bits() != b[key].to_bits() {
                differ.push(format!("step {}: {key} {x} vs {}", a["step"], b[key]));
            }
            compared += 1;
        }
    }
    assert!(differ.is_empty(), "{differ:#?}");
    assert!(compared > 60, "{compared} metrics compared");
    // The moves happened, and cost what was measured.
    for key in [
        "perf/offload_gb/update_actor",
        "perf/offload_gb/update_critic",
        "perf/offload_gb/ref",
        "perf/offload_gb/values",
        "perf/offload_gb/generate",
        "perf/offload_gb/old_log_prob",
        "timing_s/offload/update_actor",
    ] {
        assert!(
            on.iter().all(|l| l.get(key).is_some_and(|v| *v > 0.0)),
            "{key}"
        );
        assert!(
            off.iter().all(|l| !l.contains_key(key)),
            "{key} without offload"
        );
    }
    // The actor's parameters and moments stay in host memory between steps.
    let host = on[0]["perf/offload_host_gb/actor_rollout_ref"];
    assert!(host > 0.0, "{host}");
    // Weights, optimizer moments and counters saved at the last step are the same files.
    let step = |d: &tempfile::TempDir| files(&d.path().join("global_step_3"));
    let (a, b) = (step(&off_dir), step(&on_dir));
    assert!(a.len() >= 4, "{:?}", a.keys().collect::<Vec<_>>());
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (path, bytes) in &a {
        assert!(bytes == &b[path], "{} differs", path.display());
    }
}

/// The CPU default reports its memory: `perf/max_memory_allocated_gb` per phase, from the
/// counting allocator the `verl` binary installs (this test binary has none, so it installs
/// one too).
#[global_allocator]
static ALLOCATOR: verl::memory::CountingAllocator = verl::memory::CountingAllocator;

#[test]
fn memory_is_reported_per_phase() {
    let (lines, _dir) = run(&["trainer.total_training_steps=1", "trainer.save_freq=-1"]);
    let l = &lines[0];
    for phase in [
        "generate",
        "old_log_prob",
        "ref",
        "values",
        "update_critic",
        "update_actor",
    ] {
        let key = format!("perf/max_memory_allocated_gb/{phase}");
        let v = l.get(&key).copied().unwrap_or(0.0);
        assert!(v > 0.0 && v < 24.0, "{key} = {v}");
        let reserved = l[&format!("perf/max_memory_reserved_gb/{phase}")];
        assert!(
            reserved >= v,
            "{phase}: reserved {reserved} < allocated {v}"
        );
    }
    // verl's key is the largest phase's.
    let top = l["perf/max_memory_allocated_gb"];
    assert!(top >= l["perf/max_memory_allocated_gb/update_actor"]);
}

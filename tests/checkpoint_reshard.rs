//! A dist checkpoint saved on one layout resumes on another, as Megatron's distributed
//! checkpoints reshard on load: saved at tp=2 × pp=2, resumed at tp=1, tp=4 and pp=1, the next
//! steps' metrics (actor, critic, reference KL) match the run that never stopped within f32
//! summation tolerance; saved with the distributed optimizer over dp=2, resumed on a layout
//! without it; a Qwen2-MoE model saved with its experts spread over ep=2 (and cp=2), resumed on
//! one rank and on tp=2 × ep=2 with etp=1.

use std::path::Path;

mod common;

use verl::trainer::MAIN_JOB;
use verl::ConfigBuilder;

/// PPO with a critic and a KL loss against the reference (every role's checkpoint in play),
/// on the tiny model with 4 key/value heads so that tp=4 divides it.
fn fit(dir: &Path, total_steps: u64, layout: &[&str]) {
    let validated = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides([
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            "critic.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "trainer.sft_warmup_steps=4",
            "trainer.val_before_train=false",
            "trainer.save_freq=2",
            // The saved run is 2 steps long and the straight one 4: a decaying rate would
            // differ between them by design (the schedule follows the run's length).
            "actor_rollout_ref.actor.optim.lr_decay_style=constant",
            "+actor_rollout_ref.model.override_config.num_key_value_heads=4",
        ])
        .overrides(layout.iter().copied())
        .set("trainer.total_training_steps", total_steps)
        .set("trainer.default_local_dir", dir.display())
        .build()
        .unwrap();
    common::fit(validated);
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn copy_dir(from: &Path, to: &Path) {
    for file in common::files_under(from) {
        let dest = to.join(file.strip_prefix(from).unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(&file, &dest).unwrap();
    }
}

fn layout(tp: usize, pp: usize, gpus: usize) -> Vec<String> {
    vec![
        format!("trainer.n_gpus_per_node={gpus}"),
        format!("actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}"),
        format!("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"),
        format!("critic.megatron.tensor_model_parallel_size={tp}"),
        format!("critic.megatron.pipeline_model_parallel_size={pp}"),
    ]
}

/// Saves at step 2 on `saved_on`, then resumes a copy to step 4 on each of `resume_on`; every
/// step line matches the run on `saved_on` that went to step 4 without stopping.
fn resumes_on_other_layouts(saved_on: &[String], resume_on: &[(&str, Vec<String>)]) {
    // Threads of several layouts training at once can deadlock in burn's autodiff clean-up
    // (see tests/train_e2e.rs): one at a time.
    static ONE_LAYOUT_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = ONE_LAYOUT_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let straight = tempfile::tempdir().unwrap();
    fit(straight.path(), 4, &as_strs(saved_on));
    let saved = tempfile::tempdir().unwrap();
    fit(saved.path(), 2, &as_strs(saved_on));
    let want = common::step_lines(&straight.path().join("metrics.jsonl"));
    assert_eq!(want.len(), 4, "steps 1..=4");
    for (what, other) in resume_on {
        let resumed = tempfile::tempdir().unwrap();
        copy_dir(saved.path(), resumed.path());
        fit(resumed.path(), 4, &as_strs(other));
        let got = common::step_lines(&resumed.path().join("metrics.jsonl"));
        // The copy's lines for steps 1 and 2 and the resumed steps 3 and 4 (a fresh start
        // would have logged four more); step 4 follows an update that read the moments.
        common::assert_same_metrics(&want, &got, what);
        assert!(
            resumed
                .path()
                .join("global_step_4/actor/dist_ckpt")
                .is_dir(),
            "{what}: saved again on its own layout"
        );
    }
    // Control: the same resume without the optimizer moments drifts by step 4, so the
    // comparison above is sensitive to the moments being put back in the right places.
    let (what, other) = &resume_on[0];
    let partial = tempfile::tempdir().unwrap();
    copy_dir(saved.path(), partial.path());
    let mut without_moments = other.clone();
    without_moments.push("actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]".into());
    fit(partial.path(), 4, &as_strs(&without_moments));
    let got = common::step_lines(&partial.path().join("metrics.jsonl"));
    let moved: Vec<&String> = want[3]
        .iter()
        .filter(|(k, a)| {
            ![
                "timing_s/",
                "timing_per_token_ms/",
                "perf/",
                "rollout/",
                "val/",
                "val-core/",
            ]
            .iter()
            .any(|p| k.starts_with(p))
                && {
                    let b = got[3][*k];
                    (*a - b).abs() > 1e-3 * a.abs().max(1e-2)
                }
        })
        .map(|(k, _)| k)
        .collect();
    assert!(
        moved.len() >= 5,
        "{what} without moments: only {moved:?} moved"
    );
}

#[test]
fn a_checkpoint_saved_at_tp2_pp2_resumes_at_tp1_tp4_and_pp1() {
    resumes_on_other_layouts(
        &layout(2, 2, 4),
        &[
            ("tp=1", layout(1, 1, 1)),
            ("tp=4", layout(4, 1, 4)),
            ("tp=2 pp=1", layout(2, 1, 2)),
        ],
    );
}

/// dp=2 with the distributed optimizer (each rank saved half the moments) resumed at tp=2 ×
/// dp=1, and at dp=2 with the optimizer not distributed.
#[test]
fn a_distributed_optimizer_checkpoint_resumes_without_it() {
    let mut plain_dp2 = layout(1, 1, 2);
    plain_dp2.push("actor_rollout_ref.actor.megatron.use_distributed_optimizer=false".into());
    plain_dp2.push("critic.megatron.use_distributed_optimizer=false".into());
    resumes_on_other_layouts(
        &layout(1, 1, 2),
        &[("tp=2", layout(2, 1, 2)), ("dp=2 plain", plain_dp2)],
    );
}

/// A Qwen2-MoE model (4 routed experts) with `extra` layout settings on `gpus` ranks.
fn moe(gpus: usize, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        format!("trainer.n_gpus_per_node={gpus}"),
        "+actor_rollout_ref.model.override_config.num_experts=4".to_string(),
        "+actor_rollout_ref.model.override_config.moe_intermediate_size=64".to_string(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// Saved with the experts spread over ep = 2 and each sequence over cp = 2 (every rank its own
/// experts' weights and moments, the dense moments sharded by the distributed optimizer over
/// dp × cp), resumed on one rank, at tp = 2 × ep = 2 with etp = 1, and on the same layout.
#[test]
fn an_expert_parallel_checkpoint_resumes_on_other_layouts() {
    let saved_on = moe(
        4,
        &[
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "critic.megatron.expert_model_parallel_size=2",
        ],
    );
    resumes_on_other_layouts(
        &saved_on,
        &[
            ("one rank", moe(1, &[])),
            (
                "tp=2 ep=2 etp=1",
                moe(
                    2,
                    &[
                        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
                        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                    ],
                ),
            ),
            ("same layout", saved_on.clone()),
        ],
    );
}

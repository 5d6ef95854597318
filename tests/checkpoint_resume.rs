//! Exact resume: a run stopped at a checkpoint and resumed gives the same metrics and the same
//! final weights as the run that never stopped — actor, critic, reference, optimizer moments,
//! schedules, data order, sampling seeds and the adaptive KL coefficient all restored.

use std::collections::BTreeMap;
use std::path::Path;

mod common;

use verl::trainer::{PpoTrainer, MAIN_JOB};
use verl::ConfigBuilder;

/// PPO with a critic, a KL loss against the reference and an adaptive in-reward KL: every
/// piece of state a checkpoint must carry is in play.
fn fit(dir: &Path, total_steps: u64, extra: &[&str]) -> verl::trainer::RunSummary {
    let validated = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides([
            "data.train_files=builtin:addition:1",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.shuffle=true",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
            "actor_rollout_ref.actor.optim.lr_decay_steps=20",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.target_kl=0.001",
            "critic.enable=true",
            "critic.optim.lr=0.001",
            "critic.ppo_micro_batch_size_per_gpu=8",
            "critic.shuffle=true",
            "trainer.sft_warmup_steps=5",
            "trainer.test_freq=-1",
            "trainer.save_freq=2",
            "+actor_rollout_ref.model.override_config.hidden_size=32",
            "+actor_rollout_ref.model.override_config.intermediate_size=64",
            "+actor_rollout_ref.model.override_config.num_hidden_layers=1",
        ])
        .overrides(extra.iter().copied())
        .set("trainer.total_training_steps", total_steps)
        .set("trainer.default_local_dir", dir.display())
        .build()
        .unwrap();
    common::fit(validated)
}

/// The per-step metrics, without wall-clock figures and validation (which runs at a run's
/// last step, so differs between a 2-step and a 4-step run by design).
fn step_metrics(dir: &Path) -> BTreeMap<u64, BTreeMap<String, f64>> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let step = v.get("step")?.as_u64()?;
            let m = v
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| {
                    !(k.starts_with("timing_s/")
                        || k.starts_with("perf/throughput")
                        || k.starts_with("val/")
                        || k.as_str() == "rollout/seconds"
                        || k.as_str() == "perf/weight_sync_s"
                        || k.as_str() == "rollout/decode_tokens_per_s")
                })
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect();
            Some((step, m))
        })
        .collect()
}

#[test]
fn a_resumed_run_continues_exactly() {
    let straight = tempfile::tempdir().unwrap();
    let resumed = tempfile::tempdir().unwrap();
    fit(straight.path(), 4, &[]);
    // Stop after step 2 (its checkpoint), then a new trainer resumes (trainer.resume_mode=auto).
    fit(resumed.path(), 2, &[]);
    assert_eq!(
        std::fs::read_to_string(resumed.path().join("latest_checkpointed_iteration.txt")).unwrap(),
        "2"
    );
    fit(resumed.path(), 4, &["trainer.max_actor_ckpt_to_keep=1"]);

    let a = step_metrics(straight.path());
    let b = step_metrics(resumed.path());
    assert_eq!(a.keys().collect::<Vec<_>>(), vec![&0, &1, &2, &3, &4]);
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (step, ma) in &a {
        let mb = &b[step];
        assert_eq!(
            ma.keys().collect::<Vec<_>>(),
            mb.keys().collect::<Vec<_>>(),
            "step {step}"
        );
        for (k, x) in ma {
            assert_eq!(*x, mb[k], "step {step}: {k}");
        }
    }
    // The KL coefficient moved (adaptive), so its restore mattered.
    assert_ne!(
        a[&1]["actor/reward_kl_penalty_coeff"],
        a[&4]["actor/reward_kl_penalty_coeff"]
    );

    // The final weights, in HF layout, are bit for bit the same.
    let hf = |d: &Path| {
        std::fs::read(d.join("global_step_4/actor/huggingface/model.safetensors")).unwrap()
    };
    assert_eq!(hf(straight.path()), hf(resumed.path()));
    // ... and load as a Hugging Face model with no conversion.
    let hf_dir = straight.path().join("global_step_4/actor/huggingface");
    let cfg = verl::megatron::hf::HfModelConfig::from_dir(&hf_dir).unwrap();
    let ckpt = verl::megatron::hf::HfCheckpoint::open(&hf_dir).unwrap();
    verl::megatron::models::CausalLm::<verl::backend::CpuBackend>::from_checkpoint(
        &cfg,
        &ckpt,
        &Default::default(),
    )
    .unwrap();
    // max_actor_ckpt_to_keep=1 removed step 2 once step 4 was saved.
    assert!(!resumed.path().join("global_step_2").exists());
    assert!(resumed
        .path()
        .join("global_step_4/critic/dist_ckpt")
        .is_dir());
    assert!(resumed.path().join("global_step_4/actor/ref").is_dir());
    // Each rank records where its tensors sit in the full ones and its layout (what loading
    // on another layout reads).
    let extra: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            resumed
                .path()
                .join("global_step_4/actor/dist_ckpt/rank_00000/extra.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(extra["layout"]["tp_size"], 1);
    let embed = &extra["shards"]["model.embed_tokens.weight"];
    assert_eq!(
        embed["dim"],
        serde_json::Value::Null,
        "tp=1 holds whole tensors"
    );
    assert_eq!(embed["global_shape"].as_array().unwrap().len(), 2);

    // Control: resuming the weights without the optimizer moments does not continue exactly,
    // so the comparison above is sensitive to what the checkpoint carries.
    let partial = tempfile::tempdir().unwrap();
    fit(partial.path(), 2, &[]);
    fit(
        partial.path(),
        4,
        &["actor_rollout_ref.actor.checkpoint.load_contents=[model,extra]"],
    );
    let c = step_metrics(partial.path());
    assert_eq!(a[&2], c[&2]);
    assert_ne!(a[&4]["actor/pg_loss"], c[&4]["actor/pg_loss"]);
}

#[test]
fn bad_checkpoint_settings_are_refused_before_building() {
    let dir = tempfile::tempdir().unwrap();
    let build = |extra: &[&str]| {
        let v = ConfigBuilder::new()
            .overrides(MAIN_JOB)
            .overrides(extra.iter().copied())
            .set("trainer.default_local_dir", dir.path().display())
            .build()
            .unwrap();
        PpoTrainer::new(v)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let e = build(&["actor_rollout_ref.actor.checkpoint.save_contents=[model,weights]"]);
    assert!(e.contains("save_contents") && e.contains("weights"), "{e}");
    let e = build(&["trainer.resume_mode=resume_path"]);
    assert!(e.contains("trainer.resume_from_path"), "{e}");
    let e = build(&[
        "trainer.resume_mode=resume_path",
        "trainer.resume_from_path=/nonexistent/global_step_3",
    ]);
    assert!(e.contains("global_step_<N>"), "{e}");
    let e = build(&["trainer.resume_mode=sometimes"]);
    assert!(e.contains("auto, disable or resume_path"), "{e}");
}

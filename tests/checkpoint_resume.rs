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

/// The per-step metrics, without wall-clock figures and validation (which, where a run sets
/// `test_freq`, runs at its last step, so differs between a 2-step and a 4-step run by design).
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
                        || k.starts_with("timing_per_token_ms/")
                        || k.starts_with("perf/throughput")
                        || k.starts_with("perf/time_per_step")
                        || k.starts_with("val/")
                        || k.starts_with("val-core/")
                        || k.as_str() == "rollout/seconds"
                        || k.as_str() == "rollout/prefill_seconds"
                        || k.as_str() == "rollout/decode_enqueue_seconds"
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
    // max_actor_ckpt_to_keep=1 prunes only what this run saved (as verl's checkpoint manager):
    // the step 2 it resumed from was the earlier run's, so it stays.
    assert!(resumed.path().join("global_step_2/trainer.json").exists());
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

/// With bf16 products the frozen reference keeps bf16 matrices (half its memory): it is
/// saved and restored as it is, and a resumed run still continues exactly.
#[test]
fn a_bf16_run_with_its_bf16_reference_resumes_exactly() {
    let bf16 = ["actor_rollout_ref.actor.megatron.dtype=bfloat16"];
    let straight = tempfile::tempdir().unwrap();
    let resumed = tempfile::tempdir().unwrap();
    fit(straight.path(), 3, &bf16);
    fit(resumed.path(), 2, &bf16);
    fit(resumed.path(), 3, &bf16);
    let (a, b) = (step_metrics(straight.path()), step_metrics(resumed.path()));
    assert_eq!(a.keys().collect::<Vec<_>>(), vec![&0, &1, &2, &3]);
    assert_eq!(a, b);
    // The KL term saw a reference that differs from the policy after the first update.
    assert!(a[&3]["actor/kl_loss"] != 0.0, "{:?}", a[&3]);
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
    // An unknown resume mode is refused by the config reader already, naming the key.
    let e = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .set("trainer.resume_mode", "sometimes")
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("trainer.resume_mode") && e.contains("`auto`, `disable`, `resume_path`"),
        "{e}"
    );
}

/// A run of 3 steps saving every step, then its directory damaged by `damage`, then resumed to
/// 4 steps: the step it resumed after (`None`: started over).
fn resume_after_damage(damage: impl FnOnce(&Path)) -> (tempfile::TempDir, Option<u64>, u64) {
    let dir = tempfile::tempdir().unwrap();
    fit(dir.path(), 3, &["trainer.save_freq=1"]);
    damage(dir.path());
    let summary = fit(dir.path(), 4, &["trainer.save_freq=1"]);
    (dir, summary.resumed_at, summary.steps)
}

#[test]
fn a_damaged_run_directory_resumes_from_its_newest_complete_checkpoint() {
    let marker = |d: &Path| d.join("latest_checkpointed_iteration.txt");
    // The marker missing, garbled or naming a missing step: the newest complete one (3).
    for (name, damage) in [
        (
            "missing marker",
            Box::new(|d: &Path| std::fs::remove_file(marker(d)).unwrap()) as Box<dyn FnOnce(&Path)>,
        ),
        (
            "garbled marker",
            Box::new(|d: &Path| std::fs::write(marker(d), "abc").unwrap()),
        ),
        (
            "marker names a missing step",
            Box::new(|d: &Path| std::fs::write(marker(d), "9").unwrap()),
        ),
    ] {
        let (_dir, resumed, steps) = resume_after_damage(damage);
        assert_eq!(resumed, Some(3), "{name}");
        assert_eq!(steps, 1, "{name}: `done` counts the steps this run did");
    }
    // The newest trainer.json gone, or a flipped byte in a weight file: the one before (2).
    let (dir, resumed, steps) = resume_after_damage(|d| {
        std::fs::remove_file(d.join("global_step_3/trainer.json")).unwrap()
    });
    assert_eq!((resumed, steps), (Some(2), 2));
    // The unfinished step 3 was set aside, not overwritten or deleted.
    assert!(dir.path().join("global_step_3.aside-1").is_dir());
    assert!(dir.path().join("global_step_3/trainer.json").is_file());
    let (_dir, resumed, _) = resume_after_damage(|d| {
        let shard = common::files_under(&d.join("global_step_3/actor"))
            .into_iter()
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .unwrap();
        let mut bytes = std::fs::read(&shard).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&shard, bytes).unwrap();
    });
    assert_eq!(
        resumed,
        Some(2),
        "a checkpoint failing its checksum is passed over"
    );
}

/// A checkpoint whose checksums file is gone (this version always writes one), or whose
/// loop state names another step than its directory, is passed over for the one before.
#[test]
fn a_checkpoint_missing_its_checksums_or_naming_another_step_is_passed_over() {
    let (_dir, resumed, _) = resume_after_damage(|d| {
        std::fs::remove_file(d.join("global_step_3/checksums.json")).unwrap()
    });
    assert_eq!(resumed, Some(2), "no checksums.json");
    let (_dir, resumed, _) = resume_after_damage(|d| {
        // An older run's layout (no checksums) whose loop state is step 2's.
        let step = d.join("global_step_3");
        std::fs::remove_file(step.join("checksums.json")).unwrap();
        let mut state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(step.join("trainer.json")).unwrap())
                .unwrap();
        state["step"] = 2.into();
        state.as_object_mut().unwrap().remove("checksummed");
        std::fs::write(step.join("trainer.json"), state.to_string()).unwrap();
    });
    assert_eq!(resumed, Some(2), "trainer.json of another step");
}

#[test]
fn an_explicit_damaged_checkpoint_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    fit(dir.path(), 2, &[]);
    let step = dir.path().join("global_step_2");
    let file = step.join("trainer.json");
    let mut text = std::fs::read_to_string(&file).unwrap();
    text.push(' ');
    std::fs::write(&file, text).unwrap();
    let err = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .set("trainer.resume_mode", "resume_path")
        .set("trainer.resume_from_path", step.display())
        .set("trainer.default_local_dir", dir.path().display())
        .build()
        .map(|v| PpoTrainer::new(v).err().map(|e| e.to_string()));
    let msg = err.unwrap().expect("a damaged checkpoint is refused");
    assert!(
        msg.contains("trainer.json") && msg.contains("damaged"),
        "{msg}"
    );
}

#[test]
fn a_torn_metrics_line_is_dropped_on_resume_and_lines_are_whole() {
    let dir = tempfile::tempdir().unwrap();
    fit(dir.path(), 2, &[]);
    let metrics = dir.path().join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str("{\"step\": 3, \"actor/pg_lo");
    std::fs::write(&metrics, text).unwrap();
    let summary = fit(dir.path(), 3, &[]);
    assert_eq!((summary.resumed_at, summary.steps), (Some(2), 1));
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.ends_with('\n'));
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    }
    let steps: Vec<u64> = text
        .lines()
        .filter_map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()?
                .get("step")?
                .as_u64()
        })
        .filter(|&s| s > 0)
        .collect();
    assert_eq!(steps, vec![1, 2, 3]);
}

#[test]
fn a_fresh_run_never_deletes_or_overwrites_an_earlier_runs_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    fit(dir.path(), 3, &["trainer.save_freq=1"]);
    let before = std::fs::read(dir.path().join("global_step_1/trainer.json")).unwrap();
    // A new run in the same directory that starts over, keeping one checkpoint.
    fit(
        dir.path(),
        2,
        &[
            "trainer.save_freq=1",
            "trainer.resume_mode=disable",
            "trainer.max_actor_ckpt_to_keep=1",
        ],
    );
    let aside = dir.path().join("global_step_1.aside-1/trainer.json");
    assert_eq!(
        std::fs::read(aside).unwrap(),
        before,
        "the earlier step 1 is kept aside"
    );
    assert!(dir.path().join("global_step_2.aside-1").is_dir());
    assert!(
        dir.path().join("global_step_3/trainer.json").is_file(),
        "step 3 was not ours to prune"
    );
    assert!(
        !dir.path().join("global_step_1").exists(),
        "our own step 1 was pruned (keep 1)"
    );
    assert!(dir.path().join("global_step_2/trainer.json").is_file());
}

/// `trainer.max_*_ckpt_to_keep`: 0 keeps every checkpoint (verl's meaning), and since one step
/// directory holds both roles, it is pruned only when both limits let it go (0 on either keeps
/// all, an unset limit has no say, else the larger limit wins).
#[test]
fn checkpoint_limits_keep_all_at_zero_and_the_larger_of_actor_and_critic() {
    let kept = |extra: &[&str]| -> Vec<u64> {
        let dir = tempfile::tempdir().unwrap();
        let mut overrides = vec!["trainer.save_freq=1"];
        overrides.extend_from_slice(extra);
        fit(dir.path(), 3, &overrides);
        (1..=3)
            .filter(|s| {
                dir.path()
                    .join(format!("global_step_{s}/trainer.json"))
                    .is_file()
            })
            .collect()
    };
    assert_eq!(
        kept(&["trainer.max_actor_ckpt_to_keep=0"]),
        vec![1, 2, 3],
        "0 keeps all"
    );
    assert_eq!(
        kept(&[
            "trainer.max_actor_ckpt_to_keep=0",
            "trainer.max_critic_ckpt_to_keep=1",
        ]),
        vec![1, 2, 3],
        "0 on either role keeps all"
    );
    assert_eq!(
        kept(&[
            "trainer.max_actor_ckpt_to_keep=1",
            "trainer.max_critic_ckpt_to_keep=2",
        ]),
        vec![2, 3],
        "the larger limit wins"
    );
    assert_eq!(
        kept(&["trainer.max_critic_ckpt_to_keep=1"]),
        vec![3],
        "an unset actor limit has no say"
    );
}

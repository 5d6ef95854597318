//! Configuration: layers, overrides, refusals that name the key, and batch arithmetic.

use std::io::Write;

use verl_core::config::VerlConfig;
use verl_core::error::ConfigError;

/// A small runnable GRPO config on 2 simulated ranks.
const GOOD: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
];

fn with(extra: &[&str]) -> Result<VerlConfig, ConfigError> {
    let all: Vec<&str> = GOOD.iter().chain(extra).copied().collect();
    VerlConfig::from_layers(None, &all)
}

fn invalid_key(e: ConfigError) -> String {
    match e {
        ConfigError::Invalid { key, .. } | ConfigError::Key { key, .. } => key,
        other => panic!("expected a keyed error, got {other}"),
    }
}

#[test]
fn defaults_follow_verl() {
    let c = VerlConfig::from_layers(None, &[]).unwrap();
    assert_eq!(c.actor_rollout_ref.actor.ppo_mini_batch_size, 256);
    assert_eq!(c.actor_rollout_ref.actor.clip_ratio_c, 3.0);
    assert_eq!(
        c.actor_rollout_ref.actor.kl_loss_type.to_string(),
        "low_var_kl"
    );
    assert_eq!(c.algorithm.kl_penalty.to_string(), "kl");
    assert_eq!(
        c.actor_rollout_ref.rollout.dtype,
        verl_core::config::Dtype::Auto
    );
    assert_eq!(c.algorithm.adv_estimator, "gae");
    assert_eq!(c.critic.cliprange_value, 0.5);
    // Interpolated values resolve from their sources.
    assert_eq!(
        c.actor_rollout_ref.rollout.response_length,
        Some(c.data.max_response_length)
    );
    assert_eq!(c.critic.ppo_mini_batch_size, Some(256));
    assert_eq!(c.critic.enable, Some(true), "gae turns the critic on");
}

#[test]
fn overrides_parse_values_by_type() {
    let c = with(&[
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.optim.betas=[0.9, 0.95]",
        "trainer.total_training_steps=null",
        "trainer.logger=[console, jsonl]",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B",
        "actor_rollout_ref.model.override_config.attention_dropout=0.0",
        // A free-form map takes new keys after earlier ones (a preset's) filled it.
        "actor_rollout_ref.model.override_config.hidden_size=896",
        "actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=3",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    ])
    .unwrap();
    let a = &c.actor_rollout_ref.actor;
    assert_eq!(
        c.actor_rollout_ref.model.override_config["hidden_size"],
        896
    );
    assert_eq!(a.optim.lr, 1e-6);
    assert_eq!(a.optim.betas, [0.9, 0.95]);
    assert_eq!(c.trainer.logger, vec!["console", "jsonl"]);
    assert_eq!(
        c.actor_rollout_ref.model.path.as_deref(),
        Some("Qwen/Qwen2.5-0.5B")
    );
    assert_eq!(
        a.megatron.override_transformer_config["num_layers_in_first_pipeline_stage"],
        3
    );
    assert_eq!(
        c.actor_rollout_ref
            .reference
            .megatron
            .as_ref()
            .unwrap()
            .tensor_model_parallel_size,
        2
    );
}

#[test]
fn unknown_keys_list_valid_ones_and_suggest() {
    let e = with(&["actor_rollout_ref.actor.ppo_mini_batchsize=2"]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("actor_rollout_ref.actor.ppo_mini_batchsize"),
        "{msg}"
    );
    assert!(msg.contains("Did you mean `ppo_mini_batch_size`"), "{msg}");
    assert!(msg.contains("clip_ratio_c"), "lists valid keys: {msg}");

    let e = with(&["trainr.total_epochs=1"]).unwrap_err().to_string();
    assert!(
        e.contains("`trainr.total_epochs`") || e.contains("trainr"),
        "{e}"
    );
    assert!(e.contains("trainer"), "{e}");

    // Inside an optional section, the struct still refuses unknown keys, by full path.
    let e = with(&["actor_rollout_ref.ref.megatron.tensor_parallel=2"]).unwrap_err();
    assert!(
        e.to_string()
            .contains("actor_rollout_ref.ref.megatron.tensor_parallel"),
        "{e}"
    );
}

#[test]
fn type_mismatches_name_the_key() {
    let e = with(&["trainer.total_epochs=many"]).unwrap_err();
    assert_eq!(invalid_key(e), "trainer.total_epochs");
    let e = with(&["actor_rollout_ref.rollout.n=-2"]).unwrap_err();
    assert_eq!(invalid_key(e), "actor_rollout_ref.rollout.n");
    assert!(matches!(
        with(&["no_equals_sign"]),
        Err(ConfigError::OverrideSyntax { .. })
    ));
}

#[test]
fn files_in_yaml_toml_and_json_with_overrides_on_top() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("run.yaml");
    std::fs::File::create(&yaml)
        .unwrap()
        .write_all(b"trainer:\n  total_epochs: 3\n  n_gpus_per_node: 2\nalgorithm:\n  adv_estimator: grpo\n")
        .unwrap();
    let c = VerlConfig::from_layers(Some(&yaml), &["trainer.total_epochs=5"]).unwrap();
    assert_eq!((c.trainer.total_epochs, c.trainer.n_gpus_per_node), (5, 2));
    assert_eq!(c.algorithm.adv_estimator, "grpo");

    let toml = dir.path().join("run.toml");
    std::fs::write(
        &toml,
        "[data]\ntrain_batch_size = 16\n[actor_rollout_ref.rollout]\nn = 2\n",
    )
    .unwrap();
    let c = VerlConfig::from_layers(Some(&toml), &[]).unwrap();
    assert_eq!(
        (c.data.train_batch_size, c.actor_rollout_ref.rollout.n),
        (16, 2)
    );

    let json = dir.path().join("run.json");
    std::fs::write(&json, r#"{"critic": {"cliprange_value": 0.2}}"#).unwrap();
    assert_eq!(
        VerlConfig::from_layers(Some(&json), &[])
            .unwrap()
            .critic
            .cliprange_value,
        0.2
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "trainer:\n  epochs: 3\n").unwrap();
    let e = VerlConfig::from_layers(Some(&bad), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("trainer.epochs") && e.contains("total_epochs"),
        "{e}"
    );

    let e = VerlConfig::from_layers(Some(&dir.path().join("missing.yaml")), &[]).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
}

/// A key given twice in one map would silently keep the last value in YAML and JSON: refused,
/// naming the file and the dotted key, whether the key is a setting or a whole section.
#[test]
fn duplicate_keys_in_a_config_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str, &str)] = &[
        (
            "setting.yaml",
            "trainer:\n  total_epochs: 3\n  n_gpus_per_node: 2\n  total_epochs: 4\n",
            "trainer.total_epochs",
        ),
        (
            "section.yaml",
            "trainer:\n  total_epochs: 3\nalgorithm:\n  adv_estimator: grpo\ntrainer:\n  n_gpus_per_node: 2\n",
            "trainer",
        ),
        (
            "nested.yml",
            "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n      lr: 1.0e-5\n",
            "actor_rollout_ref.actor.optim.lr",
        ),
        (
            "setting.json",
            r#"{"trainer": {"total_epochs": 3, "total_epochs": 4}}"#,
            "trainer.total_epochs",
        ),
    ];
    for (name, text, key) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let e = VerlConfig::from_layers(Some(&path), &[]).unwrap_err();
        let msg = e.to_string();
        match e {
            ConfigError::DuplicateKey { path: p, key: k } => {
                assert_eq!((p.as_path(), k.as_str()), (path.as_path(), *key), "{msg}");
            }
            other => panic!("{name}: expected a duplicate-key error, got {other}"),
        }
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains(&format!("`{key}`")),
            "{msg}"
        );
    }

    // TOML's reader refuses duplicates itself; the error still names the file and the key.
    let toml = dir.path().join("twice.toml");
    std::fs::write(&toml, "[trainer]\ntotal_epochs = 3\ntotal_epochs = 4\n").unwrap();
    let e = VerlConfig::from_layers(Some(&toml), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&toml.display().to_string())
            && e.contains("total_epochs")
            && e.contains("duplicate"),
        "{e}"
    );

    // The same key in different maps is no duplicate, and a byte-order mark is skipped.
    let ok = dir.path().join("ok.json");
    std::fs::write(
        &ok,
        "\u{feff}{\"trainer\": {\"total_epochs\": 3}, \"critic\": {\"ppo_epochs\": 2}, \"actor_rollout_ref\": {\"actor\": {\"ppo_epochs\": 2}}}",
    )
    .unwrap();
    let c = VerlConfig::from_layers(Some(&ok), &[]).unwrap();
    assert_eq!(c.trainer.total_epochs, 3);
}

#[test]
fn printed_config_reloads_to_the_same_config() {
    let c = with(&["trainer.total_epochs=7"]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resolved.yaml");
    std::fs::write(&path, c.to_yaml()).unwrap();
    assert_eq!(VerlConfig::from_layers(Some(&path), &[]).unwrap(), c);
}

#[test]
fn batch_arithmetic_is_checked_before_allocation() {
    let v = with(&[]).unwrap().validate().unwrap();
    assert_eq!(
        (
            v.world_size,
            v.actor_dp,
            v.actor_mini_batch_per_dp,
            v.rollout_dp
        ),
        (2, 2, 8, 2)
    );
    assert_eq!(v.critic_dp, None);

    let cases: &[(&[&str], &str)] = &[
        (
            &["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        (
            &["actor_rollout_ref.actor.ppo_mini_batch_size=16"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
        ),
        (
            &["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ),
        (
            &["actor_rollout_ref.actor.ppo_micro_batch_size=4"],
            "actor_rollout_ref.actor.ppo_micro_batch_size",
        ),
        (
            &["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"],
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
        ),
        (
            &["actor_rollout_ref.actor.megatron.expert_model_parallel_size=3"],
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
        ),
        (
            &["actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.rollout.n",
        ),
        (
            &["algorithm.adv_estimator=grpoo"],
            "algorithm.adv_estimator",
        ),
        (
            &["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"],
            "actor_rollout_ref.actor.policy_loss.loss_mode",
        ),
        (
            &["actor_rollout_ref.rollout.top_p=0"],
            "actor_rollout_ref.rollout.top_p",
        ),
        (
            &["actor_rollout_ref.rollout.tensor_model_parallel_size=3"],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
        ),
        (&["trainer.n_gpus_per_node=3"], "data.train_batch_size"),
        (
            &["trainer.nnodes=2", "trainer.launcher=threads"],
            "trainer.launcher",
        ),
        (
            &["algorithm.adv_estimator=gae", "critic.enable=false"],
            "critic.enable",
        ),
        (
            &[
                "algorithm.adv_estimator=gae",
                "critic.ppo_micro_batch_size_per_gpu=3",
            ],
            "critic.ppo_micro_batch_size_per_gpu",
        ),
    ];
    // Settings that take one of a few names are refused by the reader, naming the key and
    // the names.
    for (extra, key, names) in [
        (
            "actor_rollout_ref.actor.loss_agg_mode=mean",
            "actor_rollout_ref.actor.loss_agg_mode",
            "`token-mean`, `seq-mean-token-sum`",
        ),
        (
            "trainer.launcher=mpi",
            "trainer.launcher",
            "`auto`, `threads`, `processes`",
        ),
        (
            "actor_rollout_ref.rollout.dtype=float16",
            "actor_rollout_ref.rollout.dtype",
            "use bfloat16, float32 or auto (float16 is not supported: it needs loss scaling)",
        ),
        (
            "algorithm.kl_penalty=k4",
            "algorithm.kl_penalty",
            "low_var_kl, k3, full, and the `+` variants",
        ),
        (
            "actor_rollout_ref.actor.kl_loss_type=full",
            "actor_rollout_ref.actor.kl_loss_type",
            "call `kl_full`",
        ),
        (
            "actor_rollout_ref.actor.optim.lr_decay_style=step",
            "actor_rollout_ref.actor.optim.lr_decay_style",
            "`constant`, `linear`, `cosine`",
        ),
    ] {
        let err = with(&[extra]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(names), "{text}");
        assert_eq!(invalid_key(err), key, "for {extra}");
    }
    for (extra, key) in cases {
        let err = with(extra).unwrap().validate().unwrap_err();
        let text = err.to_string();
        assert!(text.contains("Fix:"), "{text}");
        assert_eq!(&invalid_key(err), key, "for {extra:?}");
    }
    let e = with(&["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("per-rank mini-batch of 8 samples"), "{e}");
}

#[test]
fn profiler_roles_inherit_the_global_tool() {
    let c = with(&[
        "global_profiler.tool=nsys",
        "global_profiler.steps=[1, 2]",
        "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.actor.profiler.ranks=[0]",
    ])
    .unwrap();
    let p = &c.actor_rollout_ref.actor.profiler;
    assert_eq!(p.tool, Some(verl_core::config::ProfilerTool::Nsys));
    assert_eq!(p.save_path.as_deref(), Some("outputs/profile"));
    assert!(p.covers_rank(0) && !p.covers_rank(1));
    assert_eq!(c.global_profiler.steps, Some(vec![1, 2]));
    assert!(with(&["global_profiler.tool=perf"]).is_err());
}

#[test]
fn user_registered_algorithm_names_pass_validation() {
    let cfg = with(&[
        "algorithm.adv_estimator=my_baseline",
        "actor_rollout_ref.actor.policy_loss.loss_mode=my_loss",
    ])
    .unwrap();
    assert_eq!(
        invalid_key(cfg.validate().unwrap_err()),
        "algorithm.adv_estimator"
    );
    assert!(cfg.validate_with(&["my_baseline"], &["my_loss"]).is_ok());
}

#[test]
fn config_names_match_the_algorithm_registries() {
    use verl_core::algorithms::advantage::AdvantageRegistry;
    use verl_core::algorithms::policy_loss::PolicyLossRegistry;
    use verl_core::backend::CpuBackend as B;
    let c = VerlConfig::from_layers(None, &[]).unwrap();
    assert!(AdvantageRegistry::<B>::new()
        .get(&c.algorithm.adv_estimator)
        .is_ok());
    assert!(PolicyLossRegistry::<B>::new()
        .get(&c.actor_rollout_ref.actor.policy_loss.loss_mode)
        .is_ok());
    for name in verl_core::config::ADV_ESTIMATORS {
        assert!(AdvantageRegistry::<B>::new().get(name).is_ok(), "{name}");
    }
    for name in verl_core::config::POLICY_LOSSES {
        assert!(PolicyLossRegistry::<B>::new().get(name).is_ok(), "{name}");
    }
    assert_eq!(
        c.actor_rollout_ref.actor.loss_agg_mode,
        verl_core::algorithms::LossAggMode::TokenMean
    );
    // Every KL name is read into the estimator the algorithms parse, and written back so that
    // it reads the same.
    for name in verl_core::config::KL_TYPES {
        let c = with(&[format!("algorithm.kl_penalty={name}").as_str()]).unwrap();
        let parsed: verl_core::algorithms::kl::KlPenalty = name.parse().unwrap();
        assert_eq!(c.algorithm.kl_penalty, parsed, "{name}");
        let again = with(&[format!("algorithm.kl_penalty={parsed}").as_str()]).unwrap();
        assert_eq!(again.algorithm.kl_penalty, parsed, "{name}");
    }
    // Every name the config reader takes is the name the algorithms parse.
    for name in verl_core::config::LOSS_AGG_MODES {
        let over = format!("critic.loss_agg_mode={name}");
        let c = VerlConfig::from_layers(None, &[over.as_str()]).unwrap();
        assert_eq!(c.critic.loss_agg_mode, name.parse().unwrap(), "{name}");
    }
    let p = c.actor_rollout_ref.actor.policy_loss_params(7);
    assert_eq!(
        (p.clip_ratio_low, p.clip_ratio_c, p.tau_neg, p.seed),
        (0.2, 3.0, 1.05, 7)
    );
    let kl = c.actor_rollout_ref.actor.kl_loss_type;
    assert_eq!(kl.kind, verl_core::algorithms::kl::KlType::K3);
}

/// Numbers that no run could mean are refused by field at validation: negative rates, decay,
/// clipping and clip ranges, betas outside [0, 1), a non-positive eps.
#[test]
fn meaningless_numbers_are_refused_by_field() {
    for (set, key) in [
        (
            "actor_rollout_ref.actor.optim.lr=-1e-6",
            "actor_rollout_ref.actor.optim.lr",
        ),
        ("trainer.sft_warmup_lr=-0.1", "trainer.sft_warmup_lr"),
        (
            "actor_rollout_ref.actor.loss_scale_factor=0",
            "actor_rollout_ref.actor.loss_scale_factor",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio=-0.2",
            "actor_rollout_ref.actor.clip_ratio",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_low=-0.1",
            "actor_rollout_ref.actor.clip_ratio_low",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_high=-0.1",
            "actor_rollout_ref.actor.clip_ratio_high",
        ),
        (
            "actor_rollout_ref.actor.optim.weight_decay=-0.01",
            "actor_rollout_ref.actor.optim.weight_decay",
        ),
        (
            "actor_rollout_ref.actor.optim.clip_grad=-1",
            "actor_rollout_ref.actor.optim.clip_grad",
        ),
        (
            "actor_rollout_ref.actor.optim.eps=0",
            "actor_rollout_ref.actor.optim.eps",
        ),
        (
            "actor_rollout_ref.actor.optim.eps=-1e-8",
            "actor_rollout_ref.actor.optim.eps",
        ),
        (
            "actor_rollout_ref.actor.optim.betas=[0.9, 1.0]",
            "actor_rollout_ref.actor.optim.betas",
        ),
        (
            "actor_rollout_ref.actor.optim.betas=[-0.1, 0.99]",
            "actor_rollout_ref.actor.optim.betas",
        ),
        (
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.5",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
        ),
    ] {
        let cfg = with(&[set]).unwrap_or_else(|e| panic!("{set} parses: {e}"));
        let e = cfg.validate().expect_err(set);
        assert_eq!(invalid_key(e), key, "{set}");
    }
    // The critic's optimizer is checked when a critic runs.
    let cfg = with(&["algorithm.adv_estimator=gae", "critic.optim.lr=-1"]).unwrap();
    assert_eq!(invalid_key(cfg.validate().unwrap_err()), "critic.optim.lr");
    // Zero is a meaningful bound for each of them.
    let cfg = with(&[
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.optim.clip_grad=0",
        "actor_rollout_ref.actor.optim.betas=[0.0, 0.0]",
    ])
    .unwrap();
    cfg.validate()
        .expect("zero decay, clipping off and zero betas are valid");
}

/// verl's `ref.megatron` takes each layout key it does not set from the actor's.
#[test]
fn the_reference_inherits_the_actors_layout_key_by_key() {
    let cfg = with(&[
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.ref.megatron.param_offload=true",
    ])
    .unwrap();
    let r = cfg.actor_rollout_ref.reference.megatron.clone().unwrap();
    assert_eq!(r.tensor_model_parallel_size, 2);
    assert!(r.param_offload);
    cfg.validate().expect("the same layout as the actor's");
}

/// YAML merge keys (`<<: *anchor`, `<<: [*a, *b]`), which verl's PyYAML accepts: the merged
/// map's entries fill in, the merging map's own keys win, and of a list the earlier map wins.
#[test]
fn yaml_merge_keys_merge_as_pyyaml_merges_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("merged.yaml");
    std::fs::write(
        &path,
        "\
actor_rollout_ref:
  actor:
    optim: &actor_optim
      lr: 3.0e-6
      weight_decay: 0.02
    clip_ratio: &clip 0.3
critic:
  optim:
    <<: *actor_optim
    lr: 1.0e-5
  cliprange_value: *clip
trainer: &trainer_a
  total_epochs: 7
  project_name: a
data:
  <<: [{max_prompt_length: 99, max_response_length: 11}, {max_prompt_length: 5, train_batch_size: 4}]
",
    )
    .unwrap();
    let cfg = VerlConfig::from_layers(Some(&path), &[]).unwrap();
    assert_eq!(cfg.critic.optim.lr, 1.0e-5, "the merging map's key wins");
    assert_eq!(
        cfg.critic.optim.weight_decay, 0.02,
        "filled in from the anchor"
    );
    assert_eq!(cfg.critic.cliprange_value, 0.3, "a plain alias");
    assert_eq!(cfg.actor_rollout_ref.actor.optim.lr, 3.0e-6);
    assert_eq!(
        cfg.data.max_prompt_length, 99,
        "the earlier map of a list wins"
    );
    assert_eq!(cfg.data.max_response_length, 11);
    assert_eq!(cfg.data.train_batch_size, 4);
    // A merge key naming something other than a map is refused, naming the file.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "trainer:\n  <<: 3\n").unwrap();
    let e = VerlConfig::from_layers(Some(&bad), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.yaml") && e.contains("merge key"), "{e}");
}

/// Deeply nested flow collections in a YAML config are refused naming the line before the
/// parser scans them (its own limit came after a scan quadratic in the depth: 100 000
/// brackets took 19 s in a debug build); ordinary flow lists, quoted brackets and comments
/// pass.
#[test]
fn deeply_nested_yaml_flows_are_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let deep = dir.path().join("deep.yaml");
    let n = 100_000;
    std::fs::write(
        &deep,
        format!("trainer:\n  logger: {}{}\n", "[".repeat(n), "]".repeat(n)),
    )
    .unwrap();
    let e = VerlConfig::from_layers(Some(&deep), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("deep.yaml") && e.contains("line 2") && e.contains("nested"),
        "{e}"
    );
    // Our message, not the parser's "recursion limit exceeded": refused before it ran.
    assert!(!e.contains("recursion limit"), "{e}");
    let fine = dir.path().join("fine.yaml");
    std::fs::write(
        &fine,
        "trainer:\n  logger: [console, '[not a list', \"{nor} a map\"] # ]]]] [[[[\n  project_name: 'it''s [x'\n",
    )
    .unwrap();
    let cfg = VerlConfig::from_layers(Some(&fine), &[]).unwrap();
    assert_eq!(
        cfg.trainer.logger,
        ["console", "[not a list", "{nor} a map"]
    );
    assert_eq!(cfg.trainer.project_name, "it's [x");
}

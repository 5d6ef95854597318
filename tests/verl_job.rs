//! A verl user's job as they wrote it: verl's own flattened Megatron trainer config
//! (`tests/fixtures/verl/ppo_megatron_trainer.yaml`, verbatim, its source named at its top)
//! with the overrides of verl's GRPO example script, resolved, validated, and trained on the
//! CPU default.

use verl::ConfigBuilder;

mod common;

const VERL_YAML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/verl/ppo_megatron_trainer.yaml"
);

/// The overrides of verl's `examples/grpo_trainer/run_qwen2-7b_math_megatron.sh`, as the
/// script passes them (its data paths made local, its quoting undone by the shell).
const GRPO_EXAMPLE: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "data.train_files=['/data/gsm8k/train.parquet', '/data/math/train.parquet']",
    "data.val_files=['/data/gsm8k/test.parquet', '/data/math/test.parquet']",
    "data.return_raw_chat=True",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name=verl_grpo_example_gsm8k_math",
    "trainer.experiment_name=qwen2_7b_megatron",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
];

fn said(notes: &[String], text: &str) -> bool {
    notes.iter().any(|n| n.contains(text))
}

#[test]
fn verls_yaml_with_its_grpo_example_resolves_and_validates() {
    let v = ConfigBuilder::new()
        .file(VERL_YAML)
        .overrides(GRPO_EXAMPLE)
        .build()
        .unwrap();
    let c = &v.config;
    // verl's interpolations follow the overrides: the rollout's prompt length from the data's,
    // the checkpoint folder from the project and experiment names.
    assert_eq!(c.actor_rollout_ref.rollout.prompt_length, Some(1024));
    assert_eq!(
        c.trainer.default_local_dir.as_deref(),
        Some("checkpoints/verl_grpo_example_gsm8k_math/qwen2_7b_megatron")
    );
    assert_eq!(c.actor_rollout_ref.actor.optim.total_training_steps, None);
    // vLLM becomes the native engine, with a line saying so; wandb is kept (it runs in Python).
    assert_eq!(c.actor_rollout_ref.rollout.name, "native");
    assert_eq!(c.trainer.logger, ["console", "wandb"]);
    assert!(
        said(&c.notes, "actor_rollout_ref.rollout.name=\"vllm\""),
        "{:#?}",
        c.notes
    );
    assert_eq!((v.world_size, v.actor_dp), (8, 2));
}

#[test]
fn a_verl_key_asking_for_what_is_not_built_is_refused_by_name() {
    for (set, key, reason) in [
        (
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_rank",
            "LoRA",
        ),
        (
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true",
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
            "re-tokenised",
        ),
        (
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
            "actor_rollout_ref.rollout.agent.default_agent_loop",
            "PpoTrainerBuilder::agent",
        ),
    ] {
        let e = ConfigBuilder::new()
            .file(VERL_YAML)
            .overrides(GRPO_EXAMPLE)
            .overrides([set])
            .resolve()
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains(key) && text.contains(reason), "{set}: {text}");
    }
    // A knob of a system verl-rs does not have is taken, with a line saying it does nothing.
    let c = ConfigBuilder::new()
        .file(VERL_YAML)
        .overrides(GRPO_EXAMPLE)
        .overrides(["ray_kwargs.ray_init.num_cpus=16"])
        .resolve()
        .unwrap();
    assert!(
        said(&c.notes, "ray_kwargs.ray_init.num_cpus=16 has no effect"),
        "{:#?}",
        c.notes
    );
}

#[test]
fn verls_yaml_trains_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let validated = ConfigBuilder::new()
        .file(VERL_YAML)
        .overrides([
            // The job: GRPO on the built-in addition task with a tiny model, on one CPU rank.
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.model.path=null",
            "critic.model.path=null",
            "data.train_files=builtin:addition:1",
            "data.val_files=null",
            "data.train_batch_size=8",
            "data.max_prompt_length=16",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.n_gpus_per_node=1",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            // verl's default adds wandb, which this machine's Python does not have
            // (tests/trackers.rs runs it against a stand-in).
            "trainer.logger=[console]",
        ])
        .overrides(common::TINY_JOB[2..].iter().copied())
        .set("trainer.default_local_dir", dir.path().display())
        .build()
        .unwrap();
    let summary = common::fit(validated);
    let lines = common::step_lines(&summary.metrics_path);
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).collect();
    assert_eq!(steps.len(), 2);
    for key in [
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "critic/score/mean",
    ] {
        assert!(
            steps
                .iter()
                .all(|s| s.get(key).is_some_and(|v| v.is_finite())),
            "{key}"
        );
    }
}

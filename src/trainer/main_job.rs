//! The main job's settings.

/// The main job's settings (`verl train` with no `--config`), applied before the command
/// line's overrides: GRPO on the built-in addition task with a tiny Qwen2 trained from scratch.
pub const MAIN_JOB: &[&str] = &[
    "trainer.n_gpus_per_node=1",
    "trainer.project_name=verl_rs",
    "trainer.experiment_name=tiny_grpo_addition",
    "trainer.default_local_dir=outputs/tiny_grpo_addition",
    "trainer.total_training_steps=200",
    "trainer.sft_warmup_steps=600",
    "trainer.sft_warmup_lr=0.001",
    "trainer.test_freq=20",
    "trainer.val_before_train=true",
    "data.train_batch_size=16",
    "data.max_prompt_length=8",
    "data.max_response_length=4",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.max_num_seqs=128",
    "actor_rollout_ref.rollout.kv_cache_tokens=4096",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.optim.lr=0.0001",
    // Cosine decay over the RL steps: the score keeps its gains instead of drifting.
    "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.clip_grad=1.0",
];

//! verl-rs: reinforcement-learning post-training of large language models (PPO, GRPO and their
//! relatives) with a Megatron-style parallel backend on burn.
//!
//! This facade re-exports the workspace crates and adds typed builders. The pieces:
//!
//! - [`core`] (`verl-core`): [`DataProto`], the parallel [`topology`], [`dispatch`] modes and the
//!   single controller's [`worker`] group, the core [`traits`], [`config`], and the backends.
//! - `verl-megatron`, `verl-rollout`, `verl-offload`, `verl-profiler`: implementations of the
//!   core traits (see each crate's docs for what has landed).
//!
//! ```
//! use verl::ConfigBuilder;
//!
//! let run = ConfigBuilder::new()
//!     .set("algorithm.adv_estimator", "grpo")
//!     .set("actor_rollout_ref.rollout.n", 4)
//!     .set("trainer.n_gpus_per_node", 2)
//!     .set("data.train_batch_size", 8)
//!     .set("actor_rollout_ref.actor.ppo_mini_batch_size", 4)
//!     .set("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 2)
//!     .set("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 4)
//!     .build()?;
//! assert_eq!(run.actor_dp, 2);
//! # Ok::<(), verl::core::error::ConfigError>(())
//! ```

//! A run of your own: the trainer composed through [`trainer::PpoTrainer::builder`] from a
//! config and your parts (a reward function here; also advantage estimators, policy losses, a
//! rollout engine, data), then driven by [`trainer::PpoTrainer::fit`] or phase by phase
//! (`generate`, `score`, `compute_advantages`, `update_actor`, ...). The `examples/` directory
//! has one runnable program per part.
//!
//! ```no_run
//! use verl::trainer::{PpoTrainer, MAIN_JOB};
//! use verl::traits::RewardInput;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = verl::ConfigBuilder::new()
//!     .overrides(MAIN_JOB)
//!     .set("algorithm.adv_estimator", "grpo")
//!     .resolve()?;
//! let exact = |x: &RewardInput| f64::from(u8::from(x.solution_str.trim() == x.ground_truth));
//! let mut trainer = PpoTrainer::builder(cfg).reward(exact).build()?;
//! let summary = trainer.fit().await?;
//! println!("val score {:?} after {} steps", summary.val_score_after, summary.steps);
//! # Ok(()) }
//! ```

mod builder;

pub mod launcher;
pub mod python;
pub mod tasks;
pub mod trainer;

pub use builder::ConfigBuilder;
pub use verl_core as core;
pub use verl_core::{
    algorithms, backend, config, dispatch, error, memory, topology, traits, worker,
};
pub use verl_core::{DataProto, Error, Metrics, NamedTensor, Result};
pub use verl_megatron as megatron;
pub use verl_offload as offload;
pub use verl_profiler as profiler;
pub use verl_rollout as rollout;

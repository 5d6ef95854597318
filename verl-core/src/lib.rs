//! verl-core: the vocabulary of verl-rs.
//!
//! - [`DataProto`]: the batch that travels between the controller and rank workers.
//! - [`topology`]: Megatron's parallel layout (tp, cp, dp, pp, ep) and process groups.
//! - [`dispatch`] and [`worker`]: the single controller's dispatch modes and worker group.
//! - [`traits`]: `Actor`, `Critic`, `RolloutEngine`, `ShardingManager`, `CheckpointBackend`,
//!   `Profiler`, `RewardFn`, implemented by the other crates.
//! - [`config`]: verl's configuration tree, with overrides and validation.
//! - [`algorithms`]: advantage estimators, policy losses, KL penalties, value loss, loss
//!   aggregation, log-prob and entropy from logits — pure functions over burn tensors and masks.
//! - [`backend`]: the default CPU backend and the optional CUDA one.
//! - [`memory`]: device memory figures and per-phase peaks (`perf/max_memory_*_gb`).

pub mod algorithms;
pub mod backend;
pub mod batching;
pub mod config;
pub mod data_proto;
pub mod dispatch;
pub mod error;
pub mod files;
pub mod memory;
pub mod metrics;
pub mod profiling;
pub mod reward_score;
pub mod switch;
pub mod topology;
pub mod traits;
pub mod weights;
pub mod wire;
pub mod worker;

pub use data_proto::DataProto;
pub use error::{Error, Result};
pub use metrics::Metrics;
pub use weights::{NamedTensor, WeightStream};

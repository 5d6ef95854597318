//! verl's role workers on the Megatron backend: the actor, the critic, and the hybrid
//! actor-rollout-reference worker that owns them with the rollout engine on one rank, and the
//! reward-model worker.

pub mod actor;
pub mod actor_rollout_ref;
pub mod adamw;
pub mod batch;
pub mod critic;
pub mod engine;
pub mod offload;
pub mod optim;
pub mod reward_model;
pub mod routing_store;
mod stage;
mod state;

pub use actor::{ActorSettings, MegatronActor, RouterReplay};
pub use actor_rollout_ref::{
    ActorRolloutRefWorker, CheckpointRequest, CriticWorker, HybridShardingManager, ReferenceWorker,
};
pub use batch::MicroBatching;
pub use critic::{CriticSettings, MegatronCritic};
pub use engine::{DynamicBatch, TrainingEngine, TrainingRole};
pub use offload::{MomentOffload, Moved, ParamOffload, TrainingOffload};
pub use optim::{LrSchedule, ModelOptimizer, DEFAULT_GRAD_BUCKET_ELEMS};
pub use reward_model::RewardModelWorker;

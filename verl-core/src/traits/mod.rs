//! The core traits that backends implement. Each role is a trait so that an embedding trainer can
//! swap any one of them (a different rollout engine, a remote reward, a custom checkpoint store).
//!
//! The async traits are `?Send`: a rank's worker owns its device and runs on that rank's own
//! thread (see [`crate::worker`]), so its futures never move between threads.

mod actor;
mod checkpoint;
mod communicator;
mod critic;
mod offload;
mod profiler;
mod reward;
mod rollout;
mod sharding;
pub mod tool;

pub use actor::{Actor, LogProbOutput};
pub use checkpoint::{CheckpointBackend, CheckpointContents, CheckpointFormat, CheckpointState};
pub use communicator::{
    comm_timeout, comm_timeout_from, interleave, interleaved_inner, middle_first,
    reduce_scatter_chunk, Communicator, CommunicatorExt, ReduceOp, COMM_TIMEOUT_ENV,
};
pub use critic::Critic;
pub use offload::{HostOffload, OffloadSwitches, TransferReport};
pub use profiler::{ProfileRange, Profiler};
pub use reward::{BatchRewardFn, RewardFn, RewardInput, RewardScore};
pub use rollout::{RolloutEngine, SleepLevel};
pub use sharding::{ReshardReport, ShardingManager, WeightExporter, WeightSyncPlan};
pub use tool::{Tool, ToolOutput};

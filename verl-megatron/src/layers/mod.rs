//! Parallel-aware layers. Each holds its tensor-parallel rank's shard of the weight in the
//! Megatron split (column-parallel: output rows split; row-parallel: input columns split;
//! vocab-parallel: vocabulary rows split), so tensor parallelism can shard them without touching
//! model code. With tp = 1 the shard is the whole weight and no communication happens; the
//! collectives arrive with the `Communicator` (tensor-parallel issue).

mod embedding;
mod linear;
mod norm;
mod rope;

pub use embedding::VocabParallelEmbedding;
pub use linear::{ColumnParallelLinear, RowParallelLinear, TpShard};
pub use norm::RmsNorm;
pub use rope::RotaryEmbedding;

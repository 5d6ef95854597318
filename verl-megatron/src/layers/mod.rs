//! Parallel-aware layers. Each holds its tensor-parallel rank's shard of the weight in the
//! Megatron split (column-parallel: output rows split; row-parallel: input columns split;
//! vocab-parallel: vocabulary rows split). With tp = 1 the shard is the whole weight and no
//! communication happens; otherwise the collectives are the region operators of
//! [`crate::parallel`].

mod embedding;
mod linear;
mod norm;
pub mod precision;
mod rope;

pub use embedding::VocabParallelEmbedding;
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use norm::RmsNorm;
pub use rope::{RopeTables, RotaryEmbedding};

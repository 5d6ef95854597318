//! A decoder layer's feed-forward block: the dense SwiGLU MLP or a mixture of experts.

use burn::module::Module;
use burn::prelude::*;

use super::mlp::SwiGlu;
use super::sparse_moe::SparseMoe;
use crate::parallel::ParallelBackend;

/// A decoder layer's feed-forward block.
// One per layer: the size difference between variants costs nothing worth boxing for.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum FeedForward<B: Backend> {
    Dense(SwiGlu<B>),
    Moe(SparseMoe<B>),
}

impl<B: ParallelBackend> FeedForward<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Moe(m) => m.forward(x),
        }
    }
}

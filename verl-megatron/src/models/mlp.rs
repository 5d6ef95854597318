//! The SwiGLU MLP of a decoder layer.

use burn::module::Module;
use burn::prelude::*;

use crate::layers::{ColumnParallelLinear, RowParallelLinear};
use crate::ops::FusedOps;
use crate::parallel::{ParallelBackend, TpGroup};

/// down(silu(gate(x)) · up(x)), the intermediate features split over tp ranks.
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    pub gate_proj: ColumnParallelLinear<B>,
    pub up_proj: ColumnParallelLinear<B>,
    pub down_proj: RowParallelLinear<B>,
    #[module(skip)]
    pub tp: TpGroup,
}

impl<B: ParallelBackend> SwiGlu<B> {
    /// `x` `[batch, seq, hidden]` from the residual stream (a sequence shard with sequence
    /// parallelism) to the same.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = self.tp.enter(x);
        let y = self.forward_partial(x);
        self.tp.exit(y)
    }

    /// This rank's partial output for an input already in the tensor-parallel region: what a
    /// mixture of experts sums before its one reduction.
    pub fn forward_partial<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        // One cast of x for both products.
        let x = crate::layers::precision::operand(x);
        let gate = self.gate_proj.forward(x.clone());
        let up = self.up_proj.forward(x);
        self.down_proj.forward_partial(swiglu(gate, up))
    }
}

/// `silu(gate) · up` through the backend's [`FusedOps::swiglu`]: one fused kernel each way on
/// burn-cuda, burn's operations elsewhere.
pub fn swiglu<B: FusedOps, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    B::swiglu(gate, up)
}

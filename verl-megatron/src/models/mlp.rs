//! The gated MLP of a decoder layer: SwiGLU, or GeGLU (Gemma).

use burn::module::Module;
use burn::prelude::*;

use crate::hf::Activation;
use crate::layers::{ColumnParallelLinear, RowParallelLinear};
use crate::ops::FusedOps;
use crate::parallel::{ParallelBackend, TpGroup};

/// down(act(gate(x)) · up(x)), act SiLU (SwiGLU) or tanh-GELU (GeGLU), the intermediate
/// features split over tp ranks.
#[derive(Module, Debug)]
pub struct SwiGlu<B: Backend> {
    pub gate_proj: ColumnParallelLinear<B>,
    pub up_proj: ColumnParallelLinear<B>,
    pub down_proj: RowParallelLinear<B>,
    #[module(skip)]
    pub tp: TpGroup,
    #[module(skip)]
    pub activation: Activation,
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
        let hidden = match self.activation {
            Activation::Silu => swiglu(gate, up),
            Activation::GeluTanh => geglu(gate, up),
        };
        self.down_proj.forward_partial(hidden)
    }
}

/// `gelu_tanh(gate) · up`, in burn's operations (PyTorch's `gelu(approximate="tanh")`:
/// 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))).
pub fn geglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    gelu_tanh(gate) * up
}

/// PyTorch's `gelu(x, approximate="tanh")`, in its order of operations.
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    const BETA: f32 = 0.797_884_6; // √(2/π) as f32
    const KAPPA: f32 = 0.044_715;
    let cube = x.clone() * x.clone() * x.clone();
    let inner = (x.clone() + cube * KAPPA) * BETA;
    x * 0.5 * (inner.tanh() + 1.0)
}

/// `silu(gate) · up` through the backend's [`FusedOps::swiglu`]: one fused kernel each way on
/// burn-cuda, burn's operations elsewhere.
pub fn swiglu<B: FusedOps, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    B::swiglu(gate, up)
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_core::backend::CpuBackend as B;

    #[test]
    fn gelu_tanh_matches_pytorch_at_hand_checked_points() {
        // torch.nn.functional.gelu(x, approximate="tanh") at -2, -0.5, 0, 1 and 3.
        let x = Tensor::<B, 1>::from_floats([-2.0, -0.5, 0.0, 1.0, 3.0], &Default::default());
        let got: Vec<f32> = gelu_tanh(x).into_data().to_vec().unwrap();
        let want = [-0.045_402_3, -0.154_286, 0.0, 0.841_192, 2.996_362_6];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }
}

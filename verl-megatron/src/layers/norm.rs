use burn::module::{Module, Param};
use burn::prelude::*;

use crate::ops::FusedOps;

/// RMSNorm over the last dimension: x / sqrt(mean(x²) + ε) · w.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            eps,
        }
    }
}

impl<B: FusedOps> RmsNorm<B> {
    /// The norm through the backend's [`FusedOps::rms_norm`] (one kernel each way on
    /// burn-cuda).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.weight.val(), self.eps)
    }
}

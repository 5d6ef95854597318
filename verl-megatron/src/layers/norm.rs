use burn::module::{Module, Param};
use burn::prelude::*;

use crate::ops::FusedOps;

/// RMSNorm over the last dimension: x / sqrt(mean(x²) + ε) · w, or · (1 + w) for Gemma's
/// zero-centred weights (the weight stays as stored, so it saves and syncs unchanged).
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
    /// The scale is 1 + w (Gemma).
    pub zero_centred: bool,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            eps,
            zero_centred: false,
        }
    }

    /// Gemma's norm: the scale is 1 + `weight`.
    pub fn zero_centred(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self {
            zero_centred: true,
            ..Self::new(weight, eps)
        }
    }

    /// The scale the normalised input is multiplied by.
    pub fn scale(&self) -> Tensor<B, 1> {
        match self.zero_centred {
            // transformers adds 1 to the weight first, then multiplies (the same rounding).
            true => self.weight.val() + 1.0,
            false => self.weight.val(),
        }
    }
}

impl<B: FusedOps> RmsNorm<B> {
    /// The norm through the backend's [`FusedOps::rms_norm`] (one kernel each way on
    /// burn-cuda).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.scale(), self.eps)
    }
}

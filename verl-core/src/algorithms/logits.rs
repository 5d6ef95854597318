//! Log-probabilities of labels and entropy, from logits `[batch, len, vocab]`.

use burn::prelude::*;
use burn::tensor::activation::log_softmax;
use burn::tensor::Int;

/// log softmax(logits)[label] per position, `[batch, len]`.
///
/// ```
/// use burn::tensor::{Int, Tensor};
/// use verl_core::algorithms::logits::log_probs_from_logits;
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let logits = Tensor::<B, 3>::from_floats([[[0.0, 0.0]]], &d);
/// let labels = Tensor::<B, 2, Int>::from_ints([[1]], &d);
/// let lp = log_probs_from_logits(logits, labels).into_scalar();
/// assert!((lp - 0.5f32.ln()).abs() < 1e-6);
/// ```
pub fn log_probs_from_logits<B: Backend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
) -> Tensor<B, 2> {
    log_softmax(logits, 2)
        .gather(2, labels.unsqueeze_dim(2))
        .squeeze_dim(2)
}

/// Entropy −Σ p·log p of softmax(logits) per position, `[batch, len]`, computed as
/// logsumexp(z) − Σ softmax(z)·z for stability.
pub fn entropy_from_logits<B: Backend>(logits: Tensor<B, 3>) -> Tensor<B, 2> {
    let logp = log_softmax(logits, 2);
    -(logp.clone().exp() * logp).sum_dim(2).squeeze_dim(2)
}

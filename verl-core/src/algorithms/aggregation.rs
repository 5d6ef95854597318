//! Loss aggregation: how a `[batch, len]` matrix of per-token losses becomes one scalar.

use std::str::FromStr;

use burn::prelude::*;

use super::masked::masked_sum;
use crate::error::AlgorithmError;

/// verl's `loss_agg_mode` (in a config, by its name: `token-mean`, `seq-mean-token-sum`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossAggMode {
    /// Σ loss·mask / Σ mask: every token weighs the same.
    TokenMean,
    /// Mean over sequences of the per-sequence token sum.
    SeqMeanTokenSum,
    /// Mean over sequences of the per-sequence token mean (GRPO's original form).
    SeqMeanTokenMean,
    /// Σ of per-sequence token sums / a constant (Dr.GRPO); by default the padded length.
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    pub const NAMES: [&'static str; 4] = [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ];
}

impl FromStr for LossAggMode {
    type Err = AlgorithmError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "token-mean" => Ok(Self::TokenMean),
            "seq-mean-token-sum" => Ok(Self::SeqMeanTokenSum),
            "seq-mean-token-mean" => Ok(Self::SeqMeanTokenMean),
            "seq-mean-token-sum-norm" => Ok(Self::SeqMeanTokenSumNorm),
            other => Err(AlgorithmError::UnknownName {
                kind: "loss_agg_mode",
                name: other.into(),
                known: Self::NAMES.join(", "),
            }),
        }
    }
}

/// Global normalisers, so that a loss computed on one micro-batch of one dp rank sums to the
/// same gradient as the loss of the whole global batch. All `None`: normalise by this micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AggScale {
    /// Unmasked tokens in the global batch (token-mean).
    pub global_tokens: Option<f64>,
    /// Non-empty sequences in the global batch (seq-mean modes).
    pub global_sequences: Option<f64>,
    /// Data-parallel size the gradient is averaged over (multiplies the loss back).
    pub dp_size: Option<f64>,
    /// Divisor of `seq-mean-token-sum-norm`; `None`: the padded length.
    pub loss_scale_factor: Option<f64>,
}

/// Aggregates `loss` `[batch, len]` under `mask` into a scalar.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::{agg_loss, AggScale, LossAggMode};
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let loss = Tensor::<B, 2>::from_floats([[1., 1., 1.], [4., 0., 0.]], &d);
/// let mask = Tensor::<B, 2>::from_floats([[1., 1., 1.], [1., 0., 0.]], &d);
/// let v = |m| agg_loss(loss.clone(), mask.clone(), m, AggScale::default()).into_scalar();
/// assert_eq!(v(LossAggMode::TokenMean), 7.0 / 4.0);         // (1+1+1+4) / 4 tokens
/// assert_eq!(v(LossAggMode::SeqMeanTokenSum), 3.5);          // (3 + 4) / 2
/// assert_eq!(v(LossAggMode::SeqMeanTokenMean), 2.5);         // (1 + 4) / 2
/// assert_eq!(v(LossAggMode::SeqMeanTokenSumNorm), 7.0 / 3.0); // (3 + 4) / len 3
/// ```
pub fn agg_loss<B: Backend>(
    loss: Tensor<B, 2>,
    mask: Tensor<B, 2>,
    mode: LossAggMode,
    scale: AggScale,
) -> Tensor<B, 1> {
    let dp = scale.dp_size.unwrap_or(1.0);
    match mode {
        LossAggMode::TokenMean => {
            let total = masked_sum(loss, mask.clone());
            match scale.global_tokens {
                Some(n) => total / n * dp,
                None => total / mask.sum() * dp,
            }
        }
        LossAggMode::SeqMeanTokenSum | LossAggMode::SeqMeanTokenMean => {
            let tokens = mask.clone().sum_dim(1);
            let mut seq = (loss * mask).sum_dim(1);
            if mode == LossAggMode::SeqMeanTokenMean {
                seq = seq / (tokens.clone() + 1e-8);
            }
            // Sequences with no token are left out of the mean.
            let seq_mask = tokens.greater_elem(0.0).float();
            let total = masked_sum(seq, seq_mask.clone());
            match scale.global_sequences {
                Some(n) => total / n * dp,
                None => total / seq_mask.sum() * dp,
            }
        }
        LossAggMode::SeqMeanTokenSumNorm => {
            let len = mask.dims()[1] as f64;
            masked_sum(loss, mask) / scale.loss_scale_factor.unwrap_or(len)
        }
    }
}

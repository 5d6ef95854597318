//! The critic's clipped value loss.

use burn::prelude::*;

use super::aggregation::{agg_loss, AggScale, LossAggMode};
use super::host::scalar;
use super::masked::masked_mean;
use super::same_shape;
use crate::error::AlgorithmError;

/// PPO's clipped value loss: ½·agg(max((V − R)², (clip(V, V_old ± ε) − R)²)), and the fraction
/// of tokens where the clipped term is the larger one (`critic/vf_clipfrac`).
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::{value::value_loss, AggScale, LossAggMode};
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let t = |v: f32| Tensor::<B, 2>::from_floats([[v]], &d);
/// // V = 2, V_old = 0, R = 0, ε = 0.5: clipped V = 0.5; max(4, 0.25) = 4; loss = 2.
/// let (loss, frac) = value_loss(t(2.0), t(0.0), t(0.0), t(1.0), 0.5, LossAggMode::TokenMean, AggScale::default())?;
/// assert_eq!((loss.into_scalar(), frac), (2.0, 0.0));
/// # Ok::<(), verl_core::error::AlgorithmError>(())
/// ```
pub fn value_loss<B: Backend>(
    vpreds: Tensor<B, 2>,
    returns: Tensor<B, 2>,
    values: Tensor<B, 2>,
    response_mask: Tensor<B, 2>,
    cliprange_value: f64,
    mode: LossAggMode,
    scale: AggScale,
) -> Result<(Tensor<B, 1>, f64), AlgorithmError> {
    let d = vpreds.dims();
    same_shape("value_loss: returns", &d, &returns.dims())?;
    same_shape("value_loss: values", &d, &values.dims())?;
    same_shape("value_loss: response_mask", &d, &response_mask.dims())?;
    let lo = values.clone() - cliprange_value;
    let hi = values + cliprange_value;
    let clipped = vpreds.clone().max_pair(lo).min_pair(hi);
    let l1 = (vpreds - returns.clone()).powf_scalar(2.0);
    let l2 = (clipped - returns).powf_scalar(2.0);
    let frac = scalar(masked_mean(
        l2.clone().greater(l1.clone()).float(),
        response_mask.clone(),
    ));
    let loss = agg_loss(l1.max_pair(l2), response_mask, mode, scale) * 0.5;
    Ok((loss, frac))
}

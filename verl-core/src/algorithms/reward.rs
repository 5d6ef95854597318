//! Turning sequence scores into token-level rewards, and the in-reward KL penalty.

use burn::prelude::*;

use super::host::{scalar, Host2};
use super::kl::{kl_penalty, KlController, KlPenalty};
use super::masked::masked_mean_dim;
use super::same_shape;
use crate::error::AlgorithmError;
use crate::Metrics;

/// Places each sequence's score on its last unmasked response token (verl's reward managers);
/// a response with no unmasked token gets no reward.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::reward::token_level_rewards;
/// use verl_core::backend::CpuBackend as B;
/// let mask = Tensor::<B, 2>::from_floats([[1., 1., 0.], [1., 1., 1.]], &Default::default());
/// let r = token_level_rewards(&[2.0, -1.0], &mask)?;
/// assert_eq!(r.to_data().to_vec::<f32>().unwrap(), vec![0., 2., 0., 0., 0., -1.]);
/// # Ok::<(), verl_core::error::AlgorithmError>(())
/// ```
pub fn token_level_rewards<B: Backend>(
    scores: &[f64],
    response_mask: &Tensor<B, 2>,
) -> Result<Tensor<B, 2>, AlgorithmError> {
    let m = Host2::from_tensor(response_mask);
    same_shape("token_level_rewards: scores", &[m.rows], &[scores.len()])?;
    let mut r = Host2::zeros(m.rows, m.cols);
    for (i, &s) in scores.iter().enumerate() {
        if let Some(t) = (0..m.cols).rev().find(|&t| m.at(i, t) > 0.0) {
            r.set(i, t, s);
        }
    }
    Ok(r.to_tensor(&response_mask.device()))
}

/// rewards = scores − β·KL(old ‖ ref)·mask, then β is updated from the batch's mean
/// per-sequence KL. Metrics: `actor/reward_kl_penalty`, `actor/reward_kl_penalty_coeff`.
pub fn apply_kl_penalty<B: Backend>(
    token_level_scores: Tensor<B, 2>,
    old_log_prob: Tensor<B, 2>,
    ref_log_prob: Tensor<B, 2>,
    response_mask: Tensor<B, 2>,
    controller: &mut dyn KlController,
    penalty: KlPenalty,
) -> Result<(Tensor<B, 2>, Metrics), AlgorithmError> {
    let d = token_level_scores.dims();
    same_shape("apply_kl_penalty: old_log_prob", &d, &old_log_prob.dims())?;
    same_shape("apply_kl_penalty: ref_log_prob", &d, &ref_log_prob.dims())?;
    same_shape("apply_kl_penalty: response_mask", &d, &response_mask.dims())?;
    let beta = controller.value();
    let kld = kl_penalty(old_log_prob, ref_log_prob, penalty) * response_mask.clone();
    let rewards = token_level_scores - kld.clone() * beta;
    let current_kl = scalar(masked_mean_dim(kld, response_mask, 1).mean());
    controller.update(current_kl, d[0]);
    let mut metrics = Metrics::default();
    metrics.push("actor/reward_kl_penalty", current_kl);
    metrics.push("actor/reward_kl_penalty_coeff", beta);
    Ok((rewards, metrics))
}

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

/// DAPO's overlong reward shaping (verl's `dapo` reward manager): a response longer than
/// `max_resp_len − buffer_len` tokens loses `penalty_factor` per `buffer_len` tokens past that,
/// growing linearly to `penalty_factor` at `max_resp_len`; shorter ones lose nothing. Added to
/// the response's score.
///
/// ```
/// use verl_core::algorithms::reward::OverlongBuffer;
/// let b = OverlongBuffer { max_resp_len: 20, buffer_len: 4, penalty_factor: 1.0, log: false };
/// assert_eq!(b.reward(16), 0.0); // up to 20 − 4 tokens: no penalty
/// assert_eq!(b.reward(18), -0.5); // half-way through the buffer
/// assert_eq!(b.reward(20), -1.0); // the hard limit: the whole factor
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongBuffer {
    /// `max_resp_len` (the data's `max_response_length` in verl's DAPO recipe).
    pub max_resp_len: usize,
    /// `overlong_buffer.len`: at least 1 and at most `max_resp_len`.
    pub buffer_len: usize,
    /// `overlong_buffer.penalty_factor`.
    pub penalty_factor: f64,
    /// `overlong_buffer.log`: each response's shaping kept as reward extras.
    pub log: bool,
}

impl OverlongBuffer {
    /// The shaping term of a response of `response_len` tokens (≤ 0).
    pub fn reward(&self, response_len: usize) -> f64 {
        let expected = self.max_resp_len as f64 - self.buffer_len as f64;
        let exceed = response_len as f64 - expected;
        (-exceed / self.buffer_len.max(1) as f64 * self.penalty_factor).min(0.0)
    }
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

#[cfg(test)]
mod overlong_tests {
    use super::OverlongBuffer;

    proptest::proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// The shaping is 0 up to the buffer, never positive, linear inside the buffer, and
        /// −penalty_factor at the hard limit.
        #[test]
        fn overlong_reward_is_a_ramp_inside_the_buffer(
            max in 2usize..5000, frac in 0.01f64..1.0, factor in 0.0f64..4.0, len in 0usize..6000,
        ) {
            let buffer_len = ((max as f64 * frac) as usize).clamp(1, max);
            let b = OverlongBuffer { max_resp_len: max, buffer_len, penalty_factor: factor, log: false };
            let r = b.reward(len);
            proptest::prop_assert!(r <= 0.0);
            if len <= max - buffer_len {
                proptest::prop_assert_eq!(r, 0.0);
            } else {
                // The naive formula, term by term.
                let naive = -((len - (max - buffer_len)) as f64) / buffer_len as f64 * factor;
                proptest::prop_assert!((r - naive).abs() <= 1e-9 * naive.abs().max(1.0));
            }
            proptest::prop_assert!((b.reward(max) + factor).abs() <= 1e-9 * factor.max(1.0));
        }
    }
}

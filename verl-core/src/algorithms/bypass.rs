//! verl's bypass mode of rollout correction (`algorithm.rollout_correction.bypass_mode`): the
//! rollout's log-probs serve as the old ones, so the step skips the actor's old-log-prob pass
//! and trains two policies (rollout, current) instead of three.
//!
//! The correction then runs inside each micro-batch's loss, between the current policy
//! (detached) and the rollout's: its weights and rejection mask come from
//! [`rollout_correction`], and the loss is either
//! - `ppo_clip`: vanilla PPO with the ratio π/π_rollout, whose clipping already bounds the
//!   off-policy ratio, so no importance weights are applied (they would count it twice); or
//! - `reinforce`: REINFORCE with the truncated weights applied explicitly
//!   ([`super::policy_loss::reinforce`]).
//!
//! In both, rejection removes tokens from the policy loss only (the entropy and KL terms keep
//! the response mask), as verl's `compute_policy_loss_bypass_mode` does. The rollout's
//! log-probs stay the old ones whatever the number of mini-batches, as in verl's Megatron
//! actor (its FSDP actor swaps in the current log-probs for an update of one mini-batch and
//! one epoch). REINFORCE has no ratio to clip: its clip fractions are logged as 0 where verl
//! logs none.

use std::collections::BTreeMap;
use std::str::FromStr;

use burn::prelude::*;

use super::policy_loss::{reinforce, vanilla, PolicyLossInput, PolicyLossOutput};
use super::rollout_correction::{rollout_correction, RolloutCorrection};
use crate::error::AlgorithmError;

type Result<T> = std::result::Result<T, AlgorithmError>;

/// Bypass mode's policy loss (`algorithm.rollout_correction.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BypassLoss {
    /// PPO-clip on π/π_rollout, no importance weights (verl's default).
    PpoClip,
    /// REINFORCE with the truncated importance weights.
    Reinforce,
}

impl FromStr for BypassLoss {
    type Err = AlgorithmError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ppo_clip" => Ok(Self::PpoClip),
            "reinforce" => Ok(Self::Reinforce),
            other => Err(AlgorithmError::Invalid {
                algorithm: "rollout_correction".into(),
                message: format!(
                    "loss_type `{other}`: bypass mode's loss is `ppo_clip` or `reinforce`"
                ),
            }),
        }
    }
}

/// Bypass mode's settings: the loss, and the correction (weights, rejection) it applies.
#[derive(Debug, Clone, PartialEq)]
pub struct BypassMode {
    pub loss: BypassLoss,
    pub correction: RolloutCorrection,
}

/// One micro-batch's policy loss in bypass mode. `input.old_log_prob` holds the rollout's
/// log-probs; `input.rollout_is_weights` is ignored (the weights are computed here, from the
/// current policy). Returns the loss and the correction's `rollout_corr/` metrics.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::bypass::{bypass_mode_loss, BypassLoss, BypassMode};
/// use verl_core::algorithms::policy_loss::PolicyLossInput;
/// use verl_core::algorithms::rollout_correction::RolloutCorrection;
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let t = |v: [[f32; 2]; 1]| Tensor::<B, 2>::from_floats(v, &d);
/// let correction = RolloutCorrection::parse(Some("token"), 2.0, false, None, None)?;
/// let mode = BypassMode { loss: BypassLoss::Reinforce, correction };
/// // log π − log π_rollout = [ln 3, 0]: weights [min(3, 2), 1] = [2, 1].
/// let rollout = t([[-3.0f32.ln(), -1.0]]);
/// let x = PolicyLossInput::new(rollout, t([[0.0, -1.0]]), t([[1.0, 1.0]]), t([[1.0, 1.0]]));
/// let (out, metrics) = bypass_mode_loss(&x, &mode)?;
/// // token-mean of −A·log π·w = [0, 1·1] → 0.5.
/// assert!((out.loss.into_scalar() - 0.5).abs() < 1e-6);
/// assert!(metrics.contains_key("rollout_corr/rollout_is_mean"));
/// # Ok::<(), verl_core::error::AlgorithmError>(())
/// ```
pub fn bypass_mode_loss<B: Backend>(
    input: &PolicyLossInput<B>,
    mode: &BypassMode,
) -> Result<(PolicyLossOutput<B>, BTreeMap<String, f64>)> {
    let corrected = rollout_correction(
        input.log_prob.clone().detach(),
        input.old_log_prob.clone(),
        input.response_mask.clone(),
        &mode.correction,
    )?;
    let mut effective = input.clone();
    effective.response_mask = corrected.response_mask;
    let out = match mode.loss {
        BypassLoss::PpoClip => {
            effective.rollout_is_weights = None;
            vanilla(&effective)?
        }
        BypassLoss::Reinforce => {
            effective.rollout_is_weights = corrected.weights;
            reinforce(&effective)?
        }
    };
    Ok((out, corrected.metrics))
}

//! The RL algorithm layer, as pure functions over burn tensors and masks (backend-generic, so the
//! same code runs on CPU and GPU). Semantics, defaults and edge cases follow verl's `core_algos.py`.
//!
//! - [`masked`]: masked sum / mean / variance / whitening.
//! - [`aggregation`]: the four loss aggregation modes.
//! - [`advantage`]: GAE, GRPO, GRPO pass@k, REINFORCE++ (and its baseline variant), RLOO, ReMax,
//!   OPO, GPG and the optimal token baseline (also verl's multi-turn variant), behind a registry keyed by verl's names.
//! - [`policy_loss`]: vanilla dual-clip PPO, GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO (geo-mean) and
//!   CISPO, behind a registry; REINFORCE for bypass mode.
//! - [`bypass`]: rollout correction's bypass mode (the rollout's log-probs as the old ones):
//!   PPO-clip or REINFORCE with the correction applied per micro-batch.
//! - [`kl`]: k1 / abs / k2 / k3 / full KL estimators, straight-through `+` variants, and the
//!   fixed and adaptive KL controllers of the in-reward penalty.
//! - [`value`]: the clipped value loss.
//! - [`logits`]: log-probabilities of labels and entropy from logits.
//! - [`reward`]: token-level rewards from sequence scores and the in-reward KL penalty.
//!
//! Masks are float tensors of 0 and 1 with the shape of what they mask; `[batch, response_len]`
//! for token-level quantities.

pub mod advantage;
pub mod aggregation;
pub mod balance;
pub mod bypass;
pub mod kl;
pub mod logits;
pub mod masked;
pub mod policy_loss;
pub mod registry;
pub mod reward;
pub mod rollout_correction;
pub mod value;

mod host;

pub use aggregation::{agg_loss, AggScale, LossAggMode};

use crate::error::AlgorithmError;

type Result<T> = std::result::Result<T, AlgorithmError>;

/// Checks that two tensors share a shape.
pub(crate) fn same_shape(what: &str, expected: &[usize], found: &[usize]) -> Result<()> {
    if expected != found {
        return Err(AlgorithmError::Shape {
            what: what.to_string(),
            expected: expected.to_vec(),
            found: found.to_vec(),
        });
    }
    Ok(())
}

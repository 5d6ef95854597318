use async_trait::async_trait;
use burn::prelude::*;

use crate::{DataProto, Metrics, Result};

/// Per-token log-probabilities of the response (and optionally the entropy), `[batch, response_len]`.
#[derive(Debug, Clone)]
pub struct LogProbOutput<B: Backend> {
    pub log_probs: Tensor<B, 2>,
    pub entropy: Option<Tensor<B, 2>>,
}

/// The policy being trained.
///
/// `data` carries verl's keys: `input_ids`, `attention_mask`, `position_ids`, `responses`,
/// `response_mask`, and for updates `old_log_probs`, `advantages` (and `ref_log_prob` with a KL
/// loss). Metrics use verl's names (`actor/pg_loss`, `actor/pg_clipfrac`, `actor/ppo_kl`, ...).
#[async_trait(?Send)]
pub trait Actor<B: Backend> {
    /// Log-probabilities of the responses under the current weights (no gradient).
    async fn compute_log_prob(
        &mut self,
        data: &DataProto<B>,
        calculate_entropy: bool,
    ) -> Result<LogProbOutput<B>>;

    /// One policy update over the batch (epochs, mini-batches, micro-batches as configured).
    async fn update_policy(&mut self, data: &DataProto<B>) -> Result<Metrics>;
}

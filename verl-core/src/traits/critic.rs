use async_trait::async_trait;
use burn::prelude::*;

use crate::{DataProto, Metrics, Result};

/// The value function of PPO.
#[async_trait(?Send)]
pub trait Critic<B: Backend> {
    /// Per-token values of the response, `[batch, response_len]` (no gradient).
    async fn compute_values(&mut self, data: &DataProto<B>) -> Result<Tensor<B, 2>>;

    /// One critic update on `values`, `returns` and `response_mask` (metrics: `critic/vf_loss`, ...).
    async fn update_critic(&mut self, data: &DataProto<B>) -> Result<Metrics>;
}

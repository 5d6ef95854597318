use async_trait::async_trait;
use burn::prelude::*;

use crate::{DataProto, Result, WeightStream};

/// How deeply a sleeping rollout engine frees its memory (vLLM's sleep levels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum SleepLevel {
    /// Free the KV cache; keep the weights (they are refreshed on wake-up anyway).
    KvCache,
    /// Free the KV cache and the weights.
    All,
}

/// Generates responses for prompts.
///
/// Input: left-padded `input_ids`, `attention_mask`, `position_ids` and a `uid` per prompt.
/// Output, in verl's layout: `prompts`, `responses` (right-padded), `input_ids`,
/// `attention_mask`, `position_ids`, `response_mask` (and optionally `rollout_log_probs`).
#[async_trait(?Send)]
pub trait RolloutEngine<B: Backend> {
    async fn generate_sequences(&mut self, prompts: DataProto<B>) -> Result<DataProto<B>>;

    /// Replaces the engine's weights from a per-tensor stream. A wrong name or shape is an error
    /// that names the tensor.
    async fn update_weights(&mut self, weights: WeightStream<'_, B>) -> Result<()>;

    /// Frees memory so the trainer can use it.
    async fn sleep(&mut self, level: SleepLevel) -> Result<()>;

    /// Regains what [`Self::sleep`] freed.
    async fn wake_up(&mut self) -> Result<()>;

    /// Whether the engine is asleep.
    fn is_sleeping(&self) -> bool;

    /// What a resumed run needs to sample exactly as the saved one would have (for example the
    /// counter its per-request seeds derive from); `Null` for a stateless engine.
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// Restores [`Self::state`].
    fn load_state(&mut self, _state: &serde_json::Value) -> Result<()> {
        Ok(())
    }
}

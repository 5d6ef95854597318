//! verl-rollout's error enum.

use verl_megatron::MegatronError;

use crate::sampling::SamplingError;

/// Errors of the rollout engine. Each names the setting or the input row to fix.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("rollout setting `{field}` = {value}: {message}")]
    Config {
        field: &'static str,
        value: String,
        message: String,
    },
    #[error("prompt row {row} has {len} tokens, more than `{field}` = {limit}; raise the limit or set `data.truncation` to left, right or middle")]
    PromptTooLong {
        row: usize,
        len: usize,
        limit: usize,
        field: &'static str,
    },
    #[error("prompt row {row} is empty (its attention_mask has no 1)")]
    EmptyPrompt { row: usize },
    #[error("the rollout engine is asleep; call wake_up before generating")]
    Asleep,
    #[error("the rollout engine's weights were released by sleep(All); call update_weights first")]
    WeightsReleased,
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Model(#[from] MegatronError),
    #[error(transparent)]
    Data(#[from] verl_core::error::DataProtoError),
    #[error(transparent)]
    Core(#[from] verl_core::Error),
}

impl From<RolloutError> for verl_core::Error {
    fn from(e: RolloutError) -> Self {
        match e {
            RolloutError::Core(e) => e,
            e => verl_core::Error::backend("rollout", e),
        }
    }
}

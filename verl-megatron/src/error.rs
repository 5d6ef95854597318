//! verl-megatron's error enum.

use std::path::PathBuf;

/// Errors of models and the Hugging Face bridge.
#[derive(Debug, thiserror::Error)]
pub enum MegatronError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: architecture `{found}` is not supported; supported: {supported}")]
    UnsupportedArchitecture {
        path: PathBuf,
        found: String,
        supported: String,
    },
}

impl From<MegatronError> for verl_core::Error {
    fn from(e: MegatronError) -> Self {
        verl_core::Error::backend("megatron", e)
    }
}

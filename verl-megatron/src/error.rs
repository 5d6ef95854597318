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
    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("{file}: unexpected tensor `{name}` (not part of this architecture; is config.json the right one?)")]
    UnexpectedTensor { name: String, file: PathBuf },
    #[error("{file}: tensor `{name}` has shape {found:?}, but the config implies {expected:?}")]
    TensorShape {
        name: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{file}: tensor `{name}` is stored as {dtype}; only F32, F16 and BF16 are supported")]
    TensorDtype {
        name: String,
        file: PathBuf,
        dtype: String,
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

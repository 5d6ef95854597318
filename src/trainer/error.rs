//! The trainer's error: a message naming the setting or file to fix.

/// A trainer error: a message naming the setting or file to fix.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Core(#[from] verl_core::Error),
    #[error(transparent)]
    Data(#[from] verl_core::error::DataProtoError),
}

/// A set-up error from anything that displays (the message names the key or file).
pub(crate) fn setup(e: impl std::fmt::Display) -> TrainError {
    TrainError::Setup(e.to_string())
}

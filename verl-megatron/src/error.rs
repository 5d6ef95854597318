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
    #[error(
        "model `{path}` not found: looked at {}; give a directory, or a hub id already in the \
         Hugging Face cache (nothing is downloaded; set HF_HOME or HF_HUB_CACHE where it lives)",
        looked.join(", ")
    )]
    ModelNotFound { path: String, looked: Vec<String> },
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
    #[error("weight `{name}` is not a tensor of this model (expected HF names such as `model.layers.0.self_attn.q_proj.weight`)")]
    UnknownWeight { name: String },
    #[error("weight `{name}` has shape {found:?}, but the model's is {expected:?}")]
    WeightShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("weight `{name}` was never provided (the stream ended without it)")]
    MissingWeight { name: String },
    #[error("`{field}`: {message}")]
    Setting { field: String, message: String },
    #[error(transparent)]
    Comm(#[from] verl_core::error::CommError),
    #[error("checkpoint: {message}")]
    Checkpoint { message: String },
    #[error(
        "{missing} of {trainable} trainable parameters got no gradient from micro-batch \
         {micro_batch}'s backward; the step is refused rather than applied with a partial \
         gradient (burn-autodiff 0.21 can drop a gradient while ranks run backward on several \
         threads at once, tracel-ai/burn#5573: resume from the last checkpoint)"
    )]
    LostGradients {
        missing: usize,
        trainable: usize,
        micro_batch: usize,
    },
    #[error(
        "activation recompute: {what} got no gradient from its backward; the step is refused \
         rather than applied with a partial gradient"
    )]
    RecomputeLostGradient { what: &'static str },
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

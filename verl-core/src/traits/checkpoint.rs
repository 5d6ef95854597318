use std::path::Path;

use async_trait::async_trait;
use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::{NamedTensor, Result};

/// On-disk checkpoint formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointFormat {
    /// Hugging Face layout (config.json + safetensors), loadable by `transformers`; model only.
    Hf,
    /// Sharded per-rank checkpoint with optimizer state, for exact resume.
    Dist,
}

/// What a save or load covers (verl's `checkpoint.save_contents` / `load_contents`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointContents {
    pub model: bool,
    pub optimizer: bool,
    pub extra: bool,
}

impl CheckpointContents {
    /// Model, optimizer and extra state: what an exact resume needs.
    pub const ALL: Self = Self {
        model: true,
        optimizer: true,
        extra: true,
    };
    /// Model weights only.
    pub const MODEL: Self = Self {
        model: true,
        optimizer: false,
        extra: false,
    };
}

/// The state a role saves: model and optimizer tensors of this rank, and extra JSON state
/// (scheduler, RNG, data-loader position).
#[derive(Debug, Clone)]
pub struct CheckpointState<B: Backend> {
    pub model: Vec<NamedTensor<B>>,
    pub optimizer: Vec<NamedTensor<B>>,
    pub extra: serde_json::Value,
}

/// Stores and restores [`CheckpointState`] in one [`CheckpointFormat`].
#[async_trait(?Send)]
pub trait CheckpointBackend<B: Backend> {
    fn format(&self) -> CheckpointFormat;

    /// Saves the requested parts under `dir`. An existing checkpoint is replaced only once the
    /// new one is complete.
    async fn save(
        &self,
        dir: &Path,
        state: &CheckpointState<B>,
        contents: CheckpointContents,
    ) -> Result<()>;

    /// Loads the requested parts from `dir` onto `device`.
    async fn load(
        &self,
        dir: &Path,
        contents: CheckpointContents,
        device: &B::Device,
    ) -> Result<CheckpointState<B>>;
}

//! Sharded checkpoints for exact resume: one directory per rank.

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use burn::prelude::*;
use verl_core::traits::{CheckpointBackend, CheckpointContents, CheckpointFormat, CheckpointState};

use super::{io, read_f32_tensors, replace_dir, write_f32_tensors};
use crate::MegatronError;

/// Saves this rank's state as `<dir>/rank_<rank>/{model,optim}.safetensors` + `extra.json`
/// (f32, bit-exact), each rank independently, as Megatron's distributed checkpoints do.
///
/// ```
/// use verl_core::traits::{CheckpointBackend, CheckpointContents, CheckpointState};
/// use verl_megatron::checkpoint::DistCheckpoint;
/// type B = verl_core::backend::CpuBackend;
/// # futures::executor::block_on(async {
/// let dir = tempfile::tempdir().unwrap();
/// let state = CheckpointState::<B> { model: vec![], optimizer: vec![], extra: serde_json::json!({"step": 3}) };
/// let ckpt = DistCheckpoint::new(0);
/// ckpt.save(dir.path(), &state, CheckpointContents::ALL).await.unwrap();
/// let back: CheckpointState<B> =
///     ckpt.load(dir.path(), CheckpointContents::ALL, &Default::default()).await.unwrap();
/// assert_eq!(back.extra["step"], 3);
/// # });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DistCheckpoint {
    pub rank: usize,
}

impl DistCheckpoint {
    pub fn new(rank: usize) -> Self {
        Self { rank }
    }

    /// This rank's directory under `dir`.
    pub fn rank_dir(&self, dir: &Path) -> PathBuf {
        dir.join(format!("rank_{:05}", self.rank))
    }
}

#[async_trait(?Send)]
impl<B: Backend> CheckpointBackend<B> for DistCheckpoint {
    fn format(&self) -> CheckpointFormat {
        CheckpointFormat::Dist
    }

    async fn save(
        &self,
        dir: &Path,
        state: &CheckpointState<B>,
        contents: CheckpointContents,
    ) -> verl_core::Result<()> {
        replace_dir(&self.rank_dir(dir), |d| {
            if contents.model {
                write_f32_tensors(&d.join("model.safetensors"), &state.model)?;
            }
            if contents.optimizer {
                write_f32_tensors(&d.join("optim.safetensors"), &state.optimizer)?;
            }
            if contents.extra {
                let p = d.join("extra.json");
                let text = serde_json::to_string_pretty(&state.extra).map_err(|e| io(&p, e))?;
                std::fs::write(&p, text).map_err(|e| io(&p, e))?;
            }
            Ok(())
        })?;
        Ok(())
    }

    async fn load(
        &self,
        dir: &Path,
        contents: CheckpointContents,
        device: &B::Device,
    ) -> verl_core::Result<CheckpointState<B>> {
        let d = self.rank_dir(dir);
        if !d.is_dir() {
            return Err(MegatronError::Checkpoint {
                message: format!(
                    "{} is missing, and the checkpoint records no layout to reshard it from \
                     (saved by an older verl-rs): resume it on the layout it was saved on",
                    d.display()
                ),
            }
            .into());
        }
        let model = if contents.model {
            read_f32_tensors(&d.join("model.safetensors"), device)?
        } else {
            Vec::new()
        };
        let optimizer = if contents.optimizer {
            read_f32_tensors(&d.join("optim.safetensors"), device)?
        } else {
            Vec::new()
        };
        let extra = if contents.extra {
            let p = d.join("extra.json");
            let text = verl_core::files::read_text(&p).map_err(|e| io(&p, e))?;
            serde_json::from_str(&text).map_err(|e| io(&p, e))?
        } else {
            serde_json::Value::Null
        };
        Ok(CheckpointState {
            model,
            optimizer,
            extra,
        })
    }
}

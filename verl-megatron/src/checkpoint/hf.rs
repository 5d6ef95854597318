//! Hugging Face checkpoints as a `CheckpointBackend`: the model only.

use std::path::Path;

use async_trait::async_trait;
use burn::prelude::*;
use serde_json::Value;
use verl_core::traits::{CheckpointBackend, CheckpointContents, CheckpointFormat, CheckpointState};
use verl_core::NamedTensor;

use super::replace_dir;
use crate::hf::{save_pretrained, HfCheckpoint, SaveOptions};

/// Saves the model as `config.json` + safetensors in the chosen dtype, which
/// `transformers.AutoModel*.from_pretrained` loads; optimizer and extra state are not part of
/// this format (use [`super::DistCheckpoint`] to resume).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HfCheckpointer {
    /// The model's `config.json` (see `HfModelConfig::to_config_json`).
    pub config_json: Value,
    pub options: SaveOptions,
}

#[async_trait(?Send)]
impl<B: Backend> CheckpointBackend<B> for HfCheckpointer {
    fn format(&self) -> CheckpointFormat {
        CheckpointFormat::Hf
    }

    async fn save(
        &self,
        dir: &Path,
        state: &CheckpointState<B>,
        contents: CheckpointContents,
    ) -> verl_core::Result<()> {
        if contents.model {
            replace_dir(dir, |d| {
                save_pretrained(&state.model, &self.config_json, d, self.options)
            })?;
        }
        Ok(())
    }

    async fn load(
        &self,
        dir: &Path,
        _contents: CheckpointContents,
        device: &B::Device,
    ) -> verl_core::Result<CheckpointState<B>> {
        let ckpt = HfCheckpoint::open(dir)?;
        let mut names: Vec<String> = ckpt.names().map(str::to_string).collect();
        names.sort();
        let model = names
            .into_iter()
            .map(|name| {
                let (values, shape) = ckpt.read_f32(&name)?;
                let n = values.len();
                Ok(NamedTensor {
                    name,
                    shape,
                    values: Tensor::<B, 1>::from_data(
                        burn::tensor::TensorData::new(values, [n]),
                        device,
                    ),
                })
            })
            .collect::<Result<Vec<_>, crate::MegatronError>>()?;
        Ok(CheckpointState {
            model,
            optimizer: Vec::new(),
            extra: Value::Null,
        })
    }
}

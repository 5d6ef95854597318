//! The reward-model worker (verl's Megatron `RewardModelWorker`): a causal LM body with a
//! one-label score head scores each sequence at its last valid token; the score lands on the
//! last response token of `rm_scores`, where verl's reward manager reads token-level rewards.

use burn::prelude::*;
use burn::tensor::TensorData;
use verl_core::dispatch::{megatron_dispatch_info, DispatchInfo};
use verl_core::topology::RankCoords;
use verl_core::worker::Worker;
use verl_core::{DataProto, Result};

use super::batch::{float_col, micro_batches, ModelInputs};
use crate::hf::{HeadKind, HfModelConfig};
use crate::models::CausalLm;
use crate::parallel::ParallelBackend;
use crate::MegatronError;

/// A frozen reward model on one rank.
pub struct RewardModelWorker<B: ParallelBackend> {
    pub coords: RankCoords,
    model: CausalLm<B>,
    /// Rows per forward pass (`reward_model.micro_batch_size_per_gpu`).
    micro_batch_rows: usize,
}

impl<B: ParallelBackend> Worker for RewardModelWorker<B> {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl<B: ParallelBackend> RewardModelWorker<B> {
    /// A worker around `model` built from `cfg`, which must have a one-label score head
    /// (`…ForSequenceClassification` or `…ForTokenClassification` with `num_labels = 1`).
    pub fn new(
        coords: RankCoords,
        cfg: &HfModelConfig,
        model: CausalLm<B>,
        micro_batch_rows: usize,
    ) -> Result<Self> {
        match cfg.head {
            HeadKind::SequenceClassification { num_labels: 1 }
            | HeadKind::TokenClassification { num_labels: 1 } => Ok(Self {
                coords,
                model,
                micro_batch_rows: micro_batch_rows.max(1),
            }),
            other => Err(verl_core::Error::backend(
                "reward_model",
                MegatronError::Setting {
                    field: "reward_model.model.path".into(),
                    message: format!(
                        "a reward model needs a one-label score head (…ForSequenceClassification with num_labels = 1); this checkpoint has {other:?}"
                    ),
                },
            )),
        }
    }

    /// `rm_scores` `[batch, R]` (MegatronCompute): each sequence's score at its last response
    /// token, zero elsewhere. A row with an empty response is scored at its last prompt token
    /// and the score is put on its first response slot, as verl's index arithmetic does.
    pub async fn compute_rm_score(&mut self, data: DataProto<B>) -> Result<DataProto<B>> {
        let mut parts = Vec::new();
        for range in micro_batches(data.len(), self.micro_batch_rows) {
            let micro = data.slice(range.start, range.end)?;
            let inputs = ModelInputs::from_batch(&micro)?;
            let device = inputs.input_ids.device();
            let t = inputs.input_ids.dims()[1];
            let r = inputs.response_len;
            // Outputs at the last prompt token and at every response token: `[b, R + 1]`.
            let scores = self
                .model
                .forward_window(
                    inputs.input_ids,
                    Some(inputs.attention_mask),
                    Some(inputs.position_ids),
                    t - r - 1,
                    r + 1,
                )
                .squeeze_dim::<2>(2);
            let lengths: Vec<usize> = float_col(&micro, "response_mask")?
                .sum_dim(1)
                .into_data()
                .convert::<f32>()
                .iter::<f32>()
                .map(|l| l.round() as usize)
                .collect();
            let scores: Vec<f32> = scores.into_data().convert::<f32>().iter::<f32>().collect();
            let mut out = vec![0f32; lengths.len() * r];
            for (i, &len) in lengths.iter().enumerate() {
                let score = scores[i * (r + 1) + len];
                if r > 0 {
                    out[i * r + len.max(1) - 1] = score;
                }
            }
            parts.push(Tensor::<B, 2>::from_data(
                TensorData::new(out, [lengths.len(), r]),
                &device,
            ));
        }
        let mut result = DataProto::new();
        result.insert_float("rm_scores", Tensor::cat(parts, 0))?;
        Ok(result)
    }
}

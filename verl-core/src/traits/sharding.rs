use async_trait::async_trait;
use burn::prelude::*;

use super::RolloutEngine;
use crate::{DataProto, Result, WeightStream};

/// A source of full (un-sharded, HF-named) weights, one tensor at a time: the actor side of the
/// hybrid engine. A tensor-parallel actor gathers each tensor across its tp group as it is yielded.
pub trait WeightExporter<B: Backend> {
    fn export_weights(&self) -> WeightStream<'_, B>;
}

/// What one actor → rollout resharding moved.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ReshardReport {
    pub tensors: usize,
    pub elements: usize,
    pub seconds: f64,
}

/// The hybrid engine's switch between training and generation on the same devices.
#[async_trait(?Send)]
pub trait ShardingManager<B: Backend> {
    /// Before generation: wake the rollout and stream the actor's weights into it, resharded from
    /// the training layout (tp/pp) to the rollout's own tp.
    async fn enter(
        &mut self,
        actor: &dyn WeightExporter<B>,
        rollout: &mut dyn RolloutEngine<B>,
    ) -> Result<ReshardReport>;

    /// After generation: put the rollout to sleep so training gets its memory back.
    async fn exit(&mut self, rollout: &mut dyn RolloutEngine<B>) -> Result<()>;

    /// Rearranges a batch from the training layout to the rollout layout (e.g. gathers across the
    /// rollout's tp group); identity by default.
    fn preprocess_data(&self, data: DataProto<B>) -> Result<DataProto<B>> {
        Ok(data)
    }

    /// The inverse of [`Self::preprocess_data`]; identity by default.
    fn postprocess_data(&self, data: DataProto<B>) -> Result<DataProto<B>> {
        Ok(data)
    }
}

use async_trait::async_trait;
use burn::prelude::*;

use super::RolloutEngine;
use crate::{DataProto, Result, WeightStream};

/// How one actor → rollout weight sync travels.
///
/// ```
/// use verl_core::traits::WeightSyncPlan;
/// let plan = WeightSyncPlan::with_bucket_megabytes(512);
/// assert_eq!(plan.bucket_bytes, 512 << 20);
/// assert!(!plan.shards_fit);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightSyncPlan {
    /// Tensors are gathered and handed over in buckets of about this many bytes
    /// (`rollout.update_weights_bucket_megabytes`): the most full tensors held at once.
    pub bucket_bytes: usize,
    /// The rollout's tensor-parallel layout is the actor's (same tp, no pipeline): every rank's
    /// shards go over as they are, nothing gathered.
    pub shards_fit: bool,
}

impl WeightSyncPlan {
    pub fn with_bucket_megabytes(megabytes: usize) -> Self {
        Self {
            bucket_bytes: megabytes.max(1) << 20,
            shards_fit: false,
        }
    }
}

/// A source of HF-named weights, one tensor at a time: the actor side of the hybrid engine.
/// Each tensor is full (gathered across the actor's tensor- and pipeline-parallel groups as it
/// is yielded, a bucket at a time) or, when the plan says the shards fit, this rank's shard.
pub trait WeightExporter<B: Backend> {
    fn export_weights(&self, plan: WeightSyncPlan) -> WeightStream<'_, B>;
}

/// What one actor → rollout resharding moved.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ReshardReport {
    pub tensors: usize,
    pub elements: usize,
    /// Bytes handed to the rollout (as the actor holds them, f32).
    pub bytes: usize,
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

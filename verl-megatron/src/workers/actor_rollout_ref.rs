//! The hybrid worker of verl's Megatron backend (`ActorRolloutRefWorker`): on one rank, the actor
//! being trained, the rollout engine it feeds (its weights streamed tensor by tensor through the
//! [`HybridShardingManager`]), and the frozen reference policy; and the `CriticWorker`.
//!
//! Methods take and return `DataProto`s with verl's keys; metrics travel back in
//! `meta_info["metrics"]` (one list per name), so the controller can merge ranks' results.

use std::time::Instant;

use async_trait::async_trait;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use verl_core::dispatch::{megatron_dispatch_info, DispatchInfo};
use verl_core::topology::RankCoords;
use verl_core::traits::{
    Actor, Critic, ReshardReport, RolloutEngine, ShardingManager, SleepLevel, WeightExporter,
};
use verl_core::worker::Worker;
use verl_core::{DataProto, Metrics, Result};

use super::actor::MegatronActor;
use super::batch::{micro_batches, ModelInputs};
use super::critic::MegatronCritic;
use crate::models::CausalLm;
use verl_core::algorithms::logits::log_probs_from_logits;

/// Streams the actor's weights into the rollout engine before generation and puts the engine
/// to sleep after it, as verl's Megatron sharding manager (at tp = 1 the stream is the full
/// tensors; a tensor-parallel actor gathers each tensor as it is yielded).
#[derive(Debug, Clone, Default)]
pub struct HybridShardingManager {
    /// Free the KV cache after generation (`rollout.free_cache_engine`).
    pub free_cache_engine: bool,
}

#[async_trait(?Send)]
impl<B: Backend> ShardingManager<B> for HybridShardingManager {
    async fn enter(
        &mut self,
        actor: &dyn WeightExporter<B>,
        rollout: &mut dyn RolloutEngine<B>,
    ) -> Result<ReshardReport> {
        let start = Instant::now();
        rollout.wake_up().await?;
        // Count what goes through without holding it.
        let counted = std::rc::Rc::new(std::cell::Cell::new((0usize, 0usize)));
        let c = counted.clone();
        let stream = futures::StreamExt::inspect(actor.export_weights(), move |t| {
            if let Ok(t) = t {
                let (n, e) = c.get();
                c.set((n + 1, e + t.numel()));
            }
        });
        rollout.update_weights(Box::pin(stream)).await?;
        let (tensors, elements) = counted.get();
        Ok(ReshardReport {
            tensors,
            elements,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    async fn exit(&mut self, rollout: &mut dyn RolloutEngine<B>) -> Result<()> {
        if self.free_cache_engine {
            rollout.sleep(SleepLevel::KvCache).await?;
        }
        Ok(())
    }
}

/// Adds `metrics` to `meta_info["metrics"]` (name → list of values), keeping what is there.
fn with_metrics<B: Backend>(mut data: DataProto<B>, metrics: &Metrics) -> DataProto<B> {
    let mut m = match data.meta_info.remove("metrics") {
        Some(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    for (k, v) in &metrics.0 {
        m.insert(k.clone(), serde_json::json!(v));
    }
    data.meta_info
        .insert("metrics".into(), serde_json::Value::Object(m));
    data
}

/// Actor + rollout + reference on one rank.
pub struct ActorRolloutRefWorker<B: AutodiffBackend> {
    pub coords: RankCoords,
    pub actor: MegatronActor<B>,
    pub rollout: Box<dyn RolloutEngine<B::InnerBackend>>,
    /// The frozen reference policy (`None` when no KL is used).
    pub reference: Option<CausalLm<B::InnerBackend>>,
    pub sharding: HybridShardingManager,
}

impl<B: AutodiffBackend> Worker for ActorRolloutRefWorker<B> {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl<B: AutodiffBackend> ActorRolloutRefWorker<B> {
    /// Rollout (mode MegatronPpAsDp): syncs the actor's weights into the engine, generates in
    /// verl's layout, frees the cache. `meta_info["metrics"]` gets the resharding figures.
    pub async fn generate_sequences(
        &mut self,
        prompts: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let report = self
            .sharding
            .enter(&self.actor, self.rollout.as_mut())
            .await?;
        let out = self.rollout.generate_sequences(prompts).await;
        self.sharding.exit(self.rollout.as_mut()).await?;
        let mut metrics = Metrics::default();
        metrics.push("timing_s/reshard", report.seconds);
        metrics.push("perf/reshard_tensors", report.tensors as f64);
        Ok(with_metrics(out?, &metrics))
    }

    /// `old_log_probs` (and `entropys`) of the responses under the actor (MegatronCompute).
    pub async fn compute_log_prob(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let out = self.actor.compute_log_prob(&data, true).await?;
        let mut result = DataProto::new();
        result.insert_float("old_log_probs", out.log_probs)?;
        if let Some(e) = out.entropy {
            result.insert_float("entropys", e)?;
        }
        Ok(result)
    }

    /// `ref_log_prob` under the frozen reference policy (MegatronCompute).
    pub async fn compute_ref_log_prob(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let reference = self.reference.as_ref().ok_or_else(|| {
            verl_core::Error::backend(
                "reference",
                crate::MegatronError::Setting {
                    field: "actor_rollout_ref.ref".into(),
                    message: "no reference model was built (enable a KL loss or KL penalty)".into(),
                },
            )
        })?;
        let temperature = data
            .meta_info
            .get("temperature")
            .and_then(serde_json::Value::as_f64)
            .filter(|t| *t > 0.0)
            .unwrap_or(self.actor.settings().temperature);
        let mut parts = Vec::new();
        for range in micro_batches(data.len(), self.actor.settings().log_prob_micro_batch_rows) {
            let micro = data.slice(range.start, range.end)?;
            let inputs = ModelInputs::from_batch(&micro)?;
            let logits = inputs.response_outputs(reference) / temperature;
            parts.push(log_probs_from_logits(logits, micro.int::<2>("responses")?));
        }
        let mut result = DataProto::new();
        result.insert_float("ref_log_prob", Tensor::cat(parts, 0))?;
        Ok(result)
    }

    /// One PPO policy update on this rank's share (MegatronCompute); metrics in `meta_info`.
    pub async fn update_actor(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let start = Instant::now();
        let mut metrics = self.actor.update_policy(&data).await?;
        metrics.push("timing_s/update_actor", start.elapsed().as_secs_f64());
        Ok(with_metrics(DataProto::new(), &metrics))
    }

    /// A supervised step on the responses (warm-up); metrics in `meta_info`.
    pub async fn sft_step(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let metrics = self.actor.sft_step(&data)?;
        Ok(with_metrics(DataProto::new(), &metrics))
    }
}

/// The critic on one rank.
pub struct CriticWorker<B: AutodiffBackend> {
    pub coords: RankCoords,
    pub critic: MegatronCritic<B>,
}

impl<B: AutodiffBackend> Worker for CriticWorker<B> {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl<B: AutodiffBackend> CriticWorker<B> {
    /// `values` of the responses (MegatronCompute).
    pub async fn compute_values(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let values = self.critic.compute_values(&data).await?;
        let mut out = DataProto::new();
        out.insert_float("values", values)?;
        Ok(out)
    }

    /// One critic update (MegatronCompute); metrics in `meta_info`.
    pub async fn update_critic(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let start = Instant::now();
        let mut metrics = self.critic.update_critic(&data).await?;
        metrics.push("timing_s/update_critic", start.elapsed().as_secs_f64());
        Ok(with_metrics(DataProto::new(), &metrics))
    }
}

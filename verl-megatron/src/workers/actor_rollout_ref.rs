//! The hybrid worker of verl's Megatron backend (`ActorRolloutRefWorker`): on one rank, the actor
//! being trained, the rollout engine it feeds (its weights streamed tensor by tensor through the
//! [`HybridShardingManager`]), and the frozen reference policy; and the `CriticWorker`.
//!
//! Methods take and return `DataProto`s with verl's keys; metrics travel back in
//! `meta_info["metrics"]` (one list per name), so the controller can merge ranks' results.

use std::path::PathBuf;
use std::time::Instant;

use async_trait::async_trait;
use burn::prelude::*;
use tracing::Instrument;
use verl_core::dispatch::{megatron_dispatch_info, DispatchInfo};
use verl_core::memory::{gib, PhasePeak};
use verl_core::topology::RankCoords;
use verl_core::traits::{
    Actor, CheckpointBackend, CheckpointContents, CheckpointState, Critic, ReshardReport,
    RolloutEngine, ShardingManager, SleepLevel, WeightExporter, WeightSyncPlan,
};
use verl_core::worker::Worker;
use verl_core::{DataProto, Metrics, Result};

use super::actor::MegatronActor;
use super::batch::{map_micro_batches, MicroBatching, ModelInputs};
use super::critic::MegatronCritic;
use super::engine::TrainingRole;
use super::offload::{push_phase_metrics, ParamOffload};
use crate::checkpoint::{DistCheckpoint, HfCheckpointer};
use crate::models::CausalLm;
use crate::parallel::{ParallelAutodiffBackend, ParallelBackend};

/// Streams the actor's weights into the rollout engine before generation and puts the engine
/// to sleep after it, as verl's Megatron sharding manager: when the rollout's tensor-parallel
/// layout is the actor's, each rank's shards go over as they are; otherwise the actor's
/// tensor- and pipeline-parallel groups gather full tensors a bucket at a time
/// (`rollout.update_weights_bucket_megabytes`) and each rollout rank keeps its own shard.
#[derive(Debug, Clone)]
pub struct HybridShardingManager {
    /// How the weights travel.
    pub plan: WeightSyncPlan,
    /// Free the KV cache after generation (`rollout.free_cache_engine`).
    pub free_cache_engine: bool,
    /// Also drop the engine's weights after generation (`SleepLevel::All`): with the actor's
    /// parameters offloaded, the engine's copy is what would keep them on the device, and the
    /// next generation streams them in again anyway.
    pub release_weights: bool,
}

impl Default for HybridShardingManager {
    /// verl's defaults: 512 MiB buckets, the cache freed after generation.
    fn default() -> Self {
        Self {
            plan: WeightSyncPlan::with_bucket_megabytes(512),
            free_cache_engine: true,
            release_weights: false,
        }
    }
}

#[async_trait(?Send)]
impl<B: ParallelBackend> ShardingManager<B> for HybridShardingManager {
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
        let stream = futures::StreamExt::inspect(actor.export_weights(self.plan), move |t| {
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
            bytes: elements * 4,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    async fn exit(&mut self, rollout: &mut dyn RolloutEngine<B>) -> Result<()> {
        if self.release_weights {
            rollout.sleep(SleepLevel::All).await?;
        } else if self.free_cache_engine {
            rollout.sleep(SleepLevel::KvCache).await?;
        }
        Ok(())
    }
}

/// Adds `metrics` to `meta_info["metrics"]` (name → list of values), keeping what is there.
fn with_metrics<B: ParallelBackend>(mut data: DataProto<B>, metrics: &Metrics) -> DataProto<B> {
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

/// What `save_checkpoint` writes (verl's `checkpoint.save_contents`), under `dir`:
/// `dist_ckpt/` (each rank's shard with optimizer state, for exact resume), `huggingface/` (the
/// model in HF layout, when `hf` is given) and, for the actor, `ref/` (the frozen reference).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CheckpointRequest {
    pub dir: PathBuf,
    pub contents: CheckpointContents,
    /// Also write the model in Hugging Face layout, with this config.
    pub hf: Option<HfCheckpointer>,
}

impl CheckpointRequest {
    fn dist(&self) -> PathBuf {
        self.dir.join("dist_ckpt")
    }
}

/// Actor + rollout + reference on one rank.
pub struct ActorRolloutRefWorker<B: ParallelAutodiffBackend> {
    pub coords: RankCoords,
    pub actor: MegatronActor<B>,
    pub rollout: Box<dyn RolloutEngine<B::InnerBackend>>,
    /// The frozen reference policy (`None` when no KL is used).
    pub reference: Option<CausalLm<B::InnerBackend>>,
    pub sharding: HybridShardingManager,
    /// The reference's parameters in host memory outside `compute_ref_log_prob`
    /// (`ref.megatron.param_offload`); the actor's offload lives in the actor.
    pub reference_offload: Option<ParamOffload<B::InnerBackend>>,
}

impl<B: ParallelAutodiffBackend> Worker for ActorRolloutRefWorker<B> {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl<B: ParallelAutodiffBackend> ActorRolloutRefWorker<B> {
    /// Rollout (mode MegatronPpAsDp): syncs the actor's weights into the engine, generates in
    /// verl's layout, frees the cache, then recomputes `old_log_probs` (and `entropys`) with
    /// the actor, as verl's Megatron worker does; `meta_info["recompute_log_prob"] = false`
    /// skips that (validation). `meta_info["metrics"]` gets the resharding figures.
    pub async fn generate_sequences(
        &mut self,
        prompts: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let recompute = prompts
            .meta_info
            .get("recompute_log_prob")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(true);
        let phase = PhasePeak::start();
        self.actor.sample_memory();
        // The actor's parameters are on the device only while they stream into the engine.
        self.actor.bring_in(false)?;
        let report = self
            .sharding
            .enter(&self.actor, self.rollout.as_mut())
            .instrument(tracing::info_span!("reshard"))
            .await;
        self.actor.put_away_read_only()?;
        let report = report?;
        let out = self
            .rollout
            .generate_sequences(prompts)
            .instrument(tracing::info_span!("rollout_generate"))
            .await;
        // The KV cache is at its fullest.
        self.actor.sample_memory();
        self.sharding.exit(self.rollout.as_mut()).await?;
        let mut out = out?;
        let mut metrics = Metrics::default();
        metrics.push("perf/weight_sync_s", report.seconds);
        metrics.push("perf/weight_sync_gb", report.bytes as f64 / 1e9);
        metrics.push("perf/weight_sync_tensors", report.tensors as f64);
        self.finish_phase("generate", phase, &mut metrics);
        if recompute {
            let start = Instant::now();
            let phase = PhasePeak::start();
            self.actor.sample_memory();
            let lp = self
                .actor
                .compute_log_prob(&out, true)
                .instrument(tracing::info_span!("old_log_prob"))
                .await?;
            out.insert_float("old_log_probs", lp.log_probs)?;
            if let Some(e) = lp.entropy {
                out.insert_float("entropys", e)?;
            }
            metrics.push("timing_s/old_log_prob", start.elapsed().as_secs_f64());
            self.finish_phase("old_log_prob", phase, &mut metrics);
        }
        Ok(with_metrics(out, &metrics))
    }

    /// Ends a phase: its peak memory and what offload moved in it go into `metrics`, with the
    /// bytes this worker keeps in host memory.
    fn finish_phase(&mut self, phase: &str, peak: PhasePeak, metrics: &mut Metrics) {
        let (moved, mut host) = self.actor.take_offload_moved();
        let mut moved = moved;
        if let Some(r) = self.reference_offload.as_mut() {
            moved = moved + r.take_moved();
            host += r.host_bytes();
        }
        push_phase_metrics(metrics, phase, peak.finish(), moved);
        self.actor.release_cached_memory();
        if self.actor.offloads() || self.reference_offload.is_some() {
            metrics.push("perf/offload_host_gb/actor_rollout_ref", gib(host));
        }
    }

    /// `old_log_probs` (and `entropys`) of the responses under the actor (MegatronCompute).
    pub async fn compute_log_prob(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let phase = PhasePeak::start();
        self.actor.sample_memory();
        let out = self.actor.compute_log_prob(&data, true).await?;
        let mut result = DataProto::new();
        result.insert_float("old_log_probs", out.log_probs)?;
        if let Some(e) = out.entropy {
            result.insert_float("entropys", e)?;
        }
        let mut metrics = Metrics::default();
        self.finish_phase("old_log_prob", phase, &mut metrics);
        Ok(with_metrics(result, &metrics))
    }

    /// `ref_log_prob` under the frozen reference policy (MegatronCompute).
    pub async fn compute_ref_log_prob(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        if self.reference.is_none() {
            return Err(verl_core::Error::backend(
                "reference",
                crate::MegatronError::Setting {
                    field: "actor_rollout_ref.ref".into(),
                    message: "no reference model was built (enable a KL loss or KL penalty)".into(),
                },
            ));
        }
        let phase = PhasePeak::start();
        self.actor.sample_memory();
        if let Some(o) = self.reference_offload.as_mut() {
            o.reload(&mut self.reference)?;
        }
        let out = reference_log_probs(
            self.reference.as_ref().expect("checked above"),
            &data,
            self.actor.settings().temperature,
            self.actor.reference_batching(),
            self.actor.engine().pipeline_group().map(|g| g.as_ref()),
            self.actor
                .engine()
                .data_parallel_group()
                .map(|g| g.as_ref()),
        );
        if let Some(o) = self.reference_offload.as_mut() {
            o.offload_unchanged(&mut self.reference)?;
        }
        let mut metrics = Metrics::default();
        self.finish_phase("ref", phase, &mut metrics);
        Ok(with_metrics(out?, &metrics))
    }

    /// One PPO policy update on this rank's share (MegatronCompute); metrics in `meta_info`.
    pub async fn update_actor(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let start = Instant::now();
        let phase = PhasePeak::start();
        self.actor.sample_memory();
        let mut metrics = self.actor.update_policy(&data).await?;
        metrics.push("timing_s/update_actor", start.elapsed().as_secs_f64());
        self.finish_phase("update_actor", phase, &mut metrics);
        Ok(with_metrics(DataProto::new(), &metrics))
    }

    /// Saves this rank's actor (weights, optimizers, counters), the rollout engine's sampling
    /// state and the reference policy (OneToAll: every rank writes its own shard; rank 0 writes
    /// the HF copy).
    pub async fn save_checkpoint(&mut self, req: CheckpointRequest) -> Result<()> {
        self.bring_all_in()?;
        let saved = self.save_resident(req).await;
        self.put_all_away()?;
        saved
    }

    /// Makes the actor as it is now the reference policy (after the supervised warm-up, RL
    /// starts from the warmed-up actor); offload keeps each where its switches say. With bf16
    /// products the reference keeps its matrices in bf16 (`CausalLm::with_bf16_products`):
    /// the same log-probs, and no views of the actor's f32 matrices, which the actor's first
    /// update would otherwise have to copy, keeping a second f32 model alive for the run.
    pub fn set_reference(&mut self) -> Result<()> {
        self.actor.bring_in(false)?;
        // The old reference goes first: two on the device at once would be a model too many.
        self.reference = None;
        let actor = burn::module::AutodiffModule::valid(self.actor.model());
        self.reference = Some(actor.with_bf16_products());
        self.actor.put_away()?;
        if let Some(o) = self.reference_offload.as_mut() {
            o.forget();
            o.offload(&mut self.reference)?;
        }
        self.actor.take_offload_moved();
        if let Some(o) = self.reference_offload.as_mut() {
            o.take_moved();
        }
        Ok(())
    }

    /// Everything on the device (checkpoints read and write the whole state).
    fn bring_all_in(&mut self) -> Result<()> {
        self.actor.bring_in(true)?;
        if let Some(o) = self.reference_offload.as_mut() {
            o.reload(&mut self.reference)?;
        }
        Ok(())
    }

    /// Everything back where the offload switches keep it.
    fn put_all_away(&mut self) -> Result<()> {
        self.actor.put_away()?;
        if let Some(o) = self.reference_offload.as_mut() {
            o.offload(&mut self.reference)?;
        }
        let _ = self.actor.take_offload_moved();
        if let Some(o) = self.reference_offload.as_mut() {
            o.take_moved();
        }
        Ok(())
    }

    async fn save_resident(&mut self, req: CheckpointRequest) -> Result<()> {
        let mut state = self.actor.checkpoint_state(req.contents);
        if let Some(extra) = state.extra.as_object_mut() {
            extra.insert("rollout".into(), self.rollout.state());
        }
        let dist = DistCheckpoint::new(self.coords.rank);
        dist.save(&req.dist(), &state, req.contents).await?;
        if let Some(reference) = &self.reference {
            let r = super::state::model_state(reference);
            let contents = CheckpointContents {
                extra: true,
                ..CheckpointContents::MODEL
            };
            dist.save(&req.dir.join("ref"), &r, contents).await?;
        }
        save_hf_copy(&req, self.coords.rank, state, || self.actor.full_weights()).await
    }

    /// Restores what [`Self::save_checkpoint`] wrote (OneToAll: each rank reads its shard).
    pub async fn load_checkpoint(&mut self, req: CheckpointRequest) -> Result<()> {
        self.bring_all_in()?;
        let loaded = self.load_resident(req).await;
        self.put_all_away()?;
        loaded
    }

    async fn load_resident(&mut self, req: CheckpointRequest) -> Result<()> {
        let rank = self.coords.rank;
        let state = self
            .actor
            .engine()
            .read_dist_checkpoint(&req.dist(), rank, req.contents)
            .await?;
        let rollout = state.extra.get("rollout").cloned();
        self.actor.load_checkpoint_state(state, req.contents)?;
        if let Some(r) = rollout {
            self.rollout.load_state(&r)?;
        }
        if let Some(reference) = self.reference.as_mut() {
            let device = reference.devices().into_iter().next().unwrap_or_default();
            let saved = super::state::read_dist_state(
                &req.dir.join("ref"),
                rank,
                reference,
                &[],
                CheckpointContents::MODEL,
                &device,
            )
            .await?;
            for t in saved.model {
                reference.load_shard(t)?;
            }
        }
        Ok(())
    }

    /// A supervised step on the responses (warm-up); metrics in `meta_info`.
    pub async fn sft_step(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let phase = PhasePeak::start();
        self.actor.sample_memory();
        let mut metrics = self.actor.sft_step(&data)?;
        self.finish_phase("sft", phase, &mut metrics);
        Ok(with_metrics(DataProto::new(), &metrics))
    }
}

/// The critic on one rank.
pub struct CriticWorker<B: ParallelAutodiffBackend> {
    pub coords: RankCoords,
    pub critic: MegatronCritic<B>,
}

impl<B: ParallelAutodiffBackend> Worker for CriticWorker<B> {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl<B: ParallelAutodiffBackend> CriticWorker<B> {
    /// `values` of the responses (MegatronCompute).
    pub async fn compute_values(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let phase = PhasePeak::start();
        self.critic.sample_memory();
        let values = self.critic.compute_values(&data).await?;
        let mut out = DataProto::new();
        out.insert_float("values", values)?;
        let mut metrics = Metrics::default();
        self.finish_phase("values", phase, &mut metrics);
        Ok(with_metrics(out, &metrics))
    }

    /// Saves this rank's critic (weights, optimizer, counters) under `req.dir/dist_ckpt`, and
    /// on rank 0 the value model in HF layout when asked (OneToAll).
    pub async fn save_checkpoint(&mut self, req: CheckpointRequest) -> Result<()> {
        self.critic.bring_in(true)?;
        let state = self.critic.checkpoint_state(req.contents);
        let saved = match DistCheckpoint::new(self.coords.rank)
            .save(&req.dist(), &state, req.contents)
            .await
        {
            Ok(()) => {
                save_hf_copy(&req, self.coords.rank, state, || self.critic.full_weights()).await
            }
            Err(e) => Err(e),
        };
        self.critic.put_away()?;
        let _ = self.critic.take_offload_moved();
        saved
    }

    /// Ends a phase: its peak memory and what offload moved go into `metrics`.
    fn finish_phase(&mut self, phase: &str, peak: PhasePeak, metrics: &mut Metrics) {
        let (moved, host) = self.critic.take_offload_moved();
        push_phase_metrics(metrics, phase, peak.finish(), moved);
        self.critic.release_cached_memory();
        if self.critic.offloads() {
            metrics.push("perf/offload_host_gb/critic", gib(host));
        }
    }

    /// Restores what [`Self::save_checkpoint`] wrote (OneToAll).
    pub async fn load_checkpoint(&mut self, req: CheckpointRequest) -> Result<()> {
        self.critic.bring_in(true)?;
        let loaded = match self
            .critic
            .engine()
            .read_dist_checkpoint(&req.dist(), self.coords.rank, req.contents)
            .await
        {
            Ok(state) => self.critic.load_checkpoint_state(state, req.contents),
            Err(e) => Err(e),
        };
        self.critic.put_away()?;
        let _ = self.critic.take_offload_moved();
        loaded
    }

    /// One critic update (MegatronCompute); metrics in `meta_info`.
    pub async fn update_critic(
        &mut self,
        data: DataProto<B::InnerBackend>,
    ) -> Result<DataProto<B::InnerBackend>> {
        let start = Instant::now();
        let phase = PhasePeak::start();
        self.critic.sample_memory();
        let mut metrics = self.critic.update_critic(&data).await?;
        metrics.push("timing_s/update_critic", start.elapsed().as_secs_f64());
        self.finish_phase("update_critic", phase, &mut metrics);
        Ok(with_metrics(DataProto::new(), &metrics))
    }
}

/// When `req` asks for an HF copy: the full weights (`full`, a collective over the model-parallel
/// group, so every rank computes them) written once, by rank 0, with `state`'s extra.
async fn save_hf_copy<B: Backend>(
    req: &CheckpointRequest,
    rank: usize,
    mut state: CheckpointState<B>,
    full: impl FnOnce() -> Result<Vec<verl_core::NamedTensor<B>>>,
) -> Result<()> {
    let Some(hf) = &req.hf else {
        return Ok(());
    };
    let full = full()?;
    if rank == 0 {
        state.optimizer.clear();
        state.model = full;
        hf.save(
            &req.dir.join("huggingface"),
            &state,
            CheckpointContents::MODEL,
        )
        .await?;
    }
    Ok(())
}

/// `ref_log_prob` of the responses under a frozen policy: logits over the response window,
/// divided by the rollout temperature (`meta_info["temperature"]`, else `default_temperature`).
fn reference_log_probs<B: ParallelBackend>(
    model: &CausalLm<B>,
    data: &DataProto<B>,
    default_temperature: f64,
    how: MicroBatching,
    pp: Option<&dyn verl_core::traits::Communicator<B>>,
    dp: Option<&dyn verl_core::traits::Communicator<B>>,
) -> Result<DataProto<B>> {
    let temperature = super::actor::temperature_of(data, default_temperature);
    let parts = map_micro_batches(data, how, dp, |micro| {
        let inputs = ModelInputs::from_batch(micro)?.fused_for(model, micro, temperature)?;
        let labels = micro.int::<2>("responses")?;
        let Some(out) = inputs.pipelined_outputs(model, pp)? else {
            // Not collected (MegatronCompute reads the last stage).
            return Ok(vec![Tensor::zeros(labels.dims(), &labels.device())]);
        };
        let (log_probs, _) = super::actor::log_probs_from(model, out, labels, temperature, false);
        Ok(vec![log_probs])
    })?;
    let mut result = DataProto::new();
    result.insert_float("ref_log_prob", parts.into_iter().next().expect("log-probs"))?;
    Ok(result)
}

/// A reference policy on its own ranks (verl's `ActorRolloutRefWorker` in the `ref` role),
/// for when the reference is not colocated with the actor.
pub struct ReferenceWorker<B: ParallelBackend> {
    pub coords: RankCoords,
    /// Always present; an `Option` so offload can take it and give it back.
    pub model: Option<CausalLm<B>>,
    /// The parameters in host memory outside `compute_ref_log_prob` (`param_offload`).
    pub offload: Option<ParamOffload<B>>,
    /// The rollout temperature the log-probs are taken at, unless the batch says otherwise.
    pub temperature: f64,
    /// Rows per forward pass (`ref.log_prob_micro_batch_size_per_gpu`).
    pub micro_batch_rows: usize,
}

impl<B: ParallelBackend> Worker for ReferenceWorker<B> {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl<B: ParallelBackend> ReferenceWorker<B> {
    /// `ref_log_prob` of the responses (MegatronCompute).
    pub async fn compute_ref_log_prob(&mut self, data: DataProto<B>) -> Result<DataProto<B>> {
        if let Some(o) = self.offload.as_mut() {
            o.reload(&mut self.model)?;
        }
        let model = self.model.as_ref().ok_or_else(|| {
            verl_core::Error::backend(
                "reference",
                crate::MegatronError::Setting {
                    field: "actor_rollout_ref.ref".into(),
                    message: "the reference worker has no model".into(),
                },
            )
        })?;
        let out = reference_log_probs(
            model,
            &data,
            self.temperature,
            MicroBatching::Rows(self.micro_batch_rows),
            None,
            None,
        );
        if let Some(o) = self.offload.as_mut() {
            o.offload_unchanged(&mut self.model)?;
        }
        out
    }
}

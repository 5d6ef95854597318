//! The training engine the actor and the critic share (verl's `BaseEngine`): the model and its
//! optimizers, the parallel groups a step reduces over (data, context, expert, pipeline),
//! offload between phases, micro-batching by token budget, the full weights and the checkpoint
//! state. A role keeps only what differs: its loss, its head's outputs, its settings.
//!
//! [`TrainingRole`] gives every role that holds an engine the same builder and phase methods
//! (`with_data_parallel`, `bring_in`, `put_away`, `checkpoint_state`, ...), written once here.

use std::sync::Arc;

use burn::module::{AutodiffModule, Module};
use verl_core::traits::{CheckpointContents, CheckpointState, Communicator};
use verl_core::{NamedTensor, Result};

use super::adamw::AdamW;
use super::batch::MicroBatching;
use super::offload::{Moved, TrainingOffload};
use super::optim::{ModelOptimizer, PipelineParallelGrads};
use crate::models::CausalLm;
use crate::parallel::ParallelAutodiffBackend;

/// verl's dynamic batch size for a role: micro-batches by token budget instead of row counts
/// (`use_dynamic_bsz` with `ppo_max_token_len_per_gpu` for the update and
/// `log_prob_max_token_len_per_gpu` for the forward-only passes); `None` keeps row counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DynamicBatch {
    pub update_max_tokens: Option<usize>,
    pub forward_max_tokens: Option<usize>,
    /// The reference policy's log-prob pass (`ref.log_prob_max_token_len_per_gpu`).
    pub reference_max_tokens: Option<usize>,
}

impl DynamicBatch {
    /// The update's micro-batching: by tokens when set, else `rows` per micro-batch.
    pub fn update(&self, rows: usize, key: &'static str) -> MicroBatching {
        MicroBatching::of(self.update_max_tokens, rows, key)
    }

    /// The forward-only passes' micro-batching.
    pub fn forward(&self, rows: usize, key: &'static str) -> MicroBatching {
        MicroBatching::of(self.forward_max_tokens, rows, key)
    }

    /// The reference policy's log-prob pass.
    pub fn reference(&self, rows: usize, key: &'static str) -> MicroBatching {
        MicroBatching::of(self.reference_max_tokens, rows, key)
    }
}

/// A role's model, optimizers, parallel groups and offload: see the module documentation.
pub struct TrainingEngine<B: ParallelAutodiffBackend> {
    /// Out of its place only while a step owns it.
    pub(super) model: Option<CausalLm<B>>,
    /// The role's optimizer (checkpointed as `optim/…`).
    pub(super) optim: ModelOptimizer<B, CausalLm<B>>,
    /// The supervised warm-up's own optimizer and schedule, when the role has one
    /// (checkpointed as `sft_optim/…`).
    pub(super) sft_optim: Option<ModelOptimizer<B, CausalLm<B>>>,
    /// Updates done so far (they seed mini-batch shuffling).
    pub(super) updates: u64,
    /// The data-parallel group: batch-wide counts and gradients are summed over it.
    pub(super) dp: Option<Arc<dyn Communicator<B::InnerBackend>>>,
    /// The pipeline group, when the model is one stage of several.
    pub(super) pp: Option<Arc<dyn Communicator<B::InnerBackend>>>,
    /// Parameters and optimizer state in host memory between phases (`param_offload`,
    /// `optimizer_offload`).
    pub(super) offload: Option<TrainingOffload<B>>,
    pub(super) dynamic: DynamicBatch,
}

impl<B: ParallelAutodiffBackend> TrainingEngine<B> {
    /// `model` trained by `optim` (whose state is laid out for the model's parameters).
    pub fn new(model: CausalLm<B>, optim: ModelOptimizer<B, CausalLm<B>>) -> Self {
        let optim = super::state::for_model(optim, &model);
        Self {
            model: Some(model),
            optim,
            sft_optim: None,
            updates: 0,
            dp: None,
            pp: None,
            offload: None,
            dynamic: DynamicBatch::default(),
        }
    }

    /// The model.
    pub fn model(&self) -> &CausalLm<B> {
        self.model
            .as_ref()
            .expect("the model is only out during a step")
    }

    /// The data-parallel group (batch-wide counts are summed over it).
    pub fn data_parallel_group(&self) -> Option<&Arc<dyn Communicator<B::InnerBackend>>> {
        self.dp.as_ref()
    }

    /// The pipeline group, when the model is one stage of several.
    pub fn pipeline_group(&self) -> Option<&Arc<dyn Communicator<B::InnerBackend>>> {
        self.pp.as_ref()
    }

    /// Optimizer steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optim.step
    }

    /// `values` summed over the data-parallel group (unchanged on one rank).
    pub(super) fn dp_sum(&self, values: &[f64]) -> Result<Vec<f64>> {
        super::state::dp_sum(self.dp.as_deref(), values)
    }

    /// Whether this rank computes the losses (the last pipeline stage; always without one).
    pub(super) fn is_last_stage(&self) -> bool {
        self.model().stage.is_last()
    }

    /// Every optimizer with its checkpoint name, the role's own first.
    fn optimizers(&self) -> Vec<(&'static str, &ModelOptimizer<B, CausalLm<B>>)> {
        let mut all = vec![("optim", &self.optim)];
        all.extend(self.sft_optim.as_ref().map(|o| ("sft_optim", o)));
        all
    }

    /// Applies `f` to every optimizer (the role's and the warm-up's).
    fn map_optimizers(
        mut self,
        f: impl Fn(ModelOptimizer<B, CausalLm<B>>) -> ModelOptimizer<B, CausalLm<B>>,
    ) -> Self {
        self.optim = f(self.optim);
        self.sft_optim = self.sft_optim.map(&f);
        self
    }

    /// Gives the supervised warm-up its own optimizer and schedule (before the parallel
    /// groups are set, which it then follows).
    pub(super) fn with_sft_optimizer(mut self, optim: ModelOptimizer<B, CausalLm<B>>) -> Self {
        self.sft_optim = Some(super::state::for_model(optim, self.model()));
        self
    }

    fn with_data_parallel(
        mut self,
        comm: Arc<dyn Communicator<B::InnerBackend>>,
        bucket_elems: usize,
    ) -> Self {
        self = self.map_optimizers(|o| o.with_data_parallel(comm.clone(), bucket_elems));
        self.dp = Some(comm);
        self
    }

    fn with_pipeline_parallel(mut self, comm: Arc<dyn Communicator<B::InnerBackend>>) -> Self {
        let tied_embedding = self.model().pipeline_tied_embedding();
        self = self.map_optimizers(|o| {
            o.with_pipeline_parallel(PipelineParallelGrads {
                comm: comm.clone(),
                tied_embedding,
            })
        });
        self.pp = Some(comm);
        self
    }

    /// Runs `f` on the offload with the model and every optimizer; nothing without offload.
    fn with_offload_state(
        &mut self,
        f: impl FnOnce(
            &mut TrainingOffload<B>,
            &mut Option<CausalLm<B>>,
            &mut [&mut AdamW<B::InnerBackend>],
        ) -> Result<()>,
    ) -> Result<()> {
        let Some(offload) = self.offload.as_mut() else {
            return Ok(());
        };
        let mut optims = vec![self.optim.adamw_mut()];
        optims.extend(self.sft_optim.as_mut().map(|o| o.adamw_mut()));
        f(offload, &mut self.model, &mut optims)
    }

    /// Brings the parameters (and with `optimizer`, the optimizer state) back to the device for
    /// a phase; nothing without offload.
    pub fn bring_in(&mut self, optimizer: bool) -> Result<()> {
        self.with_offload_state(|o, model, optims| o.bring_in(model, optims, optimizer))
    }

    /// Brings the parameters back for an update and starts the optimizer state's copy (see
    /// `TrainingOffload::bring_in_for_update`); nothing without offload.
    pub(super) fn bring_in_for_update(&mut self) -> Result<()> {
        self.with_offload_state(|o, model, _| o.bring_in_for_update(model))
    }

    /// The optimizer state on the device before an optimizer step.
    pub(super) fn ready_optimizer(&mut self) -> Result<()> {
        self.with_offload_state(|o, _, optims| o.ready_optimizer(optims))
    }

    /// Sends the parameters and optimizer state away after a phase, as the switches say.
    pub fn put_away(&mut self) -> Result<()> {
        self.with_offload_state(|o, model, optims| o.put_away(model, optims))
    }

    /// [`Self::put_away`] after a phase that only read the parameters (see
    /// `TrainingOffload::put_away_read_only`).
    pub fn put_away_read_only(&mut self) -> Result<()> {
        self.with_offload_state(|o, model, optims| o.put_away_read_only(model, optims))
    }

    /// Whether any of the role's state leaves the device between phases.
    pub fn offloads(&self) -> bool {
        self.offload.as_ref().is_some_and(|o| o.switches.any())
    }

    /// What offload moved since the last call (both ways), and the bytes in host memory now.
    pub fn take_offload_moved(&mut self) -> (Moved, u64) {
        self.offload
            .as_mut()
            .map_or_else(Default::default, TrainingOffload::take_moved)
    }

    /// Records the device's usage into the open phase's peak (and traces it: see
    /// [`crate::parallel::sample_memory`]).
    #[track_caller]
    pub fn sample_memory(&self) {
        crate::parallel::sample_module_memory::<B, _>(self.model());
    }

    /// Hands cached, unused device memory back between phases (see
    /// `ParallelBackend::release_cached_memory`).
    pub fn release_cached_memory(&self) {
        crate::parallel::release_module_memory::<B, _>(self.model());
    }

    /// Every weight of the model, full (gathered over tp, and over pp stages), on every rank:
    /// what the hybrid engine hands the rollout and what HF export writes. A collective over
    /// the model-parallel group.
    pub fn full_weights(&self) -> Result<Vec<NamedTensor<B::InnerBackend>>> {
        let model = self.model().valid();
        Ok(match &self.pp {
            Some(pp) => model.export_all_stages(pp.as_ref())?,
            None => model.export_weights(),
        })
    }

    /// The role's checkpoint state: weights, every optimizer (`optim/…`, `sft_optim/…`) and
    /// the update counter that seeds mini-batch shuffling.
    pub fn checkpoint_state(
        &self,
        contents: CheckpointContents,
    ) -> CheckpointState<B::InnerBackend> {
        super::state::save_state(
            self.model(),
            &self.optimizers(),
            serde_json::json!({ "updates": self.updates }),
            contents,
        )
    }

    /// This rank's state from the dist checkpoint at `dir`, saved on this layout or any other
    /// (tensor, pipeline and data parallel sizes, distributed optimizer on or off).
    pub async fn read_dist_checkpoint(
        &self,
        dir: &std::path::Path,
        rank: usize,
        contents: CheckpointContents,
    ) -> Result<CheckpointState<B::InnerBackend>> {
        let sharded: Vec<_> = self
            .optimizers()
            .into_iter()
            .map(|(name, o)| (name, o.sharded_over()))
            .collect();
        let device = self
            .model()
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default();
        super::state::read_dist_state(dir, rank, self.model(), &sharded, contents, &device).await
    }

    /// Restores what [`Self::checkpoint_state`] saved (exact resume).
    pub fn load_checkpoint_state(
        &mut self,
        state: CheckpointState<B::InnerBackend>,
        contents: CheckpointContents,
    ) -> Result<()> {
        let mut model = self.model.take().expect("model present");
        let mut optims = vec![("optim", &mut self.optim)];
        optims.extend(self.sft_optim.as_mut().map(|o| ("sft_optim", o)));
        let result = super::state::load_state(&mut model, &mut optims, state, contents);
        self.model = Some(model);
        if let Some(u) = result?.get("updates").and_then(serde_json::Value::as_u64) {
            self.updates = u;
        }
        Ok(())
    }
}

/// A role trained by a [`TrainingEngine`] (the actor, the critic): the builder and phase
/// methods every such role has, written once over its engine.
pub trait TrainingRole<B: ParallelAutodiffBackend>: Sized {
    /// The role's engine.
    fn engine(&self) -> &TrainingEngine<B>;

    /// The role's engine, to change.
    fn engine_mut(&mut self) -> &mut TrainingEngine<B>;

    /// The role with its engine passed through `f` (the builders below).
    fn map_engine(self, f: impl FnOnce(TrainingEngine<B>) -> TrainingEngine<B>) -> Self;

    /// Keeps the parameters and optimizer state in host memory between phases, as `offload`'s
    /// switches say (they leave the device at once, as verl offloads after building the model).
    fn with_offload(mut self, offload: TrainingOffload<B>) -> Result<Self> {
        let engine = self.engine_mut();
        engine.offload = Some(offload);
        engine.put_away()?;
        Ok(self)
    }

    /// Forms micro-batches by token budget ([`DynamicBatch`]); the loss normalisation is the
    /// mini-batch's either way, so the update is the one fixed micro-batches make.
    fn with_dynamic_batch(mut self, dynamic: DynamicBatch) -> Self {
        self.engine_mut().dynamic = dynamic;
        self
    }

    /// Trains data-parallel over `comm`: each rank updates on its share of every mini-batch,
    /// with the loss normalised by the whole mini-batch and gradients summed in buckets of
    /// `bucket_elems`, so every rank applies the single-rank update.
    fn with_data_parallel(
        self,
        comm: Arc<dyn Communicator<B::InnerBackend>>,
        bucket_elems: usize,
    ) -> Self {
        self.map_engine(|e| e.with_data_parallel(comm, bucket_elems))
    }

    /// With context parallelism: the gradients are summed over `dp_cp` (data × context
    /// parallel: each cp rank's are its own tokens' share of its data-parallel rank's loss,
    /// which every cp rank computes whole from the gathered outputs), while batch-wide counts
    /// and reported losses stay summed over the data-parallel group only. Call it after
    /// [`Self::with_data_parallel`]; a distributed optimizer then shards over `dp_cp`, as
    /// Megatron's does.
    fn with_context_parallel(
        self,
        dp_cp: Arc<dyn Communicator<B::InnerBackend>>,
        bucket_elems: usize,
    ) -> Self {
        self.map_engine(|e| e.map_optimizers(|o| o.with_data_parallel(dp_cp.clone(), bucket_elems)))
    }

    /// With expert parallelism (ep > 1, or an expert tensor parallel size other than tp): the
    /// routed experts' gradients are summed over `expert_dp`, the ranks holding the same expert
    /// shard (Megatron's expert data-parallel group).
    fn with_expert_data_parallel(self, expert_dp: Arc<dyn Communicator<B::InnerBackend>>) -> Self {
        self.map_engine(|e| e.map_optimizers(|o| o.with_expert_data_parallel(expert_dp.clone())))
    }

    /// Trains one pipeline stage (the model built for its stage) with the pipeline group
    /// `comm`: each mini-batch runs through the stages in the 1F1B schedule, the gradient norm
    /// adds up over the stages and a tied embedding's gradient is summed between the first and
    /// the last stage. Losses and metrics come from the last stage.
    fn with_pipeline_parallel(self, comm: Arc<dyn Communicator<B::InnerBackend>>) -> Self {
        self.map_engine(|e| e.with_pipeline_parallel(comm))
    }

    /// The model.
    fn model(&self) -> &CausalLm<B> {
        self.engine().model()
    }

    /// See [`TrainingEngine::bring_in`].
    fn bring_in(&mut self, optimizer: bool) -> Result<()> {
        self.engine_mut().bring_in(optimizer)
    }

    /// See [`TrainingEngine::put_away`].
    fn put_away(&mut self) -> Result<()> {
        self.engine_mut().put_away()
    }

    /// See [`TrainingEngine::put_away_read_only`].
    fn put_away_read_only(&mut self) -> Result<()> {
        self.engine_mut().put_away_read_only()
    }

    /// See [`TrainingEngine::offloads`].
    fn offloads(&self) -> bool {
        self.engine().offloads()
    }

    /// See [`TrainingEngine::take_offload_moved`].
    fn take_offload_moved(&mut self) -> (Moved, u64) {
        self.engine_mut().take_offload_moved()
    }

    /// See [`TrainingEngine::sample_memory`].
    #[track_caller]
    fn sample_memory(&self) {
        self.engine().sample_memory()
    }

    /// See [`TrainingEngine::release_cached_memory`].
    fn release_cached_memory(&self) {
        self.engine().release_cached_memory()
    }

    /// See [`TrainingEngine::full_weights`].
    fn full_weights(&self) -> Result<Vec<NamedTensor<B::InnerBackend>>> {
        self.engine().full_weights()
    }

    /// See [`TrainingEngine::checkpoint_state`].
    fn checkpoint_state(&self, contents: CheckpointContents) -> CheckpointState<B::InnerBackend> {
        self.engine().checkpoint_state(contents)
    }

    /// See [`TrainingEngine::load_checkpoint_state`].
    fn load_checkpoint_state(
        &mut self,
        state: CheckpointState<B::InnerBackend>,
        contents: CheckpointContents,
    ) -> Result<()> {
        self.engine_mut().load_checkpoint_state(state, contents)
    }
}

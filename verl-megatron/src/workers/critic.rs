//! The Megatron critic: per-token values from a value head and the clipped value-loss update,
//! as verl's `MegatronPPOCritic`.

use std::sync::Arc;

use async_trait::async_trait;
use burn::module::AutodiffModule;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use verl_core::algorithms::aggregation::{AggScale, LossAggMode};
use verl_core::algorithms::masked::masked_mean;
use verl_core::algorithms::value::value_loss;
use verl_core::traits::{CheckpointContents, CheckpointState, Communicator, Critic};
use verl_core::{DataProto, Metrics, Result};

use super::actor::DynamicBatch;
use super::adamw::AdamW;
use super::batch::{float_col, map_micro_batches, training_micro_batches, ModelInputs};
use super::offload::{Moved, TrainingOffload};
use super::optim::{ModelOptimizer, PipelineParallelGrads};
use super::stage::train_micro_batches;
use crate::models::CausalLm;
use crate::parallel::ParallelAutodiffBackend;

/// The critic's update settings (row counts per rank).
#[derive(Debug, Clone, PartialEq)]
pub struct CriticSettings {
    pub mini_batch_rows: usize,
    pub micro_batch_rows: usize,
    pub forward_micro_batch_rows: usize,
    pub ppo_epochs: usize,
    pub shuffle: bool,
    pub seed: u64,
    pub cliprange_value: f64,
    pub loss_agg_mode: LossAggMode,
}

/// The value model (a causal LM body with a one-label token-classification head).
pub struct MegatronCritic<B: ParallelAutodiffBackend> {
    model: Option<CausalLm<B>>,
    optim: ModelOptimizer<B, CausalLm<B>>,
    settings: CriticSettings,
    updates: u64,
    /// The data-parallel group: batch-wide counts and gradients are summed over it.
    dp: Option<Arc<dyn Communicator<B::InnerBackend>>>,
    /// The pipeline group, when the model is one stage of several.
    pp: Option<Arc<dyn Communicator<B::InnerBackend>>>,
    /// Parameters and optimizer state in host memory between phases.
    offload: Option<TrainingOffload<B>>,
    dynamic: DynamicBatch,
}

impl<B: ParallelAutodiffBackend> MegatronCritic<B> {
    pub fn new(
        model: CausalLm<B>,
        optim: ModelOptimizer<B, CausalLm<B>>,
        settings: CriticSettings,
    ) -> Self {
        let optim = super::state::for_model(optim, &model);
        Self {
            model: Some(model),
            optim,
            settings,
            updates: 0,
            dp: None,
            pp: None,
            offload: None,
            dynamic: DynamicBatch::default(),
        }
    }

    /// Micro-batches by token budget (`critic.use_dynamic_bsz` with
    /// `ppo_max_token_len_per_gpu` and `forward_max_token_len_per_gpu`): see
    /// `MegatronActor::with_dynamic_batch`.
    pub fn with_dynamic_batch(mut self, dynamic: DynamicBatch) -> Self {
        self.dynamic = dynamic;
        self
    }

    /// Keeps the parameters and optimizer state in host memory between phases, as `offload`'s
    /// switches say (see `MegatronActor::with_offload`).
    pub fn with_offload(mut self, offload: TrainingOffload<B>) -> Result<Self> {
        self.offload = Some(offload);
        self.put_away()?;
        Ok(self)
    }

    /// Runs `f` on the offload with the model and the optimizer; nothing without offload.
    fn with_offload_state(
        &mut self,
        f: impl FnOnce(
            &mut TrainingOffload<B>,
            &mut Option<CausalLm<B>>,
            &mut [&mut AdamW<B::InnerBackend>],
        ) -> Result<()>,
    ) -> Result<()> {
        match self.offload.as_mut() {
            Some(o) => f(o, &mut self.model, &mut [self.optim.adamw_mut()]),
            None => Ok(()),
        }
    }

    /// Brings the parameters (and with `optimizer`, the optimizer state) back for a phase.
    pub fn bring_in(&mut self, optimizer: bool) -> Result<()> {
        self.with_offload_state(|o, model, optims| o.bring_in(model, optims, optimizer))
    }

    /// Brings the parameters back for an update and starts the optimizer state's copy.
    fn bring_in_for_update(&mut self) -> Result<()> {
        self.with_offload_state(|o, model, _| o.bring_in_for_update(model))
    }

    /// The optimizer state on the device before an optimizer step.
    fn ready_optimizer(&mut self) -> Result<()> {
        self.with_offload_state(|o, _, optims| o.ready_optimizer(optims))
    }

    /// Sends the parameters and optimizer state away after a phase, as the switches say.
    pub fn put_away(&mut self) -> Result<()> {
        self.with_offload_state(|o, model, optims| o.put_away(model, optims))
    }

    /// [`Self::put_away`] after a phase that only read the parameters.
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

    /// Records the device's usage into the open phase's peak.
    pub fn sample_memory(&self) {
        crate::parallel::sample_module_memory::<B, _>(self.model());
    }

    pub fn model(&self) -> &CausalLm<B> {
        self.model
            .as_ref()
            .expect("the model is only out during a step")
    }

    /// Every weight of the value model, full, on every rank (see
    /// `MegatronActor::full_weights`).
    pub fn full_weights(&self) -> Result<Vec<verl_core::NamedTensor<B::InnerBackend>>> {
        let model = self.model().valid();
        Ok(match &self.pp {
            Some(pp) => model.export_all_stages(pp.as_ref())?,
            None => model.export_weights(),
        })
    }

    /// Trains one pipeline stage with the pipeline group `comm` (see
    /// `MegatronActor::with_pipeline_parallel`).
    pub fn with_pipeline_parallel(mut self, comm: Arc<dyn Communicator<B::InnerBackend>>) -> Self {
        let tied_embedding = self.model().pipeline_tied_embedding();
        self.optim = self.optim.with_pipeline_parallel(PipelineParallelGrads {
            comm: comm.clone(),
            tied_embedding,
        });
        self.pp = Some(comm);
        self
    }

    /// Trains data-parallel over `comm` (see `MegatronActor::with_data_parallel`).
    pub fn with_data_parallel(
        mut self,
        comm: Arc<dyn Communicator<B::InnerBackend>>,
        bucket_elems: usize,
    ) -> Self {
        self.optim = self.optim.with_data_parallel(comm.clone(), bucket_elems);
        self.dp = Some(comm);
        self
    }

    /// Sums gradients over data × context parallel (see `MegatronActor::with_context_parallel`).
    pub fn with_context_parallel(
        mut self,
        dp_cp: Arc<dyn Communicator<B::InnerBackend>>,
        bucket_elems: usize,
    ) -> Self {
        self.optim = self.optim.with_data_parallel(dp_cp, bucket_elems);
        self
    }

    /// Sums the routed experts' gradients over `expert_dp` (see
    /// `MegatronActor::with_expert_data_parallel`).
    pub fn with_expert_data_parallel(
        mut self,
        expert_dp: Arc<dyn Communicator<B::InnerBackend>>,
    ) -> Self {
        self.optim = self.optim.with_expert_data_parallel(expert_dp);
        self
    }

    /// The clipped value loss of one micro-batch from its response-window outputs (the value
    /// head's); pushes the micro-batch's metrics and returns the loss with its value.
    fn value_loss_of(
        &self,
        micro: &DataProto<B::InnerBackend>,
        out: Tensor<B, 3>,
        scale: AggScale,
        metrics: &mut Metrics,
    ) -> Result<(Tensor<B, 1>, f64)> {
        let [b, r, _] = out.dims();
        let vpreds = out.reshape([b, r]);
        let mask = Tensor::<B, 2>::from_inner(float_col(micro, "response_mask")?);
        let values = Tensor::<B, 2>::from_inner(float_col(micro, "values")?);
        let returns = Tensor::<B, 2>::from_inner(float_col(micro, "returns")?);
        metrics.push(
            "critic/vpred_mean",
            masked_mean(vpreds.clone().inner(), mask.clone().inner())
                .into_scalar()
                .elem::<f64>(),
        );
        let s = &self.settings;
        let (loss, clipfrac) = value_loss(
            vpreds,
            returns,
            values,
            mask,
            s.cliprange_value,
            s.loss_agg_mode,
            scale,
        )?;
        metrics.push("critic/vf_clipfrac", clipfrac);
        let value = loss.clone().into_scalar().elem::<f64>();
        Ok((loss, value))
    }

    /// The critic's checkpoint state: weights, optimizer and update counter.
    pub fn checkpoint_state(
        &self,
        contents: CheckpointContents,
    ) -> CheckpointState<B::InnerBackend> {
        super::state::save_state(
            self.model(),
            &[("optim", &self.optim)],
            serde_json::json!({ "updates": self.updates }),
            contents,
        )
    }

    /// This rank's critic state from the dist checkpoint at `dir`, saved on this layout or any
    /// other.
    pub async fn read_dist_checkpoint(
        &self,
        dir: &std::path::Path,
        rank: usize,
        contents: CheckpointContents,
    ) -> Result<CheckpointState<B::InnerBackend>> {
        let sharded = [("optim", self.optim.sharded_over())];
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
        let result = super::state::load_state(
            &mut model,
            &mut [("optim", &mut self.optim)],
            state,
            contents,
        );
        self.model = Some(model);
        if let Some(u) = result?.get("updates").and_then(serde_json::Value::as_u64) {
            self.updates = u;
        }
        Ok(())
    }
}

#[async_trait(?Send)]
impl<B: ParallelAutodiffBackend> Critic<B::InnerBackend> for MegatronCritic<B> {
    async fn compute_values(
        &mut self,
        data: &DataProto<B::InnerBackend>,
    ) -> Result<Tensor<B::InnerBackend, 2>> {
        self.bring_in(false)?;
        let out = self.values_resident(data);
        self.put_away_read_only()?;
        out
    }

    async fn update_critic(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        self.bring_in_for_update()?;
        let out = self.update_resident(data);
        self.put_away()?;
        out
    }
}

impl<B: ParallelAutodiffBackend> MegatronCritic<B> {
    fn values_resident(
        &self,
        data: &DataProto<B::InnerBackend>,
    ) -> Result<Tensor<B::InnerBackend, 2>> {
        let model = self.model().valid();
        let how = self.dynamic.forward(
            self.settings.forward_micro_batch_rows,
            "critic.forward_max_token_len_per_gpu",
        );
        let values = map_micro_batches(data, how, self.dp.as_deref(), |micro| {
            let inputs = ModelInputs::from_batch(micro)?;
            let mask = float_col(micro, "response_mask")?;
            Ok(vec![
                match inputs.pipelined_outputs(&model, self.pp.as_deref())? {
                    Some(out) => {
                        let [b, r, _] = out.dims();
                        out.reshape([b, r]) * mask
                    }
                    // Not collected (MegatronCompute reads the last stage).
                    None => mask.zeros_like(),
                },
            ])
        })?;
        Ok(values.into_iter().next().expect("values"))
    }

    fn update_resident(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        let s = self.settings.clone();
        let mut metrics = Metrics::default();
        // Optimizer steps skipped for a non-finite gradient norm (Megatron's skipped iterations).
        let mut skipped = 0u32;
        for epoch in 0..s.ppo_epochs {
            let mut order: Vec<usize> = (0..data.len()).collect();
            if s.shuffle {
                let mut rng = StdRng::seed_from_u64(s.seed ^ (self.updates << 16) ^ epoch as u64);
                order.shuffle(&mut rng);
            }
            for mini_rows in order.chunks(s.mini_batch_rows.max(1)) {
                let mini = data.select_rows(mini_rows)?;
                let counts = super::state::dp_sum(
                    self.dp.as_deref(),
                    &[
                        float_col(&mini, "response_mask")?
                            .sum()
                            .into_scalar()
                            .elem::<f64>(),
                        mini.len() as f64,
                    ],
                )?;
                let scale = AggScale {
                    global_tokens: Some(counts[0].max(1.0)),
                    global_sequences: Some(counts[1]),
                    // The mini-batch's response width, whatever padding a micro-batch drops.
                    loss_scale_factor: Some(mini.int::<2>("responses")?.dims()[1] as f64),
                    ..Default::default()
                };
                let how = self
                    .dynamic
                    .update(s.micro_batch_rows, "critic.ppo_max_token_len_per_gpu");
                let micros = training_micro_batches(&mini, how, self.dp.as_deref())?;
                let mut total = 0.0;
                let aux =
                    super::state::MoeAuxLoss::of(self.model(), micros.len(), self.dp.as_deref())?;
                let (grads, aux_total) = train_micro_batches(
                    self.model(),
                    &micros,
                    self.pp.as_ref(),
                    (aux.scale, 1.0),
                    |micro, out| {
                        let (loss, value) = self.value_loss_of(micro, out, scale, &mut metrics)?;
                        total += value;
                        Ok(loss)
                    },
                )?;
                aux.report(
                    aux_total,
                    self.pp.as_deref(),
                    self.dp.as_deref(),
                    "critic",
                    &mut metrics,
                )?;
                self.ready_optimizer()?;
                // Parameters, gradients and optimizer state are all on the device here.
                self.sample_memory();
                let model = self.model.take().expect("model present");
                let step_span = tracing::info_span!("optimizer_step").entered();
                let optim = &mut self.optim;
                let (model, report) = crate::parallel::module_device_span::<B, _, _>(
                    model,
                    "optimizer_step",
                    |model| optim.step(model, grads),
                );
                drop(step_span);
                self.model = Some(model);
                let report = report?;
                skipped += u32::from(!report.applied);
                if self.model().stage.is_last() {
                    metrics.push(
                        "critic/vf_loss",
                        super::state::dp_sum(self.dp.as_deref(), &[total])?[0],
                    );
                    metrics.push("critic/grad_norm", report.grad_norm);
                    metrics.push("critic/lr", report.lr);
                }
            }
        }
        if self.model().stage.is_last() {
            metrics.push("critic/skipped_steps", f64::from(skipped));
        }
        self.updates += 1;
        Ok(metrics)
    }
}

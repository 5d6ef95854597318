//! The Megatron critic: per-token values from a value head and the clipped value-loss update,
//! as verl's `MegatronPPOCritic`.

use async_trait::async_trait;
use burn::module::AutodiffModule;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use verl_core::algorithms::aggregation::{AggScale, LossAggMode};
use verl_core::algorithms::masked::masked_mean;
use verl_core::algorithms::value::value_loss;
use verl_core::traits::Critic;
use verl_core::{DataProto, Metrics, Result};

use super::batch::{float_col, map_micro_batches, training_micro_batches, ModelInputs};
use super::engine::{TrainingEngine, TrainingRole};
use super::optim::ModelOptimizer;
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
    /// The value model, its optimizer, groups and offload.
    engine: TrainingEngine<B>,
    settings: CriticSettings,
}

impl<B: ParallelAutodiffBackend> MegatronCritic<B> {
    pub fn new(
        model: CausalLm<B>,
        optim: ModelOptimizer<B, CausalLm<B>>,
        settings: CriticSettings,
    ) -> Self {
        Self {
            engine: TrainingEngine::new(model, optim),
            settings,
        }
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
}

#[async_trait(?Send)]
impl<B: ParallelAutodiffBackend> Critic<B::InnerBackend> for MegatronCritic<B> {
    async fn compute_values(
        &mut self,
        data: &DataProto<B::InnerBackend>,
    ) -> Result<Tensor<B::InnerBackend, 2>> {
        self.engine.bring_in(false)?;
        let out = self.values_resident(data);
        self.engine.put_away_read_only()?;
        out
    }

    async fn update_critic(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        self.engine.bring_in_for_update()?;
        let out = self.update_resident(data);
        self.engine.put_away()?;
        out
    }
}

impl<B: ParallelAutodiffBackend> MegatronCritic<B> {
    fn values_resident(
        &self,
        data: &DataProto<B::InnerBackend>,
    ) -> Result<Tensor<B::InnerBackend, 2>> {
        let model = self.engine.model().valid();
        let how = self.engine.dynamic.forward(
            self.settings.forward_micro_batch_rows,
            "critic.forward_max_token_len_per_gpu",
        );
        let values = map_micro_batches(data, how, self.engine.dp.as_deref(), |micro| {
            let inputs = ModelInputs::from_batch(micro)?;
            let mask = float_col(micro, "response_mask")?;
            Ok(vec![
                match inputs.pipelined_outputs(&model, self.engine.pp.as_deref())? {
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
                let mut rng =
                    StdRng::seed_from_u64(s.seed ^ (self.engine.updates << 16) ^ epoch as u64);
                order.shuffle(&mut rng);
            }
            for mini_rows in order.chunks(s.mini_batch_rows.max(1)) {
                let mini = data.select_rows(mini_rows)?;
                let counts = super::state::dp_sum(
                    self.engine.dp.as_deref(),
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
                    .engine
                    .dynamic
                    .update(s.micro_batch_rows, "critic.ppo_max_token_len_per_gpu");
                let micros = training_micro_batches(&mini, how, self.engine.dp.as_deref())?;
                let mut total = 0.0;
                let aux = super::state::MoeAuxLoss::of(
                    self.engine.model(),
                    micros.len(),
                    self.engine.dp.as_deref(),
                )?;
                let (grads, aux_total) = train_micro_batches(
                    self.engine.model(),
                    &micros,
                    self.engine.pp.as_ref(),
                    (aux.scale, 1.0),
                    &[],
                    |micro, out| {
                        let (loss, value) = self.value_loss_of(micro, out, scale, &mut metrics)?;
                        total += value;
                        Ok(loss)
                    },
                )?;
                aux.report(
                    aux_total,
                    self.engine.pp.as_deref(),
                    self.engine.dp.as_deref(),
                    "critic",
                    &mut metrics,
                )?;
                self.engine.ready_optimizer()?;
                // Parameters, gradients and optimizer state are all on the device here.
                self.sample_memory();
                let model = self.engine.model.take().expect("model present");
                let step_span = tracing::info_span!("optimizer_step").entered();
                let optim = &mut self.engine.optim;
                let (model, report) = crate::parallel::module_device_span::<B, _, _>(
                    model,
                    "optimizer_step",
                    |model| optim.step(model, grads),
                );
                drop(step_span);
                self.engine.model = Some(model);
                let report = report?;
                skipped += u32::from(!report.applied);
                if self.engine.model().stage.is_last() {
                    metrics.push(
                        "critic/vf_loss",
                        super::state::dp_sum(self.engine.dp.as_deref(), &[total])?[0],
                    );
                    metrics.push("critic/grad_norm", report.grad_norm);
                    metrics.push("critic/lr", report.lr);
                }
            }
        }
        if self.engine.model().stage.is_last() {
            metrics.push("critic/skipped_steps", f64::from(skipped));
        }
        self.engine.updates += 1;
        Ok(metrics)
    }
}

impl<B: ParallelAutodiffBackend> TrainingRole<B> for MegatronCritic<B> {
    fn engine(&self) -> &TrainingEngine<B> {
        &self.engine
    }

    fn engine_mut(&mut self) -> &mut TrainingEngine<B> {
        &mut self.engine
    }

    fn map_engine(mut self, f: impl FnOnce(TrainingEngine<B>) -> TrainingEngine<B>) -> Self {
        self.engine = f(self.engine);
        self
    }
}

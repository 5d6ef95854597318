//! The Megatron actor: log-probs of responses and the PPO policy update (epochs, shuffled
//! mini-batches, micro-batches with gradient accumulation, global-norm clipping, AdamW with the
//! scheduled learning rate, entropy bonus, KL loss), as verl's `MegatronPPOActor`.

use std::sync::Arc;

use async_trait::async_trait;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use verl_core::algorithms::aggregation::{agg_loss, AggScale, LossAggMode};
use verl_core::algorithms::kl::{kl_penalty, KlPenalty};
use verl_core::algorithms::masked::masked_mean;
use verl_core::algorithms::policy_loss::{PolicyLossInput, PolicyLossParams, PolicyLossRegistry};
use verl_core::traits::{Actor, LogProbOutput, WeightExporter, WeightSyncPlan};
use verl_core::{DataProto, Metrics, NamedTensor, Result, WeightStream};

use super::batch::{
    float_col, map_micro_batches, training_micro_batches, MicroBatching, ModelInputs,
};
use super::engine::{TrainingEngine, TrainingRole};
use super::optim::ModelOptimizer;
use super::routing_store::{origins_of, RoutingStore};
use super::stage::train_micro_batches;
use crate::models::router_replay::{record_routing, replay_routing, take_disagreement, Routing};
use crate::models::{vocab_parallel_log_probs, CausalLm};
use crate::parallel::{ParallelAutodiffBackend, ParallelBackend};

/// The actor's update settings, resolved from `actor_rollout_ref.actor` (row counts per rank).
#[derive(Debug, Clone, PartialEq)]
pub struct ActorSettings {
    /// Rows (samples, not prompts) per mini-batch on this rank.
    pub mini_batch_rows: usize,
    pub micro_batch_rows: usize,
    /// Rows per forward pass in `compute_log_prob`.
    pub log_prob_micro_batch_rows: usize,
    pub ppo_epochs: usize,
    pub shuffle: bool,
    pub seed: u64,
    pub policy_loss: String,
    pub loss_params: PolicyLossParams,
    pub loss_agg_mode: LossAggMode,
    /// The divisor of `seq-mean-token-sum-norm`; `None`: the mini-batch's response width.
    pub loss_scale_factor: Option<f64>,
    pub entropy_coeff: f64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: KlPenalty,
    /// Logits are divided by the rollout temperature before log-probs, as verl does.
    pub temperature: f64,
    /// Rollout correction's bypass mode: `old_log_probs` are the rollout's, and the policy
    /// loss is bypass mode's (the correction applied per micro-batch), not `policy_loss`.
    pub bypass: Option<verl_core::algorithms::bypass::BypassMode>,
}

/// The policy model and its optimizer.
pub struct MegatronActor<B: ParallelAutodiffBackend> {
    /// The model, its optimizers (the RL one and the warm-up's), groups and offload.
    engine: TrainingEngine<B>,
    settings: ActorSettings,
    losses: PolicyLossRegistry<B>,
    /// With router replay R2: the experts the last old-log-prob pass chose for each token,
    /// which the next update replays.
    router_replay: Option<RoutingStore>,
    /// Which pass the replayed routing comes from (with `router_replay`).
    replay_source: RouterReplay,
}

/// Log-probs of `labels` (and entropy) from a model's response-window outputs: logits, divided
/// by `temperature` here and reduced vocabulary-parallel; or, from a fused head
/// ([`CausalLm::with_fused_log_probs`], which was given the labels and the temperature), the
/// log-probs and entropies it computed.
pub(crate) fn log_probs_from<C: ParallelBackend>(
    model: &CausalLm<C>,
    out: Tensor<C, 3>,
    labels: Tensor<C, 2, Int>,
    temperature: f64,
    with_entropy: bool,
) -> (Tensor<C, 2>, Option<Tensor<C, 2>>) {
    if model.fused_head_chunk.is_some() {
        let [b, r, _] = out.dims();
        let entropy = with_entropy.then(|| out.clone().narrow(2, 1, 1).reshape([b, r]));
        return (out.narrow(2, 0, 1).reshape([b, r]), entropy);
    }
    vocab_parallel_log_probs(
        out / temperature,
        labels,
        &model.tp,
        model.vocab_start(),
        with_entropy,
    )
}

/// The temperature the batch was sampled at (`meta_info["temperature"]`), else `default`.
pub(crate) fn temperature_of<B: ParallelBackend>(data: &DataProto<B>, default: f64) -> f64 {
    data.meta_info
        .get("temperature")
        .and_then(serde_json::Value::as_f64)
        .filter(|t| *t > 0.0)
        .unwrap_or(default)
}

impl<B: ParallelAutodiffBackend> MegatronActor<B> {
    pub fn new(
        model: CausalLm<B>,
        optim: ModelOptimizer<B, CausalLm<B>>,
        settings: ActorSettings,
    ) -> Self {
        Self {
            engine: TrainingEngine::new(model, optim),
            settings,
            losses: PolicyLossRegistry::new(),
            router_replay: None,
            replay_source: RouterReplay::R2,
        }
    }

    /// Router replay R2 (`actor.router_replay.mode=R2`): `compute_log_prob` records the experts
    /// every MoE block chose for each token, and the next `update_policy` replays them in all
    /// its forwards (and recomputes), so an optimizer step that moves a router cannot change a
    /// token's experts between the old policy and the policy being trained. The tokens are
    /// found again by their row's tokens and position, whatever the micro-batching or packing.
    /// Refused with sequence parallel or context parallel, whose ranks route slices of a
    /// sequence.
    pub fn with_router_replay(self) -> Result<Self> {
        self.with_router_replay_from(RouterReplay::R2)
    }

    /// Router replay from `source`: [`RouterReplay::R2`] as [`Self::with_router_replay`];
    /// [`RouterReplay::R3`] replays the rollout's routing (the batch's `routed_experts`) in
    /// `compute_log_prob` and in every forward of `update_policy`. Refused with sequence or
    /// context parallel, as R2 is.
    pub fn with_router_replay_from(mut self, source: RouterReplay) -> Result<Self> {
        let model = self.engine.model();
        let refuse = |key: &str, value: String| -> verl_core::Error {
            verl_core::error::ConfigError::Invalid {
                key: key.into(),
                value,
                message: "router replay maps each token to the row and position it came \
                          from; this layout routes slices of a sequence on each rank"
                    .into(),
                fix: format!("set {key} off (or 1), or actor.router_replay.mode=disabled"),
            }
            .into()
        };
        if model.tp.sequence_parallel {
            return Err(refuse(
                "actor_rollout_ref.actor.megatron.sequence_parallel",
                "true".into(),
            ));
        }
        if model.cp.size() > 1 {
            return Err(refuse(
                "actor_rollout_ref.actor.megatron.context_parallel_size",
                model.cp.size().to_string(),
            ));
        }
        self.router_replay = Some(RoutingStore::default());
        self.replay_source = source;
        Ok(self)
    }

    /// Registers (or replaces) a policy loss under `name`, for `policy_loss.loss_mode` to
    /// select: an embedding program's own loss beside verl's.
    pub fn with_policy_loss(
        mut self,
        name: &str,
        loss: verl_core::algorithms::policy_loss::PolicyLossFn<B>,
    ) -> Self {
        self.losses.register(name, move |x| loss(x));
        self
    }

    /// The forward-only passes' micro-batching (log-probs, and the reference's).
    pub fn log_prob_batching(&self) -> MicroBatching {
        self.engine.dynamic.forward(
            self.settings.log_prob_micro_batch_rows,
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        )
    }

    /// The reference policy's log-prob pass.
    pub fn reference_batching(&self) -> MicroBatching {
        self.engine.dynamic.reference(
            self.settings.log_prob_micro_batch_rows,
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        )
    }

    fn update_batching(&self) -> MicroBatching {
        self.engine.dynamic.update(
            self.settings.micro_batch_rows,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        )
    }

    /// Gives the supervised warm-up its own optimizer and schedule (call before
    /// [`Self::with_data_parallel`]).
    pub fn with_sft_optimizer(self, optim: ModelOptimizer<B, CausalLm<B>>) -> Self {
        self.map_engine(|e| e.with_sft_optimizer(optim))
    }

    pub fn settings(&self) -> &ActorSettings {
        &self.settings
    }

    /// Supervised fine-tuning step on the response tokens (the warm-up before RL): token-mean
    /// negative log-likelihood over `response_mask`, one optimizer step per mini-batch.
    pub fn sft_step(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        self.engine.bring_in_for_update()?;
        let out = self.sft_step_resident(data);
        self.engine.put_away()?;
        out
    }

    fn sft_step_resident(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        let mut metrics = Metrics::default();
        let mask_all = float_col(data, "response_mask")?;
        let tokens = self
            .engine
            .dp_sum(&[mask_all.sum().into_scalar().elem::<f64>()])?[0]
            .max(1.0);
        let micros =
            training_micro_batches(data, self.update_batching(), self.engine.dp.as_deref())?;
        let (grads, total) = self.run_micro_batches(
            &micros,
            StageLoss::Sft { tokens },
            &[],
            &mut Metrics::default(),
        )?;
        self.engine.ready_optimizer()?;
        self.sample_memory();
        let model = self.engine.model.take().expect("model present");
        let optim = self
            .engine
            .sft_optim
            .as_mut()
            .unwrap_or(&mut self.engine.optim);
        let (model, report) = optim.step(model, grads);
        self.engine.model = Some(model);
        let report = report?;
        if self.engine.is_last_stage() {
            // Each rank's loss is its share of the batch loss.
            metrics.push("sft/loss", self.engine.dp_sum(&[total])?[0]);
            metrics.push("sft/grad_norm", report.grad_norm);
            metrics.push("sft/lr", report.lr);
        }
        Ok(metrics)
    }

    /// The loss of one micro-batch from its response-window logits, by `kind`; pushes the
    /// micro-batch's metrics and returns the loss with the value the step reports (the policy
    /// loss, or the negative log-likelihood).
    fn stage_loss(
        &self,
        micro: &DataProto<B::InnerBackend>,
        logits: Tensor<B, 3>,
        kind: StageLoss,
        metrics: &mut Metrics,
    ) -> Result<(Tensor<B, 1>, f64)> {
        match kind {
            StageLoss::Ppo { scale, temperature } => {
                self.micro_batch_loss(micro, logits, temperature, scale, metrics)
            }
            StageLoss::Sft { tokens } => {
                let labels = Tensor::<B, 2, Int>::from_inner(micro.int::<2>("responses")?);
                let mask = Tensor::<B, 2>::from_inner(float_col(micro, "response_mask")?);
                let (log_probs, _) =
                    log_probs_from(self.engine.model(), logits, labels, 1.0, false);
                let nll = -(log_probs * mask).sum() / tokens;
                let value = nll.clone().into_scalar().elem::<f64>();
                Ok((nll.reshape([1]), value))
            }
        }
    }

    /// Forward and backward over `micros` (in the 1F1B schedule through the pipeline group
    /// when there is one): the summed gradients and the summed reported loss (last stage);
    /// the micro-batches' metrics go to `metrics`.
    fn run_micro_batches(
        &self,
        micros: &[DataProto<B::InnerBackend>],
        kind: StageLoss,
        replay: &[Arc<Routing>],
        metrics: &mut Metrics,
    ) -> Result<(GradientsParams, f64)> {
        let mut total = 0.0;
        let aux = super::state::MoeAuxLoss::of(
            self.engine.model(),
            micros.len(),
            self.engine.dp.as_deref(),
        )?;
        let temperature = match kind {
            StageLoss::Ppo { temperature, .. } => temperature,
            StageLoss::Sft { .. } => 1.0,
        };
        let (grads, aux_total) = train_micro_batches(
            self.engine.model(),
            micros,
            self.engine.pp.as_ref(),
            (aux.scale, temperature),
            replay,
            |micro, out| {
                let (loss, value) = self.stage_loss(micro, out, kind, metrics)?;
                total += value;
                Ok(loss)
            },
        )?;
        aux.report(
            aux_total,
            self.engine.pp.as_deref(),
            self.engine.dp.as_deref(),
            "actor",
            metrics,
        )?;
        Ok((grads, total))
    }

    /// The log-probs (and entropies) of `data`; with `routing`, also the routing every MoE
    /// block chose for its tokens recorded (R2), or the stored routing replayed (R3).
    fn log_probs_inner(
        &self,
        data: &DataProto<B::InnerBackend>,
        calculate_entropy: bool,
        mut routing: PassRouting<'_>,
    ) -> Result<LogProbOutput<B::InnerBackend>> {
        let model = self.engine.model().valid();
        let temperature = temperature_of(data, self.settings.temperature);
        let outputs = map_micro_batches(
            data,
            self.log_prob_batching(),
            self.engine.dp.as_deref(),
            |micro| {
                let inputs =
                    ModelInputs::from_batch(micro)?.fused_for(&model, micro, temperature)?;
                let labels = micro.int::<2>("responses")?;
                let pp = self.engine.pp.as_deref();
                let out = match &mut routing {
                    PassRouting::Record(store) => {
                        let (out, routing) =
                            record_routing(|| inputs.pipelined_outputs(&model, pp));
                        store.record(&origins_of(micro, &inputs, model.pack_sequences)?, &routing);
                        out?
                    }
                    PassRouting::Replay(store) => {
                        let origins = origins_of(micro, &inputs, model.pack_sequences)?;
                        let (replay, absent) = store.replay_for(&origins);
                        if absent > 0 {
                            tracing::warn!(
                                absent,
                                "router replay R3: tokens of the old-log-prob pass have no \
                                 recorded routing and take their router's"
                            );
                        }
                        replay_routing(Arc::new(replay), || inputs.pipelined_outputs(&model, pp))?
                    }
                    PassRouting::Own => inputs.pipelined_outputs(&model, pp)?,
                };
                let Some(out) = out else {
                    // Not collected (MegatronCompute reads the last stage): zeros of the right
                    // shape keep this stage's output well-formed.
                    let zeros = Tensor::zeros([micro.len(), inputs.response_len], &labels.device());
                    return Ok(vec![zeros.clone(), zeros]);
                };
                let (lp, ent) = log_probs_from(&model, out, labels, temperature, calculate_entropy);
                let ent = ent.unwrap_or_else(|| lp.zeros_like());
                Ok(vec![lp, ent])
            },
        )?;
        let mut outputs = outputs.into_iter();
        let log_probs = outputs.next().expect("log-probs");
        let entropy = outputs.next().filter(|_| calculate_entropy);
        Ok(LogProbOutput { log_probs, entropy })
    }

    /// The loss of one micro-batch from the model's response-window logits: the policy loss,
    /// minus the entropy bonus, plus the KL loss, each aggregated with the mini-batch's global
    /// normalisers. Pushes the micro-batch's metrics; returns the loss and the policy loss.
    fn micro_batch_loss(
        &self,
        micro: &DataProto<B::InnerBackend>,
        logits: Tensor<B, 3>,
        temperature: f64,
        scale: AggScale,
        metrics: &mut Metrics,
    ) -> Result<(Tensor<B, 1>, f64)> {
        let s = &self.settings;
        let loss_fn = self.losses.get(&s.policy_loss)?;
        let labels = Tensor::<B, 2, Int>::from_inner(micro.int::<2>("responses")?);
        let mask = Tensor::<B, 2>::from_inner(float_col(micro, "response_mask")?);
        let old = Tensor::<B, 2>::from_inner(float_col(micro, "old_log_probs")?);
        let adv = Tensor::<B, 2>::from_inner(float_col(micro, "advantages")?);
        let (log_prob, entropy) =
            log_probs_from(self.engine.model(), logits, labels, temperature, true);
        let entropy = entropy.expect("asked for");
        let input = PolicyLossInput {
            old_log_prob: old,
            log_prob: log_prob.clone(),
            advantages: adv,
            response_mask: mask.clone(),
            loss_agg_mode: s.loss_agg_mode,
            agg_scale: scale,
            params: s.loss_params,
            // Rollout correction's importance weights, when the batch carries them.
            rollout_is_weights: match micro.contains("rollout_is_weights") {
                true => Some(Tensor::from_inner(float_col(micro, "rollout_is_weights")?)),
                false => None,
            },
        };
        let out = match &s.bypass {
            Some(mode) => {
                let (out, corrections) =
                    verl_core::algorithms::bypass::bypass_mode_loss(&input, mode)?;
                for (k, v) in corrections {
                    metrics.push(k, v);
                }
                out
            }
            None => {
                // The current policy against the sampler, per micro-batch, as verl's actors
                // log it (the trainer's figures are for the old log-probs).
                if micro.contains("rollout_log_probs") {
                    let rollout =
                        Tensor::<B, 2>::from_inner(float_col(micro, "rollout_log_probs")?);
                    let current = log_prob.clone().detach();
                    for (k, v) in verl_core::algorithms::rollout_correction::offpolicy_metrics(
                        &current, &rollout, &mask,
                    ) {
                        metrics.push(k, v);
                    }
                }
                loss_fn(&input)?
            }
        };
        let mut loss = out.loss.clone();
        let pg = out.loss.into_scalar().elem::<f64>();
        metrics.push("actor/pg_clipfrac", out.pg_clipfrac);
        metrics.push("actor/ppo_kl", out.ppo_kl);
        metrics.push("actor/pg_clipfrac_lower", out.pg_clipfrac_lower);
        metrics.push(
            "actor/entropy",
            masked_mean(entropy.clone().inner(), mask.clone().inner())
                .into_scalar()
                .elem::<f64>(),
        );
        if s.entropy_coeff != 0.0 {
            let ent = agg_loss(entropy, mask.clone(), s.loss_agg_mode, scale);
            loss = loss - ent * s.entropy_coeff;
        }
        if s.use_kl_loss {
            let reference = Tensor::<B, 2>::from_inner(float_col(micro, "ref_log_prob")?);
            let kld = kl_penalty(log_prob, reference, s.kl_loss_type);
            metrics.push(
                "actor/kl_loss",
                masked_mean(kld.clone().inner(), mask.clone().inner())
                    .into_scalar()
                    .elem::<f64>(),
            );
            let kl = agg_loss(kld, mask, s.loss_agg_mode, scale);
            loss = loss + kl * s.kl_loss_coef;
        }
        Ok((loss, pg))
    }

    fn update(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        let s = self.settings.clone();
        let rows = data.len();
        let temperature = temperature_of(data, s.temperature);
        let mut metrics = Metrics::default();
        // Optimizer steps skipped for a non-finite gradient norm (Megatron's skipped iterations).
        let mut skipped = 0u32;
        for epoch in 0..s.ppo_epochs {
            let mut order: Vec<usize> = (0..rows).collect();
            if s.shuffle {
                let mut rng =
                    StdRng::seed_from_u64(s.seed ^ (self.engine.updates << 16) ^ epoch as u64);
                order.shuffle(&mut rng);
            }
            for mini_rows in order.chunks(s.mini_batch_rows.max(1)) {
                let mini = data.select_rows(mini_rows)?;
                let mini_mask = float_col(&mini, "response_mask")?;
                // Normalise by the whole mini-batch (over every data-parallel rank), so
                // micro-batching and data parallelism change nothing.
                let counts = self.engine.dp_sum(&[
                    mini_mask.clone().sum().into_scalar().elem::<f64>(),
                    mini.len() as f64,
                ])?;
                let scale = AggScale {
                    global_tokens: Some(counts[0].max(1.0)),
                    global_sequences: Some(counts[1]),
                    // The configured constant, or the mini-batch's response width (whatever
                    // padding a micro-batch drops).
                    loss_scale_factor: Some(
                        s.loss_scale_factor.unwrap_or(mini_mask.dims()[1] as f64),
                    ),
                    ..Default::default()
                };
                let micros = training_micro_batches(
                    &mini,
                    self.update_batching(),
                    self.engine.dp.as_deref(),
                )?;
                let kind = StageLoss::Ppo { scale, temperature };
                let replay = self.replays_for(&micros, &mut metrics)?;
                let (grads, pg_total) =
                    self.run_micro_batches(&micros, kind, &replay, &mut metrics)?;
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
                self.sample_memory();
                let report = report?;
                skipped += u32::from(!report.applied);
                if self.engine.is_last_stage() {
                    // Each rank's loss is its share of the mini-batch loss.
                    metrics.push("actor/pg_loss", self.engine.dp_sum(&[pg_total])?[0]);
                    metrics.push("actor/grad_norm", report.grad_norm);
                    metrics.push("actor/lr", report.lr);
                }
            }
        }
        if self.engine.is_last_stage() {
            metrics.push("actor/skipped_steps", f64::from(skipped));
        }
        // The recorded routing was the old policy's of this batch only.
        if let Some(store) = self.router_replay.as_mut() {
            store.clear();
            let (replayed, differing) = take_disagreement();
            if replayed > 0 {
                metrics.push(
                    "actor/router_replay_disagreement",
                    differing as f64 / replayed as f64,
                );
            }
        }
        self.engine.updates += 1;
        Ok(metrics)
    }

    /// Each training micro-batch's routing to replay (router replay R2), from what the last
    /// old-log-prob pass recorded; nothing without R2 or a recording. Reports the real tokens
    /// replayed and those the recording lacks (left to the router).
    fn replays_for(
        &self,
        micros: &[DataProto<B::InnerBackend>],
        metrics: &mut Metrics,
    ) -> Result<Vec<Arc<Routing>>> {
        let Some(store) = self.router_replay.as_ref() else {
            return Ok(Vec::new());
        };
        if store.is_empty() {
            // R2 without a recording (no MoE layer on this stage, or no old-log-prob pass):
            // nothing replayed, said in the metrics.
            metrics.push("actor/router_replay_tokens", 0.0);
            return Ok(Vec::new());
        }
        let model = self.engine.model();
        let (mut replayed, mut missing) = (0usize, 0usize);
        let replay = micros
            .iter()
            .map(|micro| {
                let inputs = ModelInputs::from_batch(micro)?;
                let origins = origins_of(micro, &inputs, model.pack_sequences)?;
                let (routing, absent) = store.replay_for(&origins);
                replayed += origins.iter().flatten().count() - absent;
                missing += absent;
                Ok(Arc::new(routing))
            })
            .collect::<Result<Vec<_>>>()?;
        metrics.push("actor/router_replay_tokens", replayed as f64);
        metrics.push("actor/router_replay_missing_tokens", missing as f64);
        Ok(replay)
    }
}

/// Where the routing an MoE actor replays comes from (verl's `actor.router_replay.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterReplay {
    /// The actor's own old-log-prob pass records; the update replays.
    R2,
    /// The rollout records (`routed_experts` in the batch); the old-log-prob pass and the
    /// update replay.
    R3,
}

/// What a log-prob pass does with the routing of its MoE blocks.
enum PassRouting<'a> {
    /// Routes by its own routers.
    Own,
    /// Routes by its own routers and records their choices.
    Record(&'a mut RoutingStore),
    /// Takes the stored choices.
    Replay(&'a RoutingStore),
}

/// What a micro-batch's loss is.
#[derive(Clone, Copy)]
enum StageLoss {
    /// The PPO loss, normalised by the mini-batch's global counts, on logits / temperature.
    Ppo { scale: AggScale, temperature: f64 },
    /// The supervised warm-up: negative log-likelihood over `tokens` response tokens.
    Sft { tokens: f64 },
}

#[async_trait(?Send)]
impl<B: ParallelAutodiffBackend> Actor<B::InnerBackend> for MegatronActor<B> {
    async fn compute_log_prob(
        &mut self,
        data: &DataProto<B::InnerBackend>,
        calculate_entropy: bool,
    ) -> Result<LogProbOutput<B::InnerBackend>> {
        self.engine.bring_in(false)?;
        let out = match (&self.router_replay, self.replay_source) {
            (None, _) => self.log_probs_inner(data, calculate_entropy, PassRouting::Own),
            // R3: the rollout's routing, carried by the batch.
            (Some(_), RouterReplay::R3) => {
                RoutingStore::from_routed_experts(data).and_then(|store| {
                    self.log_probs_inner(data, calculate_entropy, PassRouting::Replay(&store))
                })
            }
            // R2: this pass is the old policy's; its routing replaces the last one.
            (Some(_), RouterReplay::R2) => {
                let mut store = RoutingStore::default();
                let out =
                    self.log_probs_inner(data, calculate_entropy, PassRouting::Record(&mut store));
                self.router_replay = Some(store);
                out
            }
        };
        self.engine.put_away_read_only()?;
        out
    }

    async fn update_policy(&mut self, data: &DataProto<B::InnerBackend>) -> Result<Metrics> {
        // R3: the update replays the rollout's routing, which its rows carry (read before the
        // weights come in, so a batch without it leaves nothing on the device).
        if self.router_replay.is_some() && self.replay_source == RouterReplay::R3 {
            self.router_replay = Some(RoutingStore::from_routed_experts(data)?);
        }
        self.engine.bring_in_for_update()?;
        // The disagreement counted is the update's own (not the old-log-prob pass's).
        let _ = take_disagreement();
        let out = self.update(data);
        self.engine.put_away()?;
        out
    }
}

impl<B: ParallelAutodiffBackend> WeightExporter<B::InnerBackend> for MegatronActor<B> {
    /// Shards as they are when they fit the rollout; otherwise the full weights a bucket at a
    /// time (gathered when the stream reaches the bucket, so at most one bucket of full tensors
    /// is alive while the rollout takes them one by one).
    fn export_weights(&self, plan: WeightSyncPlan) -> WeightStream<'_, B::InnerBackend> {
        use futures::StreamExt;
        let model = self.engine.model().valid();
        if plan.shards_fit && self.engine.pp.is_none() {
            return Box::pin(futures::stream::iter(
                model.export_shards().into_iter().map(Ok),
            ));
        }
        let buckets = model.weight_buckets(plan.bucket_bytes);
        let mut shards: std::collections::HashMap<_, _> = model
            .export_shards()
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        let pp = self.engine.pp.clone();
        let stream = futures::stream::iter(buckets).flat_map(move |bucket| {
            let gathered = model.gather_bucket(&bucket, &mut shards, pp.as_deref());
            let items: Vec<Result<NamedTensor<B::InnerBackend>>> = match gathered {
                Ok(tensors) => tensors.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e.into())],
            };
            futures::stream::iter(items)
        });
        Box::pin(stream)
    }
}

impl<B: ParallelAutodiffBackend> TrainingRole<B> for MegatronActor<B> {
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

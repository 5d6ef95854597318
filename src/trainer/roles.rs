//! What each rank builds (the actor / rollout / reference worker, and the critic), worked out
//! once from the config, and the roles' methods by name. The same plans build a rank on a
//! thread of the driver or in a rank process, so both transports train the same models.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use verl_core::config::{GlobalProfilerConfig, OptimConfig, RoleProfilerConfig, VerlConfig};
use verl_core::topology::{GroupKind, Topology};
use verl_core::traits::{OffloadSwitches, WeightSyncPlan};
use verl_core::worker::{MethodFuture, MethodTable};
use verl_core::DataProto;
use verl_megatron::hf::{HeadKind, HfCheckpoint, HfModelConfig};
use verl_megatron::layers::precision::ComputeDtype;
use verl_megatron::models::causal_lm::PipelineStageLayout;
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::{ModelGroups, ProcessGroups, TpGroup};
use verl_megatron::workers::DEFAULT_GRAD_BUCKET_ELEMS;
use verl_megatron::workers::{
    ActorRolloutRefWorker, ActorSettings, CheckpointRequest, CriticSettings, CriticWorker,
    DynamicBatch, HybridShardingManager, MegatronActor, MegatronCritic, ModelOptimizer,
    ParamOffload, RouterReplay, TrainingOffload, TrainingRole,
};
use verl_offload::OffloadBackend;
use verl_profiler::RoleProfiler;
use verl_rollout::{Detokenizer, EngineConfig, NativeRollout};

use super::error::{setup, TrainError};
use super::model::{
    compute_dtype, fused_attention_runs, pipeline_split, recompute_settings, Infer, Train,
};
use verl_megatron::models::Recompute;

/// Wraps (or replaces) the native rollout engine a rank builds: how an embedding program swaps
/// in its own [`RolloutEngine`](verl_core::traits::RolloutEngine).
pub(super) type RolloutWrap = std::sync::Arc<
    dyn Fn(
            Box<dyn verl_core::traits::RolloutEngine<Infer>>,
        ) -> Box<dyn verl_core::traits::RolloutEngine<Infer>>
        + Send
        + Sync,
>;

/// Builds each rank's agent loop (the builder's `agent`).
pub(super) type AgentFactory = std::sync::Arc<dyn Fn() -> verl_rollout::agent::Agent + Send + Sync>;

/// What an embedding program put into the ranks' workers through the trainer's builder
/// (threads only: a rank process rebuilds its worker from the config).
#[derive(Clone, Default)]
pub(crate) struct RoleOverrides {
    pub rollout: Option<RolloutWrap>,
    pub agent: Option<AgentFactory>,
    pub policy_losses: Vec<(
        String,
        verl_core::algorithms::policy_loss::PolicyLossFn<Train>,
    )>,
}

impl RoleOverrides {
    pub(crate) fn is_empty(&self) -> bool {
        self.rollout.is_none() && self.agent.is_none() && self.policy_losses.is_empty()
    }
}

/// How every rank builds its actor / rollout / reference worker.
#[derive(Clone)]
pub(crate) struct ActorPlan {
    pub topo: Topology,
    /// The embedding program's rollout engine and policy losses.
    pub overrides: RoleOverrides,
    /// Router replay (`actor.router_replay.mode`): R2 or R3.
    router_replay: Option<RouterReplay>,
    settings: ActorSettings,
    engine: EngineConfig,
    split: Vec<Range<usize>>,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    actor_dtype: ComputeDtype,
    rollout_dtype: ComputeDtype,
    seed: u64,
    optim: OptimConfig,
    optim_steps: u64,
    free_cache: bool,
    /// `rollout.update_weights_bucket_megabytes`.
    bucket_megabytes: usize,
    sft_lr: Option<f64>,
    sft_steps: u64,
    model_path: Option<String>,
    model: HfModelConfig,
    detokenizer: Arc<dyn Detokenizer>,
    /// A reference policy is kept (KL loss or KL in the reward).
    pub needs_ref: bool,
    /// `actor.megatron.*_offload`.
    offload: OffloadSwitches,
    /// `ref.megatron.param_offload`.
    ref_param_offload: bool,
    /// `actor.megatron.override_transformer_config`'s MoE router settings.
    moe: MoeRouterSettings,
    /// `use_dynamic_bsz` and the token budgets of the update, log-prob and reference passes.
    dynamic: DynamicBatch,
    /// `model.use_fused_kernels`: tokens per chunk of the fused head.
    fused_head_chunk: Option<usize>,
    /// `model.use_remove_padding`: training and log-prob passes pack their sequences.
    pack_sequences: bool,
    /// `megatron.override_transformer_config.recompute_*`: activation recompute.
    recompute: Option<Recompute>,
}

/// The MoE router's training settings: Megatron's load-balancing loss from
/// `{role}.megatron.override_transformer_config` and verl's router freeze from
/// `{role}.model.override_config.moe_config`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MoeRouterSettings {
    /// `moe_aux_loss_coeff` (with `moe_router_load_balancing_type` `aux_loss`).
    aux_loss_coeff: f64,
    /// `moe_config.freeze_moe_router`.
    freeze_router: bool,
}

impl MoeRouterSettings {
    fn apply(self, model: CausalLm<Train>) -> CausalLm<Train> {
        let model = model.with_moe_aux_loss(self.aux_loss_coeff);
        match self.freeze_router {
            true => model.freeze_moe_router(),
            false => model,
        }
    }
}

/// Reads `moe_aux_loss_coeff` and `moe_router_load_balancing_type` from the role's
/// `megatron.override_transformer_config` (`megatron_key` names it), and
/// `moe_config.freeze_moe_router` from its model's `override_config` (`model_key`), where verl
/// reads them. The loss applies when a coefficient is given: the balancing type defaults to
/// `aux_loss` then and to `none` otherwise; `aux_loss` without a coefficient, another type, or
/// a value of the wrong kind is refused naming the key.
fn moe_router_settings(
    megatron: &verl_core::config::MegatronConfig,
    megatron_key: &str,
    model_override: &serde_json::Map<String, serde_json::Value>,
    model_key: &str,
) -> Result<MoeRouterSettings, TrainError> {
    use serde_json::Value;
    let o = &megatron.override_transformer_config;
    let key = |k: &str| format!("{megatron_key}.megatron.override_transformer_config.{k}");
    let coeff = match o.get("moe_aux_loss_coeff") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64()
                .filter(|c| *c >= 0.0 && c.is_finite())
                .ok_or_else(|| {
                    setup(format!(
                        "{} = {v}: must be a number ≥ 0",
                        key("moe_aux_loss_coeff")
                    ))
                })?,
        ),
    };
    let balancing = match o.get("moe_router_load_balancing_type") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_str().map(str::to_string).ok_or_else(|| {
            setup(format!(
                "{} = {v}: must be a string",
                key("moe_router_load_balancing_type")
            ))
        })?),
    };
    let aux_loss_coeff = match (balancing.as_deref(), coeff) {
        (None, c) => c.unwrap_or(0.0),
        (Some("aux_loss"), Some(c)) => c,
        (Some("aux_loss"), None) => {
            return Err(setup(format!(
                "{} = aux_loss needs {} (the loss's weight, e.g. 0.001)",
                key("moe_router_load_balancing_type"),
                key("moe_aux_loss_coeff")
            )))
        }
        (Some("none"), _) => 0.0,
        (Some(other), _) => {
            return Err(setup(format!(
                "{} = {other}: not supported yet; use aux_loss (Megatron's switch \
                 load-balancing loss) or none",
                key("moe_router_load_balancing_type")
            )))
        }
    };
    let freeze_router = match model_override
        .get("moe_config")
        .and_then(|m| m.get("freeze_moe_router"))
    {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| {
            setup(format!(
                "{model_key}.model.override_config.moe_config.freeze_moe_router = {v}: must be \
                 true or false"
            ))
        })?,
    };
    Ok(MoeRouterSettings {
        aux_loss_coeff,
        freeze_router,
    })
}

/// Tokens per chunk of the fused head (`model.use_fused_kernels`): at Qwen's 151 936-entry
/// vocabulary a chunk's f32 logits are 156 MB at tp = 1, against 0.6 MB a token unfused.
const FUSED_HEAD_CHUNK_TOKENS: usize = 256;

/// How every rank builds its critic.
#[derive(Clone)]
pub(crate) struct CriticPlan {
    pub topo: Topology,
    settings: CriticSettings,
    model: HfModelConfig,
    split: Vec<Range<usize>>,
    sequence_parallel: bool,
    distributed_optimizer: bool,
    dtype: ComputeDtype,
    seed: u64,
    optim: OptimConfig,
    optim_steps: u64,
    /// `critic.megatron.*_offload`.
    offload: OffloadSwitches,
    moe: MoeRouterSettings,
    dynamic: DynamicBatch,
    /// `critic.model.use_remove_padding`.
    pack_sequences: bool,
    /// `critic.megatron.override_transformer_config.recompute_*`.
    recompute: Option<Recompute>,
    /// `critic.model.path`: the causal LM (directory and config) whose backbone the critic
    /// starts from, under a new value head; `None`: drawn at random with the actor's shape.
    backbone: Option<(std::path::PathBuf, HfModelConfig)>,
}

/// The causal LM of `critic.model.path`, checked against the actor's vocabulary (the critic
/// reads the actor's token ids).
fn critic_backbone(
    cfg: &VerlConfig,
    actor: &HfModelConfig,
) -> Result<Option<(std::path::PathBuf, HfModelConfig)>, TrainError> {
    let Some(path) = &cfg.critic.model.path else {
        return Ok(None);
    };
    let lm = HfModelConfig::from_dir(path)
        .map_err(|e| setup(format!("critic.model.path = {path}: {e}")))?;
    if lm.vocab_size != actor.vocab_size {
        return Err(setup(format!(
            "critic.model.path = {path}: its vocabulary has {} tokens and the actor's {}; the \
             critic reads the actor's token ids, so give it a model with the actor's tokenizer",
            lm.vocab_size, actor.vocab_size
        )));
    }
    Ok(Some((path.into(), lm)))
}

/// The roles of a run, as every rank builds them.
#[derive(Clone)]
pub(crate) struct RolePlans {
    pub actor: ActorPlan,
    pub critic: Option<CriticPlan>,
    /// The rollout's chunks are not the actor's data-parallel ones (pipeline stages, or a
    /// rollout tensor parallel size other than the actor's), so the old log-probs are a
    /// separate pass rather than recomputed inside `generate_sequences`.
    pub old_log_prob_apart: bool,
}

impl RolePlans {
    /// Works the plans out from the config; a layout or optimizer that cannot work is refused
    /// here, before any model is built.
    pub(super) fn new(
        cfg: &VerlConfig,
        validated: &verl_core::config::ValidatedConfig,
        model_cfg: &HfModelConfig,
        tokens: (Arc<dyn Detokenizer>, Vec<u32>, u32),
        total_steps: u64,
    ) -> Result<Self, TrainError> {
        let (actor, old_log_prob_apart) =
            ActorPlan::new(cfg, validated, model_cfg, tokens, total_steps)?;
        let critic = match cfg.critic_enabled() {
            true => Some(CriticPlan::new(
                cfg,
                validated.world_size,
                model_cfg,
                total_steps,
            )?),
            false => None,
        };
        Ok(Self {
            actor,
            critic,
            old_log_prob_apart,
        })
    }
}

/// The actor's micro-batching and loss settings (`actor_rollout_ref.actor.*`).
fn actor_settings(
    cfg: &VerlConfig,
    validated: &verl_core::config::ValidatedConfig,
) -> Result<ActorSettings, TrainError> {
    let actor_cfg = &cfg.actor_rollout_ref.actor;
    let micro = actor_cfg
        .ppo_micro_batch_size_per_gpu
        .unwrap_or(validated.actor_mini_batch_per_dp);
    Ok(ActorSettings {
        mini_batch_rows: validated.actor_mini_batch_per_dp,
        micro_batch_rows: micro,
        log_prob_micro_batch_rows: cfg
            .actor_rollout_ref
            .rollout
            .log_prob_micro_batch_size_per_gpu
            .unwrap_or(micro),
        ppo_epochs: actor_cfg.ppo_epochs,
        shuffle: actor_cfg.shuffle,
        seed: actor_cfg.data_loader_seed.unwrap_or(cfg.trainer.seed),
        policy_loss: actor_cfg.policy_loss.loss_mode.clone(),
        loss_params: actor_cfg.policy_loss_params(cfg.trainer.seed),
        loss_agg_mode: actor_cfg.loss_agg_mode,
        loss_scale_factor: actor_cfg.loss_scale_factor,
        entropy_coeff: actor_cfg.entropy_coeff,
        use_kl_loss: actor_cfg.use_kl_loss,
        kl_loss_coef: actor_cfg.kl_loss_coef,
        kl_loss_type: actor_cfg.kl_loss_type,
        temperature: cfg.actor_rollout_ref.rollout.temperature.max(1e-6),
        bypass: cfg.algorithm.rollout_correction.bypass().map_err(setup)?,
    })
}

/// `use_dynamic_bsz` and the token budgets of the actor's update, old log-prob and reference
/// passes. verl counts a budget per cp rank: a micro-batch holds cp times as many.
fn actor_dynamic_batch(cfg: &VerlConfig, cp: usize) -> DynamicBatch {
    let actor_cfg = &cfg.actor_rollout_ref.actor;
    let (rollout, reference) = (
        &cfg.actor_rollout_ref.rollout,
        &cfg.actor_rollout_ref.reference,
    );
    DynamicBatch {
        update_max_tokens: actor_cfg
            .use_dynamic_bsz
            .then_some(actor_cfg.ppo_max_token_len_per_gpu * cp),
        forward_max_tokens: rollout
            .log_prob_use_dynamic_bsz
            .then_some(rollout.log_prob_max_token_len_per_gpu * cp),
        reference_max_tokens: reference
            .log_prob_use_dynamic_bsz
            .then_some(reference.log_prob_max_token_len_per_gpu * cp),
    }
}

/// The actor's optimizer steps over the run: epochs × the global batch over the global
/// mini-batch per RL step (each dp rank steps once per mini-batch of its share, all of them
/// together), plus the warm-up's when it shares the RL schedule.
fn actor_optim_steps(
    cfg: &VerlConfig,
    validated: &verl_core::config::ValidatedConfig,
    total_steps: u64,
) -> u64 {
    let (batch, n) = (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n);
    let global_mini = (validated.actor_mini_batch_per_dp * validated.actor_dp).max(1);
    let warm_up = if cfg.trainer.sft_warmup_lr.is_some() {
        0
    } else {
        cfg.trainer.sft_warmup_steps
    };
    total_steps.max(1)
        * cfg.actor_rollout_ref.actor.ppo_epochs as u64
        * (batch * n / global_mini).max(1) as u64
        + warm_up
}

/// The rollout engine's settings from verl's keys; rollout correction makes it return the
/// sampler's log-probs (compared with training's recompute).
fn rollout_engine_config(
    cfg: &VerlConfig,
    eos_token_ids: Vec<u32>,
    pad_token_id: u32,
) -> Result<EngineConfig, TrainError> {
    let mut engine = EngineConfig::from_verl(
        &cfg.actor_rollout_ref.rollout,
        &cfg.data,
        eos_token_ids,
        pad_token_id,
    )
    .map_err(setup)?;
    // Rollout correction compares them with training's recompute; bypass mode trains on them.
    let correction = &cfg.algorithm.rollout_correction;
    engine.calculate_log_probs |= correction.parsed().map_err(setup)?.is_active();
    engine.calculate_log_probs |= correction.bypass_mode;
    Ok(engine)
}

impl ActorPlan {
    /// The actor / rollout / reference plan, and whether the old log-probs are a separate
    /// pass.
    fn new(
        cfg: &VerlConfig,
        validated: &verl_core::config::ValidatedConfig,
        model_cfg: &HfModelConfig,
        (detokenizer, eos_token_ids, pad_token_id): (Arc<dyn Detokenizer>, Vec<u32>, u32),
        total_steps: u64,
    ) -> Result<(Self, bool), TrainError> {
        let world = validated.world_size;
        let actor_cfg = &cfg.actor_rollout_ref.actor;
        let settings = actor_settings(cfg, validated)?;
        let needs_ref = actor_cfg.use_kl_loss || cfg.algorithm.use_kl_in_reward;
        let optim_steps = actor_optim_steps(cfg, validated, total_steps);
        let engine = rollout_engine_config(cfg, eos_token_ids, pad_token_id)?;
        // Fail on an impossible optimizer or schedule before spawning anything.
        ModelOptimizer::<Train, CausalLm<Train>>::new(&actor_cfg.optim, optim_steps)
            .map_err(setup)?;
        let layout = actor_cfg.megatron.parallel();
        let split = pipeline_split(&actor_cfg.megatron, model_cfg, layout.pp)?;
        let recompute = recompute_settings(
            &actor_cfg.megatron,
            "actor_rollout_ref.actor",
            fused_attention_runs(
                compute_dtype(actor_cfg.megatron.dtype),
                layout.cp,
                model_cfg.head_dim,
            ),
        )?;
        let old_log_prob_apart = split.len() > 1
            || layout.cp > 1
            || cfg.actor_rollout_ref.rollout.tensor_model_parallel_size != layout.tp;
        let rollout_tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size;
        let topo = Topology::new(layout.clone(), world)
            .and_then(|t| t.with_rollout_tp(rollout_tp))
            .map_err(setup)?;
        model_cfg
            .check_layout(layout.tp, layout.ep, layout.expert_tp())
            .map_err(setup)?;
        model_cfg.check_tensor_parallel(rollout_tp).map_err(|e| {
            setup(format!(
                "actor_rollout_ref.rollout.tensor_model_parallel_size = {rollout_tp}: {e}"
            ))
        })?;
        let mode = actor_cfg.router_replay.mode.as_str();
        let recording = cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay;
        let router_replay = match mode {
            "disabled" => None,
            "R2" | "R3" if layout.sequence_parallel_active() || layout.cp > 1 => {
                return Err(setup(format!(
                    "actor_rollout_ref.actor.router_replay.mode={mode} maps each token to its row \
                     and position, and sequence or context parallel ranks route slices of a \
                     sequence: set actor_rollout_ref.actor.megatron.sequence_parallel=false and \
                     context_parallel_size=1, or router_replay.mode=disabled"
                )));
            }
            "R2" if cfg.algorithm.rollout_correction.bypass_mode => {
                return Err(setup(
                    "actor_rollout_ref.actor.router_replay.mode=R2 replays the actor's \
                     old-log-prob pass, which bypass mode skips \
                     (algorithm.rollout_correction.bypass_mode=true takes the rollout's): set \
                     one of them off",
                ));
            }
            "R2" if cfg.trainer.balance_batch && validated.actor_dp > 1 => {
                return Err(setup(
                    "actor_rollout_ref.actor.router_replay.mode=R2 keeps each data-parallel \
                     rank's recorded rows for its update, and trainer.balance_batch=true moves \
                     rows between ranks in between: set trainer.balance_batch=false",
                ));
            }
            "R2" => Some(RouterReplay::R2),
            "R3" if model_cfg.moe.is_none() => {
                return Err(setup(
                    "actor_rollout_ref.actor.router_replay.mode=R3 replays MoE routing, and \
                     this model has no experts: set router_replay.mode=disabled",
                ));
            }
            "R3" if !recording => {
                return Err(setup(
                    "actor_rollout_ref.actor.router_replay.mode=R3 replays the routing the \
                     rollout records: set actor_rollout_ref.rollout.enable_rollout_routing_replay\
                     =true (or router_replay.mode=R2 to record in the old-log-prob pass)",
                ));
            }
            // The routing travels with its rows: balance_batch and bypass mode keep it.
            "R3" => Some(RouterReplay::R3),
            other => {
                return Err(setup(format!(
                    "actor_rollout_ref.actor.router_replay.mode={other}: use disabled, R2 or R3"
                )));
            }
        };
        let actor = ActorPlan {
            overrides: RoleOverrides::default(),
            router_replay,
            topo,
            settings,
            engine,
            split,
            sequence_parallel: layout.sequence_parallel_active(),
            distributed_optimizer: actor_cfg.megatron.use_distributed_optimizer,
            actor_dtype: compute_dtype(actor_cfg.megatron.dtype),
            rollout_dtype: compute_dtype(cfg.actor_rollout_ref.rollout.dtype),
            seed: cfg.trainer.seed,
            optim: actor_cfg.optim.clone(),
            optim_steps,
            free_cache: cfg.actor_rollout_ref.rollout.free_cache_engine,
            bucket_megabytes: cfg
                .actor_rollout_ref
                .rollout
                .update_weights_bucket_megabytes,
            sft_lr: cfg.trainer.sft_warmup_lr,
            sft_steps: cfg.trainer.sft_warmup_steps,
            model_path: cfg.actor_rollout_ref.model.path.clone(),
            model: model_cfg.clone(),
            detokenizer,
            needs_ref,
            offload: OffloadSwitches::of(&actor_cfg.megatron),
            ref_param_offload: cfg
                .actor_rollout_ref
                .reference
                .megatron
                .as_ref()
                .is_some_and(|m| m.param_offload),
            moe: moe_router_settings(
                &actor_cfg.megatron,
                "actor_rollout_ref.actor",
                &cfg.actor_rollout_ref.model.override_config,
                "actor_rollout_ref",
            )?,
            fused_head_chunk: cfg
                .actor_rollout_ref
                .model
                .use_fused_kernels
                .then_some(FUSED_HEAD_CHUNK_TOKENS),
            pack_sequences: cfg.actor_rollout_ref.model.use_remove_padding,
            recompute,
            dynamic: actor_dynamic_batch(cfg, layout.cp),
        };
        Ok((actor, old_log_prob_apart))
    }
}

impl CriticPlan {
    /// The critic's plan (`critic.*`), when the run has a critic.
    fn new(
        cfg: &VerlConfig,
        world: usize,
        model_cfg: &HfModelConfig,
        total_steps: u64,
    ) -> Result<Self, TrainError> {
        let (batch, n) = (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n);
        let actor_cfg = &cfg.actor_rollout_ref.actor;
        let c = &cfg.critic;
        let mini = c
            .ppo_mini_batch_size
            .unwrap_or(actor_cfg.ppo_mini_batch_size)
            * n;
        let micro = c.ppo_micro_batch_size_per_gpu.unwrap_or(mini);
        let settings = CriticSettings {
            mini_batch_rows: mini,
            micro_batch_rows: micro,
            forward_micro_batch_rows: c.forward_micro_batch_size_per_gpu.unwrap_or(micro),
            ppo_epochs: c.ppo_epochs.unwrap_or(actor_cfg.ppo_epochs),
            shuffle: c.shuffle,
            seed: cfg.trainer.seed,
            cliprange_value: c.cliprange_value,
            loss_agg_mode: c.loss_agg_mode,
        };
        let backbone = critic_backbone(cfg, model_cfg)?;
        let mut vcfg = backbone.as_ref().map_or(model_cfg, |(_, lm)| lm).clone();
        vcfg.head = HeadKind::TokenClassification { num_labels: 1 };
        vcfg.tie_word_embeddings = false;
        let optim_steps = total_steps.max(1)
            * settings.ppo_epochs as u64
            * (batch * n / mini.max(1)).max(1) as u64;
        let layout = c.megatron.parallel();
        let split = pipeline_split(&c.megatron, &vcfg, layout.pp)?;
        let recompute = recompute_settings(
            &c.megatron,
            "critic",
            fused_attention_runs(compute_dtype(c.megatron.dtype), layout.cp, vcfg.head_dim),
        )?;
        let topo = Topology::new(layout.clone(), world).map_err(setup)?;
        vcfg.check_layout(layout.tp, layout.ep, layout.expert_tp())
            .map_err(setup)?;
        Ok(CriticPlan {
            topo,
            settings,
            model: vcfg,
            split,
            sequence_parallel: layout.sequence_parallel_active(),
            distributed_optimizer: c.megatron.use_distributed_optimizer,
            dtype: compute_dtype(c.megatron.dtype),
            seed: cfg.trainer.seed,
            optim: c.optim.clone(),
            optim_steps,
            offload: OffloadSwitches::of(&c.megatron),
            moe: moe_router_settings(&c.megatron, "critic", &c.model.override_config, "critic")?,
            // verl counts a budget per cp rank: a micro-batch holds cp times as many.
            dynamic: DynamicBatch {
                update_max_tokens: c
                    .use_dynamic_bsz
                    .then_some(c.ppo_max_token_len_per_gpu * layout.cp),
                forward_max_tokens: c.use_dynamic_bsz.then_some(
                    c.forward_max_token_len_per_gpu
                        .unwrap_or(c.ppo_max_token_len_per_gpu)
                        * layout.cp,
                ),
                reference_max_tokens: None,
            },
            pack_sequences: c.model.use_remove_padding,
            recompute,
            backbone,
        })
    }
}

impl ActorPlan {
    /// Rank `rank`'s actor / rollout / reference worker, joined to its `groups`.
    pub(super) fn build(
        &self,
        rank: usize,
        groups: ProcessGroups<Infer>,
    ) -> verl_core::Result<ActorRolloutRefWorker<Train>> {
        let model_groups = ModelGroups::of(&groups, self.sequence_parallel);
        let stage = PipelineStageLayout::of(groups.pp().rank(), self.split.clone());
        let ckpt = self
            .model_path
            .as_ref()
            .map(HfCheckpoint::open)
            .transpose()?;
        let model = self.training_model(&ckpt, &model_groups, &stage)?;
        let inner = burn::module::AutodiffModule::valid(&model);
        let (rollout, weight_sync) =
            self.rollout_engine(&ckpt, &groups, &model_groups, &stage, &inner)?;
        let actor = self.training_actor(model, &groups, &model_groups, &stage)?;
        let (reference, reference_offload) = self.reference(inner)?;
        Ok(ActorRolloutRefWorker {
            coords: self.topo.coords(rank)?,
            actor,
            rollout: match &self.overrides.rollout {
                Some(wrap) => wrap(rollout),
                None => rollout,
            },
            reference,
            sharding: HybridShardingManager {
                plan: weight_sync,
                free_cache_engine: self.free_cache,
                release_weights: self.offload.param,
            },
            reference_offload,
        })
    }

    /// This rank's stage of the actor's model (from the checkpoint, or drawn), with the
    /// role's compute dtype, MoE router settings, fused head and sequence packing.
    fn training_model(
        &self,
        ckpt: &Option<HfCheckpoint>,
        model_groups: &ModelGroups,
        stage: &PipelineStageLayout,
    ) -> verl_core::Result<CausalLm<Train>> {
        let (device, stage) = (Default::default(), stage.clone());
        let mcfg = &self.model;
        let model: CausalLm<Train> = match ckpt {
            None => CausalLm::init_stage(mcfg, 0.02, self.seed, &device, model_groups, &stage)?,
            Some(c) => log_load("actor", c, || {
                CausalLm::from_checkpoint_stage(mcfg, c, &device, model_groups, &stage)
            })?,
        }
        .with_compute_dtype(self.actor_dtype);
        let model = self.moe.apply(model);
        // `model.use_fused_kernels`: the head fused with log-softmax and entropy, in chunks
        // (actor and reference; the rollout samples from logits).
        let model = match self.fused_head_chunk {
            Some(chunk) => model.with_fused_log_probs(chunk),
            None => model,
        }
        // `model.use_remove_padding` (actor and reference; the rollout generates padded).
        .with_packed_sequences(self.pack_sequences)
        // Training passes only: the reference and log-prob passes keep nothing to recompute.
        .with_recompute(self.recompute);
        Ok(model)
    }

    /// The native rollout engine on this rank's rollout tensor-parallel group, and how the
    /// hybrid engine syncs the actor's weights into it.
    fn rollout_engine(
        &self,
        ckpt: &Option<HfCheckpoint>,
        groups: &ProcessGroups<Infer>,
        model_groups: &ModelGroups,
        stage: &PipelineStageLayout,
        inner: &CausalLm<Infer>,
    ) -> verl_core::Result<(
        Box<dyn verl_core::traits::RolloutEngine<Infer>>,
        WeightSyncPlan,
    )> {
        let (device, mcfg, tp) = (Default::default(), &self.model, &model_groups.tp);
        // The rollout engine runs every layer on its own tensor-parallel group (consecutive
        // ranks, no sequence parallel); the hybrid engine streams the actor's weights into it
        // before every generation. A single-rank actor (no split of any kind) and rollout share
        // the tensors.
        let rollout_tp = TpGroup::new(groups.get(GroupKind::RolloutTp).clone(), false);
        let actor_split = tp.is_parallel()
            || stage.stages > 1
            || model_groups.cp.is_parallel()
            || model_groups.ep.is_parallel()
            || model_groups.expert_tp().is_parallel();
        let rollout_model = if actor_split || rollout_tp.is_parallel() {
            match ckpt {
                None => {
                    CausalLm::<Infer>::init_sharded(mcfg, 0.02, self.seed, &device, &rollout_tp)?
                }
                Some(c) => log_load("rollout", c, || {
                    CausalLm::from_checkpoint_sharded(mcfg, c, &device, &rollout_tp)
                })?,
            }
        } else {
            inner.clone()
        }
        .with_compute_dtype(self.rollout_dtype);
        let mut weight_sync = WeightSyncPlan::with_bucket_megabytes(self.bucket_megabytes);
        // Shards go over as they are only when the rollout's layout is the actor's: the same
        // tp, one stage, and every expert on every rank split as tp splits it.
        weight_sync.shards_fit = rollout_tp.size == tp.size
            && stage.stages == 1
            && !model_groups.ep.is_parallel()
            && model_groups.expert_tp().size == tp.size;
        let mut rollout =
            NativeRollout::new(mcfg.clone(), rollout_model, self.engine.clone(), device)
                .map_err(verl_core::Error::from)?
                .with_detokenizer(self.detokenizer.clone());
        if let Some(make) = &self.overrides.agent {
            rollout = rollout.with_agent(make()).map_err(verl_core::Error::from)?;
        }
        Ok((Box::new(rollout), weight_sync))
    }

    /// The actor worker over `model`: optimizers (the warm-up's too), the parallel groups its
    /// gradients reduce over, offload, and the builder's policy losses.
    fn training_actor(
        &self,
        model: CausalLm<Train>,
        groups: &ProcessGroups<Infer>,
        model_groups: &ModelGroups,
        stage: &PipelineStageLayout,
    ) -> verl_core::Result<MegatronActor<Train>> {
        let optim = ModelOptimizer::new(&self.optim, self.optim_steps)?
            .with_distributed_optimizer(self.distributed_optimizer);
        let mut actor = MegatronActor::new(model, optim, self.settings.clone())
            .with_dynamic_batch(self.dynamic);
        for (name, loss) in &self.overrides.policy_losses {
            actor = actor.with_policy_loss(name, loss.clone());
        }
        if let Some(lr) = self.sft_lr {
            let mut o = self.optim.clone();
            o.lr = lr;
            o.lr_warmup_steps = Some(0);
            o.lr_decay_style = verl_core::config::LrDecayStyle::Constant;
            actor = actor.with_sft_optimizer(
                ModelOptimizer::new(&o, self.sft_steps.max(1))?
                    .with_distributed_optimizer(self.distributed_optimizer),
            );
        }
        if stage.stages > 1 {
            actor = actor.with_pipeline_parallel(groups.pp().clone());
        }
        if groups.dp().world_size() > 1 {
            actor = actor.with_data_parallel(groups.dp().clone(), DEFAULT_GRAD_BUCKET_ELEMS);
        }
        if model_groups.cp.is_parallel() {
            actor = actor.with_context_parallel(groups.dp_cp().clone(), DEFAULT_GRAD_BUCKET_ELEMS);
        }
        // Routed experts' gradients are summed where their shard is replicated.
        actor = actor.with_expert_data_parallel(groups.get(GroupKind::ExpertDp).clone());
        if self.offload.any() {
            actor = actor.with_offload(training_offload(self.offload, "actor"))?;
        }
        if let Some(source) = self.router_replay {
            actor = actor.with_router_replay_from(source)?;
        }
        Ok(actor)
    }

    /// The reference policy (the warmed-up actor's copy, when the run needs one), offloaded to
    /// the host with `ref.megatron.param_offload`.
    #[allow(clippy::type_complexity)]
    fn reference(
        &self,
        inner: CausalLm<Infer>,
    ) -> verl_core::Result<(Option<CausalLm<Infer>>, Option<ParamOffload<Infer>>)> {
        // bf16 product matrices where the products are bf16: the same log-probs in half the
        // memory, and the matrices no longer views of the actor's, which its first update
        // would otherwise have to copy (14.2 GiB a rank on a 7B model at tp=2).
        let mut reference = self.needs_ref.then(|| inner.with_bf16_products());
        let reference_offload = match (self.ref_param_offload, reference.is_some()) {
            (true, true) => {
                let mut o = ParamOffload::new(Infer::host_store("reference"));
                o.offload(&mut reference)?;
                o.take_moved();
                Some(o)
            }
            _ => None,
        };
        Ok((reference, reference_offload))
    }
}

impl CriticPlan {
    /// Rank `rank`'s critic, joined to its `groups`.
    pub(super) fn build(
        &self,
        rank: usize,
        groups: ProcessGroups<Infer>,
    ) -> verl_core::Result<CriticWorker<Train>> {
        let device = Default::default();
        let model_groups = ModelGroups::of(&groups, self.sequence_parallel);
        let stage = PipelineStageLayout::of(groups.pp().rank(), self.split.clone());
        let model = match &self.backbone {
            Some((path, lm)) => CausalLm::<Train>::value_model_from_checkpoint_stage(
                lm,
                &HfCheckpoint::open(path)?,
                (0.02, self.seed ^ 0xc41c),
                &device,
                &model_groups,
                &stage,
            )?,
            None => CausalLm::<Train>::init_stage(
                &self.model,
                0.02,
                self.seed ^ 0xc41c,
                &device,
                &model_groups,
                &stage,
            )?,
        }
        .with_compute_dtype(self.dtype)
        .with_packed_sequences(self.pack_sequences)
        .with_recompute(self.recompute);
        let model = self.moe.apply(model);
        let mut critic = MegatronCritic::new(
            model,
            ModelOptimizer::new(&self.optim, self.optim_steps)?
                .with_distributed_optimizer(self.distributed_optimizer),
            self.settings.clone(),
        )
        .with_dynamic_batch(self.dynamic);
        if stage.stages > 1 {
            critic = critic.with_pipeline_parallel(groups.pp().clone());
        }
        if groups.dp().world_size() > 1 {
            critic = critic.with_data_parallel(groups.dp().clone(), DEFAULT_GRAD_BUCKET_ELEMS);
        }
        if model_groups.cp.is_parallel() {
            critic =
                critic.with_context_parallel(groups.dp_cp().clone(), DEFAULT_GRAD_BUCKET_ELEMS);
        }
        critic = critic.with_expert_data_parallel(groups.get(GroupKind::ExpertDp).clone());
        if self.offload.any() {
            critic = critic.with_offload(training_offload(self.offload, "critic"))?;
        }
        Ok(CriticWorker {
            coords: self.topo.coords(rank)?,
            critic,
        })
    }
}

/// A trained role's host-memory stores (parameters on the training backend, moments on the
/// inner one), moving what `switches` say.
fn training_offload(switches: OffloadSwitches, role: &str) -> TrainingOffload<Train> {
    TrainingOffload::new(switches, Train::host_store(role), Infer::host_store(role))
}

pub(crate) type ActorWorker = ActorRolloutRefWorker<Train>;
pub(crate) type CriticRank = CriticWorker<Train>;

/// One role's profilers, one per rank, made on a rank's first call from the role's profiler
/// block (each rank's worker owns its own: threads share this table, processes each have one).
#[derive(Clone)]
pub(crate) struct GroupProfilers {
    role: &'static str,
    block: RoleProfilerConfig,
    global: GlobalProfilerConfig,
    by_rank: Arc<Mutex<HashMap<usize, RoleProfiler>>>,
}

impl GroupProfilers {
    pub(crate) fn new(role: &'static str, block: &RoleProfilerConfig, cfg: &VerlConfig) -> Self {
        Self {
            role,
            block: block.clone(),
            global: cfg.global_profiler.clone(),
            by_rank: Default::default(),
        }
    }

    fn of(&self, rank: usize) -> RoleProfiler {
        let mut by_rank = self.by_rank.lock().unwrap_or_else(|e| e.into_inner());
        by_rank
            .entry(rank)
            .or_insert_with(|| RoleProfiler::new(self.role, rank, &self.block, &self.global))
            .clone()
    }
}

/// The training step a batch belongs to (the trainer puts it in `meta_info`).
fn step_of(d: &DataProto<Infer>) -> Option<u64> {
    d.meta_info.get("global_steps").and_then(|v| v.as_u64())
}

/// A `DataProto` method run under its role's profiler (verl's `annotate`).
fn profiled<W: verl_core::worker::Worker>(
    table: MethodTable<W, Infer>,
    name: &'static str,
    profilers: &GroupProfilers,
    f: for<'a> fn(&'a mut W, DataProto<Infer>) -> MethodFuture<'a, DataProto<Infer>>,
) -> MethodTable<W, Infer> {
    let profilers = profilers.clone();
    table.proto(name, move |w: &mut W, ctx, d| {
        let profiler = profilers.of(ctx.rank);
        let step = step_of(&d);
        let run = f(w, d);
        Box::pin(async move { profiler.annotate(name, step, run).await })
    })
}

/// `start_profile` / `stop_profile` (verl's names): the trainer calls them on every rank
/// around each training step; `stop_profile` answers with the files written.
fn profile_controls<W: verl_core::worker::Worker>(
    table: MethodTable<W, Infer>,
    profilers: Vec<GroupProfilers>,
) -> MethodTable<W, Infer> {
    let stop = profilers.clone();
    table
        .value("start_profile", move |_: &mut W, ctx, step: u64| {
            for p in &profilers {
                p.of(ctx.rank).start_step(step);
            }
            Box::pin(async move { Ok(()) })
        })
        .value("stop_profile", move |_: &mut W, ctx, step: u64| {
            // Every role stops (one failed write must not leave another's capture open),
            // then the first failure is reported.
            let (mut files, mut failed) = (Vec::new(), None);
            for p in &stop {
                match p.of(ctx.rank).stop_step(step) {
                    Ok(written) => files.extend(written.iter().map(|f| f.display().to_string())),
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            let written = match failed {
                None => Ok(files),
                Some(e) => Err(verl_core::Error::backend("profiler", e)),
            };
            Box::pin(async move { written })
        })
}

/// The actor / rollout / reference worker's methods, as the trainer calls them: the actor's
/// profiler block covers generation, the log-prob passes and the update; the reference's
/// block covers `compute_ref_log_prob`.
pub(crate) fn actor_methods(cfg: &VerlConfig) -> MethodTable<ActorWorker, Infer> {
    let arr = &cfg.actor_rollout_ref;
    let actor = GroupProfilers::new("actor", &arr.actor.profiler, cfg);
    let reference = GroupProfilers::new("ref", &arr.reference.profiler, cfg);
    let mut table = MethodTable::<ActorWorker, Infer>::new();
    table = profiled(table, "generate_sequences", &actor, |w, d| {
        Box::pin(w.generate_sequences(d))
    });
    table = profiled(table, "compute_log_prob", &actor, |w, d| {
        Box::pin(w.compute_log_prob(d))
    });
    table = profiled(table, "compute_ref_log_prob", &reference, |w, d| {
        Box::pin(w.compute_ref_log_prob(d))
    });
    table = profiled(table, "update_actor", &actor, |w, d| {
        Box::pin(w.update_actor(d))
    });
    table = profiled(table, "sft_step", &actor, |w, d| Box::pin(w.sft_step(d)));
    profile_controls(table, vec![actor, reference])
        .value("set_reference", |w: &mut ActorWorker, _, (): ()| {
            Box::pin(async move { w.set_reference() })
        })
        .value(
            "save_checkpoint",
            |w: &mut ActorWorker, _, r: CheckpointRequest| Box::pin(w.save_checkpoint(r)),
        )
        .value(
            "load_checkpoint",
            |w: &mut ActorWorker, _, r: CheckpointRequest| Box::pin(w.load_checkpoint(r)),
        )
}

/// The critic's methods, as the trainer calls them.
pub(crate) fn critic_methods(cfg: &VerlConfig) -> MethodTable<CriticRank, Infer> {
    let critic = GroupProfilers::new("critic", &cfg.critic.profiler, cfg);
    let mut table = MethodTable::<CriticRank, Infer>::new();
    table = profiled(table, "compute_values", &critic, |w, d| {
        Box::pin(w.compute_values(d))
    });
    table = profiled(table, "update_critic", &critic, |w, d| {
        Box::pin(w.update_critic(d))
    });
    profile_controls(table, vec![critic])
        .value(
            "save_checkpoint",
            |w: &mut CriticRank, _, r: CheckpointRequest| Box::pin(w.save_checkpoint(r)),
        )
        .value(
            "load_checkpoint",
            |w: &mut CriticRank, _, r: CheckpointRequest| Box::pin(w.load_checkpoint(r)),
        )
}

/// Runs `load` (a model built from `ckpt`) and logs what it read and how long it took.
fn log_load<T>(
    role: &str,
    ckpt: &HfCheckpoint,
    load: impl FnOnce() -> Result<T, verl_megatron::MegatronError>,
) -> Result<T, verl_megatron::MegatronError> {
    let (before, started) = (ckpt.load_stats(), std::time::Instant::now());
    let out = load()?;
    let after = ckpt.load_stats();
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        gb = (after.bytes - before.bytes) as f64 / 1e9,
        read_s = after.read_seconds - before.read_seconds,
        device_s = after.device_seconds - before.device_seconds,
        "{role} weights read from {}",
        ckpt.dir().display()
    );
    Ok(out)
}

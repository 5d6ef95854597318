//! The PPO / GRPO trainer: verl's single-controller fit loop over the role workers.
//!
//! Each step, in verl's order: generate → reward → old log-prob → reference log-prob → values →
//! advantages → critic update → actor update; validation every `trainer.test_freq` steps. Every
//! step appends one JSON object to `<trainer.default_local_dir>/metrics.jsonl`.

pub mod builder;
pub mod checkpoint;
pub mod data;
pub mod log;
pub mod plot;
pub mod ranks;
mod roles;
mod setup;
pub mod step;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::prelude::*;
use serde_json::Value;
use verl_core::algorithms::advantage::AdvantageRegistry;
use verl_core::algorithms::kl::{KlController, KlPenalty};
use verl_core::backend::{DefaultAutodiff, DefaultBackend};
use verl_core::config::{ValidatedConfig, VerlConfig};
use verl_core::dispatch::DispatchMode;
use verl_core::topology::Topology;
use verl_core::traits::RewardInput;
use verl_core::worker::{RoleGroup, WorkerGroup};
use verl_core::{DataProto, Metrics};
use verl_megatron::checkpoint::HfCheckpointer;
use verl_megatron::hf::{HfCheckpoint, HfModelConfig, Qwen2Dims, SaveOptions};
use verl_megatron::layers::precision::ComputeDtype;
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::pipeline::stage_layers;
use verl_megatron::parallel::ProcessGroups;
use verl_megatron::workers::{CheckpointRequest, RewardModelWorker};

use crate::tasks::CharTokenizer;
use checkpoint::{contents_of, LoopState};
use data::{prompt_batch, sft_batch, Codec, PromptRow};
use log::RunLog;
use ranks::RankProcesses;
use roles::{ActorWorker, CriticRank};

/// The main job's settings (`verl train` with no `--config`), applied before the command
/// line's overrides: GRPO on the built-in addition task with a tiny Qwen2 trained from scratch.
pub const MAIN_JOB: &[&str] = &[
    "trainer.n_gpus_per_node=1",
    "trainer.project_name=verl_rs",
    "trainer.experiment_name=tiny_grpo_addition",
    "trainer.default_local_dir=outputs/tiny_grpo_addition",
    "trainer.total_training_steps=200",
    "trainer.sft_warmup_steps=600",
    "trainer.sft_warmup_lr=0.001",
    "trainer.test_freq=20",
    "trainer.val_before_train=true",
    "data.train_batch_size=16",
    "data.max_prompt_length=8",
    "data.max_response_length=4",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.max_num_seqs=128",
    "actor_rollout_ref.rollout.kv_cache_tokens=4096",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.optim.lr=0.0001",
    // Cosine decay over the RL steps: the score keeps its gains instead of drifting.
    "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.clip_grad=1.0",
];

type Train = DefaultAutodiff;
type Infer = DefaultBackend;

/// A trainer error: a message naming the setting or file to fix.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Core(#[from] verl_core::Error),
    #[error(transparent)]
    Data(#[from] verl_core::error::DataProtoError),
}

/// A `dtype` setting as the compute dtype of the binary's backend: `auto` is bfloat16 on
/// burn-cuda and float32 on the CPU default (where bf16 is emulated, and slower).
fn compute_dtype(value: &str, field: &str) -> Result<ComputeDtype, TrainError> {
    let auto = if cfg!(feature = "cuda") {
        ComputeDtype::Bf16
    } else {
        ComputeDtype::F32
    };
    Ok(ComputeDtype::parse(value, field)
        .map_err(setup)?
        .unwrap_or(auto))
}

fn setup(e: impl std::fmt::Display) -> TrainError {
    TrainError::Setup(e.to_string())
}

/// What a run ended with.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// The RL steps this run did (a resumed run counts only its own).
    pub steps: u64,
    /// The step of the checkpoint the run resumed from, if it did.
    pub resumed_at: Option<u64>,
    /// `val/score/mean` after the warm-up (before RL) and at the end.
    pub val_score_before: Option<f64>,
    pub val_score_after: Option<f64>,
    pub metrics_path: PathBuf,
    /// `metrics.png`: score and response length against step.
    pub plot_path: PathBuf,
    pub seconds: f64,
}

/// The model sizes the built-in task trains from scratch (`actor_rollout_ref.model.path` unset),
/// adjustable through `actor_rollout_ref.model.override_config`.
fn scratch_model(cfg: &VerlConfig, vocab: usize) -> Result<HfModelConfig, TrainError> {
    let o = &cfg.actor_rollout_ref.model.override_config;
    let get = |k: &str, d: usize| -> Result<usize, TrainError> {
        match o.get(k) {
            None => Ok(d),
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                setup(format!(
                    "actor_rollout_ref.model.override_config.{k} = {v}: must be a positive integer"
                ))
            }),
        }
    };
    const KEYS: [&str; 10] = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    ];
    // `moe_config` (verl's router switches) is read with the roles' settings.
    if let Some(k) = o
        .keys()
        .find(|k| !KEYS.contains(&k.as_str()) && k.as_str() != "moe_config")
    {
        return Err(setup(format!(
            "actor_rollout_ref.model.override_config.{k}: the built-in task's model takes only {}",
            KEYS.join(", ")
        )));
    }
    // A larger vocabulary than the task's tokenizer gives a model of a real one's shape (the
    // extra rows are never sampled for long).
    let vocab_size = get("vocab_size", vocab)?;
    if vocab_size < vocab {
        return Err(setup(format!(
            "actor_rollout_ref.model.override_config.vocab_size = {vocab_size}: the task's tokenizer has {vocab} tokens; use at least that"
        )));
    }
    let mut m = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size,
        hidden_size: get("hidden_size", 128)?,
        intermediate_size: get("intermediate_size", 384)?,
        num_hidden_layers: get("num_hidden_layers", 4)?,
        num_attention_heads: get("num_attention_heads", 4)?,
        num_key_value_heads: get("num_key_value_heads", 2)?,
        max_position_embeddings: 4096,
    });
    m.eos_token_ids = vec![CharTokenizer::EOS];
    // `num_experts` turns it into a Qwen2-MoE model: every layer's MLP a block of routed
    // experts plus a shared expert of `intermediate_size`.
    if o.contains_key("num_experts") {
        let experts = get("num_experts", 0)?;
        let top_k = get("num_experts_per_tok", 2)?;
        if experts == 0 || top_k == 0 || top_k > experts {
            return Err(setup(format!(
                "actor_rollout_ref.model.override_config: num_experts = {experts} and \
                 num_experts_per_tok = {top_k} must be positive, the second at most the first"
            )));
        }
        m.architecture = verl_megatron::hf::Architecture::Qwen2Moe;
        m.moe = Some(verl_megatron::hf::MoeConfig {
            num_experts: experts,
            num_experts_per_tok: top_k,
            moe_intermediate_size: get("moe_intermediate_size", m.intermediate_size / 2)?,
            shared_expert_intermediate_size: m.intermediate_size,
            norm_topk_prob: false,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
        });
    }
    if let Some(v) = o.get("tie_word_embeddings") {
        m.tie_word_embeddings = v.as_bool().ok_or_else(|| {
            setup(format!(
                "actor_rollout_ref.model.override_config.tie_word_embeddings = {v}: must be true or false"
            ))
        })?;
    }
    Ok(m)
}

/// The reward-model workers (`reward_model.enable`): a one-label score-head model loaded from
/// `reward_model.model.path`, fed the actor's token ids (so it must share the tokenizer).
fn reward_model_group(
    cfg: &VerlConfig,
    vocab_size: usize,
) -> Result<Option<WorkerGroup<RewardModelWorker<Infer>>>, TrainError> {
    let rm = &cfg.reward_model;
    if !rm.enable {
        return Ok(None);
    }
    let path = rm.model.path.clone().ok_or_else(|| {
        setup("reward_model.enable=true needs reward_model.model.path: a Hugging Face directory with a …ForSequenceClassification (num_labels = 1) model")
    })?;
    if rm.model.input_tokenizer.is_some() {
        return Err(setup("reward_model.model.input_tokenizer: re-tokenising for a reward model with its own tokenizer is not supported; the reward model reads the actor's token ids, so unset it and use a reward model that shares the actor's tokenizer"));
    }
    let rm_cfg = HfModelConfig::from_dir(&path).map_err(setup)?;
    if rm_cfg.vocab_size != vocab_size {
        return Err(setup(format!(
            "reward_model.model.path = {path}: its vocab_size {} differs from the actor's {vocab_size}; the reward model must share the actor's tokenizer",
            rm_cfg.vocab_size
        )));
    }
    let ckpt = HfCheckpoint::open(&path).map_err(setup)?;
    let micro = rm
        .micro_batch_size_per_gpu
        .unwrap_or(cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n);
    let topo = Topology::new(rm.megatron.parallel(), 1).map_err(setup)?;
    let group = WorkerGroup::spawn(1, move |ctx| {
        let model = CausalLm::<Infer>::from_checkpoint(&rm_cfg, &ckpt, &Default::default())?;
        RewardModelWorker::new(topo.coords(ctx.rank)?, &rm_cfg, model, micro)
    })?;
    Ok(Some(group))
}

/// The actor's tokenizer and model config: the built-in character tokenizer and a scratch
/// model, or those of `actor_rollout_ref.model.path`.
pub(crate) fn model_and_codec(cfg: &VerlConfig) -> Result<(Codec, HfModelConfig), TrainError> {
    let model_path = &cfg.actor_rollout_ref.model.path;
    Ok(match model_path {
        None => {
            let tok = CharTokenizer::arithmetic();
            let m = scratch_model(cfg, tok.vocab_size())?;
            (Codec::Char(tok), m)
        }
        Some(p) => {
            let m = HfModelConfig::from_dir(p).map_err(setup)?;
            let tok = verl_megatron::hf::HfTokenizer::from_dir(
                cfg.actor_rollout_ref
                    .model
                    .tokenizer_path
                    .as_deref()
                    .unwrap_or(p),
            )
            .map_err(setup)?;
            (Codec::Hf(Box::new(tok)), m)
        }
    })
}

/// The run's length: `trainer.total_training_steps`, else `total_epochs` over the data.
fn total_steps_of(cfg: &VerlConfig, rows: usize) -> u64 {
    let steps_per_epoch = (rows / cfg.data.train_batch_size.max(1)).max(1) as u64;
    cfg.trainer
        .total_training_steps
        .unwrap_or(cfg.trainer.total_epochs as u64 * steps_per_epoch)
}

/// The single controller of a PPO / GRPO run.
pub struct PpoTrainer {
    cfg: VerlConfig,
    validated: ValidatedConfig,
    actor: RoleGroup<ActorWorker, Infer>,
    critic: Option<RoleGroup<CriticRank, Infer>>,
    /// The rank processes, with `trainer.launcher=processes` (dropping them stops them).
    processes: Option<RankProcesses>,
    reward_model: Option<WorkerGroup<RewardModelWorker<Infer>>>,
    codec: Codec,
    train: Vec<PromptRow>,
    val: Vec<PromptRow>,
    kl_ctrl: Box<dyn KlController>,
    kl_penalty: KlPenalty,
    advantages: AdvantageRegistry<Infer>,
    scorer: builder::Scorer,
    /// `algorithm.rollout_correction`, parsed.
    rollout_correction: Option<verl_core::algorithms::rollout_correction::RolloutCorrection>,
    log: RunLog,
    needs_ref: bool,
    /// The old log-probs are a separate pass (see `RolePlans::old_log_prob_apart`).
    old_log_prob_apart: bool,
    total_steps: u64,
    /// The step being run (validation seeds its sampling with it).
    global_step: u64,
    out_dir: PathBuf,
    /// `config.json` of the actor's and the critic's HF copies.
    actor_config_json: Value,
    critic_config_json: Option<Value>,
    /// The checkpoint to resume from, and where its loop stood.
    resume: Option<(PathBuf, LoopState)>,
    /// The steps this run saved, oldest first: the only checkpoints it may prune.
    saved: Vec<u64>,
}

/// Each rank's communicators, to be taken by that rank's thread when it builds its worker.
type RankGroups = std::sync::Arc<std::sync::Mutex<Vec<Option<ProcessGroups<Infer>>>>>;

fn rank_groups(topo: &Topology) -> RankGroups {
    std::sync::Arc::new(std::sync::Mutex::new(
        ProcessGroups::local(topo).into_iter().map(Some).collect(),
    ))
}

/// The layers of each pipeline stage, with the `override_transformer_config` keys
/// `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`.
fn pipeline_split(
    megatron: &verl_core::config::MegatronConfig,
    model: &HfModelConfig,
    pp: usize,
) -> Result<Vec<std::ops::Range<usize>>, TrainError> {
    let key = |k: &str| -> Result<Option<usize>, TrainError> {
        match megatron.override_transformer_config.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                setup(format!(
                    "megatron.override_transformer_config.{k} = {v}: must be a whole number of \
                     layers"
                ))
            }),
        }
    };
    stage_layers(
        model.num_hidden_layers,
        pp,
        key("num_layers_in_first_pipeline_stage")?,
        key("num_layers_in_last_pipeline_stage")?,
    )
    .map_err(setup)
}

/// Rank `ctx.rank`'s communicators; a failure of any of its methods aborts them all, so its
/// peers stop waiting at once.
fn take_groups(
    groups: &RankGroups,
    ctx: &verl_core::worker::RankContext,
) -> verl_core::Result<ProcessGroups<Infer>> {
    let rank = ctx.rank;
    let taken = groups
        .lock()
        .map_err(|_| {
            verl_core::Error::backend("trainer", "a rank panicked while taking its groups")
        })?
        .get_mut(rank)
        .and_then(Option::take)
        .ok_or_else(|| {
            verl_core::Error::backend("trainer", format!("rank {rank}'s groups were taken"))
        })?;
    let aborter = taken.aborter();
    ctx.on_failure(move |why: &str| aborter(why));
    Ok(taken)
}

impl PpoTrainer {
    /// Builds the workers and data of a checked config (`verl train`: the builder with no
    /// parts of its own). A layout or batch that cannot work is refused here, before any model
    /// memory is allocated.
    pub fn new(validated: ValidatedConfig) -> Result<Self, TrainError> {
        Self::assemble(validated, builder::Parts::default())
    }

    /// The validated config the run uses.
    pub fn config(&self) -> &ValidatedConfig {
        &self.validated
    }

    /// The training rows, in their loaded order (a hand-driven loop picks its batches here).
    pub fn train_rows(&self) -> &[PromptRow] {
        &self.train
    }

    /// Appends one step's metrics (reduced to means) to `metrics.jsonl` and the progress line,
    /// as [`Self::fit`] does after each step.
    pub fn record(&mut self, step: u64, metrics: &Metrics) -> Result<(), TrainError> {
        self.log.record(step, &metrics.reduce()).map_err(setup)
    }

    /// Saves every role's state as step `step`'s checkpoint (a hand-driven loop's save; its
    /// data order is not the fit loop's, so a resumed [`Self::fit`] starts a fresh epoch).
    pub async fn save(&mut self, step: u64) -> Result<PathBuf, TrainError> {
        let mut state = LoopState::fresh(self.train.len(), self.kl_ctrl.value());
        state.step = step;
        self.save_checkpoint(&state).await
    }

    /// Scores of every row of a generated batch (by the trainer's [`Scorer`]), and their
    /// response lengths.
    async fn rewards(&self, gen: &DataProto<Infer>) -> Result<(Vec<f64>, Vec<f64>), TrainError> {
        let responses: Vec<i64> = gen
            .to_data("responses")?
            .convert::<i64>()
            .iter::<i64>()
            .collect();
        let mask: Vec<i64> = gen
            .to_data("response_mask")?
            .convert::<i64>()
            .iter::<i64>()
            .collect();
        let r = responses.len() / gen.len().max(1);
        let sources = gen.non_tensor("data_source")?;
        let truths = gen.non_tensor("reward_model")?;
        let extras = gen.non_tensor("extra_info").ok();
        let mut texts = Vec::with_capacity(gen.len());
        let mut lengths = Vec::with_capacity(gen.len());
        for i in 0..gen.len() {
            let len = mask[i * r..(i + 1) * r].iter().sum::<i64>() as usize;
            let ids: Vec<u32> = responses[i * r..i * r + len]
                .iter()
                .map(|&t| t as u32)
                .collect();
            texts.push(self.codec.decode(&ids));
            lengths.push(len as f64);
        }
        let null = Value::Null;
        let inputs: Vec<RewardInput<'_>> = (0..gen.len())
            .map(|i| RewardInput {
                data_source: sources[i].as_str().unwrap_or_default(),
                solution_str: &texts[i],
                ground_truth: truths[i]
                    .get("ground_truth")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
                extra_info: extras.as_ref().map_or(&null, |e| &e[i]),
            })
            .collect();
        let scores = self.scorer.score(&inputs).await?;
        Ok((scores, lengths))
    }

    /// Greedy validation (`rollout.val_kwargs`) on the validation set: `val/score/mean`.
    pub async fn validate(&mut self) -> Result<f64, TrainError> {
        let rows: Vec<&PromptRow> = self.val.iter().collect();
        let mut total = 0.0;
        let mut count = 0usize;
        for chunk in rows.chunks(self.cfg.data.val_batch_size.unwrap_or(rows.len()).max(1)) {
            let mut batch = prompt_batch::<Infer>(
                chunk,
                self.codec.pad_token_id(),
                "val",
                &Default::default(),
            )?;
            batch.meta_info.insert("validate".into(), Value::Bool(true));
            batch
                .meta_info
                .insert("recompute_log_prob".into(), Value::Bool(false));
            batch
                .meta_info
                .insert("global_steps".into(), self.global_step.into());
            let gen = self
                .actor
                .call_proto(&rollout_mesh(), "generate_sequences", batch)
                .await?;
            let (scores, _) = self.rewards(&gen).await?;
            total += scores.iter().sum::<f64>();
            count += scores.len();
        }
        Ok(total / count.max(1) as f64)
    }

    /// Supervised warm-up on ground-truth answers (`trainer.sft_warmup_steps`), then the
    /// reference policy is set to the warmed-up actor.
    pub async fn warm_up(&mut self) -> Result<(), TrainError> {
        let steps = self.cfg.trainer.sft_warmup_steps;
        let b = self.cfg.data.train_batch_size * self.cfg.actor_rollout_ref.rollout.n;
        for s in 0..steps {
            let rows: Vec<&PromptRow> = (0..b)
                .map(|i| &self.train[(s as usize * b + i) % self.train.len()])
                .collect();
            let batch =
                sft_batch::<Infer>(&rows, &self.codec, &Default::default()).map_err(setup)?;
            let out = self
                .actor
                .call_proto(&DispatchMode::MegatronCompute, "sft_step", batch)
                .await?;
            let m = metrics_of(&out);
            self.log.sft(s + 1, steps, &m.reduce()).map_err(setup)?;
        }
        if self.needs_ref {
            self.actor.call_all::<_, ()>("set_reference", &()).await?;
        }
        Ok(())
    }

    /// verl's `start_profile` / `stop_profile` on every rank of every role around a profiled
    /// step (nothing when the step is not listed in `global_profiler.steps`); the files the
    /// captures wrote are logged.
    async fn profile(&self, method: &str, step: u64) -> Result<(), TrainError> {
        let p = &self.cfg.global_profiler;
        let listed = p.steps.as_ref().is_some_and(|s| s.contains(&step));
        if p.tool.is_none() || !listed {
            return Ok(());
        }
        let mut written: Vec<Vec<String>> = Vec::new();
        if method == "stop_profile" {
            written.extend(self.actor.call_all::<_, Vec<String>>(method, &step).await?);
            if let Some(critic) = &self.critic {
                written.extend(critic.call_all::<_, Vec<String>>(method, &step).await?);
            }
        } else {
            self.actor.call_all::<_, ()>(method, &step).await?;
            if let Some(critic) = &self.critic {
                critic.call_all::<_, ()>(method, &step).await?;
            }
        }
        for file in written.into_iter().flatten() {
            tracing::info!("profiler: step {step}: wrote {file}");
        }
        Ok(())
    }

    /// Saves step `state.step` in verl's layout (see [`checkpoint`]): every rank of each role
    /// writes its shard, then the loop state, then `latest_checkpointed_iteration.txt`; older
    /// checkpoints this run saved beyond the `trainer.max_*_ckpt_to_keep` limits are removed
    /// (see [`checkpoint::keep_limit`]: 0 keeps all, as in verl). A directory of the same step that this run did not write is set aside,
    /// never overwritten; `checksums.json` lists every file for verification at resume.
    pub async fn save_checkpoint(&mut self, state: &LoopState) -> Result<PathBuf, TrainError> {
        let dir = checkpoint::step_dir(&self.out_dir, state.step);
        if !self.saved.contains(&state.step) {
            let moved = checkpoint::set_aside(&self.out_dir, state.step)
                .map_err(|e| setup(format!("{}: {e}", dir.display())))?;
            if let Some(to) = moved {
                tracing::warn!(
                    "{} was not written by this run: moved to {} rather than overwritten",
                    dir.display(),
                    to.display()
                );
            }
        }
        let (contents, hf) = contents_of(
            &self.cfg.actor_rollout_ref.actor.checkpoint,
            "actor_rollout_ref.actor",
            true,
        )?;
        let req = CheckpointRequest {
            dir: dir.join("actor"),
            contents,
            hf: hf.then(|| HfCheckpointer {
                config_json: self.actor_config_json.clone(),
                options: SaveOptions::default(),
            }),
        };
        self.actor
            .call_all::<_, ()>("save_checkpoint", &req)
            .await?;
        if let Some(critic) = &self.critic {
            let (contents, hf) = contents_of(&self.cfg.critic.checkpoint, "critic", true)?;
            let req = CheckpointRequest {
                dir: dir.join("critic"),
                contents,
                hf: match (&self.critic_config_json, hf) {
                    (Some(json), true) => Some(HfCheckpointer {
                        config_json: json.clone(),
                        options: SaveOptions::default(),
                    }),
                    _ => None,
                },
            };
            critic.call_all::<_, ()>("save_checkpoint", &req).await?;
        }
        checkpoint::write_loop_state(&dir, state)?;
        checkpoint::write_checksums(&dir)?;
        checkpoint::mark_latest(&self.out_dir, state.step)
            .map_err(|e| setup(format!("{}: {e}", self.out_dir.display())))?;
        self.saved.retain(|&s| s != state.step);
        self.saved.push(state.step);
        let t = &self.cfg.trainer;
        // A run without a critic has no critic checkpoints for its limit to count.
        let critic_limit = t.max_critic_ckpt_to_keep.filter(|_| self.critic.is_some());
        let keep = checkpoint::keep_limit(t.max_actor_ckpt_to_keep, critic_limit);
        if let Some(k) = keep {
            checkpoint::prune(&self.out_dir, &mut self.saved, k)
                .map_err(|e| setup(format!("{}: {e}", self.out_dir.display())))?;
        }
        Ok(dir)
    }

    /// Loads every role's state from a `global_step_<N>` directory (`load_contents`).
    async fn load_checkpoint(&mut self, dir: &Path) -> Result<(), TrainError> {
        let (contents, _) = contents_of(
            &self.cfg.actor_rollout_ref.actor.checkpoint,
            "actor_rollout_ref.actor",
            false,
        )?;
        let req = CheckpointRequest {
            dir: dir.join("actor"),
            contents,
            hf: None,
        };
        self.actor
            .call_all::<_, ()>("load_checkpoint", &req)
            .await?;
        if let Some(critic) = &self.critic {
            if !dir.join("critic").is_dir() {
                return Err(setup(format!(
                    "{}: no critic was saved in this checkpoint, but critic.enable is on",
                    dir.display()
                )));
            }
            let (contents, _) = contents_of(&self.cfg.critic.checkpoint, "critic", false)?;
            let req = CheckpointRequest {
                dir: dir.join("critic"),
                contents,
                hf: None,
            };
            critic.call_all::<_, ()>("load_checkpoint", &req).await?;
        }
        Ok(())
    }

    /// The whole run: warm-up, optional validation before training, the RL steps (epochs over
    /// the shuffled prompts, bounded by `trainer.total_training_steps`), validation every
    /// `trainer.test_freq` steps and at the end, a checkpoint every `trainer.save_freq` steps
    /// and at the end. A run that finds a checkpoint (`trainer.resume_mode`) continues from it
    /// exactly: same batches, samples, optimizer state and metrics as if never stopped.
    pub async fn fit(&mut self) -> Result<RunSummary, TrainError> {
        let start = Instant::now();
        let mut ls = match self.resume.take() {
            Some((dir, ls)) => {
                self.load_checkpoint(&dir).await?;
                self.kl_ctrl.restore(ls.kl_coef);
                tracing::info!("resumed from {} (step {})", dir.display(), ls.step);
                if self.cfg.trainer.del_local_ckpt_after_load {
                    std::fs::remove_dir_all(&dir).map_err(setup)?;
                }
                ls
            }
            None => {
                self.warm_up().await?;
                let mut ls = LoopState::fresh(self.train.len(), self.kl_ctrl.value());
                if self.cfg.trainer.val_before_train {
                    let v = self.validate().await?;
                    self.log
                        .record(
                            0,
                            &[("val/score/mean".to_string(), v)].into_iter().collect(),
                        )
                        .map_err(setup)?;
                    ls.val_before = Some(v);
                }
                ls
            }
        };
        let b = self.cfg.data.train_batch_size;
        let mut after = ls.val_before;
        let first_step = ls.step + 1;
        for step in ls.step + 1..=self.total_steps {
            self.global_step = step;
            if ls.cursor + b > ls.order.len() {
                if self.cfg.data.shuffle {
                    use rand::seq::SliceRandom;
                    use rand::SeedableRng;
                    let mut rng = rand::rngs::StdRng::seed_from_u64(self.cfg.data.seed ^ ls.epoch);
                    ls.order.shuffle(&mut rng);
                }
                ls.epoch += 1;
                ls.cursor = 0;
            }
            let rows: Vec<PromptRow> = ls.order[ls.cursor..ls.cursor + b]
                .iter()
                .map(|&i| self.train[i].clone())
                .collect();
            ls.cursor += b;
            let refs: Vec<&PromptRow> = rows.iter().collect();
            self.profile("start_profile", step).await?;
            let metrics = self.step(step, &refs).await?;
            self.profile("stop_profile", step).await?;
            let mut reduced = metrics.reduce();
            reduced.insert("training/epoch".into(), ls.epoch as f64);
            let freq = self.cfg.trainer.test_freq;
            if (freq > 0 && step % freq as u64 == 0) || step == self.total_steps {
                let v = self.validate().await?;
                reduced.insert("val/score/mean".into(), v);
                after = Some(v);
            }
            self.log.record(step, &reduced).map_err(setup)?;
            ls.step = step;
            let save = self.cfg.trainer.save_freq;
            if save > 0 && (step % save as u64 == 0 || step == self.total_steps) {
                ls.kl_coef = self.kl_ctrl.value();
                self.save_checkpoint(&ls).await?;
            }
        }
        self.log.finish();
        if let Some(p) = &mut self.processes {
            p.finish()?;
        }
        Ok(RunSummary {
            steps: (self.total_steps + 1).saturating_sub(first_step),
            resumed_at: first_step.checked_sub(1).filter(|&s| s > 0),
            val_score_before: ls.val_before,
            val_score_after: after,
            metrics_path: self.log.metrics_path().to_path_buf(),
            plot_path: self.log.plot_path(),
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

/// `data` without the metrics a worker returned in it, which go into `metrics`.
fn take_metrics<B: Backend>(mut data: DataProto<B>, metrics: &mut Metrics) -> DataProto<B> {
    metrics.extend(metrics_of(&data));
    data.meta_info.remove("metrics");
    data
}

/// The metrics a worker returned in `meta_info["metrics"]` (one object of lists per rank, or
/// a list of them after collecting several ranks).
pub fn metrics_of<B: Backend>(data: &DataProto<B>) -> Metrics {
    let mut out = Metrics::default();
    let mut add = |obj: &serde_json::Map<String, Value>| {
        for (k, v) in obj {
            match v {
                Value::Array(xs) => xs
                    .iter()
                    .filter_map(Value::as_f64)
                    .for_each(|x| out.push(k.clone(), x)),
                other => {
                    if let Some(x) = other.as_f64() {
                        out.push(k.clone(), x)
                    }
                }
            }
        }
    };
    match data.meta_info.get("metrics") {
        Some(Value::Object(o)) => add(o),
        Some(Value::Array(parts)) => parts.iter().filter_map(Value::as_object).for_each(&mut add),
        _ => {}
    }
    out
}

/// How `generate_sequences` is dispatched: verl's rollout mesh (each rollout tensor-parallel
/// group one chunk, collected from its first rank).
fn rollout_mesh() -> DispatchMode {
    DispatchMode::Nd {
        mesh: verl_core::dispatch::MESH_ROLLOUT.into(),
    }
}

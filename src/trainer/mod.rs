//! The PPO / GRPO trainer: verl's single-controller fit loop over the role workers.
//!
//! Each step, in verl's order: generate → reward → old log-prob → reference log-prob → values →
//! advantages → critic update → actor update; validation every `trainer.test_freq` steps. Every
//! step appends one JSON object to `<trainer.default_local_dir>/metrics.jsonl`.

pub mod data;
pub mod log;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::prelude::*;
use serde_json::Value;
use verl_core::algorithms::advantage::{AdvantageInput, AdvantageRegistry};
use verl_core::algorithms::aggregation::LossAggMode;
use verl_core::algorithms::kl::{kl_controller, KlController, KlPenalty};
use verl_core::algorithms::reward::{apply_kl_penalty, token_level_rewards};
use verl_core::backend::{CpuAutodiff, CpuBackend};
use verl_core::config::{ValidatedConfig, VerlConfig};
use verl_core::dispatch::DispatchMode;
use verl_core::reward_score::default_compute_score;
use verl_core::topology::Topology;
use verl_core::worker::WorkerGroup;
use verl_core::{DataProto, Metrics};
use verl_megatron::hf::{HeadKind, HfCheckpoint, HfModelConfig, Qwen2Dims};
use verl_megatron::models::CausalLm;
use verl_megatron::workers::{
    ActorRolloutRefWorker, ActorSettings, CriticSettings, CriticWorker, HybridShardingManager,
    MegatronActor, MegatronCritic, ModelOptimizer,
};
use verl_rollout::{EngineConfig, NativeRollout};

use crate::tasks::{ArithmeticTask, CharTokenizer};
use data::{arithmetic_rows, jsonl_rows, prompt_batch, sft_batch, Codec, PromptRow};
use log::RunLog;

/// The main job's settings (`verl train` with no `--config`), applied before the command
/// line's overrides: GRPO on the built-in addition task with a tiny Qwen2 trained from scratch.
pub const MAIN_JOB: &[&str] = &[
    "trainer.n_gpus_per_node=1",
    "trainer.project_name=verl_rs",
    "trainer.experiment_name=tiny_grpo_addition",
    "trainer.default_local_dir=outputs/tiny_grpo_addition",
    "trainer.total_training_steps=200",
    "trainer.sft_warmup_steps=300",
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
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.clip_grad=1.0",
];

type Train = CpuAutodiff;
type Infer = CpuBackend;

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

fn setup(e: impl std::fmt::Display) -> TrainError {
    TrainError::Setup(e.to_string())
}

/// What a run ended with.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub steps: u64,
    /// `val/score/mean` after the warm-up (before RL) and at the end.
    pub val_score_before: Option<f64>,
    pub val_score_after: Option<f64>,
    pub metrics_path: PathBuf,
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
    let mut m = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: vocab,
        hidden_size: get("hidden_size", 128)?,
        intermediate_size: get("intermediate_size", 384)?,
        num_hidden_layers: get("num_hidden_layers", 4)?,
        num_attention_heads: get("num_attention_heads", 4)?,
        num_key_value_heads: get("num_key_value_heads", 2)?,
        max_position_embeddings: 4096,
    });
    m.eos_token_ids = vec![CharTokenizer::EOS];
    Ok(m)
}

/// The single controller of a PPO / GRPO run.
pub struct PpoTrainer {
    cfg: VerlConfig,
    validated: ValidatedConfig,
    actor: WorkerGroup<ActorRolloutRefWorker<Train>>,
    critic: Option<WorkerGroup<CriticWorker<Train>>>,
    codec: Codec,
    train: Vec<PromptRow>,
    val: Vec<PromptRow>,
    kl_ctrl: Box<dyn KlController>,
    kl_penalty: KlPenalty,
    advantages: AdvantageRegistry<Infer>,
    log: RunLog,
    needs_ref: bool,
    total_steps: u64,
}

impl PpoTrainer {
    /// Builds the workers and data of a checked config. A layout or batch that cannot work is
    /// refused here, before any model memory is allocated.
    pub fn new(validated: ValidatedConfig) -> Result<Self, TrainError> {
        let cfg = validated.config.clone();
        if validated.world_size != 1 {
            return Err(setup(format!(
                "trainer.nnodes × trainer.n_gpus_per_node = {}: training on more than one rank \
                 needs the communicator (tensor / data parallel gradients), which is not built \
                 yet; set trainer.n_gpus_per_node=1",
                validated.world_size
            )));
        }
        let model_path = cfg.actor_rollout_ref.model.path.clone();
        let (codec, model_cfg) = match &model_path {
            None => {
                let tok = CharTokenizer::arithmetic();
                let m = scratch_model(&cfg, tok.vocab_size())?;
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
        };
        // Data: JSONL files, or the built-in task.
        let builtin = match &cfg.data.train_files {
            None => Some(ArithmeticTask { digits: 2 }),
            Some(f) => match f.paths().as_slice() {
                [one] if one.starts_with("builtin:") => {
                    Some(ArithmeticTask::from_spec(one).map_err(setup)?)
                }
                _ => None,
            },
        };
        let (train, val) = match (&builtin, &cfg.data.train_files) {
            (Some(task), _) => (
                arithmetic_rows(task, &codec, 4096, cfg.data.seed).map_err(setup)?,
                arithmetic_rows(task, &codec, 128, cfg.data.seed ^ 0x5eed).map_err(setup)?,
            ),
            (None, Some(files)) => {
                let load = |paths: Vec<&str>| -> Result<Vec<PromptRow>, TrainError> {
                    let mut rows = Vec::new();
                    for p in paths {
                        rows.extend(
                            jsonl_rows(Path::new(p), &codec, &cfg.data.prompt_key)
                                .map_err(setup)?,
                        );
                    }
                    Ok(rows)
                };
                let train = load(files.paths())?;
                let val = match &cfg.data.val_files {
                    Some(v) => load(v.paths())?,
                    None => train.iter().take(64).cloned().collect(),
                };
                (train, val)
            }
            (None, None) => unreachable!("no files means the built-in task"),
        };
        if builtin.is_some() && model_path.is_some() {
            return Err(setup("the built-in task uses its own character tokenizer: set data.train_files to JSONL files to train an HF model at actor_rollout_ref.model.path"));
        }
        let longest = train
            .iter()
            .chain(&val)
            .map(|r| r.prompt_ids.len())
            .max()
            .unwrap_or(0);
        if longest > cfg.data.max_prompt_length
            && cfg.data.truncation == verl_core::config::Truncation::Error
        {
            return Err(setup(format!(
                "a prompt has {longest} tokens, more than data.max_prompt_length = {}; raise it or set data.truncation",
                cfg.data.max_prompt_length
            )));
        }
        let batch = cfg.data.train_batch_size;
        let steps_per_epoch = (train.len() / batch).max(1) as u64;
        let total_steps = cfg
            .trainer
            .total_training_steps
            .unwrap_or(cfg.trainer.total_epochs as u64 * steps_per_epoch);
        let n = cfg.actor_rollout_ref.rollout.n;
        let actor_cfg = &cfg.actor_rollout_ref.actor;
        let micro = actor_cfg
            .ppo_micro_batch_size_per_gpu
            .unwrap_or(validated.actor_mini_batch_per_dp);
        let settings = ActorSettings {
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
            loss_agg_mode: actor_cfg.loss_agg_mode.parse().map_err(setup)?,
            entropy_coeff: actor_cfg.entropy_coeff,
            use_kl_loss: actor_cfg.use_kl_loss,
            kl_loss_coef: actor_cfg.kl_loss_coef,
            kl_loss_type: actor_cfg.kl_loss_type.parse().map_err(setup)?,
            temperature: cfg.actor_rollout_ref.rollout.temperature.max(1e-6),
        };
        let needs_ref = actor_cfg.use_kl_loss || cfg.algorithm.use_kl_in_reward;
        let optim_steps = total_steps.max(1)
            * actor_cfg.ppo_epochs as u64
            * (batch * n / validated.actor_mini_batch_per_dp.max(1)).max(1) as u64
            + if cfg.trainer.sft_warmup_lr.is_some() {
                0
            } else {
                cfg.trainer.sft_warmup_steps
            };
        let engine = EngineConfig::from_verl(
            &cfg.actor_rollout_ref.rollout,
            &cfg.data,
            codec.eos_token_ids(),
            codec.pad_token_id(),
        )
        .map_err(setup)?;
        // Fail on an impossible optimizer or schedule before spawning anything.
        ModelOptimizer::<Train, CausalLm<Train>>::new(&actor_cfg.optim, optim_steps)
            .map_err(setup)?;
        let topo = Topology::new(actor_cfg.megatron.parallel(), 1).map_err(setup)?;
        let seed = cfg.trainer.seed;
        let actor_optim = actor_cfg.optim.clone();
        let free_cache = cfg.actor_rollout_ref.rollout.free_cache_engine;
        let sft_lr = cfg.trainer.sft_warmup_lr;
        let sft_steps = cfg.trainer.sft_warmup_steps;
        let path = model_path.clone();
        let mcfg = model_cfg.clone();
        let actor = WorkerGroup::spawn(1, move |ctx| {
            let device = Default::default();
            let model: CausalLm<Train> = match &path {
                None => CausalLm::init(&mcfg, 0.02, seed, &device),
                Some(p) => {
                    let ckpt = HfCheckpoint::open(p)?;
                    CausalLm::from_checkpoint(&mcfg, &ckpt, &device)?
                }
            };
            let inner = burn::module::AutodiffModule::valid(&model);
            let rollout = NativeRollout::new(mcfg.clone(), inner.clone(), engine.clone(), device)
                .map_err(verl_core::Error::from)?;
            let optim = ModelOptimizer::new(&actor_optim, optim_steps)?;
            let mut actor = MegatronActor::new(model, optim, settings.clone());
            if let Some(lr) = sft_lr {
                let mut o = actor_optim.clone();
                o.lr = lr;
                o.lr_warmup_steps = Some(0);
                o.lr_decay_style = "constant".into();
                actor = actor.with_sft_optimizer(ModelOptimizer::new(&o, sft_steps.max(1))?);
            }
            Ok(ActorRolloutRefWorker {
                coords: topo.coords(ctx.rank)?,
                actor,
                rollout: Box::new(rollout),
                reference: needs_ref.then_some(inner),
                sharding: HybridShardingManager {
                    free_cache_engine: free_cache,
                },
            })
        })?;
        let critic = if cfg.critic_enabled() {
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
                seed,
                cliprange_value: c.cliprange_value,
                loss_agg_mode: c.loss_agg_mode.parse::<LossAggMode>().map_err(setup)?,
            };
            let mut vcfg = model_cfg.clone();
            vcfg.head = HeadKind::TokenClassification { num_labels: 1 };
            vcfg.tie_word_embeddings = false;
            let optim_cfg = c.optim.clone();
            let critic_steps = total_steps.max(1)
                * settings.ppo_epochs as u64
                * (batch * n / mini.max(1)).max(1) as u64;
            let topo = Topology::new(c.megatron.parallel(), 1).map_err(setup)?;
            Some(WorkerGroup::spawn(1, move |ctx| {
                let device = Default::default();
                let model = CausalLm::<Train>::init(&vcfg, 0.02, seed ^ 0xc41c, &device);
                Ok(CriticWorker {
                    coords: topo.coords(ctx.rank)?,
                    critic: MegatronCritic::new(
                        model,
                        ModelOptimizer::new(&optim_cfg, critic_steps)?,
                        settings.clone(),
                    ),
                })
            })?)
        } else {
            None
        };
        let out_dir = PathBuf::from(cfg.trainer.default_local_dir.clone().unwrap_or_else(|| {
            format!(
                "checkpoints/{}/{}",
                cfg.trainer.project_name, cfg.trainer.experiment_name
            )
        }));
        Ok(Self {
            kl_ctrl: kl_controller(&cfg.algorithm.kl_ctrl).map_err(setup)?,
            kl_penalty: cfg.algorithm.kl_penalty.parse().map_err(setup)?,
            advantages: AdvantageRegistry::new(),
            log: RunLog::create(&out_dir, total_steps).map_err(setup)?,
            cfg,
            validated,
            actor,
            critic,
            codec,
            train,
            val,
            needs_ref,
            total_steps,
        })
    }

    /// The validated config the run uses.
    pub fn config(&self) -> &ValidatedConfig {
        &self.validated
    }

    fn score(&self, data_source: &str, solution: &str, ground_truth: &str) -> f64 {
        if data_source == ArithmeticTask::DATA_SOURCE {
            return ArithmeticTask::score(solution, ground_truth);
        }
        default_compute_score(data_source, solution, ground_truth).unwrap_or(0.0)
    }

    /// Scores of every row of a generated batch, and their response lengths.
    fn rewards(&self, gen: &DataProto<Infer>) -> Result<(Vec<f64>, Vec<f64>), TrainError> {
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
        let mut scores = Vec::with_capacity(gen.len());
        let mut lengths = Vec::with_capacity(gen.len());
        for i in 0..gen.len() {
            let len = mask[i * r..(i + 1) * r].iter().sum::<i64>() as usize;
            let ids: Vec<u32> = responses[i * r..i * r + len]
                .iter()
                .map(|&t| t as u32)
                .collect();
            let text = self.codec.decode(&ids);
            let truth = truths[i]
                .get("ground_truth")
                .and_then(Value::as_str)
                .unwrap_or_default();
            scores.push(self.score(sources[i].as_str().unwrap_or_default(), &text, truth));
            lengths.push(len as f64);
        }
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
            let gen = self
                .actor
                .call_proto(
                    &DispatchMode::MegatronPpAsDp,
                    "generate_sequences",
                    batch,
                    |w, _, d| Box::pin(w.generate_sequences(d)),
                )
                .await?;
            let (scores, _) = self.rewards(&gen)?;
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
                .call_proto(
                    &DispatchMode::MegatronCompute,
                    "sft_step",
                    batch,
                    |w, _, d| Box::pin(w.sft_step(d)),
                )
                .await?;
            let m = metrics_of(&out);
            self.log.sft(s + 1, steps, &m.reduce()).map_err(setup)?;
        }
        if self.needs_ref {
            self.actor
                .execute_all("set_reference", (), |w, _, ()| {
                    Box::pin(async move {
                        w.reference = Some(burn::module::AutodiffModule::valid(w.actor.model()));
                        Ok(())
                    })
                })
                .await?;
        }
        Ok(())
    }

    /// One PPO / GRPO step on `rows`; returns the step's metrics (verl's names).
    pub async fn step(&mut self, step: u64, rows: &[&PromptRow]) -> Result<Metrics, TrainError> {
        let t_step = Instant::now();
        let mut metrics = Metrics::default();
        let device = Default::default();
        let batch = prompt_batch::<Infer>(
            rows,
            self.codec.pad_token_id(),
            &format!("s{step}"),
            &device,
        )?;

        let t = Instant::now();
        let mut gen = self
            .actor
            .call_proto(
                &DispatchMode::MegatronPpAsDp,
                "generate_sequences",
                batch,
                |w, _, d| Box::pin(w.generate_sequences(d)),
            )
            .await?;
        metrics.extend(metrics_of(&gen));
        gen.meta_info.remove("metrics");
        metrics.push("timing_s/gen", t.elapsed().as_secs_f64());

        let t = Instant::now();
        let (scores, lengths) = self.rewards(&gen)?;
        let mask = verl_megatron::workers::batch::float_col(&gen, "response_mask")?;
        let token_scores = token_level_rewards(&scores, &mask).map_err(setup)?;
        metrics.push("timing_s/reward", t.elapsed().as_secs_f64());

        let inputs = gen.select(
            Some(&[
                "input_ids",
                "attention_mask",
                "position_ids",
                "responses",
                "response_mask",
            ]),
            Some(&[]),
            None,
        )?;
        let model_inputs = || -> Result<DataProto<Infer>, TrainError> { Ok(inputs.clone()) };
        let t = Instant::now();
        let old = self
            .actor
            .call_proto(
                &DispatchMode::MegatronCompute,
                "compute_log_prob",
                model_inputs()?,
                |w, _, d| Box::pin(w.compute_log_prob(d)),
            )
            .await?;
        metrics.push("timing_s/old_log_prob", t.elapsed().as_secs_f64());
        if let Ok(e) = old.float::<2>("entropys") {
            metrics.push(
                "actor/entropy_rollout",
                verl_core::algorithms::masked::masked_mean(e, mask.clone())
                    .into_scalar()
                    .elem::<f64>(),
            );
        }
        let mut data = gen.union(old.select(Some(&["old_log_probs"]), Some(&[]), None)?)?;

        if self.needs_ref {
            let t = Instant::now();
            let r = self
                .actor
                .call_proto(
                    &DispatchMode::MegatronCompute,
                    "compute_ref_log_prob",
                    model_inputs()?,
                    |w, _, d| Box::pin(w.compute_ref_log_prob(d)),
                )
                .await?;
            data = data.union(r)?;
            metrics.push("timing_s/ref", t.elapsed().as_secs_f64());
        }
        if let Some(critic) = &self.critic {
            let t = Instant::now();
            let v = critic
                .call_proto(
                    &DispatchMode::MegatronCompute,
                    "compute_values",
                    model_inputs()?,
                    |w, _, d| Box::pin(w.compute_values(d)),
                )
                .await?;
            data = data.union(v)?;
            metrics.push("timing_s/values", t.elapsed().as_secs_f64());
        }

        let t = Instant::now();
        let rewards = if self.cfg.algorithm.use_kl_in_reward {
            let (r, m) = apply_kl_penalty(
                token_scores.clone(),
                data.float::<2>("old_log_probs")?,
                data.float::<2>("ref_log_prob")?,
                mask.clone(),
                self.kl_ctrl.as_mut(),
                self.kl_penalty,
            )
            .map_err(setup)?;
            metrics.extend(m);
            r
        } else {
            token_scores.clone()
        };
        let uids: Vec<String> = data
            .non_tensor("uid")?
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect();
        let alg = &self.cfg.algorithm;
        let mut input = AdvantageInput::new(rewards.clone(), mask.clone())
            .with_index(&uids)
            .with_gamma_lam(alg.gamma, alg.lam);
        input.norm_adv_by_std_in_grpo = alg.norm_adv_by_std_in_grpo;
        if self.critic.is_some() {
            input = input.with_values(data.float::<2>("values")?);
        }
        let (adv, returns) = self
            .advantages
            .compute(&alg.adv_estimator, &input)
            .map_err(setup)?;
        data.insert_float("advantages", adv.clone())?;
        data.insert_float("returns", returns.clone())?;
        data.insert_float("token_level_scores", token_scores.clone())?;
        data.insert_float("token_level_rewards", rewards.clone())?;
        metrics.push("timing_s/adv", t.elapsed().as_secs_f64());

        let train_inputs = |keys: &[&str]| data.select(Some(keys), Some(&[]), None);
        if let Some(critic) = &self.critic {
            let t = Instant::now();
            let out = critic
                .call_proto(
                    &DispatchMode::MegatronCompute,
                    "update_critic",
                    train_inputs(&[
                        "input_ids",
                        "attention_mask",
                        "position_ids",
                        "responses",
                        "response_mask",
                        "values",
                        "returns",
                    ])?,
                    |w, _, d| Box::pin(w.update_critic(d)),
                )
                .await?;
            metrics.extend(metrics_of(&out));
            metrics.push("timing_s/update_critic", t.elapsed().as_secs_f64());
        }
        if step > self.cfg.trainer.critic_warmup {
            let mut keys = vec![
                "input_ids",
                "attention_mask",
                "position_ids",
                "responses",
                "response_mask",
                "old_log_probs",
                "advantages",
            ];
            if self.cfg.actor_rollout_ref.actor.use_kl_loss {
                keys.push("ref_log_prob");
            }
            let out = self
                .actor
                .call_proto(
                    &DispatchMode::MegatronCompute,
                    "update_actor",
                    train_inputs(&keys)?,
                    |w, _, d| Box::pin(w.update_actor(d)),
                )
                .await?;
            metrics.extend(metrics_of(&out));
        }

        // Data metrics under verl's names.
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let masked = |t: Tensor<Infer, 2>| {
            verl_core::algorithms::masked::masked_mean(t, mask.clone())
                .into_scalar()
                .elem::<f64>()
        };
        let seq_sum = |t: Tensor<Infer, 2>| -> Vec<f64> {
            (t * mask.clone())
                .sum_dim(1)
                .into_data()
                .convert::<f64>()
                .iter::<f64>()
                .collect()
        };
        metrics.push("critic/score/mean", mean(&scores));
        metrics.push(
            "critic/score/max",
            scores.iter().copied().fold(f64::MIN, f64::max),
        );
        metrics.push(
            "critic/score/min",
            scores.iter().copied().fold(f64::MAX, f64::min),
        );
        metrics.push("critic/rewards/mean", mean(&seq_sum(rewards)));
        metrics.push("critic/advantages/mean", masked(adv));
        metrics.push("critic/returns/mean", masked(returns));
        if let Ok(v) = data.float::<2>("values") {
            metrics.push("critic/values/mean", masked(v));
        }
        metrics.push("response_length/mean", mean(&lengths));
        metrics.push(
            "response_length/max",
            lengths.iter().copied().fold(0.0, f64::max),
        );
        let r = self
            .cfg
            .actor_rollout_ref
            .rollout
            .response_length
            .unwrap_or(self.cfg.data.max_response_length) as f64;
        metrics.push(
            "response_length/clip_ratio",
            lengths.iter().filter(|&&l| l >= r).count() as f64 / lengths.len().max(1) as f64,
        );
        let step_s = t_step.elapsed().as_secs_f64();
        let tokens: f64 = verl_megatron::workers::batch::float_col(&data, "attention_mask")?
            .sum()
            .into_scalar()
            .elem::<f64>();
        metrics.push("timing_s/step", step_s);
        metrics.push("perf/total_num_tokens", tokens);
        metrics.push("perf/throughput", tokens / step_s.max(1e-9));
        Ok(metrics)
    }

    /// The whole run: warm-up, optional validation before training, the RL steps (epochs over
    /// the shuffled prompts, bounded by `trainer.total_training_steps`), validation every
    /// `trainer.test_freq` steps and at the end.
    pub async fn fit(&mut self) -> Result<RunSummary, TrainError> {
        let start = Instant::now();
        self.warm_up().await?;
        let mut before = None;
        if self.cfg.trainer.val_before_train {
            let v = self.validate().await?;
            self.log
                .record(
                    0,
                    &[("val/score/mean".to_string(), v)].into_iter().collect(),
                )
                .map_err(setup)?;
            before = Some(v);
        }
        let b = self.cfg.data.train_batch_size;
        let mut order: Vec<usize> = (0..self.train.len()).collect();
        let mut cursor = order.len();
        let mut epoch = 0u64;
        let mut after = before;
        for step in 1..=self.total_steps {
            if cursor + b > order.len() {
                if self.cfg.data.shuffle {
                    use rand::seq::SliceRandom;
                    use rand::SeedableRng;
                    let mut rng = rand::rngs::StdRng::seed_from_u64(self.cfg.data.seed ^ epoch);
                    order.shuffle(&mut rng);
                }
                epoch += 1;
                cursor = 0;
            }
            let rows: Vec<&PromptRow> = order[cursor..cursor + b]
                .iter()
                .map(|&i| &self.train[i])
                .collect();
            let rows: Vec<PromptRow> = rows.into_iter().cloned().collect();
            cursor += b;
            let refs: Vec<&PromptRow> = rows.iter().collect();
            let metrics = self.step(step, &refs).await?;
            let mut reduced = metrics.reduce();
            reduced.insert("training/epoch".into(), epoch as f64);
            let freq = self.cfg.trainer.test_freq;
            if (freq > 0 && step % freq as u64 == 0) || step == self.total_steps {
                let v = self.validate().await?;
                reduced.insert("val/score/mean".into(), v);
                after = Some(v);
            }
            self.log.record(step, &reduced).map_err(setup)?;
        }
        self.log.finish();
        Ok(RunSummary {
            steps: self.total_steps,
            val_score_before: before,
            val_score_after: after,
            metrics_path: self.log.metrics_path().to_path_buf(),
            seconds: start.elapsed().as_secs_f64(),
        })
    }
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

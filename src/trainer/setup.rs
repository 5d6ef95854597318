//! How [`PpoTrainer`] is put together from a checked config and the builder's parts, one named
//! step per concern: data, scorers, checkpoints and resumption, the run log, the roles.

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;

use verl_core::algorithms::advantage::AdvantageRegistry;
use verl_core::algorithms::kl::kl_controller;
use verl_core::config::{ResumeMode, ValidatedConfig, VerlConfig};
use verl_core::worker::{RoleGroup, WorkerGroup};
use verl_megatron::hf::HeadKind;

use super::builder::Parts;
use super::checkpoint::{self, contents_of, LoopState};
use super::data::{arithmetic_rows, file_rows, Codec, PromptRow};
use super::error::{setup, TrainError};
use super::groups::{rank_groups, reward_model_group, take_groups};
use super::log::RunLog;
use super::model::{model_and_codec, Infer};
use super::ppo_trainer::PpoTrainer;
use super::ranks::{launcher_of, LauncherKind, RankProcesses};
use super::roles::{actor_methods, critic_methods, ActorWorker, CriticRank, RolePlans};
use super::scorer::Scorer;
use crate::tasks::ArithmeticTask;

/// The roles' worker groups, and the rank processes when the ranks are processes.
type Roles = (
    RoleGroup<ActorWorker, Infer>,
    Option<RoleGroup<CriticRank, Infer>>,
    Option<RankProcesses>,
);

impl PpoTrainer {
    /// Builds the workers and data of a checked config (`verl train`: the builder with no
    /// parts of its own). A layout or batch that cannot work is refused here, before any model
    /// memory is allocated.
    pub fn new(validated: ValidatedConfig) -> Result<Self, TrainError> {
        Self::assemble(validated, Parts::default())
    }

    /// The trainer of `validated` with the builder's `parts`: every check first, the workers
    /// (and their model memory) last.
    pub(crate) fn assemble(
        mut validated: ValidatedConfig,
        parts: Parts,
    ) -> Result<Self, TrainError> {
        // A failure on burn-cuda's device thread must reach the rank's report.
        #[cfg(feature = "cuda")]
        crate::megatron::device_faults::install_panic_hook();
        resolve_model_paths(&mut validated.config)?;
        let cfg = validated.config.clone();
        verl_core::traits::comm_timeout().map_err(setup)?;
        let (codec, model_cfg) = model_and_codec(&cfg)?;
        let file_tools = file_tools(&cfg)?;
        // verl's ToolAgentLoop renders each prompt with the tools' schemas.
        let codec = match (&parts.roles.agent, &file_tools) {
            _ if !cfg.actor_rollout_ref.rollout.multi_turn.enable => codec,
            (Some(make), _) => codec.with_tools(make().tools.schemas()),
            (None, Some(tools)) => codec.with_tools(tools.tools().schemas()),
            (None, None) => codec,
        };
        let (train, val) = match parts.train {
            Some(rows) => {
                let val = parts
                    .val
                    .unwrap_or_else(|| rows.iter().take(64).cloned().collect());
                (tokenized(rows, &codec)?, tokenized(val, &codec)?)
            }
            None => config_rows(&cfg, &codec)?,
        };
        check_token_ids(&codec, model_cfg.vocab_size, &train, &val)?;
        let (train, val) = (
            fit_prompts(&cfg, train, "training")?,
            fit_prompts(&cfg, val, "validation")?,
        );
        if train.len() < cfg.data.train_batch_size {
            return Err(setup(format!(
                "data.train_batch_size = {} but the training data has {} rows{}: lower data.train_batch_size to at most {} or add rows",
                cfg.data.train_batch_size,
                train.len(),
                if cfg.data.filter_overlong_prompts { " (after data.filter_overlong_prompts)" } else { "" },
                train.len(),
            )));
        }
        let scorer = python_scorer(&cfg, parts.scorer)?;
        check_scorers(&cfg, &scorer, &train, &val)?;
        let out_dir = output_dir(&cfg);
        // Before anything in the directory is read, renamed or set aside.
        let run_lock = super::run_lock::RunLock::acquire(&out_dir)?;
        check_checkpoint_contents(&cfg)?;
        let resume = resume_point(&cfg, &out_dir, train.len())?;
        let total_steps = total_steps_of(&cfg, train.len());
        let log = open_log(&cfg, &out_dir, &resume, total_steps)?;
        let actor_config_json = match &cfg.actor_rollout_ref.model.path {
            Some(p) => verl_megatron::hf::read_config_json(p).map_err(setup)?,
            None => model_cfg.to_config_json(),
        };
        let critic_base = match &cfg.critic.model.path {
            Some(p) if cfg.critic_enabled() => {
                verl_megatron::hf::HfModelConfig::from_dir(p).map_err(setup)?
            }
            _ => model_cfg.clone(),
        };
        let critic_config_json = cfg.critic_enabled().then(|| {
            let mut v = critic_base;
            v.head = HeadKind::TokenClassification { num_labels: 1 };
            v.tie_word_embeddings = false;
            v.to_config_json()
        });
        let reward_model = reward_model_group(&cfg, model_cfg.vocab_size)?;
        let mut plans = RolePlans::new(
            &cfg,
            &validated,
            &model_cfg,
            (
                codec.detokenizer(),
                codec.eos_token_ids(),
                codec.pad_token_id(),
            ),
            total_steps,
        )?;
        plans.actor.overrides = parts.roles;
        agent_limits(&cfg, &mut plans.actor.overrides, &codec, file_tools)?;
        let (actor, critic, processes) =
            launch_roles(&cfg, validated.world_size, &plans, total_steps)?;
        let mut advantages = AdvantageRegistry::new();
        for (name, f) in parts.estimators {
            advantages.register(&name, move |x| f(x));
        }
        Ok(Self {
            _run_lock: run_lock,
            kl_ctrl: kl_controller(&cfg.algorithm.kl_ctrl).map_err(setup)?,
            kl_penalty: cfg.algorithm.kl_penalty,
            advantages,
            scorer,
            rollout_correction: Some(cfg.algorithm.rollout_correction.parsed().map_err(setup)?),
            overlong: cfg
                .reward_model
                .overlong_shaping(cfg.data.max_response_length)
                .map_err(setup)?,
            log,
            needs_ref: plans.actor.needs_ref,
            old_log_prob_apart: plans.old_log_prob_apart,
            bypass: cfg.algorithm.rollout_correction.bypass_mode,
            balance_dp: cfg
                .trainer
                .balance_batch
                .then(|| (validated.actor_dp, validated.critic_dp.unwrap_or(1))),
            cfg,
            validated,
            actor,
            critic,
            processes,
            reward_model,
            codec,
            train,
            val,
            total_steps,
            global_step: 0,
            out_dir,
            actor_config_json,
            critic_config_json,
            resume,
            saved: Vec::new(),
        })
    }
}

/// `rows` with token ids: those made from text ([`PromptRow::new`]) tokenised with `codec`.
fn tokenized(rows: Vec<PromptRow>, codec: &Codec) -> Result<Vec<PromptRow>, TrainError> {
    rows.into_iter()
        .map(|mut r| {
            if r.prompt_ids.is_empty() {
                r.prompt_ids = codec.encode_prompt(&r.prompt).map_err(setup)?;
            }
            Ok(r)
        })
        .collect()
}

/// Training and validation rows from the config: parquet / JSONL files, or the built-in task.
fn config_rows(
    cfg: &VerlConfig,
    codec: &Codec,
) -> Result<(Vec<PromptRow>, Vec<PromptRow>), TrainError> {
    let builtin = match &cfg.data.train_files {
        None => Some(ArithmeticTask { digits: 2 }),
        Some(f) => match f.paths().as_slice() {
            [one] if one.starts_with("builtin:") => {
                Some(ArithmeticTask::from_spec(one).map_err(setup)?)
            }
            _ => None,
        },
    };
    if let Some(task) = builtin {
        if cfg.actor_rollout_ref.model.path.is_some() {
            return Err(setup("the built-in task uses its own character tokenizer: set data.train_files to parquet or JSONL files to train an HF model at actor_rollout_ref.model.path"));
        }
        return Ok((
            arithmetic_rows(&task, codec, 4096, cfg.data.shuffle_seed()).map_err(setup)?,
            arithmetic_rows(&task, codec, 128, cfg.data.shuffle_seed() ^ 0x5eed).map_err(setup)?,
        ));
    }
    let load = |paths: Vec<&str>| -> Result<Vec<PromptRow>, TrainError> {
        let mut rows = Vec::new();
        for p in paths {
            let file = file_rows(
                Path::new(p),
                codec,
                &cfg.data.prompt_key,
                &cfg.data.reward_fn_key,
            );
            rows.extend(file.map_err(setup)?);
        }
        Ok(rows)
    };
    let files = cfg
        .data
        .train_files
        .as_ref()
        .ok_or_else(|| setup("data.train_files: no files and no built-in task"))?;
    let shuffle = cfg.data.shuffle.then(|| cfg.data.shuffle_seed());
    let train = cap_rows(load(files.paths())?, cfg.data.train_max_samples, shuffle);
    let val = match &cfg.data.val_files {
        Some(v) => load(v.paths())?,
        None => train.iter().take(64).cloned().collect(),
    };
    Ok((train, cap_rows(val, cfg.data.val_max_samples, shuffle)))
}

/// At most `max` of `rows` (`max` ≤ 0: all of them), as verl's dataset applies
/// `data.train_max_samples` / `data.val_max_samples` before filtering overlong prompts: the
/// first rows, or with a shuffle seed a random subset in drawn order (verl draws with numpy's
/// generator, so its subset is another one).
fn cap_rows<T>(rows: Vec<T>, max: i64, shuffle: Option<u64>) -> Vec<T> {
    let max = match usize::try_from(max) {
        Ok(m) if m > 0 && m < rows.len() => m,
        _ => return rows,
    };
    let Some(seed) = shuffle else {
        let mut rows = rows;
        rows.truncate(max);
        return rows;
    };
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    order.truncate(max);
    let mut slots: Vec<Option<T>> = rows.into_iter().map(Some).collect();
    order
        .into_iter()
        .map(|i| {
            slots[i]
                .take()
                .expect("a shuffled order names each row once")
        })
        .collect()
}

/// `rows` fitted to `data.max_prompt_length` as verl's dataset does: with
/// `data.filter_overlong_prompts` longer prompts are dropped (saying how many), otherwise they
/// are cut by `data.truncation` (`error` refuses them, naming the row). `which` names the set.
fn fit_prompts(
    cfg: &VerlConfig,
    rows: Vec<PromptRow>,
    which: &str,
) -> Result<Vec<PromptRow>, TrainError> {
    let limit = cfg.data.max_prompt_length;
    let before = rows.len();
    if cfg.data.filter_overlong_prompts {
        let kept: Vec<PromptRow> = rows
            .into_iter()
            .filter(|r| r.prompt_ids.len() <= limit)
            .collect();
        if kept.len() < before {
            tracing::info!(
                "data.filter_overlong_prompts: dropped {} of {before} {which} prompts longer than data.max_prompt_length = {limit}",
                before - kept.len()
            );
        }
        if kept.is_empty() && before > 0 {
            return Err(setup(format!(
                "data.filter_overlong_prompts dropped every one of the {before} {which} prompts: all are longer than data.max_prompt_length = {limit}; raise it"
            )));
        }
        return Ok(kept);
    }
    rows.into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            r.prompt_ids = cfg
                .data
                .truncation
                .apply(std::mem::take(&mut r.prompt_ids), limit)
                .map_err(|len| {
                    setup(format!(
                        "{which} prompt {i} has {len} tokens, more than data.max_prompt_length = {limit}; raise it, set data.truncation to left, right or middle, or set data.filter_overlong_prompts=true"
                    ))
                })?;
            Ok(r)
        })
        .collect()
}

/// Every prompt token id (and the tokenizer's special ids) must be a row of the model's
/// embedding: a tokenizer larger than the model is refused here, not deep in a gather.
fn check_token_ids(
    codec: &Codec,
    vocab_size: usize,
    train: &[PromptRow],
    val: &[PromptRow],
) -> Result<(), TrainError> {
    let fix = "the tokenizer and the model disagree: use the tokenizer that came with the model (actor_rollout_ref.model.tokenizer_path), or a model whose vocab_size covers it";
    for (which, rows) in [("training", train), ("validation", val)] {
        for (i, r) in rows.iter().enumerate() {
            if let Some(&id) = r.prompt_ids.iter().find(|&&id| id as usize >= vocab_size) {
                return Err(setup(format!(
                    "{which} prompt {i} has token id {id}, but the model's vocab_size is {vocab_size}; {fix}"
                )));
            }
        }
    }
    let specials = codec
        .eos_token_ids()
        .into_iter()
        .map(|id| ("an end-of-sequence", id))
        .chain([("the padding", codec.pad_token_id())]);
    for (what, id) in specials {
        if id as usize >= vocab_size {
            return Err(setup(format!(
                "{what} token id is {id}, but the model's vocab_size is {vocab_size}; {fix}"
            )));
        }
    }
    Ok(())
}

/// Every model path of the config as the directory it names: `~` expanded, a hub id
/// (`Qwen/Qwen2.5-7B-Instruct`) found in the local Hugging Face cache; a path that names
/// nothing is refused with its key and where it was looked for.
fn resolve_model_paths(cfg: &mut VerlConfig) -> Result<(), TrainError> {
    // Only the roles that run: a disabled critic's path (verl's YAML names one) is not read.
    let (critic, reward_model) = (cfg.critic_enabled(), cfg.reward_model.enable);
    let m = &mut cfg.actor_rollout_ref.model;
    let c = &mut cfg.critic.model;
    let mut slots = vec![
        ("actor_rollout_ref.model.path", &mut m.path),
        (
            "actor_rollout_ref.model.tokenizer_path",
            &mut m.tokenizer_path,
        ),
    ];
    if critic {
        slots.push(("critic.model.path", &mut c.path));
        slots.push(("critic.model.tokenizer_path", &mut c.tokenizer_path));
    }
    if reward_model {
        slots.push(("reward_model.model.path", &mut cfg.reward_model.model.path));
    }
    for (key, slot) in slots {
        if let Some(path) = slot.as_mut() {
            let dir = verl_megatron::hf::resolve_model_dir(path)
                .map_err(|e| setup(format!("{key}: {e}")))?;
            *path = dir.display().to_string();
        }
    }
    Ok(())
}

/// verl's `custom_reward_function.path` (+ `name`): the Python function scores every row, in
/// a pool of worker processes (batched with `reward_model.reward_manager=batch`). A scorer the
/// embedding program gave the trainer comes first.
fn python_scorer(cfg: &VerlConfig, given: Scorer) -> Result<Scorer, TrainError> {
    let (Scorer::Rules, Some(path)) = (&given, &cfg.custom_reward_function.path) else {
        return Ok(given);
    };
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(8));
    let calls = match cfg.reward_model.reward_manager.as_str() {
        "batch" => crate::python::RewardCalls::Batched,
        // verl's prime manager gives every row 300 s; VERL_REWARD_TIMEOUT_S changes it here.
        "prime" => crate::python::RewardCalls::Prime {
            row_timeout: crate::python::reward_timeout(),
        },
        _ => crate::python::RewardCalls::PerRow,
    };
    let reward = crate::python::PythonReward::start_with(
        path,
        &cfg.custom_reward_function.name,
        calls,
        workers,
    )
    .map_err(|e| setup(e.to_string()))?;
    Ok(Scorer::Batched(std::sync::Arc::new(reward)))
}

/// Every row needs a scorer: the run's reward function, or the reward model for training rows
/// (validation always scores by the reward function, as verl's does).
fn check_scorers(
    cfg: &VerlConfig,
    scorer: &Scorer,
    train: &[PromptRow],
    val: &[PromptRow],
) -> Result<(), TrainError> {
    let must_score: Vec<&PromptRow> = if cfg.reward_model.enable {
        val.iter().collect()
    } else {
        train.iter().chain(val).collect()
    };
    match must_score.iter().find(|r| !scorer.knows(&r.data_source)) {
        Some(row) => Err(setup(format!(
            "data_source `{}` has no rule-based scorer (built in: {}, openai/gsm8k){}; use one of those, give the trainer a reward function (PpoTrainer::builder(..).reward(..)), or set reward_model.enable=true with reward_model.model.path for training rows",
            row.data_source,
            ArithmeticTask::DATA_SOURCE,
            // `unknown` is what a row without the column reads as (data.rs), so say which
            // column was looked for.
            if row.data_source == "unknown" {
                format!(
                    " (rows without a `{}` column read as `unknown`; data.reward_fn_key names the column)",
                    cfg.data.reward_fn_key
                )
            } else {
                String::new()
            },
        ))),
        None => Ok(()),
    }
}

/// `trainer.default_local_dir`, else verl's `checkpoints/<project>/<experiment>`.
fn output_dir(cfg: &VerlConfig) -> PathBuf {
    PathBuf::from(cfg.trainer.default_local_dir.clone().unwrap_or_else(|| {
        format!(
            "checkpoints/{}/{}",
            cfg.trainer.project_name, cfg.trainer.experiment_name
        )
    }))
}

/// What each role saves and loads, checked before any model is built.
fn check_checkpoint_contents(cfg: &VerlConfig) -> Result<(), TrainError> {
    for save in [true, false] {
        contents_of(
            &cfg.actor_rollout_ref.actor.checkpoint,
            "actor_rollout_ref.actor",
            save,
        )?;
        if cfg.critic_enabled() {
            contents_of(&cfg.critic.checkpoint, "critic", save)?;
        }
    }
    Ok(())
}

/// The checkpoint to resume from (`trainer.resume_mode`) and where its loop stood.
fn resume_point(
    cfg: &VerlConfig,
    out_dir: &Path,
    train_rows: usize,
) -> Result<Option<(PathBuf, LoopState)>, TrainError> {
    let dir = match cfg.trainer.resume_mode {
        ResumeMode::Disable => None,
        ResumeMode::Auto => checkpoint::latest(out_dir).map(|found| {
            for why in &found.passed_over {
                tracing::warn!("resume: passed over: {why}");
            }
            if !found.passed_over.is_empty() {
                tracing::warn!(
                    "resume: the newest complete checkpoint is {} (step {})",
                    found.dir.display(),
                    found.step
                );
            }
            found.dir
        }),
        ResumeMode::ResumePath => {
            let dir = PathBuf::from(cfg.trainer.resume_from_path.clone().ok_or_else(|| {
                setup("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_<N> directory)")
            })?);
            checkpoint::verify(&dir).map_err(|why| {
                setup(format!(
                    "trainer.resume_from_path: {why}; name another global_step_<N> directory, or use trainer.resume_mode=auto to take the newest complete one"
                ))
            })?;
            Some(dir)
        }
    };
    if dir.is_none() && cfg.trainer.resume_mode == ResumeMode::Auto {
        let left = checkpoint::saved_steps(out_dir);
        if !left.is_empty() {
            tracing::warn!(
                "resume: no complete checkpoint under {} (steps {left:?} are damaged or unfinished); starting from step 0, setting aside any directory a save would reuse",
                out_dir.display()
            );
        }
    }
    let Some(dir) = dir else {
        return Ok(None);
    };
    let state = checkpoint::read_loop_state(&dir)?;
    if state.order.len() != train_rows {
        return Err(setup(format!(
            "{}: saved with {} training rows, the data now has {train_rows}; resume with the same data.train_files",
            dir.display(),
            state.order.len(),
        )));
    }
    Ok(Some((dir, state)))
}

/// The run's metrics log: a fresh one, or the resumed run's, continued.
fn open_log(
    cfg: &VerlConfig,
    out_dir: &Path,
    resume: &Option<(PathBuf, LoopState)>,
    total_steps: u64,
) -> Result<RunLog, TrainError> {
    let name = &cfg.trainer.experiment_name;
    let log = match resume {
        Some((_, state)) => RunLog::resume(out_dir, total_steps, name, state.step),
        None => RunLog::create(out_dir, total_steps, name),
    }
    .map_err(setup)?;
    Ok(log.with_trackers(super::trackers::open(cfg)?))
}

/// Starts every rank's workers: threads of this process talking through in-process
/// communicators, or rank processes (`trainer.launcher`).
fn launch_roles(
    cfg: &VerlConfig,
    world: usize,
    plans: &RolePlans,
    total_steps: u64,
) -> Result<Roles, TrainError> {
    match launcher_of(cfg, world)? {
        LauncherKind::Threads => {
            let groups = rank_groups(&plans.actor.topo);
            let plan = plans.actor.clone();
            let threads = WorkerGroup::spawn(world, move |ctx| {
                plan.build(ctx.rank, take_groups(&groups, &ctx)?)
            })?;
            let actor =
                RoleGroup::threads("actor", threads, actor_methods(cfg), Default::default());
            let critic = match plans.critic.clone() {
                Some(plan) => {
                    let groups = rank_groups(&plan.topo);
                    let threads = WorkerGroup::spawn(world, move |ctx| {
                        plan.build(ctx.rank, take_groups(&groups, &ctx)?)
                    })?;
                    let methods = critic_methods(cfg);
                    Some(RoleGroup::threads(
                        "critic",
                        threads,
                        methods,
                        Default::default(),
                    ))
                }
                None => None,
            };
            Ok((actor, critic, None))
        }
        LauncherKind::Processes => {
            let launched = RankProcesses::launch(cfg, world, total_steps)?;
            let ranks = launched.ranks.clone();
            let actor =
                RoleGroup::processes("actor", ranks, actor_methods(cfg), Default::default());
            let critic = plans.critic.is_some().then(|| {
                let ranks = launched.ranks.clone();
                RoleGroup::processes("critic", ranks, critic_methods(cfg), Default::default())
            });
            Ok((actor, critic, Some(launched)))
        }
    }
}

/// The run's length: `trainer.total_training_steps`, else `total_epochs` over the data.
pub(super) fn total_steps_of(cfg: &VerlConfig, rows: usize) -> u64 {
    let steps_per_epoch = (rows / cfg.data.train_batch_size.max(1)).max(1) as u64;
    cfg.trainer
        .total_training_steps
        .unwrap_or(cfg.trainer.total_epochs as u64 * steps_per_epoch)
}

/// `rollout.multi_turn.tool_config_path`, read and checked where the loop is on (verl reads it
/// only then).
fn file_tools(cfg: &VerlConfig) -> Result<Option<verl_rollout::agent::ToolConfig>, TrainError> {
    let mt = &cfg.actor_rollout_ref.rollout.multi_turn;
    match &mt.tool_config_path {
        Some(path) if mt.enable => verl_rollout::agent::ToolConfig::from_file(path)
            .map(Some)
            .map_err(setup),
        _ => Ok(None),
    }
}

/// `rollout.multi_turn`: with `enable`, the agent loop is the builder's, or the tool file's
/// tools with the model's chat template as its turns ([`verl_rollout::agent::HfChatTurns`]);
/// either takes verl's limits (checked here, before any worker starts).
fn agent_limits(
    cfg: &VerlConfig,
    overrides: &mut super::roles::RoleOverrides,
    codec: &Codec,
    file_tools: Option<verl_rollout::agent::ToolConfig>,
) -> Result<(), TrainError> {
    use verl_rollout::agent::{Agent, AgentLoopConfig, HfChatTurns};
    let mt = &cfg.actor_rollout_ref.rollout.multi_turn;
    // What is not built is refused whether or not the loop is enabled.
    let limits = verl_rollout::agent::AgentLimits::from_verl(mt).map_err(setup)?;
    if !mt.enable {
        return Ok(());
    }
    let make: super::roles::AgentFactory =
        match (overrides.agent.clone(), file_tools) {
            (Some(_), Some(_)) => {
                return Err(setup(
                    "actor_rollout_ref.rollout.multi_turn.tool_config_path: the builder's agent \
                 (PpoTrainerBuilder::agent) gives the agent loop and its tools already; set \
                 tool_config_path null, or drop the builder's agent to take the file's tools",
                ))
            }
            (Some(make), None) => make,
            (None, Some(tools)) => {
                let Codec::Hf { tokenizer, .. } = codec else {
                    return Err(setup(
                    "actor_rollout_ref.rollout.multi_turn.tool_config_path: the tool turns are \
                     written with the model's chat template, and the built-in task's character \
                     tokenizer has none; train an HF model (actor_rollout_ref.model.path) or give \
                     the agent with PpoTrainerBuilder::agent",
                ));
                };
                let chat = HfChatTurns::new(tokenizer.as_ref().clone()).map_err(|e| {
                    setup(format!(
                        "actor_rollout_ref.rollout.multi_turn.tool_config_path: the model's chat \
                         template cannot write the tool turns ({e}); use a template that writes \
                         one turn per message and takes the `tool` role, or set \
                         multi_turn.enable=false"
                    ))
                })?;
                std::sync::Arc::new(move || Agent {
                    chat: Box::new(chat.clone()),
                    tools: tools.tools(),
                    // verl's limits replace these below; the engine sets the response length and
                    // sampling per call.
                    config: AgentLoopConfig {
                        max_assistant_turns: 0,
                        max_turn_tokens: None,
                        response_length: 0,
                        max_parallel_calls: 1,
                        max_tool_response_length: 256,
                        tool_response_truncate_side: Default::default(),
                        sampling: Default::default(),
                    },
                })
            }
            (None, None) => return Err(setup(
                "actor_rollout_ref.rollout.multi_turn.enable=true needs an agent loop: the tools \
                 from actor_rollout_ref.rollout.multi_turn.tool_config_path (verl's tool file; \
                 the turns follow the model's chat template), or an embedding program's \
                 PpoTrainerBuilder::agent; else set multi_turn.enable=false",
            )),
        };
    overrides.agent = Some(std::sync::Arc::new(move || {
        let mut agent = make();
        agent.config = agent.config.with_limits(&limits);
        agent
    }));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cap_rows;

    /// Without a shuffle the first rows; with one a seeded subset of distinct rows, the same for
    /// the same seed; a cap of zero, below zero or past the rows keeps them all.
    #[test]
    fn max_samples_take_the_first_rows_or_a_seeded_subset() {
        let rows: Vec<u32> = (0..10).collect();
        assert_eq!(cap_rows(rows.clone(), 3, None), vec![0, 1, 2]);
        for all in [-1, 0, 10, 11] {
            assert_eq!(cap_rows(rows.clone(), all, Some(7)), rows);
        }
        let drawn = cap_rows(rows.clone(), 4, Some(7));
        assert_eq!(drawn.len(), 4);
        let mut distinct = drawn.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 4);
        assert_eq!(cap_rows(rows.clone(), 4, Some(7)), drawn);
        assert_ne!(
            cap_rows(rows.clone(), 4, Some(8)),
            drawn,
            "another seed, another subset"
        );
    }
}

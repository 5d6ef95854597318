//! [`PpoTrainer::builder`]: a run composed from a config and the embedding program's own parts
//! (reward, advantage estimator, policy loss, rollout engine, data), each plugged in through a
//! core trait or function type, and typed settings for the profiler, offload and checkpoints. `verl train` is this builder with no parts of its own.
//!
//! What the types check at compile time: each part's signature (a reward is a
//! [`RewardFn`] or a [`BatchRewardFn`]; an estimator maps an [`AdvantageInput`] to advantages
//! and returns; a policy loss maps a [`PolicyLossInput`] to its output; a rollout engine
//! implements [`RolloutEngine`] on the trainer's backend; data rows are [`PromptRow`]s). What
//! [`PpoTrainerBuilder::build`] checks, before any model memory is allocated: the config (names,
//! layouts, batch arithmetic) with the registered estimator and loss names accepted, that a
//! part living in the ranks' workers (rollout, policy loss) has thread ranks to live in, that
//! the data has rows and every row can be scored.

use std::sync::Arc;

use verl_core::algorithms::advantage::{AdvantageFn, AdvantageInput, AdvantageOutput};
use verl_core::algorithms::policy_loss::{PolicyLossInput, PolicyLossOutput};
use verl_core::config::{CheckpointConfig, GlobalProfilerConfig, VerlConfig};
use verl_core::error::AlgorithmError;
use verl_core::traits::{BatchRewardFn, OffloadSwitches, RewardFn, RolloutEngine};

use super::data::PromptRow;
use super::error::{setup, TrainError};
use super::model::{Infer, Train};
use super::ppo_trainer::PpoTrainer;
use super::ranks::{launcher_of, LauncherKind};
use super::roles::RoleOverrides;
use super::scorer::Scorer;

/// What the builder hands to the trainer's assembly.
#[derive(Clone, Default)]
pub(crate) struct Parts {
    pub scorer: Scorer,
    pub estimators: Vec<(String, AdvantageFn<Infer>)>,
    pub train: Option<Vec<PromptRow>>,
    pub val: Option<Vec<PromptRow>>,
    pub roles: RoleOverrides,
}

/// Composes a [`PpoTrainer`] (see the [module docs](self) for what is checked where).
///
/// ```no_run
/// use verl::trainer::PpoTrainer;
/// use verl::traits::RewardInput;
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let cfg = verl::ConfigBuilder::new()
///     .overrides(verl::trainer::MAIN_JOB)
///     .set("trainer.total_training_steps", 2)
///     .resolve()?;
/// let mut trainer = PpoTrainer::builder(cfg)
///     .reward(|x: &RewardInput| if x.solution_str.trim() == x.ground_truth { 1.0 } else { 0.0 })
///     .build()?;
/// let summary = trainer.fit().await?;
/// println!("{} steps", summary.steps);
/// # Ok(()) }
/// ```
pub struct PpoTrainerBuilder {
    cfg: VerlConfig,
    parts: Parts,
}

impl PpoTrainer {
    /// A builder over `cfg` (unchecked: [`PpoTrainerBuilder::build`] checks it, knowing the
    /// names the builder registered).
    pub fn builder(cfg: VerlConfig) -> PpoTrainerBuilder {
        PpoTrainerBuilder {
            cfg,
            parts: Parts::default(),
        }
    }
}

impl PpoTrainerBuilder {
    /// Scores each response with `reward` (training and validation), instead of the
    /// rule-based scorer of its `data_source`. Any `Fn(&RewardInput) -> f64` is a
    /// [`RewardFn`].
    pub fn reward(mut self, reward: impl RewardFn + 'static) -> Self {
        self.parts.scorer = Scorer::PerSample(Arc::new(reward));
        self
    }

    /// Scores each batch of responses with one awaited call.
    pub fn batch_reward(mut self, reward: impl BatchRewardFn + 'static) -> Self {
        self.parts.scorer = Scorer::Batched(Arc::new(reward));
        self
    }

    /// Registers an advantage estimator under `name`, which `algorithm.adv_estimator` can
    /// then select (verl's names stay available; a registered name replaces a built-in one).
    pub fn advantage(
        mut self,
        name: &str,
        estimator: impl Fn(&AdvantageInput<'_, Infer>) -> Result<AdvantageOutput<Infer>, AlgorithmError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.parts
            .estimators
            .push((name.to_string(), Arc::new(estimator)));
        self
    }

    /// Registers a policy loss under `name`, which `actor.policy_loss.loss_mode` can then
    /// select. It runs on the actor's ranks (thread ranks only).
    pub fn policy_loss(
        mut self,
        name: &str,
        loss: impl Fn(&PolicyLossInput<Train>) -> Result<PolicyLossOutput<Train>, AlgorithmError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.parts
            .roles
            .policy_losses
            .push((name.to_string(), Arc::new(loss)));
        self
    }

    /// Each rank's rollout engine: `wrap` gets the native engine the rank built (sharded,
    /// weights synced by the hybrid engine) and returns the engine to use, which may wrap it or
    /// ignore it. It runs on the actor's ranks (thread ranks only).
    pub fn rollout(
        mut self,
        wrap: impl Fn(Box<dyn RolloutEngine<Infer>>) -> Box<dyn RolloutEngine<Infer>>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.parts.roles.rollout = Some(Arc::new(wrap));
        self
    }

    /// Multi-turn rollouts with tools: every rank's native engine runs the agent loop `make`
    /// builds (its chat template's turns, its tools, its limits; see
    /// [`verl_rollout::agent`]), and tool tokens are masked out of the loss. Thread ranks only.
    pub fn agent(
        mut self,
        make: impl Fn() -> verl_rollout::agent::Agent + Send + Sync + 'static,
    ) -> Self {
        self.parts.roles.agent = Some(Arc::new(make));
        self
    }

    /// Trains on `rows` instead of `data.train_files` (or the built-in task). Rows made with
    /// [`PromptRow::new`] are tokenised with the run's tokenizer.
    pub fn data(mut self, rows: impl IntoIterator<Item = PromptRow>) -> Self {
        self.parts.train = Some(rows.into_iter().collect());
        self
    }

    /// Validates on `rows` (default with [`Self::data`]: its first 64 rows).
    pub fn val_data(mut self, rows: impl IntoIterator<Item = PromptRow>) -> Self {
        self.parts.val = Some(rows.into_iter().collect());
        self
    }

    /// Profiles the run as `global_profiler` says (tool, steps, ranks, output directory); the
    /// roles' own `profiler` sections still select which roles are captured.
    pub fn profiler(mut self, profiler: GlobalProfilerConfig) -> Self {
        self.cfg.global_profiler = profiler;
        self
    }

    /// Moves the actor's parameters, gradients and optimizer state to host memory between the
    /// phases that use them (`actor.megatron.{param,grad,optimizer}_offload`).
    pub fn offload(mut self, switches: OffloadSwitches) -> Self {
        let m = &mut self.cfg.actor_rollout_ref.actor.megatron;
        (m.param_offload, m.grad_offload, m.optimizer_offload) =
            (switches.param, switches.grad, switches.optimizer);
        self
    }

    /// What the actor's checkpoints save and load (`actor.checkpoint`: `model`, `optimizer`,
    /// `extra`, `hf_model`); when is `trainer.save_freq`.
    pub fn checkpoint(mut self, checkpoint: CheckpointConfig) -> Self {
        self.cfg.actor_rollout_ref.actor.checkpoint = checkpoint;
        self
    }

    /// Checks the config with the registered names and the parts against it, then builds the
    /// workers (the only step that allocates model memory).
    pub fn build(self) -> Result<PpoTrainer, TrainError> {
        let Self { cfg, parts } = self;
        let estimators: Vec<&str> = parts.estimators.iter().map(|(n, _)| n.as_str()).collect();
        let losses: Vec<&str> = parts
            .roles
            .policy_losses
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        let validated = cfg.validate_with(&estimators, &losses).map_err(setup)?;
        if !parts.roles.is_empty()
            && matches!(
                launcher_of(&validated.config, validated.world_size)?,
                LauncherKind::Processes
            )
        {
            return Err(setup(
                "the builder's rollout engine / agent loop / policy loss live in the ranks' \
                 workers, which \
                 trainer.launcher=processes rebuilds from the config in each rank process: set \
                 trainer.launcher=threads",
            ));
        }
        if parts.train.as_ref().is_some_and(Vec::is_empty) {
            return Err(setup("PpoTrainerBuilder::data: no rows to train on"));
        }
        PpoTrainer::assemble(validated, parts)
    }
}

use serde::{Deserialize, Serialize};

/// `trainer.launcher`: how the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Launcher {
    /// Processes for a multi-GPU CUDA run or several nodes, else threads.
    Auto,
    /// Threads of the driver process.
    Threads,
    /// One process per GPU, started by the driver on this node; other nodes' by `verl worker`,
    /// torchrun or srun.
    Processes,
}

/// `trainer.resume_mode`: where a run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// From the newest complete checkpoint under the run's directory, if there is one.
    Auto,
    /// From scratch, whatever is saved.
    Disable,
    /// From `trainer.resume_from_path`.
    ResumePath,
}

/// `trainer.device`: where the workers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// burn-cuda (verl's default; the CPU build takes it as its embedded default).
    Cuda,
    /// The CPU backend.
    Cpu,
}

/// `trainer.logger` entries written natively: the console and metrics.jsonl (every run writes
/// both) and verl's JSON-lines `file` logger.
pub const NATIVE_LOGGERS: &[&str] = &["console", "jsonl", "file"];

/// `trainer.logger` entries run by a `python3` worker, as verl's `Tracking` sets them up.
pub const PYTHON_LOGGERS: &[&str] = &[
    "wandb",
    "mlflow",
    "tensorboard",
    "swanlab",
    "trackio",
    "clearml",
];

/// `trainer`: the run's length, cadence, devices and output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    pub balance_batch: bool,
    pub total_epochs: usize,
    /// Overrides the step count derived from epochs when set.
    pub total_training_steps: Option<u64>,
    pub project_name: String,
    pub experiment_name: String,
    pub logger: Vec<String>,
    pub log_val_generations: usize,
    pub nnodes: usize,
    /// Ranks per node; on the CPU default these are simulated in-process.
    pub n_gpus_per_node: usize,
    /// How the ranks run ([`Launcher`]).
    pub launcher: Launcher,
    /// Save a checkpoint every this many steps; -1: never.
    pub save_freq: i64,
    /// Where a run starts ([`ResumeMode`]).
    pub resume_mode: ResumeMode,
    pub resume_from_path: Option<String>,
    pub val_before_train: bool,
    /// Validate before training (the starting policy, or a resumed checkpoint's) and stop, as
    /// verl does; needs `val_before_train`.
    pub val_only: bool,
    /// Validate every this many steps; -1: never.
    pub test_freq: i64,
    pub critic_warmup: u64,
    /// Supervised steps on the ground-truth responses before RL (verl-rs's addition; the main
    /// job's warm-up of a model trained from scratch). 0: none.
    pub sft_warmup_steps: u64,
    /// Learning rate of the warm-up (constant); `None`: the actor's `optim.lr`.
    pub sft_warmup_lr: Option<f64>,
    /// `None`: `checkpoints/{project_name}/{experiment_name}`.
    pub default_local_dir: Option<String>,
    pub del_local_ckpt_after_load: bool,
    /// How many of the run's own `global_step_<N>` checkpoints to keep (older ones this run
    /// saved are removed; earlier runs' are never touched). `None` (unset) has no say, 0 keeps
    /// all as in verl. A step directory holds both roles and resumes only whole, so it goes
    /// only when both limits let it: any 0 keeps all, else the larger set limit wins
    /// (`actor=1, critic=3` keeps 3); both unset keeps all.
    pub max_actor_ckpt_to_keep: Option<usize>,
    /// The critic's limit, combined with the actor's as above (ignored without a critic).
    pub max_critic_ckpt_to_keep: Option<usize>,
    /// Where the workers run: `cuda` (the default of a `cuda` build, and verl's) or `cpu` (the
    /// default of the CPU build, which also takes `cuda` as its embedded default). A `cuda`
    /// build refuses `cpu`: its workers run on burn-cuda.
    pub device: Device,
    pub seed: u64,
    /// A directory where each training step's samples go, as verl dumps them: `<step>.jsonl`,
    /// one line per response with `input` (the prompt's text), `output`, `gts` (the ground
    /// truth), `score` (the response's summed token-level score) and `step`.
    pub rollout_data_dir: Option<String>,
    /// The same for each validation's greedy samples (verl reads it as
    /// `+trainer.validation_data_dir`); validation before training is step 0.
    pub validation_data_dir: Option<String>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            balance_batch: false,
            total_epochs: 30,
            total_training_steps: None,
            project_name: "verl_examples".into(),
            experiment_name: "gsm8k".into(),
            logger: vec!["console".into()],
            log_val_generations: 0,
            nnodes: 1,
            n_gpus_per_node: 8,
            launcher: Launcher::Auto,
            save_freq: -1,
            resume_mode: ResumeMode::Auto,
            resume_from_path: None,
            val_before_train: true,
            val_only: false,
            test_freq: -1,
            critic_warmup: 0,
            sft_warmup_steps: 0,
            sft_warmup_lr: None,
            default_local_dir: None,
            del_local_ckpt_after_load: false,
            max_actor_ckpt_to_keep: None,
            max_critic_ckpt_to_keep: None,
            device: if cfg!(feature = "cuda") {
                Device::Cuda
            } else {
                Device::Cpu
            },
            seed: 42,
            rollout_data_dir: None,
            validation_data_dir: None,
        }
    }
}

impl TrainerConfig {
    /// Ranks in the run: `nnodes × n_gpus_per_node`.
    pub fn world_size(&self) -> usize {
        // Saturating: an absurd product is refused by validation, not an overflow.
        self.nnodes.saturating_mul(self.n_gpus_per_node)
    }

    /// Where checkpoints and metrics go.
    pub fn local_dir(&self) -> String {
        self.default_local_dir.clone().unwrap_or_else(|| {
            format!("checkpoints/{}/{}", self.project_name, self.experiment_name)
        })
    }
}

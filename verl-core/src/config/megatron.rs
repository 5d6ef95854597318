use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::topology::ParallelConfig;

/// A compute dtype setting (`*.megatron.dtype`, `rollout.dtype`): `bfloat16` (also `bf16`),
/// `float32` (also `fp32`, `f32`, `float`), or `auto`, the backend's choice (bfloat16 on GPUs,
/// float32 on the CPU default). Case does not matter. float16 is refused: it needs loss scaling.
///
/// ```
/// use verl_core::config::Dtype;
/// assert_eq!("BF16".parse::<Dtype>().unwrap(), Dtype::Bfloat16);
/// assert!("float16".parse::<Dtype>().unwrap_err().contains("loss scaling"));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Dtype {
    /// The backend picks: bfloat16 on GPUs, float32 on the CPU default.
    #[default]
    Auto,
    Bfloat16,
    Float32,
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "bfloat16" | "bf16" => Ok(Self::Bfloat16),
            "float32" | "fp32" | "f32" | "float" => Ok(Self::Float32),
            other => Err(format!(
                "`{other}` is not a compute dtype; use bfloat16, float32 or auto \
                 (float16 is not supported: it needs loss scaling)"
            )),
        }
    }
}

impl TryFrom<String> for Dtype {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl From<Dtype> for String {
    fn from(d: Dtype) -> String {
        d.to_string()
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Bfloat16 => "bfloat16",
            Self::Float32 => "float32",
        })
    }
}

/// `optim.lr_decay_style`: how the learning rate falls from its peak after warm-up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrDecayStyle {
    /// Stays at the peak.
    #[default]
    Constant,
    /// Falls linearly to `min_lr` over the decay steps.
    Linear,
    /// Falls along half a cosine to `min_lr` over the decay steps.
    Cosine,
}

/// `*.megatron.*`: the Megatron parallel layout and memory options of one role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MegatronConfig {
    pub param_offload: bool,
    pub grad_offload: bool,
    pub optimizer_offload: bool,
    pub tensor_model_parallel_size: usize,
    pub expert_model_parallel_size: usize,
    /// `None`: same as `tensor_model_parallel_size`.
    pub expert_tensor_parallel_size: Option<usize>,
    pub pipeline_model_parallel_size: usize,
    pub virtual_pipeline_model_parallel_size: Option<usize>,
    pub context_parallel_size: usize,
    pub sequence_parallel: bool,
    pub use_distributed_optimizer: bool,
    pub use_dist_checkpointing: bool,
    pub dist_checkpointing_path: Option<String>,
    pub seed: u64,
    /// Extra transformer settings, e.g. `num_layers_in_first_pipeline_stage`.
    pub override_transformer_config: Map<String, Value>,
    /// Load and save Hugging Face checkpoints directly (always on in verl-rs; kept for config compatibility).
    pub use_mbridge: bool,
    /// The compute dtype of the matrix products: `bfloat16` (f32 master weights, f32 optimizer
    /// state, f32 log-probs and losses), `float32`, or `auto` (bfloat16 on GPUs, float32 on the
    /// CPU backend, where bf16 is emulated and slower).
    pub dtype: Dtype,
}

impl Default for MegatronConfig {
    fn default() -> Self {
        Self {
            param_offload: false,
            grad_offload: false,
            optimizer_offload: false,
            tensor_model_parallel_size: 1,
            expert_model_parallel_size: 1,
            expert_tensor_parallel_size: None,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: None,
            context_parallel_size: 1,
            sequence_parallel: true,
            use_distributed_optimizer: true,
            use_dist_checkpointing: false,
            dist_checkpointing_path: None,
            seed: 42,
            override_transformer_config: Map::new(),
            use_mbridge: true,
            dtype: Dtype::Auto,
        }
    }
}

impl MegatronConfig {
    /// The parallel layout these keys describe.
    pub fn parallel(&self) -> ParallelConfig {
        ParallelConfig {
            tp: self.tensor_model_parallel_size,
            pp: self.pipeline_model_parallel_size,
            vpp: self.virtual_pipeline_model_parallel_size,
            cp: self.context_parallel_size,
            ep: self.expert_model_parallel_size,
            etp: self.expert_tensor_parallel_size,
            sequence_parallel: self.sequence_parallel,
        }
    }

    /// The config key that holds a [`ParallelConfig`] field, for error messages.
    pub fn key_of(field: &str) -> &'static str {
        match field {
            "tp" => "tensor_model_parallel_size",
            "pp" => "pipeline_model_parallel_size",
            "vpp" => "virtual_pipeline_model_parallel_size",
            "cp" => "context_parallel_size",
            "ep" => "expert_model_parallel_size",
            "etp" => "expert_tensor_parallel_size",
            _ => "tensor_model_parallel_size",
        }
    }
}

/// `*.optim.*`: the optimizer and learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Only `adam` (AdamW with decoupled weight decay, as Megatron's) is supported.
    pub optimizer: String,
    pub lr: f64,
    pub min_lr: f64,
    /// Warm-up steps; `None` or negative: use `lr_warmup_steps_ratio`.
    pub lr_warmup_steps: Option<i64>,
    pub lr_warmup_steps_ratio: f64,
    pub lr_warmup_init: f64,
    /// How the learning rate falls after warm-up: `constant`, `cosine` or `linear`.
    pub lr_decay_style: LrDecayStyle,
    pub lr_decay_steps: Option<u64>,
    /// Filled in by the trainer from the run length when `None`.
    pub total_training_steps: Option<u64>,
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Global-norm gradient clipping.
    pub clip_grad: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            optimizer: "adam".into(),
            lr: 1e-6,
            min_lr: 0.0,
            lr_warmup_steps: None,
            lr_warmup_steps_ratio: 0.0,
            lr_warmup_init: 0.0,
            lr_decay_style: LrDecayStyle::Constant,
            lr_decay_steps: None,
            total_training_steps: None,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
            clip_grad: 1.0,
        }
    }
}

/// `*.checkpoint.*`: what a save and a load cover.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Any of `model`, `optimizer`, `extra`, `hf_model`.
    pub save_contents: Vec<String>,
    pub load_contents: Vec<String>,
    pub async_save: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        let all = vec![
            "model".to_string(),
            "optimizer".to_string(),
            "extra".to_string(),
        ];
        Self {
            save_contents: all.clone(),
            load_contents: all,
            async_save: false,
        }
    }
}

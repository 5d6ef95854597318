use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::topology::ParallelConfig;

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
    pub dtype: String,
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
            dtype: "auto".into(),
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
    /// `constant`, `cosine` or `linear`.
    pub lr_decay_style: String,
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
            lr_decay_style: "constant".into(),
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

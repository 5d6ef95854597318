use serde::{Deserialize, Serialize};

use crate::algorithms::aggregation::LossAggMode;
use serde_json::{Map, Value};

use super::megatron::{CheckpointConfig, MegatronConfig, OptimConfig};
use super::profiler::RoleProfilerConfig;

/// `critic.model`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticModelConfig {
    /// `None`: the actor's model path.
    pub path: Option<String>,
    pub tokenizer_path: Option<String>,
    pub override_config: Map<String, Value>,
    pub external_lib: Option<String>,
    pub enable_gradient_checkpointing: bool,
    pub trust_remote_code: bool,
    /// Pack each micro-batch's sequences into one row (no padding computed).
    pub use_remove_padding: bool,
}

/// `critic`: the value model of PPO.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// `None`: on exactly when `algorithm.adv_estimator` is `gae`.
    pub enable: Option<bool>,
    pub strategy: String,
    pub model: CriticModelConfig,
    pub optim: OptimConfig,
    pub megatron: MegatronConfig,
    /// `None`: the actor's `ppo_mini_batch_size`.
    pub ppo_mini_batch_size: Option<usize>,
    pub ppo_micro_batch_size: Option<usize>,
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    pub forward_micro_batch_size_per_gpu: Option<usize>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: usize,
    /// The value pass's token budget with `use_dynamic_bsz`; `None`: `ppo_max_token_len_per_gpu`
    /// (verl's default).
    pub forward_max_token_len_per_gpu: Option<usize>,
    /// `None`: the actor's `ppo_epochs`.
    pub ppo_epochs: Option<usize>,
    pub shuffle: bool,
    pub cliprange_value: f64,
    pub loss_agg_mode: LossAggMode,
    pub checkpoint: CheckpointConfig,
    pub profiler: RoleProfilerConfig,
    pub load_weight: bool,
}

impl Default for CriticConfig {
    fn default() -> Self {
        Self {
            enable: None,
            strategy: "megatron".into(),
            model: CriticModelConfig::default(),
            optim: OptimConfig {
                lr: 1e-5,
                ..OptimConfig::default()
            },
            megatron: MegatronConfig::default(),
            ppo_mini_batch_size: None,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            forward_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 32768,
            forward_max_token_len_per_gpu: None,
            ppo_epochs: None,
            shuffle: false,
            cliprange_value: 0.5,
            loss_agg_mode: LossAggMode::TokenMean,
            checkpoint: CheckpointConfig::default(),
            profiler: RoleProfilerConfig::default(),
            load_weight: true,
        }
    }
}

/// `reward_model.model`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelModelConfig {
    pub input_tokenizer: Option<String>,
    pub path: Option<String>,
    pub external_lib: Option<String>,
    pub trust_remote_code: bool,
}

/// `reward_model`: a learned reward model with a score head (off: rule-based rewards only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    pub enable: bool,
    pub strategy: String,
    pub model: RewardModelModelConfig,
    pub megatron: MegatronConfig,
    pub micro_batch_size: Option<usize>,
    pub micro_batch_size_per_gpu: Option<usize>,
    pub use_dynamic_bsz: bool,
    pub forward_max_token_len_per_gpu: usize,
    pub max_length: Option<usize>,
    /// How rule-based scores are computed: `naive` (per sample) or `batch`.
    pub reward_manager: String,
    pub launch_reward_fn_async: bool,
    pub load_weight: bool,
    pub profiler: RoleProfilerConfig,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            enable: false,
            strategy: "megatron".into(),
            model: RewardModelModelConfig::default(),
            megatron: MegatronConfig::default(),
            micro_batch_size: None,
            micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            forward_max_token_len_per_gpu: 32768,
            max_length: None,
            reward_manager: "naive".into(),
            launch_reward_fn_async: false,
            load_weight: true,
            profiler: RoleProfilerConfig::default(),
        }
    }
}

/// `custom_reward_function`: a reward registered by name in the embedding program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    pub path: Option<String>,
    pub name: String,
}

impl Default for CustomRewardFunctionConfig {
    fn default() -> Self {
        Self {
            path: None,
            name: "compute_score".into(),
        }
    }
}

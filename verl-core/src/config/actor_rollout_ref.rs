use serde::{Deserialize, Serialize};

use crate::algorithms::aggregation::LossAggMode;
use crate::algorithms::kl::KlPenalty;
use serde_json::{Map, Value};

use super::megatron::{CheckpointConfig, Dtype, MegatronConfig, OptimConfig};
use super::profiler::RoleProfilerConfig;

/// `actor_rollout_ref`: the hybrid worker's model, actor, reference and rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    /// Actor and rollout share devices and swap memory (verl's HybridEngine).
    pub hybrid_engine: bool,
    pub model: ModelConfig,
    pub actor: ActorConfig,
    #[serde(rename = "ref")]
    pub reference: RefConfig,
    pub rollout: RolloutConfig,
}

impl Default for ActorRolloutRefConfig {
    fn default() -> Self {
        Self {
            hybrid_engine: true,
            model: ModelConfig::default(),
            actor: ActorConfig::default(),
            reference: RefConfig::default(),
            rollout: RolloutConfig::default(),
        }
    }
}

/// `actor_rollout_ref.model`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// A Hugging Face model directory; `None`: the built-in tiny model, trained from scratch.
    pub path: Option<String>,
    pub tokenizer_path: Option<String>,
    /// Overrides of `config.json` fields.
    pub override_config: Map<String, Value>,
    pub external_lib: Option<String>,
    pub enable_gradient_checkpointing: bool,
    pub trust_remote_code: bool,
    /// Pack each micro-batch's sequences into one row in the actor's and reference's
    /// training and log-prob passes (no padding computed; the rollout generates padded).
    pub use_remove_padding: bool,
    pub use_fused_kernels: bool,
    pub custom_chat_template: Option<String>,
}

/// `actor_rollout_ref.actor.policy_loss`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// `vanilla`, `gspo`, `sapo`, `gpg`, `clip_cov`, `kl_cov`, `geo_mean`, `cispo`.
    pub loss_mode: String,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// SAPO gate temperature for positive advantages.
    pub tau_pos: f64,
    /// SAPO gate temperature for negative advantages.
    pub tau_neg: f64,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            loss_mode: "vanilla".into(),
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            tau_pos: 1.0,
            tau_neg: 1.05,
        }
    }
}

/// `actor_rollout_ref.actor.router_replay`: MoE router replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterReplayConfig {
    /// `disabled`; `R2`: the actor's old-log-prob pass records the experts every MoE block
    /// chose for each token and the update's forwards replay them; `R3`: the rollout records
    /// them (`rollout.enable_rollout_routing_replay=true`) and both the old-log-prob pass and
    /// the update replay the rollout's. (`record_file` / `replay_file`, verl's dumps, are not
    /// built.)
    pub mode: String,
}

impl Default for RouterReplayConfig {
    fn default() -> Self {
        Self {
            mode: "disabled".into(),
        }
    }
}

/// `actor_rollout_ref.actor`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    pub strategy: String,
    /// Prompts per mini-batch (each expands to `rollout.n` samples).
    pub ppo_mini_batch_size: usize,
    /// Deprecated global micro-batch size; prefer `ppo_micro_batch_size_per_gpu`.
    pub ppo_micro_batch_size: Option<usize>,
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: usize,
    pub clip_ratio: f64,
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip lower bound constant c (> 1).
    pub clip_ratio_c: f64,
    /// `token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean`, `seq-mean-token-sum-norm`.
    pub loss_agg_mode: LossAggMode,
    /// The divisor of `seq-mean-token-sum-norm` (verl's `loss_scale_factor`): a constant keeps
    /// the normalisation the same whatever the batch's padded response length; `null` divides
    /// by that length.
    pub loss_scale_factor: Option<f64>,
    pub entropy_coeff: f64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    /// The KL estimator of the KL loss: `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`, or a
    /// straight-through `+` variant (e.g. `k3+`).
    pub kl_loss_type: KlPenalty,
    pub ppo_epochs: usize,
    pub shuffle: bool,
    pub data_loader_seed: Option<u64>,
    pub policy_loss: PolicyLossConfig,
    pub optim: OptimConfig,
    pub megatron: MegatronConfig,
    pub checkpoint: CheckpointConfig,
    pub profiler: RoleProfilerConfig,
    pub load_weight: bool,
    pub router_replay: RouterReplayConfig,
}

impl Default for ActorConfig {
    fn default() -> Self {
        Self {
            strategy: "megatron".into(),
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            clip_ratio: 0.2,
            clip_ratio_low: None,
            clip_ratio_high: None,
            clip_ratio_c: 3.0,
            loss_agg_mode: LossAggMode::TokenMean,
            loss_scale_factor: None,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: KlPenalty::LOW_VAR_KL,
            ppo_epochs: 1,
            shuffle: false,
            data_loader_seed: Some(42),
            policy_loss: PolicyLossConfig::default(),
            optim: OptimConfig::default(),
            megatron: MegatronConfig::default(),
            checkpoint: CheckpointConfig::default(),
            profiler: RoleProfilerConfig::default(),
            load_weight: true,
            router_replay: RouterReplayConfig::default(),
        }
    }
}

impl ActorConfig {
    /// Lower clip bound in force (`clip_ratio_low`, else `clip_ratio`).
    pub fn clip_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }
    /// Upper clip bound in force (`clip_ratio_high`, else `clip_ratio`).
    pub fn clip_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }

    /// The policy-loss hyper-parameters these keys set; `seed` drives Clip-Cov's random choice.
    pub fn policy_loss_params(
        &self,
        seed: u64,
    ) -> crate::algorithms::policy_loss::PolicyLossParams {
        let p = &self.policy_loss;
        crate::algorithms::policy_loss::PolicyLossParams {
            clip_ratio_low: self.clip_low(),
            clip_ratio_high: self.clip_high(),
            clip_ratio_c: self.clip_ratio_c,
            clip_cov_ratio: p.clip_cov_ratio,
            clip_cov_lb: p.clip_cov_lb,
            clip_cov_ub: p.clip_cov_ub,
            kl_cov_ratio: p.kl_cov_ratio,
            ppo_kl_coef: p.ppo_kl_coef,
            tau_pos: p.tau_pos,
            tau_neg: p.tau_neg,
            seed,
        }
    }
}

/// `actor_rollout_ref.ref`: the frozen reference policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RefConfig {
    pub strategy: String,
    /// `None`: the actor's layout.
    pub megatron: Option<MegatronConfig>,
    pub log_prob_micro_batch_size: Option<usize>,
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    pub log_prob_use_dynamic_bsz: bool,
    pub log_prob_max_token_len_per_gpu: usize,
    pub load_weight: bool,
    pub profiler: RoleProfilerConfig,
}

impl Default for RefConfig {
    fn default() -> Self {
        Self {
            strategy: "megatron".into(),
            megatron: None,
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: false,
            log_prob_max_token_len_per_gpu: 16384,
            load_weight: true,
            profiler: RoleProfilerConfig::default(),
        }
    }
}

/// `actor_rollout_ref.rollout.val_kwargs`: sampling for validation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ValKwargs {
    pub top_k: i64,
    pub top_p: f64,
    pub temperature: f64,
    pub n: usize,
    pub do_sample: bool,
}

impl Default for ValKwargs {
    fn default() -> Self {
        Self {
            top_k: -1,
            top_p: 1.0,
            temperature: 0.0,
            n: 1,
            do_sample: false,
        }
    }
}

/// `actor_rollout_ref.rollout.multi_turn`: verl's agent loop (multi-turn rollouts with tool
/// calls), run by `verl_rollout::agent`. The chat template's tool turns and the tools come from
/// the embedding program (`PpoTrainerBuilder::agent`); these keys set the loop's limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiTurnConfig {
    pub enable: bool,
    /// Most model turns per trajectory; null = no limit.
    pub max_assistant_turns: Option<usize>,
    /// Tools from a YAML file (verl's tool registry): not read yet.
    pub tool_config_path: Option<String>,
    /// Most user (interaction) turns: interactions are not built.
    pub max_user_turns: Option<usize>,
    /// Most tool calls run from one model turn.
    pub max_parallel_calls: usize,
    /// Most characters of one tool answer the model sees.
    pub max_tool_response_length: usize,
    /// `left`, `right` or `middle`: which part of a longer answer is kept.
    pub tool_response_truncate_side: String,
    /// Interactions from a YAML file: not built.
    pub interaction_config_path: Option<String>,
    /// The tool-call format the model writes: `hermes`.
    pub format: String,
    /// Rollouts repeated per prompt by the agent loop: not built (use `rollout.n`).
    pub num_repeat_rollouts: Option<usize>,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        Self {
            enable: false,
            max_assistant_turns: None,
            tool_config_path: None,
            max_user_turns: None,
            max_parallel_calls: 1,
            max_tool_response_length: 256,
            tool_response_truncate_side: "middle".into(),
            interaction_config_path: None,
            format: "hermes".into(),
            num_repeat_rollouts: None,
        }
    }
}

/// `actor_rollout_ref.rollout`: the generation engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Engine name; `native` is verl-rs's own engine.
    pub name: String,
    pub mode: String,
    pub temperature: f64,
    /// `-1` (or 0): no top-k filtering.
    pub top_k: i64,
    pub top_p: f64,
    /// Keep tokens at least `min_p` times as likely as the most likely one (vLLM's `min_p`);
    /// 0: off.
    pub min_p: f64,
    /// `None`: `data.max_prompt_length`.
    pub prompt_length: Option<usize>,
    /// `None`: `data.max_response_length`.
    pub response_length: Option<usize>,
    /// The compute dtype of generation: `bfloat16`, `float32` or `auto` (bfloat16 on GPUs,
    /// float32 on the CPU backend).
    pub dtype: Dtype,
    /// vLLM's fraction of the device's total memory: the KV cache takes it less what is in use
    /// when the cache is allocated (resolved again whenever a generation needs a larger
    /// cache; on the CPU default, the fraction is of the host's available memory). Ignored
    /// when `kv_cache_tokens` is set.
    pub gpu_memory_utilization: f64,
    /// An explicit KV-cache budget in token positions (all sequences together); verl-rs's
    /// addition, the reproducible alternative to `gpu_memory_utilization`.
    pub kv_cache_tokens: Option<usize>,
    pub ignore_eos: bool,
    /// Strings that end a response at the token completing one (vLLM's `stop`; the token is
    /// kept). Matched on the decoded text, so the run needs the model's tokenizer.
    pub stop: Vec<String>,
    pub enforce_eager: bool,
    pub free_cache_engine: bool,
    /// The rollout engine's own tensor parallel size (verl: "training TP can differ from
    /// inference TP"): groups of this many consecutive ranks each generate one share.
    pub tensor_model_parallel_size: usize,
    /// The actor's weights reach the rollout in buckets of this many MiB: the most full
    /// tensors a weight sync holds at once.
    pub update_weights_bucket_megabytes: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: Option<usize>,
    pub max_num_seqs: usize,
    pub log_prob_micro_batch_size: Option<usize>,
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    pub log_prob_use_dynamic_bsz: bool,
    pub log_prob_max_token_len_per_gpu: usize,
    pub do_sample: bool,
    /// Samples per prompt (the GRPO group size).
    pub n: usize,
    pub seed: u64,
    /// Return each sampled token's log-prob under the rollout engine.
    pub calculate_log_probs: bool,
    /// Samples of one prompt admitted together share one prefill of it, and a request keeps
    /// the start of its prompt that a finished request left in the slot it takes (vLLM's
    /// prefix caching, on the engine's slots).
    pub enable_prefix_caching: bool,
    /// Prefill a prompt longer than `max_num_batched_tokens` allows in chunks over several
    /// steps, interleaved with the other sequences' decode steps.
    pub enable_chunked_prefill: bool,
    /// Router replay R3: the rollout records the experts every MoE layer chose for each
    /// token and returns them as `routed_experts`, which the actor replays in its old-log-prob
    /// pass and its update (with `actor.router_replay.mode=R3`).
    pub enable_rollout_routing_replay: bool,
    /// Multi-turn rollouts with tools (verl's agent loop).
    pub multi_turn: MultiTurnConfig,
    pub val_kwargs: ValKwargs,
    /// verl's rollout profiler block (the rollout runs inside the actor worker here, so the
    /// actor's profiler covers it; enabling this one is refused with that advice).
    pub profiler: RoleProfilerConfig,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            name: "native".into(),
            mode: "sync".into(),
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            min_p: 0.0,
            prompt_length: None,
            response_length: None,
            dtype: Dtype::Auto,
            gpu_memory_utilization: 0.5,
            kv_cache_tokens: None,
            ignore_eos: false,
            stop: Vec::new(),
            enforce_eager: true,
            free_cache_engine: true,
            tensor_model_parallel_size: 1,
            update_weights_bucket_megabytes: 512,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            max_num_seqs: 256,
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: false,
            log_prob_max_token_len_per_gpu: 16384,
            do_sample: true,
            n: 1,
            seed: 0,
            calculate_log_probs: false,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            enable_rollout_routing_replay: false,
            multi_turn: MultiTurnConfig::default(),
            val_kwargs: ValKwargs::default(),
            profiler: RoleProfilerConfig::default(),
        }
    }
}

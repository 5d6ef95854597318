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
    /// How rule-based scores are computed: `naive` (per sample), `dapo` (per sample, with
    /// DAPO's overlong reward shaping) or `batch`.
    pub reward_manager: String,
    /// Keyword arguments of the reward manager, as verl passes them (`dapo`: `max_resp_len`,
    /// `overlong_buffer_cfg`); see [`RewardModelConfig::overlong_shaping`].
    pub reward_kwargs: Map<String, Value>,
    /// verl's DAPO recipe's overlong buffer (the recipe's form of `overlong_buffer_cfg`).
    pub overlong_buffer: OverlongBufferConfig,
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
            reward_kwargs: Map::new(),
            overlong_buffer: OverlongBufferConfig::default(),
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

/// DAPO's overlong reward shaping settings (`overlong_buffer` / `overlong_buffer_cfg`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    pub enable: bool,
    /// Tokens before `max_resp_len` where the penalty ramps up.
    pub len: usize,
    pub penalty_factor: f64,
    /// Store each response's shaping in its reward extras (`overlong_reward`, `overlong`),
    /// which validation reports as `val-aux/<data_source>/<name>/mean@<n>`.
    pub log: bool,
}

impl RewardModelConfig {
    /// DAPO's overlong shaping, if this config asks for it: `reward_manager=dapo` with
    /// `reward_kwargs.overlong_buffer_cfg` (verl's trainer) or `overlong_buffer` (verl's DAPO
    /// recipe) enabled; `max_resp_len` from `reward_kwargs` or, as the recipe passes it, the
    /// data's `max_response_length`. Refused by name: reward kwargs without `dapo` or not
    /// read, an enabled buffer elsewhere, a length of 0 or over `max_resp_len`.
    pub fn overlong_shaping(
        &self,
        max_response_length: usize,
    ) -> Result<Option<crate::algorithms::reward::OverlongBuffer>, crate::error::ConfigError> {
        use crate::error::ConfigError;
        let refuse = |field: &str, message: String| ConfigError::Key {
            key: field.to_string(),
            message,
        };
        let kw = &self.reward_kwargs;
        if self.reward_manager != "dapo" {
            if let Some(k) = kw.keys().next() {
                return Err(refuse(
                    &format!("reward_model.reward_kwargs.{k}"),
                    "read by reward_manager=dapo only; remove it or set reward_model.reward_manager=dapo".into(),
                ));
            }
            if self.overlong_buffer.enable {
                return Err(refuse(
                    "reward_model.overlong_buffer.enable",
                    "overlong reward shaping is DAPO's: set reward_model.reward_manager=dapo"
                        .into(),
                ));
            }
            return Ok(None);
        }
        for (k, v) in kw {
            let known = match k.as_str() {
                "max_resp_len" | "overlong_buffer_cfg" => true,
                "reward_fn_key" => v.as_str() == Some("data_source"),
                _ => false,
            };
            if !known {
                return Err(refuse(
                    &format!("reward_model.reward_kwargs.{k}"),
                    format!("{v}: not read; the dapo manager reads max_resp_len and overlong_buffer_cfg (reward_fn_key must be data_source)"),
                ));
            }
        }
        let (cfg, field) = match kw.get("overlong_buffer_cfg").filter(|v| !v.is_null()) {
            Some(v) => (
                serde_json::from_value::<OverlongBufferConfig>(v.clone()).map_err(|e| {
                    refuse(
                        "reward_model.reward_kwargs.overlong_buffer_cfg",
                        format!("{e}"),
                    )
                })?,
                "reward_model.reward_kwargs.overlong_buffer_cfg",
            ),
            None => (self.overlong_buffer.clone(), "reward_model.overlong_buffer"),
        };
        if !cfg.enable {
            return Ok(None);
        }
        let max_resp_len = match kw.get("max_resp_len").filter(|v| !v.is_null()) {
            Some(v) => v.as_u64().ok_or_else(|| {
                refuse(
                    "reward_model.reward_kwargs.max_resp_len",
                    format!("{v}: must be a whole number of tokens"),
                )
            })? as usize,
            None => max_response_length,
        };
        if cfg.len == 0 || cfg.len > max_resp_len {
            return Err(refuse(
                &format!("{field}.len"),
                format!(
                    "{}: must be between 1 and max_resp_len ({max_resp_len})",
                    cfg.len
                ),
            ));
        }
        if !cfg.penalty_factor.is_finite() {
            return Err(refuse(
                &format!("{field}.penalty_factor"),
                format!("{}: must be a finite number", cfg.penalty_factor),
            ));
        }
        Ok(Some(crate::algorithms::reward::OverlongBuffer {
            max_resp_len,
            buffer_len: cfg.len,
            penalty_factor: cfg.penalty_factor,
            log: cfg.log,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::reward::OverlongBuffer;

    fn dapo(kwargs: Value, recipe: OverlongBufferConfig) -> RewardModelConfig {
        RewardModelConfig {
            reward_manager: "dapo".into(),
            reward_kwargs: kwargs.as_object().cloned().unwrap_or_default(),
            overlong_buffer: recipe,
            ..Default::default()
        }
    }

    fn on(len: usize, factor: f64) -> OverlongBufferConfig {
        OverlongBufferConfig {
            enable: true,
            len,
            penalty_factor: factor,
            log: false,
        }
    }

    #[test]
    fn dapo_overlong_settings_come_from_either_form() {
        // verl's trainer form: reward_kwargs.
        let kw = serde_json::json!({
            "max_resp_len": 100,
            "overlong_buffer_cfg": {"enable": true, "len": 20, "penalty_factor": 1.5, "log": false}
        });
        assert_eq!(
            dapo(kw, OverlongBufferConfig::default())
                .overlong_shaping(512)
                .ok(),
            Some(Some(OverlongBuffer {
                max_resp_len: 100,
                buffer_len: 20,
                penalty_factor: 1.5,
                log: false
            }))
        );
        // The recipe's form: max_resp_len is the data's max_response_length.
        assert_eq!(
            dapo(serde_json::json!({}), on(64, 1.0))
                .overlong_shaping(512)
                .ok(),
            Some(Some(OverlongBuffer {
                max_resp_len: 512,
                buffer_len: 64,
                penalty_factor: 1.0,
                log: false
            }))
        );
        // `log` keeps each response's shaping as reward extras.
        let logged = OverlongBufferConfig {
            log: true,
            ..on(64, 1.0)
        };
        assert!(dapo(serde_json::json!({}), logged)
            .overlong_shaping(512)
            .ok()
            .flatten()
            .is_some_and(|b| b.log));
        // Off: dapo scores as naive does.
        let off = dapo(serde_json::json!({}), OverlongBufferConfig::default());
        assert_eq!(off.overlong_shaping(512).ok(), Some(None));
        assert_eq!(
            RewardModelConfig::default().overlong_shaping(512).ok(),
            Some(None)
        );
    }

    #[test]
    fn wrong_dapo_settings_are_refused_by_key() {
        let naive_with_kwargs = RewardModelConfig {
            reward_kwargs: serde_json::json!({"max_resp_len": 8})
                .as_object()
                .cloned()
                .unwrap(),
            ..Default::default()
        };
        let naive_with_buffer = RewardModelConfig {
            overlong_buffer: on(4, 1.0),
            ..Default::default()
        };
        for (cfg, key) in [
            (naive_with_kwargs, "reward_model.reward_kwargs.max_resp_len"),
            (naive_with_buffer, "reward_model.overlong_buffer.enable"),
            (
                dapo(serde_json::json!({"foo": 1}), Default::default()),
                "reward_model.reward_kwargs.foo",
            ),
            (
                dapo(serde_json::json!({}), on(0, 1.0)),
                "reward_model.overlong_buffer.len",
            ),
            (
                dapo(serde_json::json!({}), on(600, 1.0)),
                "reward_model.overlong_buffer.len",
            ),
            (
                dapo(
                    serde_json::json!({"overlong_buffer_cfg": {"enable": true, "len": 4, "bogus": 1}}),
                    Default::default(),
                ),
                "reward_model.reward_kwargs.overlong_buffer_cfg",
            ),
        ] {
            let e = cfg.overlong_shaping(512).expect_err("refused").to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}

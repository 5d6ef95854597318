//! The model a run trains: the backends, the compute dtype, the built-in task's model sizes,
//! the tokenizer codec and the pipeline split.

use serde_json::Value;
use verl_core::backend::{DefaultAutodiff, DefaultBackend};
use verl_core::config::{Dtype, VerlConfig};
use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
use verl_megatron::layers::precision::ComputeDtype;
use verl_megatron::models::{Recompute, RecomputeMethod};
use verl_megatron::parallel::pipeline::stage_layers;

use super::data::Codec;
use super::error::{setup, TrainError};
use crate::tasks::CharTokenizer;

/// The backend the roles train on (with autodiff) and infer on.
pub(crate) type Train = DefaultAutodiff;
pub(crate) type Infer = DefaultBackend;

/// A `dtype` setting as the compute dtype of the binary's backend: `auto` is bfloat16 on
/// burn-cuda and float32 on the CPU default (where bf16 is emulated, and slower).
pub(super) fn compute_dtype(setting: Dtype) -> ComputeDtype {
    let auto = if cfg!(feature = "cuda") {
        ComputeDtype::Bf16
    } else {
        ComputeDtype::F32
    };
    ComputeDtype::from_setting(setting).unwrap_or(auto)
}

/// The model sizes the built-in task trains from scratch (`actor_rollout_ref.model.path` unset),
/// adjustable through `actor_rollout_ref.model.override_config`.
pub(super) fn scratch_model(cfg: &VerlConfig, vocab: usize) -> Result<HfModelConfig, TrainError> {
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
    // `moe_config` (verl's router switches) is read with the roles' settings; an empty entry
    // (verl's own `model_config: {}`) asks for nothing.
    let empty = |v: &Value| v.is_null() || v.as_object().is_some_and(|m| m.is_empty());
    if let Some(k) = o
        .iter()
        .find(|(k, v)| !KEYS.contains(&k.as_str()) && k.as_str() != "moe_config" && !empty(v))
        .map(|(k, _)| k)
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

/// The layers of each pipeline stage, with the `override_transformer_config` keys
/// `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage`.
pub(super) fn pipeline_split(
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

/// Megatron's activation recompute for a role, from its `megatron.override_transformer_config`
/// (`prefix` names the role's section) as Megatron reads it: `recompute_granularity: full`
/// with `recompute_method` (uniform or block) and `recompute_num_layers` recomputes whole
/// layers ([`Recompute`]); `selective` with `recompute_modules: [core_attn]` is what the
/// fused attention always does (its backward recomputes the probabilities from the saved
/// log-sum-exp; the plain CPU path keeps them), so it asks for nothing more; unset asks for
/// nothing. Anything else is refused naming the key, before any weight exists. `split` holds
/// the layers of each pipeline stage (block recomputes layers of every stage).
pub(super) fn recompute_settings(
    megatron: &verl_core::config::MegatronConfig,
    prefix: &str,
    split: &[std::ops::Range<usize>],
) -> Result<Option<Recompute>, TrainError> {
    let o = &megatron.override_transformer_config;
    let key = |k: &str| format!("{prefix}.megatron.override_transformer_config.{k}");
    let get = |k: &str| o.get(k).filter(|v| !v.is_null());
    let text = |k: &str| -> Result<Option<&str>, TrainError> {
        get(k)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| setup(format!("{} = {v}: must be a string", key(k))))
            })
            .transpose()
    };
    let granularity = text("recompute_granularity")?;
    let method = text("recompute_method")?;
    let layers = match get("recompute_num_layers") {
        None => None,
        Some(v) => Some(v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
            setup(format!(
                "{} = {v}: must be a whole number of layers, at least 1",
                key("recompute_num_layers")
            ))
        })? as usize),
    };
    match granularity {
        None | Some("selective") => {
            if let Some(which) = [
                method.map(|_| "recompute_method"),
                layers.map(|_| "recompute_num_layers"),
            ]
            .into_iter()
            .flatten()
            .next()
            {
                return Err(setup(format!(
                    "{} applies to recompute_granularity: full only; set {} = full or remove it",
                    key(which),
                    key("recompute_granularity")
                )));
            }
            if granularity.is_some() {
                let modules = match get("recompute_modules") {
                    None => vec!["core_attn".to_string()],
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|m| m.as_str().unwrap_or("?").to_string())
                        .collect(),
                    Some(v) => vec![v.to_string()],
                };
                if let Some(other) = modules.iter().find(|m| *m != "core_attn") {
                    return Err(setup(format!(
                        "{} contains `{other}`: selective recompute of core_attn only is \
                         supported (the fused attention's backward recomputes it); use \
                         recompute_granularity: full to recompute whole layers",
                        key("recompute_modules")
                    )));
                }
            }
            Ok(None)
        }
        Some("full") => {
            let method = match method {
                Some("uniform") => RecomputeMethod::Uniform,
                Some("block") => RecomputeMethod::Block,
                Some(other) => {
                    return Err(setup(format!(
                        "{} = {other}: use uniform or block",
                        key("recompute_method")
                    )))
                }
                None => {
                    return Err(setup(format!(
                        "{} = full needs {} (uniform or block)",
                        key("recompute_granularity"),
                        key("recompute_method")
                    )))
                }
            };
            let num_layers = layers.ok_or_else(|| {
                setup(format!(
                    "{} = full needs {} (e.g. 1: every layer's input kept)",
                    key("recompute_granularity"),
                    key("recompute_num_layers")
                ))
            })?;
            let fewest = split.iter().map(|r| r.len()).min().unwrap_or(0);
            if method == RecomputeMethod::Block && num_layers > fewest {
                return Err(setup(format!(
                    "{} = {num_layers} exceeds the {fewest} layers of a pipeline stage; the \
                     block method recomputes that many layers of every stage",
                    key("recompute_num_layers")
                )));
            }
            Ok(Some(Recompute { method, num_layers }))
        }
        Some(other) => Err(setup(format!(
            "{} = {other}: use full, selective or null",
            key("recompute_granularity")
        ))),
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one pipeline stage of four layers
mod tests {
    use super::*;
    use verl_core::config::MegatronConfig;

    fn settings(
        pairs: &[(&str, Value)],
        split: &[std::ops::Range<usize>],
    ) -> Result<Option<Recompute>, String> {
        let mut m = MegatronConfig::default();
        for (k, v) in pairs {
            m.override_transformer_config
                .insert(k.to_string(), v.clone());
        }
        recompute_settings(&m, "critic", split).map_err(|e| e.to_string())
    }

    #[test]
    fn megatron_recompute_keys_become_the_recompute_setting() {
        let one = [0..4];
        assert_eq!(settings(&[], &one), Ok(None));
        let full = |method: &str, n: u64| {
            vec![
                ("recompute_granularity", Value::from("full")),
                ("recompute_method", Value::from(method)),
                ("recompute_num_layers", Value::from(n)),
            ]
        };
        assert_eq!(
            settings(&full("uniform", 2), &one),
            Ok(Some(Recompute {
                method: RecomputeMethod::Uniform,
                num_layers: 2
            }))
        );
        assert_eq!(
            settings(&full("block", 2), &[0..2, 2..4]),
            Ok(Some(Recompute {
                method: RecomputeMethod::Block,
                num_layers: 2
            }))
        );
        // Selective recompute of core attention is what the fused attention does anyway.
        let selective = [
            ("recompute_granularity", Value::from("selective")),
            ("recompute_modules", serde_json::json!(["core_attn"])),
        ];
        assert_eq!(settings(&selective, &one), Ok(None));
        // verl's defaults: modules listed, granularity null.
        let defaults = [
            ("recompute_granularity", Value::Null),
            ("recompute_modules", serde_json::json!(["core_attn"])),
            ("recompute_method", Value::Null),
            ("recompute_num_layers", Value::Null),
        ];
        assert_eq!(settings(&defaults, &one), Ok(None));
    }

    #[test]
    fn wrong_recompute_keys_are_refused_by_name() {
        let key = |k: &str| format!("critic.megatron.override_transformer_config.{k}");
        for (pairs, named, split) in [
            (
                vec![("recompute_granularity", Value::from("full"))],
                key("recompute_method"),
                vec![0..4],
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("full")),
                    ("recompute_method", Value::from("uniform")),
                ],
                key("recompute_num_layers"),
                vec![0..4],
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("full")),
                    ("recompute_method", Value::from("interleaved")),
                    ("recompute_num_layers", Value::from(1)),
                ],
                key("recompute_method"),
                vec![0..4],
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("full")),
                    ("recompute_method", Value::from("block")),
                    ("recompute_num_layers", Value::from(3)),
                ],
                key("recompute_num_layers"),
                vec![0..2, 2..4],
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("full")),
                    ("recompute_method", Value::from("uniform")),
                    ("recompute_num_layers", Value::from(0)),
                ],
                key("recompute_num_layers"),
                vec![0..4],
            ),
            (
                vec![("recompute_method", Value::from("uniform"))],
                key("recompute_method"),
                vec![0..4],
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("selective")),
                    ("recompute_modules", serde_json::json!(["core_attn", "mlp"])),
                ],
                key("recompute_modules"),
                vec![0..4],
            ),
            (
                vec![("recompute_granularity", Value::from("everything"))],
                key("recompute_granularity"),
                vec![0..4],
            ),
        ] {
            let e = settings(&pairs, &split).expect_err("refused");
            assert!(e.contains(&named), "{pairs:?}: {e}");
        }
    }
}

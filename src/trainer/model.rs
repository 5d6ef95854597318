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
            routing: Default::default(),
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
            // The actor samples next tokens: a score head has none to give.
            if let Some(what) = m.head.score_head() {
                let config_json = m.to_config_json();
                let arch = config_json["architectures"][0]
                    .as_str()
                    .unwrap_or("its architecture");
                return Err(setup(format!(
                    "actor_rollout_ref.model.path = {p}: {arch} is {what}; the actor needs a \
                     causal LM (an `…ForCausalLM` architecture in config.json). A value model \
                     goes in critic.model.path, a reward model in reward_model.model.path"
                )));
            }
            let tok = verl_megatron::hf::HfTokenizer::from_dir(
                cfg.actor_rollout_ref
                    .model
                    .tokenizer_path
                    .as_deref()
                    .unwrap_or(p),
            )
            .map_err(setup)?;
            (Codec::hf(tok), m)
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
/// (`prefix` names the role's section), read as Megatron reads it: `recompute_granularity:
/// full` with `recompute_method` (uniform or block) and `recompute_num_layers` recomputes whole
/// layers ([`Recompute`]; block over a stage with fewer layers recomputes all of them);
/// `selective` with `recompute_modules: [core_attn]` asks for what the fused attention kernel
/// always does (its backward recomputes the probabilities from the saved log-sum-exp), so it
/// is accepted where that kernel runs (`fused_attention`: a CUDA build, bf16, no context
/// parallelism, a head size it takes) and refused elsewhere, where attention keeps them; unset
/// asks for nothing (a method or layer count without a granularity is ignored, as Megatron
/// does, with a warning). Anything else is refused naming the key, before any weight exists.
pub(super) fn recompute_settings(
    megatron: &verl_core::config::MegatronConfig,
    prefix: &str,
    fused_attention: bool,
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
    let method = match text("recompute_method")? {
        None => None,
        Some("uniform") => Some(RecomputeMethod::Uniform),
        Some("block") => Some(RecomputeMethod::Block),
        Some(other) => {
            return Err(setup(format!(
                "{} = {other}: use uniform or block",
                key("recompute_method")
            )))
        }
    };
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
        None => {
            if method.is_some() || layers.is_some() {
                tracing::warn!(
                    "{} and {} apply with {} = full only; without it nothing is recomputed, as \
                     in Megatron",
                    key("recompute_method"),
                    key("recompute_num_layers"),
                    key("recompute_granularity")
                );
            }
            Ok(None)
        }
        Some("selective") => {
            if layers.is_some() {
                return Err(setup(format!(
                    "{} must be unset with recompute_granularity: selective (as in Megatron)",
                    key("recompute_num_layers")
                )));
            }
            let modules = match get("recompute_modules") {
                None => vec!["core_attn".to_string()],
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_string))
                    .collect(),
                Some(Value::String(one)) => vec![one.clone()],
                Some(v) => vec![v.to_string()],
            };
            if let Some(other) = modules.iter().find(|m| *m != "core_attn") {
                return Err(setup(format!(
                    "{} contains `{other}`: selective recompute of core_attn only is \
                     supported; use recompute_granularity: full to recompute whole layers",
                    key("recompute_modules")
                )));
            }
            if !fused_attention {
                return Err(setup(format!(
                    "{} = selective: this run's attention is the decomposed one (a CPU build, \
                     f32 products, context parallelism or a head size over 128), which keeps \
                     the attention probabilities; use recompute_granularity: full",
                    key("recompute_granularity")
                )));
            }
            Ok(None)
        }
        Some("full") => {
            let method = method.ok_or_else(|| {
                setup(format!(
                    "{} = full needs {} (uniform or block)",
                    key("recompute_granularity"),
                    key("recompute_method")
                ))
            })?;
            let num_layers = layers.ok_or_else(|| {
                setup(format!(
                    "{} = full needs {} (e.g. 1: every layer's input kept)",
                    key("recompute_granularity"),
                    key("recompute_num_layers")
                ))
            })?;
            Ok(Some(Recompute { method, num_layers }))
        }
        Some(other) => Err(setup(format!(
            "{} = {other}: use full, selective or null",
            key("recompute_granularity")
        ))),
    }
}

/// Whether the fused attention kernel runs this role's training attention: a CUDA build,
/// bf16 products, no context parallelism, a head size the kernel takes (what `selective`
/// recompute of core_attn needs).
pub(super) fn fused_attention_runs(dtype: ComputeDtype, cp: usize, head_dim: usize) -> bool {
    cfg!(feature = "cuda")
        && dtype == ComputeDtype::Bf16
        && cp == 1
        && verl_megatron::ops::fused_attention_head_dim(head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_core::config::MegatronConfig;

    fn settings_with(pairs: &[(&str, Value)], fused: bool) -> Result<Option<Recompute>, String> {
        let mut m = MegatronConfig::default();
        for (k, v) in pairs {
            m.override_transformer_config
                .insert(k.to_string(), v.clone());
        }
        recompute_settings(&m, "critic", fused).map_err(|e| e.to_string())
    }

    fn settings(pairs: &[(&str, Value)]) -> Result<Option<Recompute>, String> {
        settings_with(pairs, true)
    }

    fn full(method: &str, n: u64) -> Vec<(&'static str, Value)> {
        vec![
            ("recompute_granularity", Value::from("full")),
            ("recompute_method", Value::from(method)),
            ("recompute_num_layers", Value::from(n)),
        ]
    }

    #[test]
    fn megatron_recompute_keys_become_the_recompute_setting() {
        assert_eq!(settings(&[]), Ok(None));
        assert_eq!(
            settings(&full("uniform", 2)),
            Ok(Some(Recompute {
                method: RecomputeMethod::Uniform,
                num_layers: 2
            }))
        );
        // Block over more layers than a stage has recomputes all of them (`chunks` clamps).
        assert_eq!(
            settings(&full("block", 9)),
            Ok(Some(Recompute {
                method: RecomputeMethod::Block,
                num_layers: 9
            }))
        );
        // Selective recompute of core attention is what the fused attention does anyway; a
        // method beside it is ignored, as Megatron ignores it.
        let selective = [
            ("recompute_granularity", Value::from("selective")),
            ("recompute_modules", serde_json::json!(["core_attn"])),
            ("recompute_method", Value::from("uniform")),
        ];
        assert_eq!(settings(&selective), Ok(None));
        let one_string = [
            ("recompute_granularity", Value::from("selective")),
            ("recompute_modules", Value::from("core_attn")),
        ];
        assert_eq!(settings(&one_string), Ok(None));
        // verl's defaults: modules listed, granularity null; a method alone is ignored too.
        let defaults = [
            ("recompute_granularity", Value::Null),
            ("recompute_modules", serde_json::json!(["core_attn"])),
            ("recompute_method", Value::from("block")),
            ("recompute_num_layers", Value::Null),
        ];
        assert_eq!(settings(&defaults), Ok(None));
    }

    #[test]
    fn wrong_recompute_keys_are_refused_by_name() {
        let key = |k: &str| format!("critic.megatron.override_transformer_config.{k}");
        let selective = vec![("recompute_granularity", Value::from("selective"))];
        for (pairs, named, fused) in [
            (
                vec![("recompute_granularity", Value::from("full"))],
                key("recompute_method"),
                true,
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("full")),
                    ("recompute_method", Value::from("uniform")),
                ],
                key("recompute_num_layers"),
                true,
            ),
            (full("interleaved", 1), key("recompute_method"), true),
            (full("uniform", 0), key("recompute_num_layers"), true),
            (
                vec![
                    ("recompute_granularity", Value::from("selective")),
                    ("recompute_num_layers", Value::from(2)),
                ],
                key("recompute_num_layers"),
                true,
            ),
            (
                vec![
                    ("recompute_granularity", Value::from("selective")),
                    ("recompute_modules", serde_json::json!(["core_attn", "mlp"])),
                ],
                key("recompute_modules"),
                true,
            ),
            // Where attention is decomposed, selective would keep the probabilities.
            (selective, key("recompute_granularity"), false),
            (
                vec![("recompute_granularity", Value::from("everything"))],
                key("recompute_granularity"),
                true,
            ),
        ] {
            let e = settings_with(&pairs, fused).expect_err("refused");
            assert!(e.contains(&named), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn the_fused_attention_runs_only_where_its_kernel_does() {
        assert!(!fused_attention_runs(ComputeDtype::F32, 1, 128));
        assert!(!fused_attention_runs(ComputeDtype::Bf16, 2, 128));
        assert!(!fused_attention_runs(ComputeDtype::Bf16, 1, 256));
        assert_eq!(
            fused_attention_runs(ComputeDtype::Bf16, 1, 128),
            cfg!(feature = "cuda")
        );
    }
}

//! Reading config.json in both transformers dialects, from the committed fixtures.

mod common;
use common::fixture;

use std::path::Path;

use verl_core::topology::ParallelConfig;
use verl_megatron::hf::{Architecture, HfModelConfig, RopeScaling, WeightDtype};
use verl_megatron::MegatronError;

#[test]
fn fixtures_parse_with_their_architectures() {
    let q = HfModelConfig::from_dir(fixture("qwen2")).unwrap();
    assert_eq!(q.architecture, Architecture::Qwen2);
    assert_eq!(
        (
            q.hidden_size,
            q.num_attention_heads,
            q.num_key_value_heads,
            q.head_dim
        ),
        (32, 4, 2, 8)
    );
    assert!(q.qkv_bias && !q.o_bias && q.tie_word_embeddings);
    assert_eq!(
        (q.rope_theta, q.rope_scaling, q.dtype),
        (10000.0, RopeScaling::Default, WeightDtype::F32)
    );
    assert_eq!(q.eos_token_ids, vec![2]);

    let l = HfModelConfig::from_dir(fixture("llama3")).unwrap();
    assert_eq!(l.architecture, Architecture::Llama);
    assert_eq!(l.rope_theta, 500000.0);
    assert_eq!(
        l.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32
        }
    );
    assert!(!l.tie_word_embeddings && !l.qkv_bias);

    let q3 = HfModelConfig::from_dir(fixture("qwen3")).unwrap();
    assert_eq!(
        (q3.architecture, q3.head_dim, q3.rope_theta),
        (Architecture::Qwen3, 16, 1_000_000.0)
    );

    let m = HfModelConfig::from_dir(fixture("qwen2_moe")).unwrap();
    let moe = m.moe.as_ref().unwrap();
    assert_eq!(
        (
            moe.num_experts,
            moe.num_experts_per_tok,
            moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size
        ),
        (4, 2, 16, 48)
    );
    assert!(!moe.norm_topk_prob && moe.is_moe_layer(0) && moe.is_moe_layer(1));
}

#[test]
fn transformers_4_and_5_dialects_give_the_same_config() {
    // qwen2_sharded_tf4 is qwen2 with `rope_theta` / `rope_scaling: null` / `torch_dtype` keys.
    let tf5 = HfModelConfig::from_dir(fixture("qwen2")).unwrap();
    let tf4 = HfModelConfig::from_dir(fixture("qwen2_sharded_tf4")).unwrap();
    assert_eq!(tf4, tf5);

    // A transformers-4 Llama-3 config with a `type`-keyed rope_scaling and bf16 weights.
    let text = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "eos_token_id": [128001, 128009]}"#;
    let c = HfModelConfig::from_json(text, Path::new("config.json")).unwrap();
    assert_eq!(
        (c.dtype, c.num_key_value_heads, c.head_dim),
        (WeightDtype::BF16, 2, 8)
    );
    assert!(matches!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            original_max_position_embeddings: 8192,
            ..
        }
    ));
    assert_eq!(c.eos_token_ids, vec![128001, 128009]);
}

fn refused(patch: &str) -> String {
    let base = r#""vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2"#;
    let text = format!("{{{base}, {patch}}}");
    HfModelConfig::from_json(&text, Path::new("m/config.json"))
        .unwrap_err()
        .to_string()
}

#[test]
fn unsupported_values_are_refused_by_field_name() {
    let e = refused(r#""architectures": ["Phi3ForCausalLM"]"#);
    assert!(
        e.contains("Phi3ForCausalLM")
            && e.contains("Gemma3")
            && e.contains("ForSequenceClassification"),
        "{e}"
    );
    // Qwen2's window: from max_window_layers on (28 where absent, as Qwen2Config says), 4096
    // wide where `sliding_window` is absent, nowhere where it is null.
    let base = r#""vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true"#;
    for (patch, windows) in [
        (r#""max_window_layers": 1"#, [None, Some(4096)]),
        (
            r#""sliding_window": 32, "max_window_layers": 2"#,
            [None, None],
        ),
        (r#""sliding_window": 32"#, [None, None]),
        (
            r#""sliding_window": 32, "max_window_layers": 0"#,
            [Some(32), Some(32)],
        ),
        (
            r#""sliding_window": null, "max_window_layers": 0"#,
            [None, None],
        ),
        // An explicit list wins over max_window_layers.
        (
            r#""sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]"#,
            [Some(8), None],
        ),
    ] {
        let text = format!("{{{base}, {patch}}}");
        let cfg = HfModelConfig::from_json(&text, Path::new("m/config.json")).unwrap();
        let got = [0, 1].map(|l| cfg.variants.sliding_window_of(l));
        assert_eq!(got, windows, "{patch}");
    }
    // Sliding layers with no window, a list of the wrong length or an unknown layer type.
    let qwen2 = r#""architectures": ["Qwen2ForCausalLM"]"#;
    for (patch, says) in [
        (
            r#""layer_types": ["sliding_attention", "full_attention"]"#,
            "no sliding_window",
        ),
        (
            r#""use_sliding_window": true, "layer_types": ["sliding_attention"]"#,
            "lists 1 layers",
        ),
        (
            r#""layer_types": ["chunked_attention", "full_attention"]"#,
            "chunked_attention",
        ),
    ] {
        let e = refused(&format!("{qwen2}, {patch}"));
        assert!(e.contains("layer_types") && e.contains(says), "{e}");
    }
    // Mistral v0.1's window (and transformers' default of 4096 where the key is absent) on
    // every layer; none from v0.2 on (null).
    for (patch, window) in [
        (r#", "sliding_window": 4096"#, Some(4096)),
        ("", Some(4096)),
        (r#", "sliding_window": null"#, None),
    ] {
        let base = r#""vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "architectures": ["MistralForCausalLM"]"#;
        let text = format!("{{{base}{patch}}}");
        let cfg = HfModelConfig::from_json(&text, Path::new("m/config.json")).unwrap();
        assert_eq!(cfg.variants.sliding_window_of(1), window, "{patch}");
    }
    // The MoE variants' own sliding rules are not built.
    let e = refused(
        r#""architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": true, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
    );
    assert!(
        e.contains("use_sliding_window") && e.contains("Qwen3-MoE"),
        "{e}"
    );
    let e = refused(r#""architectures": ["MistralForCausalLM"], "sliding_window": 0"#);
    assert!(e.contains("sliding_window"), "{e}");
    let e = refused(r#""architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu""#);
    assert!(
        e.contains("hidden_activation") && e.contains("gelu_pytorch_tanh"),
        "{e}"
    );
    let e = refused(r#""architectures": ["Gemma2ForCausalLM"], "final_logit_softcapping": -1"#);
    assert!(e.contains("final_logit_softcapping"), "{e}");
    let e = refused(r#""architectures": ["LlamaForCausalLM"], "hidden_act": "gelu""#);
    assert!(e.contains("hidden_act"), "{e}");
    let e = refused(r#""architectures": ["LlamaForCausalLM"], "num_key_value_heads": 3"#);
    assert!(e.contains("num_key_value_heads"), "{e}");
    let e = refused(r#""architectures": ["LlamaForCausalLM"], "dtype": "float8""#);
    assert!(e.contains("`dtype`") && e.contains("float8"), "{e}");
    let e = refused(
        r#""architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 8, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8"#,
    );
    assert!(e.contains("num_experts_per_tok"), "{e}");
    assert!(e.contains("m/config.json"), "names the file: {e}");
    // Mixtral with router jitter.
    let mixtral = r#""architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2"#;
    let e = refused(&format!(r#"{mixtral}, "router_jitter_noise": 0.01"#));
    assert!(e.contains("router_jitter_noise"), "{e}");
    // The rope types that depend on the sequence length.
    let e = refused(
        r#""architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}"#,
    );
    assert!(e.contains("original_max_position_embeddings"), "{e}");
    // A transformers-5 file's errors name its own key, rope_parameters.
    let e = refused(
        r#""architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": "fast"}"#,
    );
    assert!(e.contains("rope_parameters.beta_fast"), "{e}");
    let e = refused(
        r#""architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}"#,
    );
    assert!(e.contains("rope_parameters.rope_type"), "{e}");
    for rope_type in ["dynamic", "longrope"] {
        let e = refused(&format!(
            r#""architectures": ["LlamaForCausalLM"], "rope_scaling": {{"rope_type": "{rope_type}", "factor": 2.0}}"#
        ));
        assert!(e.contains(rope_type) && e.contains("yarn"), "{e}");
        assert_eq!(
            e.contains("longest sequence"),
            rope_type == "dynamic",
            "{e}"
        );
    }
    let e = refused(
        r#""architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "linear"}"#,
    );
    assert!(e.contains("rope_scaling.factor"), "{e}");
    let missing = HfModelConfig::from_dir(fixture("does_not_exist")).unwrap_err();
    assert!(matches!(missing, MegatronError::Io { .. }));
}

/// Layout errors name the expert sizes by the keys the model's config uses.
#[test]
fn expert_layout_errors_name_the_config_keys() {
    let mixtral = HfModelConfig::from_dir(fixture("mixtral")).unwrap();
    let e = mixtral.check_layout(1, 3, 1).unwrap_err().to_string();
    assert!(e.contains("num_local_experts (4)"), "{e}");
    let qwen3_moe = HfModelConfig::from_dir(fixture("qwen3_moe")).unwrap();
    let e = qwen3_moe.check_layout(1, 3, 1).unwrap_err().to_string();
    assert!(e.contains("num_experts (4)"), "{e}");
}

#[test]
fn parallel_layouts_are_checked_against_the_model() {
    let q = HfModelConfig::from_dir(fixture("qwen2")).unwrap();
    let dims = q.model_dims();
    assert!(ParallelConfig {
        tp: 2,
        pp: 2,
        ..Default::default()
    }
    .validate_for_model(&dims)
    .is_ok());
    // 2 kv heads cannot be split over tp = 4.
    let e = ParallelConfig {
        tp: 4,
        ..Default::default()
    }
    .validate_for_model(&dims)
    .unwrap_err()
    .to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    let moe = HfModelConfig::from_dir(fixture("qwen2_moe"))
        .unwrap()
        .model_dims();
    assert!(ParallelConfig {
        ep: 4,
        ..Default::default()
    }
    .validate_for_model(&moe)
    .is_ok());
    assert!(ParallelConfig {
        ep: 3,
        ..Default::default()
    }
    .validate_for_model(&moe)
    .is_err());
}

#[test]
fn written_config_json_reads_back_unchanged() {
    // Every fixture family and head: what `to_config_json` writes, `from_json` reads back.
    for name in [
        "llama3",
        "qwen2",
        "qwen2_moe",
        "qwen2_moe_norm_topk",
        "qwen2_reward",
        "qwen2_sharded_tf4",
        "qwen2_value",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "mistral",
        "llama_rope_linear",
        "qwen3_yarn",
    ] {
        let cfg = HfModelConfig::from_dir(fixture(name)).unwrap();
        let json = cfg.to_config_json();
        let back = HfModelConfig::from_json(&json.to_string(), Path::new("config.json")).unwrap();
        assert_eq!(back, cfg, "{name}");
    }
}

#[test]
fn qwen3_moe_reads_either_name_for_its_experts_and_has_no_shared_expert() {
    // transformers 5.17 wrote the fixture with `num_local_experts`; the Hub's Qwen3-MoE
    // checkpoints say `num_experts`. Written back, it says `num_experts` and no shared expert.
    let cfg = HfModelConfig::from_dir(fixture("qwen3_moe")).unwrap();
    assert_eq!(cfg.architecture, Architecture::Qwen3Moe);
    assert!(cfg.architecture.has_qk_norm() && !cfg.qkv_bias && !cfg.o_bias);
    let json = cfg.to_config_json();
    assert_eq!(json["architectures"][0], "Qwen3MoeForCausalLM");
    assert_eq!(json["model_type"], "qwen3_moe");
    assert_eq!(json["num_experts"], 4);
    assert!(json.get("shared_expert_intermediate_size").is_none());
    let mut map = json.as_object().unwrap().clone();
    map.remove("num_experts");
    let missing = HfModelConfig::from_json(
        &serde_json::Value::Object(map).to_string(),
        Path::new("m/config.json"),
    )
    .unwrap_err()
    .to_string();
    assert!(missing.contains("num_experts"), "{missing}");
    // Qwen2-MoE still needs its shared expert's width.
    let q2 = r#"{"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 8}"#;
    let e = HfModelConfig::from_json(q2, Path::new("m/config.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("shared_expert_intermediate_size"), "{e}");
}

/// A small Llama config.json with `patch`'s keys set (or, where `null`, removed).
fn llama_with(patch: serde_json::Value) -> String {
    let mut base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    });
    for (k, v) in patch.as_object().unwrap() {
        if v.is_null() {
            base.as_object_mut().unwrap().remove(k);
        } else {
            base[k] = v.clone();
        }
    }
    base.to_string()
}

/// The error of parsing `llama_with(patch)`, which must be refused.
fn refused_llama(patch: serde_json::Value) -> String {
    let text = llama_with(patch);
    match HfModelConfig::from_json(&text, Path::new("m/config.json")) {
        Ok(c) => panic!("accepted {text}: {c:?}"),
        Err(e) => e.to_string(),
    }
}

/// Values that parse but mean nothing (a negative epsilon, a non-positive RoPE base, a zero
/// scaling factor, no attention heads) are refused naming their field, in transformers 4's
/// spelling (`rope_theta`, `rope_scaling`) and 5's (`rope_parameters`).
#[test]
fn meaningless_numbers_are_refused_by_field_name() {
    use serde_json::json;
    // The base itself parses, so each refusal below is the patched field's.
    HfModelConfig::from_json(&llama_with(json!({})), Path::new("m/config.json")).unwrap();

    for eps in [json!(-1e-6), json!(0.0)] {
        let e = refused_llama(json!({ "rms_norm_eps": eps }));
        assert!(e.contains("`rms_norm_eps`"), "{e}");
        assert!(e.contains("m/config.json"), "names the file: {e}");
    }

    for theta in [json!(-10000.0), json!(0.0), json!(0)] {
        // transformers 4: a top-level key.
        let e = refused_llama(json!({ "rope_theta": theta.clone() }));
        assert!(e.contains("`rope_theta`") && e.contains("positive"), "{e}");
        // transformers 5: inside rope_parameters.
        let e = refused_llama(json!({
            "rope_parameters": { "rope_type": "default", "rope_theta": theta }
        }));
        assert!(e.contains("`rope_theta`") && e.contains("positive"), "{e}");
    }

    let llama3 = |factor: serde_json::Value| {
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        })
    };
    // The same scaling with a sound factor parses in both spellings.
    for key in ["rope_scaling", "rope_parameters"] {
        let mut patch = json!({ "rope_theta": 500000.0 });
        patch[key] = llama3(json!(8.0));
        let c = HfModelConfig::from_json(&llama_with(patch), Path::new("m/config.json")).unwrap();
        assert!(
            matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0),
            "{key}: {:?}",
            c.rope_scaling
        );
    }
    for factor in [json!(0.0), json!(0), json!(-2.0)] {
        // transformers 4: `rope_scaling` beside `rope_theta`.
        let e = refused_llama(json!({
            "rope_theta": 500000.0,
            "rope_scaling": llama3(factor.clone()),
        }));
        assert!(
            e.contains("`rope_scaling.factor`") && e.contains("positive"),
            "{e}"
        );
        // transformers 5: one `rope_parameters` object.
        let mut params = llama3(factor);
        params["rope_theta"] = json!(500000.0);
        let e = refused_llama(json!({ "rope_parameters": params }));
        assert!(e.contains("factor`") && e.contains("positive"), "{e}");
        assert!(!e.contains("freq_factor"), "blames the factor itself: {e}");
    }
    // transformers 4 also spells the rope type `type`.
    let mut old = llama3(json!(0.0));
    let o = old.as_object_mut().unwrap();
    o.remove("rope_type");
    o.insert("type".into(), json!("llama3"));
    let e = refused_llama(json!({ "rope_scaling": old }));
    assert!(e.contains("`rope_scaling.factor`"), "{e}");

    // No attention heads: blamed on num_attention_heads, not on the key/value heads that
    // cannot divide it.
    let e = refused_llama(json!({ "num_attention_heads": 0, "num_key_value_heads": null }));
    assert!(e.contains("`num_attention_heads`"), "{e}");
    assert!(!e.contains("num_key_value_heads"), "{e}");
    let e = refused_llama(json!({ "num_attention_heads": 0 }));
    assert!(e.contains("`num_attention_heads`"), "{e}");

    // Sizes of zero.
    for field in [
        "hidden_size",
        "vocab_size",
        "intermediate_size",
        "num_hidden_layers",
    ] {
        let mut patch = json!({});
        patch[field] = json!(0);
        let e = refused_llama(patch);
        assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
    }
    // A layer count written as a float (1e12 in JSON) is not an integer: refused by name
    // before anything is sized by it.
    let e = refused_llama(json!({ "num_hidden_layers": 1e12 }));
    assert!(e.contains("`num_hidden_layers`"), "{e}");
}

/// YaRN's settings as transformers 5 reads them: the attention factor given, or from DeepSeek's
/// `mscale` / `mscale_all_dim`, or 0.1 ln(factor) + 1; betas of 0 or null take 32 and 1;
/// `truncate` absent is true and null false; without `original_max_position_embeddings` the
/// context is `max_position_embeddings`, and without a factor it is their ratio.
#[test]
fn yarn_settings_read_as_transformers_reads_them() {
    let yarn = |scaling: serde_json::Value| {
        let json = serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 4096,
            "rope_scaling": scaling,
        });
        match HfModelConfig::from_json(&json.to_string(), Path::new("m/config.json"))
            .unwrap()
            .rope_scaling
        {
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => (
                factor,
                original_max_position_embeddings,
                (beta_fast, beta_slow),
                attention_factor,
                truncate,
            ),
            other => panic!("{other:?}"),
        }
    };
    let mscale = |factor: f64, m: f64| 0.1 * m * f64::ln(factor) + 1.0;
    let (factor, original, betas, attention, truncate) = yarn(serde_json::json!({
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 0, "beta_slow": null, "truncate": null,
    }));
    assert_eq!(
        (factor, original, betas, truncate),
        (4.0, 1024, (32.0, 1.0), false)
    );
    assert!((attention - mscale(4.0, 1.0)).abs() < 1e-12);
    let (_, _, _, attention, truncate) = yarn(serde_json::json!({
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
    }));
    assert!((attention - mscale(40.0, 1.0) / mscale(40.0, 0.707)).abs() < 1e-12);
    assert!(truncate);
    let (_, _, betas, attention, _) = yarn(serde_json::json!({
        "rope_type": "yarn", "factor": 2.0, "attention_factor": 1.5, "beta_fast": 16,
        "beta_slow": 2, "truncate": false,
    }));
    assert_eq!((betas, attention), ((16.0, 2.0), 1.5));
    let (factor, original, ..) = yarn(serde_json::json!({"rope_type": "yarn", "factor": 2.0}));
    assert_eq!((factor, original), (2.0, 4096));
    let (factor, original, ..) = yarn(serde_json::json!({
        "rope_type": "yarn", "original_max_position_embeddings": 1024,
    }));
    assert_eq!((factor, original), (4.0, 1024));
}

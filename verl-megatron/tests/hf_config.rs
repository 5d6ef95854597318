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
    let e = refused(r#""architectures": ["MistralForCausalLM"]"#);
    assert!(
        e.contains("MistralForCausalLM")
            && e.contains("Qwen2Moe")
            && e.contains("ForSequenceClassification"),
        "{e}"
    );
    let e = refused(r#""architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true"#);
    assert!(e.contains("use_sliding_window"), "{e}");
    let e = refused(
        r#""architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#,
    );
    assert!(
        e.contains("rope_scaling.rope_type") && e.contains("yarn"),
        "{e}"
    );
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
    let missing = HfModelConfig::from_dir(fixture("does_not_exist")).unwrap_err();
    assert!(matches!(missing, MegatronError::Io { .. }));
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
    ] {
        let cfg = HfModelConfig::from_dir(fixture(name)).unwrap();
        let json = cfg.to_config_json();
        let back = HfModelConfig::from_json(&json.to_string(), Path::new("config.json")).unwrap();
        assert_eq!(back, cfg, "{name}");
    }
}

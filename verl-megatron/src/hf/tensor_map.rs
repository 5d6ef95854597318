//! The Hugging Face tensor names and shapes of each architecture: one table shared by loading,
//! saving and per-tensor export to the rollout engine.

use super::config::{HeadKind, HfModelConfig, MoeRouting};
use super::latent_attention::LatentAttentionConfig;

/// One tensor a checkpoint of the architecture holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// May be absent (`lm_head.weight` of a model with tied embeddings).
    pub optional: bool,
}

fn spec(name: String, shape: Vec<usize>) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        optional: false,
    }
}

/// Every tensor of a checkpoint of `cfg`, in HF names.
pub fn hf_tensor_specs(cfg: &HfModelConfig) -> Vec<TensorSpec> {
    let (h, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut out = vec![spec("model.embed_tokens.weight".into(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push(spec(format!("{p}.input_layernorm.weight"), vec![h]));
        out.push(spec(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
        ));
        if cfg.architecture.is_gemma() {
            for norm in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                out.push(spec(format!("{p}.{norm}.weight"), vec![h]));
            }
        }
        match &cfg.mla {
            Some(mla) => latent_attention_specs(&mut out, &p, cfg, mla),
            None => {
                for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                    out.push(spec(format!("{p}.self_attn.{proj}.weight"), vec![rows, h]));
                    if cfg.qkv_bias {
                        out.push(spec(format!("{p}.self_attn.{proj}.bias"), vec![rows]));
                    }
                }
                out.push(spec(format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            }
        }
        if cfg.o_bias {
            out.push(spec(format!("{p}.self_attn.o_proj.bias"), vec![h]));
        }
        if cfg.architecture.has_qk_norm() {
            out.push(spec(format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            out.push(spec(format!("{p}.self_attn.k_norm.weight"), vec![hd]));
        }
        let mlp = |out: &mut Vec<TensorSpec>, prefix: String, inter: usize| {
            out.push(spec(format!("{prefix}.gate_proj.weight"), vec![inter, h]));
            out.push(spec(format!("{prefix}.up_proj.weight"), vec![inter, h]));
            out.push(spec(format!("{prefix}.down_proj.weight"), vec![h, inter]));
        };
        match &cfg.moe {
            Some(moe) if moe.is_moe_layer(l) => {
                out.push(spec(
                    format!("{p}.mlp.gate.weight"),
                    vec![moe.num_experts, h],
                ));
                if moe.routing != MoeRouting::Softmax {
                    out.push(spec(
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        vec![moe.num_experts],
                    ));
                }
                for e in 0..moe.num_experts {
                    mlp(
                        &mut out,
                        format!("{p}.mlp.experts.{e}"),
                        moe.moe_intermediate_size,
                    );
                }
                if moe.shared_expert_intermediate_size > 0 {
                    mlp(
                        &mut out,
                        format!("{p}.mlp.shared_expert"),
                        moe.shared_expert_intermediate_size,
                    );
                    if moe.shared_expert_gated() {
                        out.push(spec(
                            format!("{p}.mlp.shared_expert_gate.weight"),
                            vec![1, h],
                        ));
                    }
                }
            }
            _ => mlp(&mut out, format!("{p}.mlp"), cfg.intermediate_size),
        }
    }
    out.push(spec("model.norm.weight".into(), vec![h]));
    match cfg.head {
        HeadKind::CausalLm => out.push(TensorSpec {
            name: "lm_head.weight".into(),
            shape: vec![v, h],
            optional: cfg.tie_word_embeddings,
        }),
        HeadKind::TokenClassification { num_labels } => {
            out.push(spec("score.weight".into(), vec![num_labels, h]));
            out.push(spec("score.bias".into(), vec![num_labels]));
        }
        HeadKind::SequenceClassification { num_labels } => {
            out.push(spec("score.weight".into(), vec![num_labels, h]))
        }
    }
    out
}

/// Layer `p`'s multi-head latent attention (DeepSeek-V3).
fn latent_attention_specs(
    out: &mut Vec<TensorSpec>,
    p: &str,
    cfg: &HfModelConfig,
    mla: &LatentAttentionConfig,
) {
    let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let a = format!("{p}.self_attn");
    match mla.q_lora_rank {
        Some(rank) => {
            out.push(spec(format!("{a}.q_a_proj.weight"), vec![rank, h]));
            out.push(spec(format!("{a}.q_a_layernorm.weight"), vec![rank]));
            out.push(spec(
                format!("{a}.q_b_proj.weight"),
                vec![heads * mla.qk_head_dim(), rank],
            ));
        }
        None => out.push(spec(
            format!("{a}.q_proj.weight"),
            vec![heads * mla.qk_head_dim(), h],
        )),
    }
    out.push(spec(
        format!("{a}.kv_a_proj_with_mqa.weight"),
        vec![mla.kv_lora_rank + mla.qk_rope_head_dim, h],
    ));
    out.push(spec(
        format!("{a}.kv_a_layernorm.weight"),
        vec![mla.kv_lora_rank],
    ));
    out.push(spec(
        format!("{a}.kv_b_proj.weight"),
        vec![
            heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            mla.kv_lora_rank,
        ],
    ));
    out.push(spec(
        format!("{a}.o_proj.weight"),
        vec![h, heads * mla.v_head_dim],
    ));
}

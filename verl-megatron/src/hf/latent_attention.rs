//! DeepSeek-V3's multi-head latent attention settings in `config.json`: the low ranks of the
//! query and of the keys/values, each head's parts (a part without rope, a rope part shared by
//! the heads' keys, the value), the rope layout, and the softmax scale YaRN changes.
//!
//! ```
//! use std::path::Path;
//! use verl_megatron::hf::HfModelConfig;
//! let json = r#"{"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64,
//!     "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
//!     "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 8,
//!     "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
//!     "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
//!     "v_head_dim": 12}"#;
//! let cfg = HfModelConfig::from_json(json, Path::new("config.json")).unwrap();
//! let mla = cfg.mla.unwrap();
//! assert_eq!((mla.qk_head_dim(), cfg.head_dim), (16, 16));
//! assert!((mla.softmax_scale - 0.25).abs() < 1e-12);
//! ```

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::Reader;
use crate::error::MegatronError;

/// Multi-head latent attention's sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatentAttentionConfig {
    /// The query's low rank (`q_a_proj` → `q_a_layernorm` → `q_b_proj`); `None`: one
    /// `q_proj` (DeepSeek-V2-Lite's form).
    pub q_lora_rank: Option<usize>,
    /// The compressed keys and values' rank (`kv_a_proj_with_mqa` → `kv_a_layernorm` →
    /// `kv_b_proj`).
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// The rope part of each query head and the one key head all heads share.
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The checkpoint stores the rope parts as interleaved pairs (`rope_interleave`, the
    /// default): rotated as pairs, written back as evens then odds.
    pub rope_interleave: bool,
    /// The scores' scale: `qk_head_dim^-1/2`, times YaRN's `mscale²` where the rope sets
    /// `mscale_all_dim`.
    pub softmax_scale: f64,
    /// The rope's `mscale_all_dim` that scale came from (kept to write it back).
    pub mscale_all_dim: Option<f64>,
}

impl LatentAttentionConfig {
    /// A query or key head: the part without rope, then the rope part.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The attention's width: query/key heads and value heads padded to the larger.
    pub fn width(&self) -> usize {
        self.qk_head_dim().max(self.v_head_dim)
    }

    /// `config.json` keys (transformers' names).
    pub(super) fn write(&self, put: &mut impl FnMut(&str, Value)) {
        put(
            "q_lora_rank",
            self.q_lora_rank.map_or(Value::Null, Value::from),
        );
        put("kv_lora_rank", self.kv_lora_rank.into());
        put("qk_nope_head_dim", self.qk_nope_head_dim.into());
        put("qk_rope_head_dim", self.qk_rope_head_dim.into());
        put("v_head_dim", self.v_head_dim.into());
        put("rope_interleave", self.rope_interleave.into());
    }
}

/// Reads the settings of a model of `heads` heads (which `num_key_value_heads` must equal:
/// `kv_b_proj` makes every head's key and value).
pub(super) fn latent_attention_of(
    r: &Reader<'_>,
    heads: usize,
) -> Result<LatentAttentionConfig, MegatronError> {
    if let Some(kv) = r.get("num_key_value_heads") {
        if kv.as_u64() != Some(heads as u64) {
            return Err(r.err(
                "num_key_value_heads",
                format!(
                    "({kv}) must equal num_attention_heads ({heads}): latent attention makes \
                     every head's keys and values"
                ),
            ));
        }
    }
    if r.bool_or("attention_bias", false)? {
        return Err(r.err(
            "attention_bias",
            "biases on the latent attention's projections are not supported; set it to false",
        ));
    }
    // transformers' DeepseekV3Config defaults where a key is absent; a null query rank means
    // one q_proj.
    let q_lora_rank = match r.map.get("q_lora_rank") {
        None => Some(1536),
        Some(Value::Null) => None,
        Some(_) => Some(r.positive("q_lora_rank")?),
    };
    let rope = r.positive_or("qk_rope_head_dim", 64)?;
    if rope % 2 == 1 {
        return Err(r.err(
            "qk_rope_head_dim",
            format!("({rope}) must be even (rope rotates pairs)"),
        ));
    }
    let nope = r.usize_or("qk_nope_head_dim", 128)?;
    let mut mla = LatentAttentionConfig {
        q_lora_rank,
        kv_lora_rank: r.positive_or("kv_lora_rank", 512)?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: r.positive_or("v_head_dim", 128)?,
        rope_interleave: r.bool_or("rope_interleave", true)?,
        softmax_scale: 0.0,
        mscale_all_dim: None,
    };
    let (mscale_squared, all_dim) = yarn_mscale_squared(r)?;
    mla.softmax_scale = (mla.qk_head_dim() as f64).powf(-0.5) * mscale_squared;
    mla.mscale_all_dim = all_dim;
    Ok(mla)
}

/// `mscale(factor, mscale_all_dim)²` when the rope is scaled and sets `mscale_all_dim` (else 1),
/// with `mscale(s, m) = 0.1 · m · ln s + 1` for `s > 1`, as transformers' DeepSeek attention;
/// and that `mscale_all_dim`.
fn yarn_mscale_squared(r: &Reader<'_>) -> Result<(f64, Option<f64>), MegatronError> {
    // transformers reads `rope_scaling or rope_parameters`.
    let (section, rope) = match (r.get("rope_scaling"), r.get("rope_parameters")) {
        (Some(Value::Object(m)), _) => ("rope_scaling", m),
        (_, Some(Value::Object(m))) => ("rope_parameters", m),
        _ => return Ok((1.0, None)),
    };
    let rope_type = rope
        .get("rope_type")
        .or(rope.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let all_dim = r
        .f64_in(rope, "mscale_all_dim")
        .map_err(|_| r.err(&format!("{section}.mscale_all_dim"), "must be a number"))?
        .unwrap_or(0.0);
    if rope_type == "default" || all_dim == 0.0 {
        return Ok((1.0, None));
    }
    let factor = r
        .f64_in(rope, "factor")
        .map_err(|_| r.err(&format!("{section}.factor"), "must be a number"))?
        .unwrap_or(1.0);
    let m = match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * all_dim * factor.ln() + 1.0,
    };
    Ok((m * m, Some(all_dim)))
}

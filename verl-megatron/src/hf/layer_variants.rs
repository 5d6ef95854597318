//! How a decoder's layers depart from Llama's, as `config.json` says: sliding-window attention
//! on some layers (Mistral, Qwen2's `use_sliding_window`, Gemma's local layers), the MLP's
//! activation, and Gemma's attention scale, soft-caps and local rope. Read with transformers 5's
//! rules (layer types derived from the window keys when `layer_types` is absent).
//!
//! ```
//! use std::path::Path;
//! use verl_megatron::hf::HfModelConfig;
//! let json = r#"{"architectures": ["Gemma2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
//!     "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
//!     "head_dim": 8, "sliding_window": 16}"#;
//! let cfg = HfModelConfig::from_json(json, Path::new("config.json")).unwrap();
//! // Gemma 2 alternates local and global layers, local first.
//! assert_eq!(cfg.variants.sliding_window_of(0), Some(16));
//! assert_eq!(cfg.variants.sliding_window_of(1), None);
//! assert_eq!(cfg.variants.final_logit_softcapping, Some(30.0));
//! ```

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::config::{Architecture, Reader, RopeScaling};
use crate::error::MegatronError;

/// The MLP's gate activation (`hidden_act`, Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Activation {
    /// `silu`: x · σ(x) (SwiGLU).
    #[default]
    Silu,
    /// `gelu_pytorch_tanh`: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))) (GeGLU).
    GeluTanh,
}

impl Activation {
    /// transformers' name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::GeluTanh => "gelu_pytorch_tanh",
        }
    }
}

/// How a decoder's layers depart from Llama's; `Default` is not at all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct LayerVariants {
    /// Keys a sliding layer's query attends to: itself and the `window - 1` tokens before it
    /// (transformers' `0 <= q - k < window`). `None` when no layer slides.
    pub sliding_window: Option<usize>,
    /// Per layer, whether it slides; empty when none does.
    pub sliding_layers: Vec<bool>,
    pub activation: Activation,
    /// Attention scores scaled by `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2`
    /// (Gemma).
    pub query_pre_attn_scalar: Option<f64>,
    /// Attention scores soft-capped as `cap · tanh(s / cap)` after scaling, before the mask
    /// (Gemma 2).
    pub attn_logit_softcapping: Option<f64>,
    /// Logits soft-capped the same way (Gemma 2).
    pub final_logit_softcapping: Option<f64>,
    /// The sliding layers' own rope θ and scaling (Gemma 3's `rope_local_base_freq`); `None`:
    /// every layer uses the model's.
    pub local_rope: Option<Rope>,
}

impl LayerVariants {
    /// The sliding window of layer `layer` (its HF index), `None` for a full-attention layer.
    pub fn sliding_window_of(&self, layer: usize) -> Option<usize> {
        match self.sliding_layers.get(layer) {
            Some(true) => self.sliding_window,
            _ => None,
        }
    }

    /// `config.json` keys for these variants (transformers 5 names; 4 reads them too).
    pub(super) fn write(
        &self,
        architecture: Architecture,
        layers: usize,
        put: &mut impl FnMut(&str, Value),
    ) {
        let sliding = match self.sliding_layers.is_empty() {
            true => vec![false; layers],
            false => self.sliding_layers.clone(),
        };
        let types: Vec<Value> = sliding
            .iter()
            .map(|&s| {
                match s {
                    true => "sliding_attention",
                    false => "full_attention",
                }
                .into()
            })
            .collect();
        let window = self.sliding_window.map_or(Value::Null, Value::from);
        match architecture {
            Architecture::Mistral | Architecture::Mixtral => put("sliding_window", window),
            Architecture::Llama => {}
            _ => {
                let qwen = !architecture.is_gemma();
                if qwen {
                    put("use_sliding_window", self.sliding_window.is_some().into());
                }
                put("sliding_window", window);
                put("layer_types", types.into());
            }
        }
        if architecture.is_gemma() {
            put("hidden_activation", self.activation.hf_name().into());
            let opt = |v: Option<f64>| v.map_or(Value::Null, Value::from);
            put("query_pre_attn_scalar", opt(self.query_pre_attn_scalar));
            put("attn_logit_softcapping", opt(self.attn_logit_softcapping));
            put("final_logit_softcapping", opt(self.final_logit_softcapping));
        } else {
            put("hidden_act", self.activation.hf_name().into());
        }
    }
}

/// Reads the variants of `architecture` with `layers` layers.
pub(super) fn layer_variants_of(
    r: &Reader<'_>,
    architecture: Architecture,
    layers: usize,
) -> Result<LayerVariants, MegatronError> {
    let activation = activation_of(r, architecture)?;
    let window = |default: Option<usize>| -> Result<Option<usize>, MegatronError> {
        match r.map.get("sliding_window") {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(_) => Ok(Some(r.positive("sliding_window")?)),
        }
    };
    let (window, sliding_layers) = match architecture {
        Architecture::Llama => (None, Vec::new()),
        // One mask for every layer; `layer_types` is not read (transformers only warns).
        Architecture::Mistral | Architecture::Mixtral => {
            // transformers' MistralConfig defaults to a 4 096-token window, Mixtral's to none.
            let default = (architecture == Architecture::Mistral).then_some(4096);
            let w = window(default)?;
            (
                w,
                if w.is_some() {
                    vec![true; layers]
                } else {
                    Vec::new()
                },
            )
        }
        Architecture::Gemma2 | Architecture::Gemma3 => {
            let w = window(Some(4096))?;
            // Gemma 2 alternates (local first), Gemma 3 has one global layer in
            // `sliding_window_pattern` (6 by default; transformers 5 saves it with a leading
            // underscore).
            let pattern = match architecture {
                Architecture::Gemma2 => 2,
                _ => match (
                    r.get("sliding_window_pattern"),
                    r.get("_sliding_window_pattern"),
                ) {
                    (Some(_), _) => r.positive("sliding_window_pattern")?,
                    (None, Some(_)) => r.positive("_sliding_window_pattern")?,
                    (None, None) => 6,
                },
            };
            let derived = (0..layers)
                .map(|i| !(i + 1).is_multiple_of(pattern))
                .collect();
            (w, layer_types_or(r, layers, derived)?)
        }
        // The MoE variants choose their sliding layers by rules of their own (Qwen2-MoE
        // alternates below `max_window_layers`, Qwen3-MoE slides every layer); no released
        // checkpoint turns them on.
        Architecture::Qwen2Moe | Architecture::Qwen3Moe => {
            if r.bool_or("use_sliding_window", false)? && window(Some(4096))?.is_some() {
                return Err(r.err(
                    "use_sliding_window",
                    "sliding windows are not supported for Qwen2-MoE and Qwen3-MoE (their \
                     layer rules differ from Qwen2's); set it to false",
                ));
            }
            (None, Vec::new())
        }
        // Qwen2 and Qwen3: the window (when `use_sliding_window`) on the layers from
        // `max_window_layers` on.
        _ => {
            let w = match r.bool_or("use_sliding_window", false)? {
                true => window(Some(4096))?,
                false => None,
            };
            let from = r.usize_or("max_window_layers", 28)?;
            let derived = match w {
                Some(_) => (0..layers).map(|i| i >= from).collect(),
                None => Vec::new(),
            };
            (w, layer_types_or(r, layers, derived)?)
        }
    };
    let any_sliding = sliding_layers.iter().any(|&s| s);
    if any_sliding && window.is_none() {
        return Err(r.err(
            "layer_types",
            "lists sliding_attention layers but no sliding_window is set (for Qwen2, \
             use_sliding_window must be true); set sliding_window or make every layer \
             full_attention",
        ));
    }
    let float_or = |field: &str, default: Option<f64>| -> Result<Option<f64>, MegatronError> {
        let v = match r.map.get(field) {
            None => default,
            Some(Value::Null) => None,
            Some(_) => r.f64_in(r.map, field)?,
        };
        match v {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(r.err(field, format!("({x}) must be a positive number or null")))
            }
            v => Ok(v),
        }
    };
    let (query_pre_attn_scalar, attn_cap, final_cap) = match architecture {
        Architecture::Gemma2 => (
            float_or("query_pre_attn_scalar", Some(256.0))?,
            float_or("attn_logit_softcapping", Some(50.0))?,
            float_or("final_logit_softcapping", Some(30.0))?,
        ),
        // Gemma 3's attention never applies `attn_logit_softcapping` (transformers keeps the
        // key but does not pass it on), so it is not read.
        Architecture::Gemma3 => (
            float_or("query_pre_attn_scalar", Some(256.0))?,
            None,
            float_or("final_logit_softcapping", None)?,
        ),
        _ => (None, None, None),
    };
    Ok(LayerVariants {
        sliding_window: window.filter(|_| any_sliding),
        sliding_layers: if any_sliding {
            sliding_layers
        } else {
            Vec::new()
        },
        activation,
        query_pre_attn_scalar,
        attn_logit_softcapping: attn_cap,
        final_logit_softcapping: final_cap,
        local_rope: None,
    })
}

/// `layer_types` when the file lists them (one per layer), else `derived`.
fn layer_types_or(
    r: &Reader<'_>,
    layers: usize,
    derived: Vec<bool>,
) -> Result<Vec<bool>, MegatronError> {
    let Some(v) = r.get("layer_types") else {
        return Ok(derived);
    };
    let list = match v {
        Value::Array(a) if a.is_empty() => return Ok(derived),
        Value::Array(a) => a,
        other => {
            return Err(r.err(
                "layer_types",
                format!(
                    "must be a list of \"full_attention\" / \"sliding_attention\", got {other}"
                ),
            ))
        }
    };
    let sliding = list
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(r.err(
                "layer_types",
                format!(
                    "`{t}` is not supported; each entry must be \"full_attention\" or \
                     \"sliding_attention\""
                ),
            )),
        })
        .collect::<Result<Vec<bool>, _>>()?;
    // Every layer full: nothing slides, whatever the count (the checkpoint's layers are checked
    // against num_hidden_layers elsewhere).
    if !sliding.contains(&true) {
        return Ok(Vec::new());
    }
    if sliding.len() != layers {
        return Err(r.err(
            "layer_types",
            format!(
                "lists {} layers; num_hidden_layers is {layers}",
                sliding.len()
            ),
        ));
    }
    Ok(sliding)
}

/// The MLP activation: Gemma's `hidden_activation` (its `hidden_act` is not read), else
/// `hidden_act`.
fn activation_of(r: &Reader<'_>, architecture: Architecture) -> Result<Activation, MegatronError> {
    let (field, default) = match architecture.is_gemma() {
        true => ("hidden_activation", "gelu_pytorch_tanh"),
        false => ("hidden_act", "silu"),
    };
    match r.get(field) {
        None => Ok(parse_activation(default).expect("a known default")),
        Some(v) => v.as_str().and_then(parse_activation).ok_or_else(|| {
            r.err(
                field,
                format!("{v} is not supported; supported: \"silu\", \"gelu_pytorch_tanh\""),
            )
        }),
    }
}

fn parse_activation(name: &str) -> Option<Activation> {
    match name {
        "silu" | "swish" => Some(Activation::Silu),
        "gelu_pytorch_tanh" => Some(Activation::GeluTanh),
        _ => None,
    }
}

/// One rope: θ and its scaling.
pub type Rope = (f64, RopeScaling);

/// Gemma 3's two ropes: `(global θ, global scaling)` and the local layers' `(θ, scaling)`, from
/// transformers 5's `rope_parameters` keyed by layer type, or 4's `rope_theta` (10⁶ by default),
/// `rope_local_base_freq` (10⁴) and `rope_scaling` (global layers only).
pub(super) fn gemma3_ropes(
    r: &Reader<'_>,
    parse: impl Fn(&Map<String, Value>, &str, f64) -> Result<Rope, MegatronError>,
) -> Result<(Rope, Rope), MegatronError> {
    let empty = Map::new();
    if let Some(Value::Object(by_type)) = r.get("rope_parameters") {
        if by_type.contains_key("full_attention") || by_type.contains_key("sliding_attention") {
            let part = |key: &str| -> Result<&Map<String, Value>, MegatronError> {
                match by_type.get(key) {
                    None | Some(Value::Null) => Ok(&empty),
                    Some(Value::Object(m)) => Ok(m),
                    Some(v) => Err(r.err(
                        &format!("rope_parameters.{key}"),
                        format!("must be an object, got {v}"),
                    )),
                }
            };
            let global = parse(
                part("full_attention")?,
                "rope_parameters.full_attention",
                1e6,
            )?;
            let local = parse(
                part("sliding_attention")?,
                "rope_parameters.sliding_attention",
                1e4,
            )?;
            return Ok((global, local));
        }
    }
    let scaling = match r.get("rope_scaling").or(r.get("rope_parameters")) {
        Some(Value::Object(m)) => m.clone(),
        _ => Map::new(),
    };
    let mut global_map = scaling;
    if let Some(theta) = r.get("rope_theta") {
        global_map
            .entry("rope_theta")
            .or_insert_with(|| theta.clone());
    }
    let global = parse(&global_map, "rope_scaling", 1e6)?;
    let mut local_map = Map::new();
    if let Some(theta) = r.get("rope_local_base_freq") {
        local_map.insert("rope_theta".into(), theta.clone());
    }
    let local = parse(&local_map, "rope_local_base_freq", 1e4)?;
    Ok((global, local))
}

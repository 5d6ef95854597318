//! `config.json` of a Hugging Face decoder, in either dialect:
//! transformers 4 (`rope_theta`, `rope_scaling`, `torch_dtype`) or transformers 5
//! (`rope_parameters`, `dtype`). Fields whose values verl-rs cannot honour are refused by name.
//!
//! ```no_run
//! use verl_megatron::hf::HfModelConfig;
//! let cfg = HfModelConfig::from_dir("Qwen2.5-0.5B-Instruct")?;
//! println!("{:?}: {} layers, head_dim {}", cfg.architecture, cfg.num_hidden_layers, cfg.head_dim);
//! # Ok::<(), verl_megatron::MegatronError>(())
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use verl_core::topology::{ModelDims, ParallelConfig};

use super::latent_attention::{latent_attention_of, LatentAttentionConfig};
use super::layer_variants::{gemma3_ropes, layer_variants_of, LayerVariants};
use crate::error::MegatronError;

/// The largest size `config.json` may give (2^24).
const MAX_SIZE: u64 = 1 << 24;
/// The decoder families verl-rs implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// `Qwen2ForCausalLM`: q/k/v biases.
    Qwen2,
    /// `LlamaForCausalLM`: optional attention biases, Llama-3 rope scaling.
    Llama,
    /// `Qwen3ForCausalLM`: RMSNorm on q and k per head, explicit head_dim.
    Qwen3,
    /// `Qwen2MoeForCausalLM`: top-k routed experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention (RMSNorm on q and k per head) and top-k routed
    /// experts without a shared expert.
    Qwen3Moe,
    /// `MistralForCausalLM`: Llama's layers without biases, an explicit head_dim (Mistral-Nemo),
    /// no sliding window (v0.2 on).
    Mistral,
    /// `MixtralForCausalLM`: Llama's attention and in every layer `num_local_experts` experts
    /// of `intermediate_size`, top-k weights renormalised, no shared expert (its tensors are
    /// named `block_sparse_moe.*` and `w1`/`w3`/`w2`: `hf::names`).
    Mixtral,
    /// `Gemma2ForCausalLM`: embeddings scaled by √hidden, zero-centred RMSNorms (scale 1 + w)
    /// before and after both sublayers, a GeGLU MLP, local (sliding-window) and global layers
    /// alternating, attention scores scaled by `query_pre_attn_scalar` and soft-capped, logits
    /// soft-capped.
    Gemma2,
    /// `Gemma3ForCausalLM` (text): Gemma 2's layers with RMSNorm on q and k per head, one
    /// global layer in six, the local layers with a rope of their own, no attention soft-cap.
    Gemma3,
    /// `DeepseekV3ForCausalLM`: multi-head latent attention (low-rank queries and keys/values,
    /// a decoupled rope part shared by the heads), MoE with sigmoid, group-limited routing and
    /// shared experts after `first_k_dense_replace` dense layers.
    DeepseekV3,
}

/// What sits on top of the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HeadKind {
    /// `…ForCausalLM`: next-token logits (the actor, reference and rollout).
    CausalLm,
    /// `…ForTokenClassification`: a score per token, `score.weight` + `score.bias` (the critic's
    /// value head, with one label).
    TokenClassification { num_labels: usize },
    /// `…ForSequenceClassification`: a score per sequence read at its last token, `score.weight`
    /// (a reward model's score head).
    SequenceClassification { num_labels: usize },
}

impl HeadKind {
    /// What a score head makes of the model (`None` for a causal LM): the words errors use
    /// where a causal LM is needed (the actor, `verl generate`).
    ///
    /// ```
    /// use verl_megatron::hf::HeadKind;
    /// assert_eq!(HeadKind::CausalLm.score_head(), None);
    /// assert!(HeadKind::TokenClassification { num_labels: 1 }.score_head().unwrap().contains("value"));
    /// ```
    pub fn score_head(&self) -> Option<&'static str> {
        match self {
            HeadKind::CausalLm => None,
            HeadKind::TokenClassification { .. } => Some("a value model (a per-token score head)"),
            HeadKind::SequenceClassification { .. } => {
                Some("a reward model (a sequence score head)")
            }
        }
    }
}

impl Architecture {
    const SUPPORTED: &'static str = "Qwen2, Llama, Qwen3, Qwen2Moe, Qwen3Moe, Mistral, Mixtral, Gemma2, Gemma3 and DeepseekV3, each ForCausalLM, ForTokenClassification or ForSequenceClassification";

    /// Whether attention normalises q and k per head (Qwen3's `q_norm` / `k_norm`).
    ///
    /// ```
    /// use verl_megatron::hf::Architecture;
    /// assert!(Architecture::Qwen3Moe.has_qk_norm() && !Architecture::Qwen2Moe.has_qk_norm());
    /// ```
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Self::Qwen3 | Self::Qwen3Moe | Self::Gemma3)
    }

    /// Gemma's layers: embeddings × √hidden, RMSNorm weights stored zero-centred (the scale is
    /// 1 + w), and the attention and MLP outputs normed before the residual add
    /// (`post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
    ///
    /// ```
    /// use verl_megatron::hf::Architecture;
    /// assert!(Architecture::Gemma3.is_gemma() && !Architecture::Llama.is_gemma());
    /// ```
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    /// Whether the MLP is a mixture of experts.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Self::Qwen2Moe | Self::Qwen3Moe | Self::Mixtral | Self::DeepseekV3
        )
    }

    /// The family and the head kind's suffix of an `architectures` entry.
    fn from_hf(name: &str) -> Option<(Self, &'static str)> {
        let suffixes = [
            "ForCausalLM",
            "ForTokenClassification",
            "ForSequenceClassification",
        ];
        let suffix = suffixes.into_iter().find(|s| name.ends_with(s))?;
        let family = match &name[..name.len() - suffix.len()] {
            "Qwen2" => Self::Qwen2,
            "Llama" => Self::Llama,
            "Qwen3" => Self::Qwen3,
            "Qwen2Moe" => Self::Qwen2Moe,
            "Qwen3Moe" => Self::Qwen3Moe,
            "Mistral" => Self::Mistral,
            "Mixtral" => Self::Mixtral,
            "Gemma2" => Self::Gemma2,
            "Gemma3" => Self::Gemma3,
            "DeepseekV3" => Self::DeepseekV3,
            _ => return None,
        };
        Some((family, suffix))
    }
}

/// Rotary-embedding frequency scaling (transformers' `rope_type`s that do not depend on the
/// sequence length: `dynamic` and `longrope` are refused).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// YaRN: frequencies blended between interpolated (`/ factor`) and original along a ramp
    /// over the dimensions whose wavelengths fit `original_max_position_embeddings` between
    /// `beta_slow` and `beta_fast` rotations (ends rounded outwards when `truncate`); cos and sin
    /// scaled by `attention_factor` (so attention scores by its square).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
    /// Llama 3.1's scaling of low frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

/// The checkpoint's storage dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

/// The model hyper-parameters verl-rs reads from `config.json`, normalised across dialects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfModelConfig {
    pub architecture: Architecture,
    pub head: HeadKind,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (always for Qwen2 and Qwen2-MoE).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    pub dtype: WeightDtype,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral).
    pub moe: Option<MoeConfig>,
    /// Sliding windows, the MLP's activation, Gemma's scales and soft-caps.
    #[serde(default)]
    pub variants: LayerVariants,
    /// Multi-head latent attention (DeepSeek-V3); `head_dim` is then the attention's width,
    /// the larger of the query/key heads and the value heads.
    #[serde(default)]
    pub mla: Option<LatentAttentionConfig>,
}

/// The expert settings of Qwen2-MoE, Qwen3-MoE and Mixtral (whose `num_local_experts` and
/// `intermediate_size` are read as `num_experts` and `moe_intermediate_size`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// The shared expert's width (Qwen2-MoE); 0: no shared expert (Qwen3-MoE).
    pub shared_expert_intermediate_size: usize,
    /// Renormalise the top-k routing weights to sum to 1.
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// How the router turns its logits into expert weights.
    #[serde(default)]
    pub routing: MoeRouting,
}

/// A router's scores and choice.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub enum MoeRouting {
    /// Softmax over the experts, the top-k of it (Qwen-MoE, Mixtral).
    #[default]
    Softmax,
    /// DeepSeek-V3's: sigmoid scores; experts chosen by the scores plus a selection bias
    /// (`e_score_correction_bias`) among the `topk_group` groups (of `n_group`) whose two best
    /// biased scores sum highest; weights the unbiased scores (renormalised with
    /// `norm_topk_prob`) times `routed_scaling_factor`.
    SigmoidGroups {
        n_group: usize,
        topk_group: usize,
        routed_scaling_factor: f64,
    },
}

impl HfModelConfig {
    /// Refuses a tensor-parallel size this model cannot be split by (the layout checks of
    /// `ParallelConfig::validate_for_model`, plus Qwen2-MoE's shared expert), naming the model
    /// field that does not divide and the sizes that would.
    pub fn check_tensor_parallel(&self, tp: usize) -> Result<(), MegatronError> {
        self.check_layout(tp, 1, tp)
    }

    /// [`Self::check_tensor_parallel`] with expert parallelism: `num_experts` split over `ep`
    /// ranks and each expert's `moe_intermediate_size` over `etp`.
    pub fn check_layout(&self, tp: usize, ep: usize, etp: usize) -> Result<(), MegatronError> {
        let field = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size";
        let refuse = |message: String| MegatronError::Setting {
            field: field.into(),
            message,
        };
        if tp == 0 {
            return Err(refuse("must be at least 1".into()));
        }
        let layout = ParallelConfig {
            tp,
            ep,
            etp: Some(etp),
            ..ParallelConfig::default()
        };
        layout
            .validate_for_model(&self.model_dims())
            .map_err(|e| refuse(e.to_string()))?;
        if let Some(moe) = &self.moe {
            let size = moe.shared_expert_intermediate_size;
            if !size.is_multiple_of(tp) {
                return Err(refuse(format!(
                    "{tp} does not divide shared_expert_intermediate_size ({size})"
                )));
            }
        }
        Ok(())
    }
}

impl MoeConfig {
    /// Whether the shared expert's output is scaled by a sigmoid gate of its own (Qwen2-MoE;
    /// DeepSeek's shared experts are not gated).
    pub fn shared_expert_gated(&self) -> bool {
        self.shared_expert_intermediate_size > 0 && self.routing == MoeRouting::Softmax
    }

    /// Whether decoder layer `layer` uses experts (else a dense MLP), as transformers decides.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

pub(super) struct Reader<'a> {
    pub(super) path: &'a Path,
    pub(super) map: &'a Map<String, Value>,
}

impl Reader<'_> {
    pub(super) fn err(&self, field: &str, message: impl Into<String>) -> MegatronError {
        MegatronError::Config {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }
    pub(super) fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }
    /// A size that must be at least 1.
    pub(super) fn positive(&self, field: &str) -> Result<usize, MegatronError> {
        match self.usize(field)? {
            0 => Err(self.err(field, "must be at least 1")),
            v => Ok(v),
        }
    }
    /// A size that must be at least 1 where given, `default` where absent.
    pub(super) fn positive_or(&self, field: &str, default: usize) -> Result<usize, MegatronError> {
        match self.get(field) {
            None => Ok(default),
            Some(_) => self.positive(field),
        }
    }
    pub(super) fn usize(&self, field: &str) -> Result<usize, MegatronError> {
        let v = self
            .get(field)
            .ok_or_else(|| self.err(field, "is required"))?;
        let x = v
            .as_u64()
            .ok_or_else(|| self.err(field, format!("must be a non-negative integer, got {v}")))?;
        // Beyond any model (the largest vocabularies and context lengths are ~2^20), and low
        // enough that products of a tensor's dimensions cannot overflow.
        if x > MAX_SIZE {
            return Err(self.err(
                field,
                format!("({x}) is beyond any model (at most {MAX_SIZE})"),
            ));
        }
        Ok(x as usize)
    }
    pub(super) fn usize_or(&self, field: &str, default: usize) -> Result<usize, MegatronError> {
        if self.get(field).is_some() {
            self.usize(field)
        } else {
            Ok(default)
        }
    }
    pub(super) fn f64_in(
        &self,
        map: &Map<String, Value>,
        field: &str,
    ) -> Result<Option<f64>, MegatronError> {
        match map.get(field).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("must be a number, got {v}"))),
        }
    }
    pub(super) fn bool_or(&self, field: &str, default: bool) -> Result<bool, MegatronError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("must be true or false, got {v}"))),
        }
    }
    fn token_ids(&self, field: &str) -> Result<Vec<u32>, MegatronError> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or_else(|| self.err(field, "must hold token ids (below 2^32)"))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(|x| vec![x])
                .ok_or_else(|| {
                    self.err(
                        field,
                        format!("must be a token id or a list of them, got {v}"),
                    )
                }),
        }
    }
}

/// The sizes of a Qwen2-architecture model built from scratch ([`HfModelConfig::qwen2`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Qwen2Dims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub max_position_embeddings: usize,
}

impl HfModelConfig {
    /// A Qwen2 causal-LM config of the given sizes (tied embeddings, q/k/v bias, RoPE θ = 10⁶,
    /// as Qwen2's small models), for models trained from scratch and benchmarks.
    ///
    /// ```
    /// use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
    /// let cfg = HfModelConfig::qwen2(Qwen2Dims {
    ///     vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
    ///     num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128,
    /// });
    /// assert_eq!(cfg.head_dim, 8);
    /// ```
    pub fn qwen2(d: Qwen2Dims) -> Self {
        Self {
            architecture: Architecture::Qwen2,
            head: HeadKind::CausalLm,
            vocab_size: d.vocab_size,
            hidden_size: d.hidden_size,
            intermediate_size: d.intermediate_size,
            num_hidden_layers: d.num_hidden_layers,
            num_attention_heads: d.num_attention_heads,
            num_key_value_heads: d.num_key_value_heads,
            head_dim: d.hidden_size / d.num_attention_heads.max(1),
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: d.max_position_embeddings,
            tie_word_embeddings: true,
            qkv_bias: true,
            o_bias: false,
            dtype: WeightDtype::F32,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            moe: None,
            variants: LayerVariants::default(),
            mla: None,
        }
    }

    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, MegatronError> {
        let path = dir.as_ref().join("config.json");
        let text = verl_core::files::read_text(&path).map_err(|e| MegatronError::Io {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Self::from_json(&text, &path)
    }

    /// Parses config JSON; `path` names the file in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, MegatronError> {
        let value: Value = serde_json::from_str(text).map_err(|e| MegatronError::Io {
            path: path.into(),
            message: format!("not valid JSON: {e}"),
        })?;
        let map = value.as_object().ok_or_else(|| MegatronError::Io {
            path: path.into(),
            message: "the top level must be an object".into(),
        })?;
        let r = Reader { path, map };
        let (architecture, head) = architecture_of(&r)?;
        refuse_unsupported_layers(&r)?;
        if architecture == Architecture::Mixtral {
            refuse_router_jitter(&r)?;
        }
        let (hidden_size, num_attention_heads, num_key_value_heads, head_dim) =
            attention_sizes(&r, architecture)?;
        let num_hidden_layers = r.positive("num_hidden_layers")?;
        let mut variants = layer_variants_of(&r, architecture, num_hidden_layers)?;
        let (rope_theta, rope_scaling) = match architecture {
            Architecture::Gemma3 => {
                let parse = |m: &Map<String, Value>, section: &str, theta: f64| {
                    parse_rope(&r, m, section, theta)
                };
                let (global, local) = gemma3_ropes(&r, parse)?;
                variants.local_rope = Some(local);
                global
            }
            _ => rope_of(&r, architecture)?,
        };
        let dtype = weight_dtype_of(&r)?;
        let attention_bias = r.bool_or("attention_bias", false)?;
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 | Architecture::Qwen2Moe => (true, false),
            Architecture::Llama | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                (attention_bias, attention_bias)
            }
            Architecture::Mistral | Architecture::Mixtral => (false, false),
            Architecture::Gemma2 | Architecture::Gemma3 => (attention_bias, attention_bias),
            Architecture::DeepseekV3 => (false, false),
        };

        let moe = moe_of(&r, architecture, num_hidden_layers)?;
        let mla = match architecture {
            Architecture::DeepseekV3 => Some(latent_attention_of(&r, num_attention_heads)?),
            _ => None,
        };
        // The attention's width: the larger of MLA's query/key and value heads.
        let head_dim = mla.as_ref().map_or(head_dim, |m| m.width());
        // transformers' defaults where the key is absent: Mixtral's 1e-5, the others' 1e-6.
        let default_eps = match architecture {
            Architecture::Mixtral => 1e-5,
            _ => 1e-6,
        };
        let rms_norm_eps = r.f64_in(map, "rms_norm_eps")?.unwrap_or(default_eps);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(r.err(
                "rms_norm_eps",
                format!("({rms_norm_eps}) must be a small positive number, e.g. 1e-6"),
            ));
        }
        let bos_token_id = r.token_ids("bos_token_id")?.first().copied();
        Ok(Self {
            architecture,
            head,
            vocab_size: r.positive("vocab_size")?,
            hidden_size,
            intermediate_size: r.positive("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: r.usize_or("max_position_embeddings", 4096)?,
            // Gemma's configs tie by default.
            tie_word_embeddings: r.bool_or("tie_word_embeddings", architecture.is_gemma())?,
            qkv_bias,
            o_bias,
            dtype,
            bos_token_id,
            eos_token_ids: r.token_ids("eos_token_id")?,
            moe,
            variants,
            mla,
        })
    }

    /// `config.json` for this model in transformers 4 keys (`rope_theta`, `rope_scaling`,
    /// `torch_dtype`), which transformers 5 reads too, so a model trained from scratch saves
    /// as a loadable Hugging Face directory. [`Self::from_json`] reads it back unchanged.
    ///
    /// ```
    /// use std::path::Path;
    /// use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
    /// let cfg = HfModelConfig::qwen2(Qwen2Dims {
    ///     vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
    ///     num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 128,
    /// });
    /// let json = cfg.to_config_json();
    /// assert_eq!(json["architectures"][0], "Qwen2ForCausalLM");
    /// let back = HfModelConfig::from_json(&json.to_string(), Path::new("config.json")).unwrap();
    /// assert_eq!(back, cfg);
    /// ```
    pub fn to_config_json(&self) -> Value {
        let (family, model_type) = match self.architecture {
            Architecture::Qwen2 => ("Qwen2", "qwen2"),
            Architecture::Llama => ("Llama", "llama"),
            Architecture::Qwen3 => ("Qwen3", "qwen3"),
            Architecture::Qwen2Moe => ("Qwen2Moe", "qwen2_moe"),
            Architecture::Qwen3Moe => ("Qwen3Moe", "qwen3_moe"),
            Architecture::Mistral => ("Mistral", "mistral"),
            Architecture::Mixtral => ("Mixtral", "mixtral"),
            Architecture::Gemma2 => ("Gemma2", "gemma2"),
            Architecture::Gemma3 => ("Gemma3", "gemma3_text"),
            Architecture::DeepseekV3 => ("DeepseekV3", "deepseek_v3"),
        };
        let (suffix, num_labels) = match self.head {
            HeadKind::CausalLm => ("ForCausalLM", None),
            HeadKind::TokenClassification { num_labels } => {
                ("ForTokenClassification", Some(num_labels))
            }
            HeadKind::SequenceClassification { num_labels } => {
                ("ForSequenceClassification", Some(num_labels))
            }
        };
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put(
            "architectures",
            Value::from(vec![format!("{family}{suffix}")]),
        );
        put("model_type", model_type.into());
        put("vocab_size", self.vocab_size.into());
        put("hidden_size", self.hidden_size.into());
        put("intermediate_size", self.intermediate_size.into());
        put("num_hidden_layers", self.num_hidden_layers.into());
        put("num_attention_heads", self.num_attention_heads.into());
        put("num_key_value_heads", self.num_key_value_heads.into());
        put("head_dim", self.head_dim.into());
        put("rms_norm_eps", self.rms_norm_eps.into());
        put("rope_theta", self.rope_theta.into());
        let mut scaling = rope_scaling_json(&self.rope_scaling);
        // DeepSeek's softmax scale follows the rope's `mscale_all_dim`.
        if let (Some(all), Value::Object(m)) = (
            self.mla.as_ref().and_then(|m| m.mscale_all_dim),
            &mut scaling,
        ) {
            m.insert("mscale_all_dim".into(), all.into());
        }
        put("rope_scaling", scaling);
        if let Some((theta, local)) = &self.variants.local_rope {
            match local {
                RopeScaling::Default => put("rope_local_base_freq", (*theta).into()),
                // Only transformers 5's form says a local rope's scaling.
                _ => {
                    let with_theta = |theta: f64, scaling: &RopeScaling| {
                        let mut m = match rope_scaling_json(scaling) {
                            Value::Object(m) => m,
                            _ => Map::from_iter([("rope_type".into(), "default".into())]),
                        };
                        m.insert("rope_theta".into(), theta.into());
                        Value::Object(m)
                    };
                    put(
                        "rope_parameters",
                        serde_json::json!({
                            "full_attention": with_theta(self.rope_theta, &self.rope_scaling),
                            "sliding_attention": with_theta(*theta, local),
                        }),
                    );
                }
            }
        }
        put(
            "max_position_embeddings",
            self.max_position_embeddings.into(),
        );
        put("tie_word_embeddings", self.tie_word_embeddings.into());
        if matches!(
            self.architecture,
            Architecture::Llama
                | Architecture::Qwen3
                | Architecture::Qwen3Moe
                | Architecture::Gemma2
                | Architecture::Gemma3
        ) {
            put("attention_bias", self.qkv_bias.into());
        }
        put(
            "torch_dtype",
            match self.dtype {
                WeightDtype::F32 => "float32",
                WeightDtype::F16 => "float16",
                WeightDtype::BF16 => "bfloat16",
            }
            .into(),
        );
        self.variants
            .write(self.architecture, self.num_hidden_layers, &mut put);
        if let Some(n) = num_labels {
            put("num_labels", n.into());
        }
        if let Some(b) = self.bos_token_id {
            put("bos_token_id", b.into());
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => put("eos_token_id", (*one).into()),
            many => put("eos_token_id", many.to_vec().into()),
        }
        if let Some(mla) = &self.mla {
            mla.write(&mut put);
            // transformers' own derivation: the rope part's width.
            put("head_dim", mla.qk_rope_head_dim.into());
        }
        if let (Some(moe), Architecture::DeepseekV3) = (&self.moe, self.architecture) {
            put("n_routed_experts", moe.num_experts.into());
            put("num_experts_per_tok", moe.num_experts_per_tok.into());
            put("moe_intermediate_size", moe.moe_intermediate_size.into());
            put(
                "n_shared_experts",
                (moe.shared_expert_intermediate_size / moe.moe_intermediate_size.max(1)).into(),
            );
            put("norm_topk_prob", moe.norm_topk_prob.into());
            put("first_k_dense_replace", moe.mlp_only_layers.len().into());
            if let MoeRouting::SigmoidGroups {
                n_group,
                topk_group,
                routed_scaling_factor,
            } = moe.routing
            {
                put("n_group", n_group.into());
                put("topk_group", topk_group.into());
                put("routed_scaling_factor", routed_scaling_factor.into());
            }
        } else if let (Some(moe), Architecture::Mixtral) = (&self.moe, self.architecture) {
            // Mixtral's own keys: its experts are `intermediate_size` wide.
            put("num_local_experts", moe.num_experts.into());
            put("num_experts_per_tok", moe.num_experts_per_tok.into());
        } else if let Some(moe) = &self.moe {
            put("num_experts", moe.num_experts.into());
            put("num_experts_per_tok", moe.num_experts_per_tok.into());
            put("moe_intermediate_size", moe.moe_intermediate_size.into());
            if self.architecture == Architecture::Qwen2Moe {
                put(
                    "shared_expert_intermediate_size",
                    moe.shared_expert_intermediate_size.into(),
                );
            }
            put("norm_topk_prob", moe.norm_topk_prob.into());
            put("decoder_sparse_step", moe.decoder_sparse_step.into());
            put("mlp_only_layers", moe.mlp_only_layers.clone().into());
        }
        Value::Object(m)
    }

    /// The sizes a parallel layout must divide (for `ParallelConfig::validate_for_model`).
    pub fn model_dims(&self) -> ModelDims {
        ModelDims {
            num_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            intermediate_size: self.intermediate_size,
            vocab_size: self.vocab_size,
            num_experts: self.moe.as_ref().map(|m| m.num_experts),
            moe_intermediate_size: self.moe.as_ref().map(|m| m.moe_intermediate_size),
            expert_keys: match self.architecture {
                Architecture::Mixtral => ("num_local_experts", "intermediate_size"),
                _ => verl_core::topology::QWEN_MOE_KEYS,
            },
        }
    }
}

/// transformers 4's `rope_scaling` for `scaling` (null for plain rope).
fn rope_scaling_json(scaling: &RopeScaling) -> Value {
    match *scaling {
        RopeScaling::Default => Value::Null,
        RopeScaling::Linear { factor } => {
            serde_json::json!({ "rope_type": "linear", "factor": factor })
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        } => serde_json::json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "attention_factor": attention_factor,
            "truncate": truncate,
        }),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => serde_json::json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    }
}

/// The architecture and the head its `architectures` entry names (`…ForCausalLM`,
/// `…ForTokenClassification` with `num_labels`, `…ForSequenceClassification`).
fn architecture_of(r: &Reader<'_>) -> Result<(Architecture, HeadKind), MegatronError> {
    let path = r.path;
    let arch_name = match r.get("architectures") {
        Some(Value::Array(a)) if a.len() == 1 => a[0].as_str().unwrap_or_default().to_string(),
        Some(v) => {
            return Err(r.err(
                "architectures",
                format!("must list exactly one architecture, got {v}"),
            ))
        }
        None => return Err(r.err("architectures", "is required (e.g. [\"Qwen2ForCausalLM\"])")),
    };
    let (architecture, suffix) = Architecture::from_hf(&arch_name).ok_or_else(|| {
        MegatronError::UnsupportedArchitecture {
            path: PathBuf::from(path),
            found: arch_name.clone(),
            supported: Architecture::SUPPORTED.into(),
        }
    })?;

    // transformers' default is 2 labels; `id2label` or `num_labels` say otherwise.
    let num_labels = match (r.get("num_labels"), r.get("id2label")) {
        (Some(_), _) => r.usize("num_labels")?,
        (None, Some(Value::Object(m))) => m.len(),
        _ => 2,
    };
    let head = match suffix {
        "ForTokenClassification" => HeadKind::TokenClassification { num_labels },
        "ForSequenceClassification" => HeadKind::SequenceClassification { num_labels },
        _ => HeadKind::CausalLm,
    };
    Ok((architecture, head))
}

/// Refuses the layer variants the decoder does not implement (MLP biases); the activation and
/// sliding windows are read by [`layer_variants_of`].
fn refuse_unsupported_layers(r: &Reader<'_>) -> Result<(), MegatronError> {
    if r.bool_or("mlp_bias", false)? {
        return Err(r.err("mlp_bias", "MLP biases are not supported"));
    }
    Ok(())
}

/// Mixtral's router jitter (training noise on the router's logits), which the decoder does not
/// implement.
fn refuse_router_jitter(r: &Reader<'_>) -> Result<(), MegatronError> {
    if let Some(jitter) = r.f64_in(r.map, "router_jitter_noise")? {
        if jitter != 0.0 {
            return Err(r.err(
                "router_jitter_noise",
                format!("({jitter}) router jitter is not supported; set it to 0"),
            ));
        }
    }
    Ok(())
}

/// `(hidden_size, num_attention_heads, num_key_value_heads, head_dim)`, checked.
fn attention_sizes(
    r: &Reader<'_>,
    architecture: Architecture,
) -> Result<(usize, usize, usize, usize), MegatronError> {
    let hidden_size = r.usize("hidden_size")?;
    let num_attention_heads = r.usize("num_attention_heads")?;
    for (field, v) in [
        ("hidden_size", hidden_size),
        ("num_attention_heads", num_attention_heads),
    ] {
        if v == 0 {
            return Err(r.err(field, "must be at least 1"));
        }
    }
    let num_key_value_heads = r.usize_or("num_key_value_heads", num_attention_heads)?;
    if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
        return Err(r.err(
            "num_key_value_heads",
            format!(
                "({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})"
            ),
        ));
    }
    // Gemma's configs default to heads of 256 (its products need not match hidden_size).
    let head_dim = match architecture.is_gemma() {
        true => r.usize_or("head_dim", 256)?,
        false => r.usize_or("head_dim", hidden_size / num_attention_heads)?,
    };
    if head_dim == 0 || head_dim % 2 == 1 {
        return Err(r.err(
            "head_dim",
            format!("({head_dim}) must be even and at least 2 (rope rotates pairs)"),
        ));
    }
    Ok((
        hidden_size,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
    ))
}

/// `rope_theta` and the rope scaling, from either dialect's keys. YaRN follows transformers 5
/// (`factor` as given; 4.x replaced it by `max_position_embeddings /
/// original_max_position_embeddings` whenever the latter was set).
fn rope_of(
    r: &Reader<'_>,
    architecture: Architecture,
) -> Result<(f64, RopeScaling), MegatronError> {
    // transformers 5 puts rope settings in `rope_parameters`; 4 in `rope_theta` + `rope_scaling`.
    // Errors name the key the file used.
    // transformers reads `rope_scaling or rope_parameters`: a set `rope_scaling` wins.
    let section = match (r.get("rope_scaling"), r.get("rope_parameters")) {
        (None, Some(_)) => "rope_parameters",
        _ => "rope_scaling",
    };
    let rope_map = match (r.get("rope_scaling"), r.get("rope_parameters")) {
        (Some(Value::Object(m)), _) => m.clone(),
        (Some(v), _) => {
            return Err(r.err(
                "rope_scaling",
                format!("must be an object or null, got {v}"),
            ))
        }
        (None, Some(Value::Object(m))) => m.clone(),
        (None, Some(v)) => {
            return Err(r.err("rope_parameters", format!("must be an object, got {v}")))
        }
        (None, None) => Map::new(),
    };
    let mut rope_map = rope_map;
    let unset = rope_map.get("rope_theta").is_none_or(Value::is_null);
    if let (true, Some(theta)) = (unset, r.get("rope_theta")) {
        rope_map.insert("rope_theta".into(), theta.clone());
    }
    // transformers' defaults where the key is absent: Mixtral's 1e6, the others' 1e4.
    let default_theta = match architecture {
        Architecture::Mixtral => 1e6,
        _ => 1e4,
    };
    parse_rope(r, &rope_map, section, default_theta)
}

/// One rope's θ and scaling from its settings `rope_map` (named `section` in errors), θ
/// `default_theta` where absent.
pub(super) fn parse_rope(
    r: &Reader<'_>,
    rope_map: &Map<String, Value>,
    section: &str,
    default_theta: f64,
) -> Result<(f64, RopeScaling), MegatronError> {
    let in_section = |e: MegatronError| match e {
        MegatronError::Config {
            path,
            field,
            message,
        } => MegatronError::Config {
            path,
            field: format!("{section}.{field}"),
            message,
        },
        other => other,
    };
    let top_level = matches!(section, "rope_parameters" | "rope_scaling");
    let theta_field = match top_level {
        true => "rope_theta".to_string(),
        false => format!("{section}.rope_theta"),
    };
    let rope_theta = r
        .f64_in(rope_map, "rope_theta")
        .map_err(|e| match top_level {
            true => e,
            false => in_section(e),
        })?
        .unwrap_or(default_theta);
    if !(rope_theta.is_finite() && rope_theta > 0.0) {
        return Err(r.err(
            &theta_field,
            format!("({rope_theta}) must be a positive number, e.g. 10000 or 1000000"),
        ));
    }
    let rope_type = rope_map
        .get("rope_type")
        .or(rope_map.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    // An optional positive setting of the scaling (transformers treats 0 and null as unset).
    let optional = |f: &str| -> Result<Option<f64>, MegatronError> {
        match r.f64_in(rope_map, f).map_err(in_section)? {
            None => Ok(None),
            Some(0.0) => Ok(None),
            Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
            Some(v) => Err(r.err(
                &format!("{section}.{f}"),
                format!("({v}) must be a positive number"),
            )),
        }
    };
    let factor = || -> Result<f64, MegatronError> {
        optional("factor")?.ok_or_else(|| {
            r.err(
                &format!("{section}.factor"),
                format!("is required for {rope_type} rope scaling (a positive number)"),
            )
        })
    };
    let rope_scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "yarn" => {
            let original = match r
                .f64_in(rope_map, "original_max_position_embeddings")
                .map_err(in_section)?
            {
                None => None,
                Some(v) if v >= 1.0 && v.fract() == 0.0 && v <= MAX_SIZE as f64 => Some(v as usize),
                Some(v) => {
                    return Err(r.err(
                        &format!("{section}.original_max_position_embeddings"),
                        format!("({v}) must be a whole number of positions, e.g. 32768"),
                    ))
                }
            };
            let max_positions = r.usize("max_position_embeddings")?;
            // Without a factor, transformers takes the context's growth over the original.
            let factor = match (optional("factor")?, original) {
                (Some(f), _) => f,
                (None, Some(o)) => max_positions as f64 / o as f64,
                (None, None) => factor()?,
            };
            let original = original.unwrap_or(max_positions);
            // transformers' default: 0.1 ln(factor) + 1, or the ratio of two such terms
            // (DeepSeek's `mscale` / `mscale_all_dim`).
            let mscale = |m: f64| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let attention_factor = match (
                optional("attention_factor")?,
                optional("mscale")?,
                optional("mscale_all_dim")?,
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) => mscale(m) / mscale(all),
                _ => mscale(1.0),
            };
            // Absent: true; a present null is falsy in transformers (`.get("truncate", True)`).
            let truncate = match rope_map.get("truncate") {
                None => true,
                Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(r.err(
                        &format!("{section}.truncate"),
                        format!("must be true or false, got {v}"),
                    ))
                }
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: optional("beta_fast")?.unwrap_or(32.0),
                beta_slow: optional("beta_slow")?.unwrap_or(1.0),
                attention_factor,
                truncate,
            }
        }
        "llama3" => {
            let need = |f: &str| -> Result<f64, MegatronError> {
                r.f64_in(rope_map, f).map_err(in_section)?.ok_or_else(|| {
                    r.err(
                        &format!("{section}.{f}"),
                        "is required for llama3 rope scaling",
                    )
                })
            };
            let positive = |f: &str| -> Result<f64, MegatronError> {
                let v = need(f)?;
                if v.is_finite() && v > 0.0 {
                    Ok(v)
                } else {
                    Err(r.err(
                        &format!("{section}.{f}"),
                        format!("({v}) must be a positive number"),
                    ))
                }
            };
            let (low, high) = (positive("low_freq_factor")?, positive("high_freq_factor")?);
            if high <= low {
                return Err(r.err(
                    &format!("{section}.high_freq_factor"),
                    format!("({high}) must be greater than low_freq_factor ({low}); Llama 3 uses 4 and 1"),
                ));
            }
            RopeScaling::Llama3 {
                factor: positive("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: positive("original_max_position_embeddings")?
                    as usize,
            }
        }
        other => {
            return Err(r.err(
                &format!("{section}.rope_type"),
                format!(
                    "`{other}` is not supported; supported: default, linear, llama3, yarn{}",
                    match other {
                        // Its frequencies follow each batch's longest sequence: a rollout and
                        // its training pass would rotate the same token differently.
                        "dynamic" =>
                            " (dynamic NTK changes the frequencies with the batch's \
                                      longest sequence)",
                        _ => "",
                    }
                ),
            ));
        }
    };
    Ok((rope_theta, rope_scaling))
}

/// The weights' dtype (`dtype`, or transformers 4's `torch_dtype`).
fn weight_dtype_of(r: &Reader<'_>) -> Result<WeightDtype, MegatronError> {
    let dtype_field = if r.get("dtype").is_some() {
        "dtype"
    } else {
        "torch_dtype"
    };
    let dtype = match r
        .get(dtype_field)
        .and_then(Value::as_str)
        .unwrap_or("float32")
    {
        "float32" => WeightDtype::F32,
        "float16" => WeightDtype::F16,
        "bfloat16" => WeightDtype::BF16,
        other => {
            return Err(r.err(
                dtype_field,
                format!("`{other}` is not supported; use float32, float16 or bfloat16"),
            ))
        }
    };
    Ok(dtype)
}

/// The expert settings of Qwen2-MoE, Qwen3-MoE, Mixtral and DeepSeek-V3 (`None` for the dense
/// architectures) of a model of `layers` layers.
fn moe_of(
    r: &Reader<'_>,
    architecture: Architecture,
    layers: usize,
) -> Result<Option<MoeConfig>, MegatronError> {
    if architecture == Architecture::DeepseekV3 {
        return deepseek_moe_of(r, layers).map(Some);
    }
    let moe = if architecture.is_moe() {
        let mlp_only_layers = match r.get("mlp_only_layers") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&x| x <= MAX_SIZE)
                        .map(|x| x as usize)
                        .ok_or_else(|| r.err("mlp_only_layers", "must list layer indices"))
                })
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(r.err("mlp_only_layers", format!("must be a list, got {v}"))),
        };
        // transformers 5.17 writes Qwen3-MoE's count as `num_local_experts` (Mixtral's name);
        // the Hub's checkpoints and later versions write `num_experts`.
        let experts_field = match (r.get("num_experts"), r.get("num_local_experts")) {
            _ if architecture == Architecture::Mixtral => "num_local_experts",
            (None, Some(_)) => "num_local_experts",
            _ => "num_experts",
        };
        let moe = MoeConfig {
            num_experts: r.usize(experts_field)?,
            num_experts_per_tok: r.usize("num_experts_per_tok")?,
            // Mixtral's experts are `intermediate_size` wide (it has no dense layers).
            moe_intermediate_size: match architecture {
                Architecture::Mixtral => r.usize("intermediate_size")?,
                _ => r.usize("moe_intermediate_size")?,
            },
            // Qwen3-MoE has no shared expert (0: none).
            shared_expert_intermediate_size: match architecture {
                Architecture::Qwen2Moe => r.usize("shared_expert_intermediate_size")?,
                _ => 0,
            },
            // Mixtral always renormalises its top-k weights, and every layer is sparse.
            norm_topk_prob: architecture == Architecture::Mixtral
                || r.bool_or("norm_topk_prob", false)?,
            decoder_sparse_step: match architecture {
                Architecture::Mixtral => 1,
                _ => r.usize_or("decoder_sparse_step", 1)?.max(1),
            },
            mlp_only_layers: match architecture {
                Architecture::Mixtral => Vec::new(),
                _ => mlp_only_layers,
            },
            routing: MoeRouting::Softmax,
        };
        if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > moe.num_experts {
            return Err(r.err(
                "num_experts_per_tok",
                format!("must be between 1 and num_experts ({})", moe.num_experts),
            ));
        }
        Some(moe)
    } else {
        None
    };
    Ok(moe)
}

/// DeepSeek-V3's experts: `n_routed_experts` (transformers' `num_local_experts` alias) of
/// `moe_intermediate_size`, `n_shared_experts` of them shared (one MLP that wide times the
/// count), dense MLPs in the first `first_k_dense_replace` layers, sigmoid routing over groups.
fn deepseek_moe_of(r: &Reader<'_>, layers: usize) -> Result<MoeConfig, MegatronError> {
    let experts_field = match r.get("n_routed_experts") {
        None if r.get("num_local_experts").is_some() => "num_local_experts",
        _ => "n_routed_experts",
    };
    let num_experts = r.positive_or(experts_field, 256)?;
    let moe_intermediate_size = r.positive_or("moe_intermediate_size", 2048)?;
    let top_k = r.positive_or("num_experts_per_tok", 8)?;
    // transformers' DeepseekV3Config defaults where a key is absent.
    let n_group = r.usize_or("n_group", 8)?;
    let topk_group = r.usize_or("topk_group", 4)?;
    if n_group == 0 || !num_experts.is_multiple_of(n_group) {
        return Err(r.err(
            "n_group",
            format!("({n_group}) must divide {experts_field} ({num_experts})"),
        ));
    }
    let per_group = num_experts / n_group;
    if per_group < 2 && n_group > 1 {
        return Err(r.err(
            "n_group",
            format!(
                "({n_group}) leaves {per_group} expert a group; a group's score sums its two best \
                 experts"
            ),
        ));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(r.err(
            "topk_group",
            format!("({topk_group}) must be between 1 and n_group ({n_group})"),
        ));
    }
    if top_k > topk_group * per_group {
        return Err(r.err(
            "num_experts_per_tok",
            format!(
                "({top_k}) is more than the {} experts of topk_group ({topk_group}) groups",
                topk_group * per_group
            ),
        ));
    }
    let scaling = r.f64_in(r.map, "routed_scaling_factor")?.unwrap_or(2.5);
    if !(scaling.is_finite() && scaling > 0.0) {
        return Err(r.err(
            "routed_scaling_factor",
            format!("({scaling}) must be a positive number, e.g. 2.5"),
        ));
    }
    let dense = r.usize_or("first_k_dense_replace", 3)?.min(layers);
    if r.usize_or("moe_layer_freq", 1)? != 1 {
        return Err(r.err(
            "moe_layer_freq",
            "only 1 (every layer after first_k_dense_replace sparse) is supported",
        ));
    }
    Ok(MoeConfig {
        num_experts,
        num_experts_per_tok: top_k,
        moe_intermediate_size,
        shared_expert_intermediate_size: r.usize_or("n_shared_experts", 0)? * moe_intermediate_size,
        norm_topk_prob: r.bool_or("norm_topk_prob", true)?,
        decoder_sparse_step: 1,
        mlp_only_layers: (0..dense).collect(),
        routing: MoeRouting::SigmoidGroups {
            n_group,
            topk_group,
            routed_scaling_factor: scaling,
        },
    })
}

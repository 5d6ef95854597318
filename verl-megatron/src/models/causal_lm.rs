//! The decoder-only causal language model and its loading from a Hugging Face checkpoint.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl_core::NamedTensor;

use super::attention::{Attention, LayerKv};
use super::mlp::{FeedForward, SwiGlu};
use super::qwen2_moe::SparseMoe;
use crate::error::MegatronError;
use crate::hf::{Architecture, HeadKind, HfCheckpoint, HfModelConfig};
use crate::layers::{
    ColumnParallelLinear, RmsNorm, RotaryEmbedding, RowParallelLinear, TpShard,
    VocabParallelEmbedding,
};

/// Cached keys and values of every layer, and how many positions they hold.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerKv<B>>,
    pub len: usize,
}

impl<B: Backend> Default for KvCache<B> {
    fn default() -> Self {
        Self {
            layers: Vec::new(),
            len: 0,
        }
    }
}

impl<B: Backend> KvCache<B> {
    /// Drops everything cached (the memory a sleeping rollout engine gives back).
    pub fn clear(&mut self) {
        self.layers.clear();
        self.len = 0;
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: FeedForward<B>,
}

/// A decoder-only LM (Qwen2, Llama, Qwen3, Qwen2-MoE) on one tensor-parallel rank.
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    pub embed_tokens: VocabParallelEmbedding<B>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: RmsNorm<B>,
    /// `None` when the output projection is tied to the embedding (or a score head replaces it).
    pub lm_head: Option<ColumnParallelLinear<B>>,
    /// The value head (token classification) or reward score head (sequence classification),
    /// `[num_labels, hidden]`, replicated on every rank. Replaces the LM output when present.
    pub score: Option<ColumnParallelLinear<B>>,
    #[module(skip)]
    pub rope: RotaryEmbedding,
}

impl<B: Backend> CausalLm<B> {
    /// Loads the model from an open checkpoint (verified against `cfg` first), one tensor at a
    /// time.
    pub fn from_checkpoint(
        cfg: &HfModelConfig,
        ckpt: &HfCheckpoint,
        device: &B::Device,
    ) -> Result<Self, MegatronError> {
        ckpt.verify(cfg)?;
        let tp = TpShard::NONE;
        let w2 = |name: &str| ckpt.load::<B, 2>(name, device);
        let w1 = |name: &str| ckpt.load::<B, 1>(name, device);
        let opt1 = |name: String, present: bool| -> Result<Option<Tensor<B, 1>>, MegatronError> {
            if present {
                Ok(Some(w1(&name)?))
            } else {
                Ok(None)
            }
        };
        let norm = |name: &str| -> Result<RmsNorm<B>, MegatronError> {
            Ok(RmsNorm::new(w1(name)?, cfg.rms_norm_eps))
        };
        let swiglu = |p: &str| -> Result<SwiGlu<B>, MegatronError> {
            Ok(SwiGlu {
                gate_proj: ColumnParallelLinear::from_full(
                    w2(&format!("{p}.gate_proj.weight"))?,
                    None,
                    tp,
                ),
                up_proj: ColumnParallelLinear::from_full(
                    w2(&format!("{p}.up_proj.weight"))?,
                    None,
                    tp,
                ),
                down_proj: RowParallelLinear::from_full(
                    w2(&format!("{p}.down_proj.weight"))?,
                    None,
                    tp,
                ),
            })
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let qkv = |proj: &str| -> Result<ColumnParallelLinear<B>, MegatronError> {
                Ok(ColumnParallelLinear::from_full(
                    w2(&format!("{a}.{proj}.weight"))?,
                    opt1(format!("{a}.{proj}.bias"), cfg.qkv_bias)?,
                    tp,
                ))
            };
            let qk_norm = cfg.architecture == Architecture::Qwen3;
            let self_attn = Attention {
                q_proj: qkv("q_proj")?,
                k_proj: qkv("k_proj")?,
                v_proj: qkv("v_proj")?,
                o_proj: RowParallelLinear::from_full(
                    w2(&format!("{a}.o_proj.weight"))?,
                    opt1(format!("{a}.o_proj.bias"), cfg.o_bias)?,
                    tp,
                ),
                q_norm: if qk_norm {
                    Some(norm(&format!("{a}.q_norm.weight"))?)
                } else {
                    None
                },
                k_norm: if qk_norm {
                    Some(norm(&format!("{a}.k_norm.weight"))?)
                } else {
                    None
                },
                num_heads: cfg.num_attention_heads / tp.size,
                num_kv_heads: cfg.num_key_value_heads / tp.size,
                head_dim: cfg.head_dim,
            };
            let mlp = match &cfg.moe {
                Some(moe) if moe.is_moe_layer(l) => FeedForward::Moe(SparseMoe {
                    gate: ColumnParallelLinear::from_full(
                        w2(&format!("{p}.mlp.gate.weight"))?,
                        None,
                        TpShard::NONE,
                    ),
                    experts: (0..moe.num_experts)
                        .map(|e| swiglu(&format!("{p}.mlp.experts.{e}")))
                        .collect::<Result<_, _>>()?,
                    shared_expert: swiglu(&format!("{p}.mlp.shared_expert"))?,
                    shared_expert_gate: ColumnParallelLinear::from_full(
                        w2(&format!("{p}.mlp.shared_expert_gate.weight"))?,
                        None,
                        TpShard::NONE,
                    ),
                    top_k: moe.num_experts_per_tok,
                    norm_topk_prob: moe.norm_topk_prob,
                }),
                _ => FeedForward::Dense(swiglu(&format!("{p}.mlp"))?),
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"))?,
                self_attn,
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                mlp,
            });
        }
        let (lm_head, score) = match cfg.head {
            HeadKind::CausalLm if cfg.tie_word_embeddings => (None, None),
            HeadKind::CausalLm => (
                Some(ColumnParallelLinear::from_full(
                    w2("lm_head.weight")?,
                    None,
                    tp,
                )),
                None,
            ),
            HeadKind::TokenClassification { .. } => (
                None,
                Some(ColumnParallelLinear::from_full(
                    w2("score.weight")?,
                    Some(w1("score.bias")?),
                    TpShard::NONE,
                )),
            ),
            HeadKind::SequenceClassification { .. } => (
                None,
                Some(ColumnParallelLinear::from_full(
                    w2("score.weight")?,
                    None,
                    TpShard::NONE,
                )),
            ),
        };
        Ok(Self {
            embed_tokens: VocabParallelEmbedding::from_full(w2("model.embed_tokens.weight")?, tp),
            layers,
            norm: norm("model.norm.weight")?,
            lm_head,
            score,
            rope: RotaryEmbedding::new(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
        })
    }

    /// Logits `[batch, seq, vocab]` for `input_ids` `[batch, seq]` (with a score head:
    /// scores `[batch, seq, num_labels]`). `attention_mask` `[batch,
    /// seq]` (1 = token, 0 = padding) and `position_ids` default to all-ones and 0..seq.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        self.run(input_ids, attention_mask, position_ids, None)
    }

    /// As [`Self::forward`] for the new tokens `input_ids` `[batch, new]`, attending to the
    /// cached keys too, and extending `cache`. `attention_mask` covers every key, cached and new
    /// (`[batch, cached + new]`); `position_ids` are the new tokens' positions. A prefill is a
    /// call on an empty cache; a decode step is a call with one new token per row.
    pub fn forward_cached(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2>,
        position_ids: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        if cache.layers.len() != self.layers.len() {
            cache.layers = (0..self.layers.len()).map(|_| None).collect();
            cache.len = 0;
        }
        let new = input_ids.dims()[1];
        let out = self.run(
            input_ids,
            Some(attention_mask),
            Some(position_ids),
            Some(cache),
        );
        cache.len += new;
        out
    }

    fn run(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let [b, t] = input_ids.dims();
        let device = input_ids.device();
        let past = cache.as_ref().map_or(0, |c| c.len);
        let keys = past + t;
        let positions = position_ids.unwrap_or_else(|| {
            Tensor::<B, 1, Int>::arange(past as i64..keys as i64, &device)
                .unsqueeze_dim::<2>(0)
                .repeat_dim(0, b)
        });
        let (cos, sin) = self.rope.tables(&positions);
        // 0 where new query i (absolute index past + i) may attend key j: j ≤ past + i and j is
        // a token; −∞ elsewhere.
        let mut allowed: Vec<f32> = Vec::with_capacity(t * keys);
        for i in 0..t {
            for j in 0..keys {
                allowed.push(if j <= past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                });
            }
        }
        let mut bias = Tensor::<B, 2>::from_data(TensorData::new(allowed, [t, keys]), &device)
            .reshape([1, 1, t, keys])
            .repeat_dim(0, b);
        if let Some(mask) = attention_mask {
            let masked_keys = mask
                .reshape([b, 1, 1, keys])
                .lower_elem(0.5)
                .repeat_dim(2, t);
            bias = bias.mask_fill(masked_keys, f32::NEG_INFINITY);
            // A padded query row would be all −∞: let it attend to itself so softmax stays finite.
            let mut own: Vec<f32> = vec![0.0; t * keys];
            for i in 0..t {
                own[i * keys + past + i] = 1.0;
            }
            let diag = Tensor::<B, 2>::from_data(TensorData::new(own, [t, keys]), &device)
                .reshape([1, 1, t, keys])
                .repeat_dim(0, b)
                .greater_elem(0.5);
            bias = bias.mask_fill(diag, 0.0);
        }
        let mut h = self.embed_tokens.forward(input_ids);
        for (l, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_mut().map(|c| &mut c.layers[l]);
            let attn = layer.self_attn.forward(
                layer.input_layernorm.forward(h.clone()),
                &bias,
                &cos,
                &sin,
                layer_cache,
            );
            h = h + attn;
            let ff = layer
                .mlp
                .forward(layer.post_attention_layernorm.forward(h.clone()));
            h = h + ff;
        }
        let h = self.norm.forward(h);
        if let Some(score) = &self.score {
            return score.forward(h);
        }
        match &self.lm_head {
            Some(head) => head.forward(h),
            None => {
                let [_, _, hidden] = h.dims();
                let w = self.embed_tokens.weight.val();
                let [vocab, _] = w.dims();
                h.reshape([b * t, hidden])
                    .matmul(w.transpose())
                    .reshape([b, t, vocab])
            }
        }
    }
}

impl<B: Backend> CausalLm<B> {
    /// Every weight under its Hugging Face name, one tensor at a time (full tensors at tp = 1):
    /// what saving writes and what the rollout engine's `update_weights` consumes.
    pub fn export_weights(&self) -> Vec<NamedTensor<B>> {
        let mut out = vec![NamedTensor::new(
            "model.embed_tokens.weight",
            self.embed_tokens.weight.val(),
        )];
        let lin = |out: &mut Vec<NamedTensor<B>>,
                   name: String,
                   w: Tensor<B, 2>,
                   b: Option<Tensor<B, 1>>| {
            if let Some(b) = b {
                out.push(NamedTensor::new(format!("{name}.bias"), b));
            }
            out.push(NamedTensor::new(format!("{name}.weight"), w));
        };
        let swiglu = |out: &mut Vec<NamedTensor<B>>, p: String, m: &SwiGlu<B>| {
            out.push(NamedTensor::new(
                format!("{p}.gate_proj.weight"),
                m.gate_proj.weight.val(),
            ));
            out.push(NamedTensor::new(
                format!("{p}.up_proj.weight"),
                m.up_proj.weight.val(),
            ));
            out.push(NamedTensor::new(
                format!("{p}.down_proj.weight"),
                m.down_proj.weight.val(),
            ));
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            out.push(NamedTensor::new(
                format!("{p}.input_layernorm.weight"),
                layer.input_layernorm.weight.val(),
            ));
            out.push(NamedTensor::new(
                format!("{p}.post_attention_layernorm.weight"),
                layer.post_attention_layernorm.weight.val(),
            ));
            let a = &layer.self_attn;
            for (name, proj) in [
                ("q_proj", &a.q_proj),
                ("k_proj", &a.k_proj),
                ("v_proj", &a.v_proj),
            ] {
                lin(
                    &mut out,
                    format!("{p}.self_attn.{name}"),
                    proj.weight.val(),
                    proj.bias.as_ref().map(|b| b.val()),
                );
            }
            lin(
                &mut out,
                format!("{p}.self_attn.o_proj"),
                a.o_proj.weight.val(),
                a.o_proj.bias.as_ref().map(|b| b.val()),
            );
            if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
                out.push(NamedTensor::new(
                    format!("{p}.self_attn.q_norm.weight"),
                    qn.weight.val(),
                ));
                out.push(NamedTensor::new(
                    format!("{p}.self_attn.k_norm.weight"),
                    kn.weight.val(),
                ));
            }
            match &layer.mlp {
                FeedForward::Dense(m) => swiglu(&mut out, format!("{p}.mlp"), m),
                FeedForward::Moe(m) => {
                    out.push(NamedTensor::new(
                        format!("{p}.mlp.gate.weight"),
                        m.gate.weight.val(),
                    ));
                    for (e, expert) in m.experts.iter().enumerate() {
                        swiglu(&mut out, format!("{p}.mlp.experts.{e}"), expert);
                    }
                    swiglu(&mut out, format!("{p}.mlp.shared_expert"), &m.shared_expert);
                    out.push(NamedTensor::new(
                        format!("{p}.mlp.shared_expert_gate.weight"),
                        m.shared_expert_gate.weight.val(),
                    ));
                }
            }
        }
        out.push(NamedTensor::new(
            "model.norm.weight",
            self.norm.weight.val(),
        ));
        if let Some(head) = &self.lm_head {
            out.push(NamedTensor::new("lm_head.weight", head.weight.val()));
        }
        if let Some(score) = &self.score {
            out.push(NamedTensor::new("score.weight", score.weight.val()));
            if let Some(b) = &score.bias {
                out.push(NamedTensor::new("score.bias", b.val()));
            }
        }
        out
    }

    /// A sequence score read at each row's last token (`attention_mask` 1 = token; `None`: the
    /// last position), from per-token scores `[batch, seq, labels]` → `[batch, labels]`. This is
    /// where a reward model's score, and verl's outcome reward, live.
    pub fn last_token_scores(
        scores: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 2> {
        let [b, t, labels] = scores.dims();
        let last: Vec<i64> = match attention_mask {
            None => vec![t as i64 - 1; b],
            Some(mask) => {
                let m: Vec<f64> = mask.to_data().iter::<f64>().collect();
                (0..b)
                    .map(|i| (0..t).rev().find(|&j| m[i * t + j] > 0.5).unwrap_or(t - 1) as i64)
                    .collect()
            }
        };
        let idx =
            Tensor::<B, 3, Int>::from_data(TensorData::new(last, [b, 1, 1]), &scores.device())
                .repeat_dim(2, labels);
        scores.gather(1, idx).reshape([b, labels])
    }
}

//! A generation-only model's fused weights and its decode step with fewer launches.
//!
//! A decode step feeds one token per slot; at rollout batch sizes each of its products reads a
//! few MB of weights, so the step is bound by how many kernels it launches, not by arithmetic.
//! With bf16 products the rollout engine's model ([`CausalLm::with_generation_matrices`])
//! keeps, per dense decoder layer, q/k/v stacked into one matrix (one product instead of three,
//! the biases added inside decode attention) and gate/up stacked into one (one product instead
//! of two, SwiGLU reading both halves of its rows), plus a bf16 copy of a tied LM head. The
//! separate q/k/v and gate/up weights become views of the stacked ones, so nothing is stored
//! twice (where the backend can view them at their offsets).
//!
//! A decoder layer's step is then: residual add + RMSNorm + bf16 rounding (one kernel), the
//! q/k/v product, decode attention (bias, RoPE, cache write, attention, rounding: one kernel),
//! the output product, add + norm again, the gate/up product, SwiGLU to bf16, the down product:
//! 8 launches where the layer-by-layer path takes about 20. Each fused kernel computes exactly
//! what the chain it replaces computes (same operations in the same order), and falls back to
//! that chain on every other backend, so on the CPU this path runs the plain operations and is
//! checked against the model without fused weights.

use burn::module::Param;
use burn::prelude::*;

use super::attention::{AttentionMask, AttnCache};
use super::causal_lm::{is_product_matrix, CausalLm, ParamMut};
use super::feed_forward::FeedForward;
use super::generation_weights::{FusedLayer, FusedWeights, GenerationWeights};
use super::kv_cache::SlotKvCache;
use super::mlp::swiglu;
use crate::layers::precision::{self, ComputeDtype};
use crate::layers::{RmsNorm, RopeTables};
use crate::ops::FusedOps;
use crate::parallel::ParallelBackend;

impl<B: ParallelBackend> GenerationWeights<B> {
    /// Stacks `model`'s matrices, pointing its separate q/k/v and gate/up weights at views of
    /// the stacked ones. `None` (and the model untouched) unless the model has bf16 products,
    /// its whole decoder (one pipeline stage holding embedding, layers and final norm), an LM
    /// head, no sequence parallelism, and only dense layers without per-head q/k norms whose
    /// q/k/v projections all have a bias or none has.
    ///
    /// `VERL_FUSED_DECODE=off` in the environment turns this off (benchmarks measure the
    /// layer-by-layer step with it).
    pub fn build(model: &mut CausalLm<B>) -> Option<Self> {
        let switched_off = std::env::var("VERL_FUSED_DECODE")
            .is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "decomposed"));
        let fits = !switched_off
            && model.compute_dtype == ComputeDtype::Bf16
            && model.embed_tokens.is_some()
            && model.norm.is_some()
            && model.score.is_none()
            && !model.tp.sequence_parallel
            // Its loop is Llama's layer: no sandwich norms, GeGLU or soft-caps.
            && !model.config.architecture.is_gemma()
            && model.config.variants.activation == crate::hf::Activation::Silu
            && model.config.variants.final_logit_softcapping.is_none()
            && model.layers.iter().all(|l| {
                let a = &l.self_attn;
                let (Some(q), Some(k), Some(v)) = (&a.q_proj, &a.k_proj, &a.v_proj) else {
                    // Latent attention.
                    return false;
                };
                let biases = [&q.bias, &k.bias, &v.bias]
                    .iter()
                    .filter(|b| b.is_some())
                    .count();
                matches!(l.mlp, FeedForward::Dense(_))
                    && a.q_norm.is_none()
                    && (biases == 0 || biases == 3)
            });
        if !fits {
            return None;
        }
        let mut layers = Vec::with_capacity(model.layers.len());
        for layer in &mut model.layers {
            let a = &mut layer.self_attn;
            let (Some(q), Some(k), Some(v)) = (&mut a.q_proj, &mut a.k_proj, &mut a.v_proj) else {
                unreachable!("checked above: q, k and v projections")
            };
            let qkv = stack(&mut [&mut q.weight, &mut k.weight, &mut v.weight]);
            let qkv_bias = match (&q.bias, &k.bias, &v.bias) {
                (Some(q), Some(k), Some(v)) => {
                    Some(Tensor::cat(vec![q.val(), k.val(), v.val()], 0))
                }
                _ => None,
            };
            let FeedForward::Dense(mlp) = &mut layer.mlp else {
                unreachable!("checked above: dense layers only")
            };
            let gate_up = stack(&mut [&mut mlp.gate_proj.weight, &mut mlp.up_proj.weight]);
            layers.push(FusedLayer {
                qkv,
                qkv_bias,
                gate_up,
            });
        }
        let tied_head = match &model.lm_head {
            Some(_) => None,
            None => model
                .embed_tokens
                .as_ref()
                .map(|e| e.weight.val().cast(burn::tensor::FloatDType::BF16)),
        };
        Some(Self { layers, tied_head })
    }
}

/// The matrices `parts` stacked along their rows; each part's parameter becomes a view of its
/// rows of the stack (same id, same values).
fn stack<B: Backend>(parts: &mut [&mut Param<Tensor<B, 2>>]) -> Tensor<B, 2> {
    let stacked = Tensor::cat(parts.iter().map(|p| p.val()).collect(), 0);
    let mut start = 0;
    for p in parts.iter_mut() {
        let n = p.dims()[0];
        **p = Param::initialized(p.id, stacked.clone().narrow(0, start, n));
        start += n;
    }
    stacked
}

impl<B: FusedOps> RmsNorm<B> {
    /// A decode step's residual sum `s = h + delta` (`h` itself without `delta`) and this norm
    /// of `s` as the next products' operand (bf16 under bf16 products): `(s, operand)`. One
    /// kernel on burn-cuda with bf16 products; elsewhere the add, [`Self::forward`] and the
    /// cast.
    pub fn add_then_forward(
        &self,
        h: Tensor<B, 2>,
        delta: Option<Tensor<B, 2>>,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        if precision::current() == ComputeDtype::Bf16 {
            return B::add_rms_norm_bf16(h, delta, self.scale(), self.eps);
        }
        let s = match delta {
            Some(d) => h + d,
            None => h,
        };
        let y = precision::operand(self.forward(s.clone()));
        (s, y)
    }
}

/// `silu(gate) · up` from the fused gate/up product `gu` `[rows, 2 · inter]`, as the down
/// projection's operand: one kernel on burn-cuda, else the halves through [`swiglu`] and a
/// cast.
fn swiglu_operand<B: FusedOps>(gu: Tensor<B, 2>) -> Tensor<B, 2> {
    if precision::current() == ComputeDtype::Bf16 {
        return B::swiglu_packed_bf16(gu);
    }
    let [_, width] = gu.dims();
    let inter = width / 2;
    let gate = gu.clone().narrow(1, 0, inter);
    let up = gu.narrow(1, inter, inter);
    precision::operand(swiglu(gate, up))
}

impl<B: ParallelBackend> CausalLm<B> {
    /// The decoder of one decode step over the slot cache through the fused weights `fused`:
    /// embeddings of `ids` `[slots, 1]`, every layer, the final norm; returns the normed hidden
    /// states `[slots, 1, hidden]` as the LM head's operand. Runs inside the model's compute
    /// dtype (the caller entered it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_fused(
        &self,
        fused: &GenerationWeights<B>,
        ids: Tensor<B, 2, Int>,
        mask: &AttentionMask<B>,
        rope: &RopeTables<B>,
        cache: &mut SlotKvCache<B>,
        (positions, window, on_device): (&[usize], usize, Option<&Tensor<B, 1>>),
    ) -> Tensor<B, 3> {
        let embed = self
            .embed_tokens
            .as_ref()
            .expect("fused weights exist only with the embedding");
        let h = embed.forward(ids);
        let [slots, _, hidden] = h.dims();
        let mut h = h.reshape([slots, hidden]);
        let mut delta = None;
        for (l, (layer, f)) in self.layers.iter().zip(&fused.layers).enumerate() {
            let (sum, x) = layer.input_layernorm.add_then_forward(h, delta.take());
            let attn = &layer.self_attn;
            let (cos, sin) = rope.for_layer(attn.scores.sliding_window.is_some());
            let qkv = precision::linear(attn.tp.enter(x), f.qkv.clone());
            let out = attn.decode_packed(
                qkv,
                f.qkv_bias.clone(),
                mask,
                cos,
                sin,
                AttnCache::Slots {
                    cache,
                    layer: l,
                    positions,
                    window,
                    on_device,
                },
            );
            let o = attn.o_proj.forward(out);
            let (sum, x) = layer
                .post_attention_layernorm
                .add_then_forward(sum, Some(o));
            h = sum;
            let FeedForward::Dense(mlp) = &layer.mlp else {
                unreachable!("fused weights exist only for dense layers")
            };
            let gu = precision::linear(mlp.tp.enter(x), f.gate_up.clone());
            delta = Some(mlp.down_proj.forward(swiglu_operand(gu)));
        }
        let norm = self
            .norm
            .as_ref()
            .expect("fused weights exist only with the final norm");
        let (_, y) = norm.add_then_forward(h, delta);
        y.reshape([slots, 1, hidden])
    }
}

impl<B: ParallelBackend> CausalLm<B> {
    /// For a model that only generates (the rollout engine's copy): with bf16 products, keeps
    /// the linear layers' matrices (projections and LM head; not the embedding, norms, biases
    /// or router) in bf16, so a product reads its weight as it is instead of casting the f32
    /// matrix on every call: one launch and ~6 bytes of traffic per weight less per decode
    /// step. Weights loaded later keep that dtype ([`Self::load_shard`] casts them).
    ///
    /// It also stacks the matrices a decode step can multiply together (q/k/v, gate/up) for
    /// the fused decode step of [`crate::models::generation`].
    pub fn with_generation_matrices(mut self) -> Self {
        self.prepare_generation();
        self
    }

    /// [`Self::with_generation_matrices`] in place: after weights were loaded (which clears
    /// the fused weights, as their values changed), rebuilds what is missing. A model without
    /// bf16 products is left as it is.
    pub fn prepare_generation(&mut self) {
        if self.compute_dtype != ComputeDtype::Bf16 || self.generation().is_some() {
            return;
        }
        self.cast_products_to_bf16();
        let weights = FusedWeights::of(GenerationWeights::build(self));
        self.set_generation(weights);
    }

    /// For a model that only runs forward passes with bf16 products (the frozen reference
    /// policy): keeps the linear layers' matrices (projections and LM head; not the embedding,
    /// norms, biases or router) in bf16. Every product casts its f32 matrix to bf16 anyway, so
    /// the outputs are the same to the bit, and the matrices take half the memory. A model
    /// with f32 products is returned as it is.
    ///
    /// ```
    /// use burn::backend::Flex;
    /// use burn::tensor::DType;
    /// use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
    /// use verl_megatron::layers::precision::ComputeDtype;
    /// use verl_megatron::models::CausalLm;
    /// let cfg = HfModelConfig::qwen2(Qwen2Dims {
    ///     vocab_size: 16, hidden_size: 8, intermediate_size: 16, num_hidden_layers: 1,
    ///     num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 32,
    /// });
    /// let model = CausalLm::<Flex>::init(&cfg, 0.1, 1, &Default::default())
    ///     .with_compute_dtype(ComputeDtype::Bf16)
    ///     .with_bf16_products();
    /// let shards = model.export_shards();
    /// let dtype = |name: &str| shards.iter().find(|t| t.name == name).unwrap().values.dtype();
    /// assert_eq!(dtype("model.layers.0.self_attn.q_proj.weight"), DType::BF16);
    /// assert_eq!(dtype("model.embed_tokens.weight"), DType::F32);
    /// ```
    pub fn with_bf16_products(mut self) -> Self {
        if self.compute_dtype == ComputeDtype::Bf16 {
            self.cast_products_to_bf16();
        }
        self
    }

    /// Casts the product matrices to bf16 (see [`Self::with_bf16_products`]).
    fn cast_products_to_bf16(&mut self) {
        let names: Vec<String> = self
            .export_shards()
            .into_iter()
            .filter(|t| t.shape.len() == 2 && is_product_matrix(&t.name))
            .map(|t| t.name)
            .collect();
        for name in names {
            if let Some(ParamMut::Matrix(p)) = self.param_mut(&name) {
                let low = p.val().cast(burn::tensor::FloatDType::BF16);
                *p = Param::initialized(p.id, low);
            }
        }
    }
}

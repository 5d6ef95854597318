//! Causal self-attention with grouped-query heads.

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::softmax;

use super::kv_cache::{LayerKv, SlotKvCache};
use crate::layers::{precision, ColumnParallelLinear, RmsNorm, RotaryEmbedding, RowParallelLinear};
use crate::parallel::{ParallelBackend, TpGroup};

/// Where an attention call reads and writes cached keys and values.
pub enum AttnCache<'a, B: Backend> {
    /// No cache: keys are this call's tokens.
    None,
    /// Keys are the cached ones followed by this call's; the cache grows.
    Grow(&'a mut LayerKv<B>),
    /// One new token per slot, written at each slot's own position; keys are the slot's first
    /// `window` positions.
    Slots {
        cache: &'a mut SlotKvCache<B>,
        layer: usize,
        positions: &'a [usize],
        window: usize,
    },
}

/// One attention block: q/k/v projections (column-parallel), optional per-head q/k RMSNorm
/// (Qwen3), rotary embedding, causal softmax attention, output projection (row-parallel).
/// With tensor parallelism each rank holds `heads / tp` query heads and `kv_heads / tp` kv
/// heads (grouped-query groups stay whole on one rank).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub q_proj: ColumnParallelLinear<B>,
    pub k_proj: ColumnParallelLinear<B>,
    pub v_proj: ColumnParallelLinear<B>,
    pub o_proj: RowParallelLinear<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    /// Heads on this tp rank.
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    #[module(skip)]
    pub tp: TpGroup,
}

impl<B: ParallelBackend> Attention<B> {
    /// `x` `[batch, seq, hidden]`; `bias` `[batch, 1, seq, keys]` is 0 where attention is allowed
    /// and −∞ elsewhere (causal and padding); cos/sin from [`RotaryEmbedding::tables`]. `cache`
    /// says which keys are attended to besides this call's ([`AttnCache`]).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        bias: &Tensor<B, 4>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        cache: AttnCache<'_, B>,
    ) -> Tensor<B, 3> {
        // One entry into the tensor-parallel region for the three projections.
        let x = self.tp.enter(x);
        let [b, t, _] = x.dims();
        let (hd, nh, nkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let heads = |y: Tensor<B, 3>, n: usize| y.reshape([b, t, n, hd]).swap_dims(1, 2);
        let mut q = heads(self.q_proj.forward(x.clone()), nh);
        let mut k = heads(self.k_proj.forward(x.clone()), nkv);
        let v = heads(self.v_proj.forward(x), nkv);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(q);
            k = kn.forward(k);
        }
        let q = RotaryEmbedding::apply(q, cos, sin);
        let mut k = RotaryEmbedding::apply(k, cos, sin);
        let mut v = v;
        match cache {
            AttnCache::None => {}
            // The new keys and values (after RoPE) extend the cached ones.
            AttnCache::Grow(cache) => {
                if let Some((ck, cv)) = cache.take() {
                    k = Tensor::cat(vec![ck, k], 2);
                    v = Tensor::cat(vec![cv, v], 2);
                }
                *cache = Some((k.clone(), v.clone()));
            }
            AttnCache::Slots {
                cache,
                layer,
                positions,
                window,
            } => (k, v) = cache.write_step(layer, k, v, positions, window),
        }
        let keys = k.dims()[2];
        // Grouped-query attention: query heads g·rep .. (g+1)·rep share kv head g. Folding those
        // heads into the query rows lets them read the kv head directly, with no copies of it.
        let rep = nh / nkv;
        let q = q.reshape([b, nkv, rep * t, hd]);
        let bias = if rep == 1 {
            bias.clone()
        } else {
            bias.clone()
                .unsqueeze_dim::<5>(2)
                .repeat_dim(2, rep)
                .reshape([b, 1, rep * t, keys])
        };
        let scores = precision::matmul(q, k.swap_dims(2, 3)) / (hd as f64).sqrt() + bias;
        let probs = softmax(scores, 3);
        let out = precision::matmul(probs, v)
            .reshape([b, nh, t, hd])
            .swap_dims(1, 2)
            .reshape([b, t, nh * hd]);
        self.o_proj.forward(out)
    }
}

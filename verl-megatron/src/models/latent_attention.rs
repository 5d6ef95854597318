//! DeepSeek-V3's multi-head latent attention: queries from a low-rank code (or one projection),
//! keys and values from a compressed code every head expands, and a rope part of the key that
//! all heads share. The projections here make each head's query, key and value; attention
//! itself is [`super::attention::Attention`]'s, over heads padded to one width (the value's
//! padding is zeros, cut from the output).
//!
//! The cache holds each head's expanded key and value (the compressed code times `kv_b_proj`),
//! not the compressed code: simple and exact, but `heads · width` numbers a token where the
//! absorbed form would keep `kv_lora_rank + qk_rope_head_dim`.

use burn::module::Module;
use burn::prelude::*;

use crate::hf::LatentAttentionConfig;
use crate::layers::{ColumnParallelLinear, RmsNorm, RotaryEmbedding};
use crate::ops::FusedOps;

/// The projections of one layer's latent attention.
#[derive(Module, Debug)]
pub struct LatentAttention<B: Backend> {
    /// `[q_lora_rank, hidden]`, with a query rank.
    pub q_a_proj: Option<ColumnParallelLinear<B>>,
    pub q_a_layernorm: Option<RmsNorm<B>>,
    /// `q_b_proj` `[heads · qk_head_dim, q_lora_rank]`, or without a query rank `q_proj`
    /// `[heads · qk_head_dim, hidden]`.
    pub q_b_proj: ColumnParallelLinear<B>,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`: the compressed code, then the shared rope
    /// key.
    pub kv_a_proj_with_mqa: ColumnParallelLinear<B>,
    pub kv_a_layernorm: RmsNorm<B>,
    /// `[heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: each head's key part without
    /// rope, then its value.
    pub kv_b_proj: ColumnParallelLinear<B>,
    #[module(skip)]
    pub dims: LatentAttentionConfig,
}

impl<B: FusedOps> LatentAttention<B> {
    /// Each head's rotated query and key and its value, `[batch, seq, heads, width]` (heads
    /// padded with zeros to `width`), from `x` `[batch, seq, hidden]`; `cos`/`sin`
    /// `[batch, 1, seq, qk_rope_head_dim]` the rope part's tables.
    pub fn project(
        &self,
        x: Tensor<B, 3>,
        heads: usize,
        width: usize,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
        let d = &self.dims;
        let [b, t, _] = x.dims();
        let (nope, rope, dv, rank) = (
            d.qk_nope_head_dim,
            d.qk_rope_head_dim,
            d.v_head_dim,
            d.kv_lora_rank,
        );
        let qk = nope + rope;
        let q = match (&self.q_a_proj, &self.q_a_layernorm) {
            (Some(a), Some(norm)) => self.q_b_proj.forward(norm.forward(a.forward(x.clone()))),
            _ => self.q_b_proj.forward(x.clone()),
        };
        // [batch, heads, seq, qk]: the query's part without rope, then its rope part.
        let q = q.reshape([b, t, heads, qk]).swap_dims(1, 2);
        let q_pass = q.clone().narrow(3, 0, nope);
        let q_rot = self.rotate(q.narrow(3, nope, rope), cos, sin);
        let compressed = self.kv_a_proj_with_mqa.forward(x);
        let code = self
            .kv_a_layernorm
            .forward(compressed.clone().narrow(2, 0, rank));
        // One rope key for every head.
        let k_rot = self.rotate(
            compressed.narrow(2, rank, rope).reshape([b, 1, t, rope]),
            cos,
            sin,
        );
        let kv = self
            .kv_b_proj
            .forward(code)
            .reshape([b, t, heads, nope + dv])
            .swap_dims(1, 2);
        let k_pass = kv.clone().narrow(3, 0, nope);
        let v = kv.narrow(3, nope, dv);
        let q = Tensor::cat(vec![q_pass, q_rot], 3);
        let k = Tensor::cat(vec![k_pass, k_rot.repeat_dim(1, heads)], 3);
        let pad = |x: Tensor<B, 4>, have: usize| match width - have {
            0 => x,
            extra => {
                let zeros = Tensor::zeros([b, heads, t, extra], &x.device());
                Tensor::cat(vec![x, zeros], 3)
            }
        };
        // Back to [batch, seq, heads, width], attention's layout before RoPE.
        (
            pad(q, qk).swap_dims(1, 2),
            pad(k, qk).swap_dims(1, 2),
            pad(v, dv).swap_dims(1, 2),
        )
    }

    /// RoPE on a rope part `[batch, heads, seq, rope]`: stored as interleaved pairs
    /// (`rope_interleave`), the evens and odds are rotated as halves and stay in that order,
    /// as transformers' DeepSeek-V3 writes them.
    fn rotate(&self, x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
        let x = match self.dims.rope_interleave {
            true => {
                let rope = self.dims.qk_rope_head_dim;
                let order: Vec<usize> = (0..rope).step_by(2).chain((1..rope).step_by(2)).collect();
                x.select(3, super::index_tensor::<B>(&order, &cos.device()))
            }
            false => x,
        };
        RotaryEmbedding::apply(x, cos, sin)
    }
}

/// Tables that leave a rotation as it is (cos 1, sin 0), `[batch, 1, seq, width]`: attention's
/// RoPE step over heads whose rope part is already rotated.
pub(crate) fn identity_tables<B: Backend>(
    batch: usize,
    seq: usize,
    width: usize,
    device: &B::Device,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    (
        Tensor::ones([batch, 1, seq, width], device),
        Tensor::zeros([batch, 1, seq, width], device),
    )
}

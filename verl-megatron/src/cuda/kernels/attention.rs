//! Fused causal attention with grouped-query heads (`attention.cu`): one kernel for the
//! forward, three for the backward (dq, per-head dk/dv, their sum per kv head), in place of the
//! decomposed path's ~30 burn operations per layer (scores, bias, softmax, products, their
//! casts and their gradients), and with no `[batch, heads, seq, seq]` tensor kept for the
//! backward: what makes long sequences fit.
//!
//! It applies to training and log-prob passes (no KV cache) on burn-cuda with bf16 products
//! and a head size that is a multiple of 16 up to 128. Everything else, and every backend but
//! burn-cuda, runs the decomposed path in `models::attention`, which `verl bench kernels`
//! compares this kernel against (outputs and the three gradients, odd lengths, padding, GQA).

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::{cast, into_contiguous};
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, record, CudaPrimitive, KernelSwitch};
use crate::ops::FusedScores;

/// The kernels after what they share with the GEMMs (`gemm_common.cuh`: cp.async copies).
const SOURCE: &str = concat!(
    include_str!("gemm_common.cuh"),
    include_str!("attention.cu")
);
/// Rows per block (queries or keys) and threads per block, as in `attention.cu`.
const TILE: usize = 64;
const THREADS: u32 = 128;
/// Threads per block of the group sum.
const GROUP_SUM_THREADS: u32 = 256;

/// Whether the fused kernel is used where it applies: on unless `VERL_ATTENTION=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_ATTENTION");

/// Whether a head size has a compiled variant.
pub fn supports_head_dim(head_dim: usize) -> bool {
    crate::ops::fused_attention_head_dim(head_dim)
}

/// Queries per step of the dk/dv kernel (`QTILE` in `attention.cu`): narrower for large heads,
/// whose dk and dv accumulators take most of a lane's registers.
fn query_tile(d: usize) -> usize {
    if d > 64 {
        32
    } else {
        64
    }
}

/// Bytes of shared memory of each kernel for head size `d`, the regions laid out as in
/// `attention.cu` (each but the last rounded up to 128 bytes): bf16 tiles of row stride `d + 8` (the tiles
/// the loop streams in two stages), and f32 rows of statistics or mask.
fn shared_bytes(entry: &str, d: usize) -> usize {
    let r = |x: usize| x.div_ceil(128) * 128;
    let tile = |rows: usize| r(rows * (d + 8) * 2);
    match entry {
        // q, then k and v in two stages; the key mask.
        "verl_attention_forward" => 5 * tile(TILE) + TILE * 4,
        // q and dout, then k and v in two stages; log-sum-exp, delta, the key mask.
        "verl_attention_backward_dq" => 6 * tile(TILE) + 2 * r(TILE * 4) + TILE * 4,
        // k and v, then q and dout in two stages; log-sum-exp and delta in two stages.
        _ => {
            let q = query_tile(d);
            2 * tile(TILE) + 4 * tile(q) + 3 * r(q * 4) + q * 4
        }
    }
}

/// Shape of a call: batch, sequence, query heads, kv heads, head size.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// A sliding window of keys (0: none).
    window: u32,
}

impl Dims {
    fn kernel(&self, entry: &'static str) -> CudaSource {
        CudaSource {
            entry,
            text: SOURCE,
            defines: vec![("HEAD_DIM", self.head_dim as u32)],
            block: THREADS,
            shared_bytes: shared_bytes(entry, self.head_dim),
        }
    }

    /// With a sliding window of `window` keys (0 in the kernels' parameters: none).
    fn with_window(self, window: Option<usize>) -> Self {
        Self {
            window: window.map_or(0, |w| w.clamp(1, u32::MAX as usize) as u32),
            ..self
        }
    }

    /// The kernels' `AttnParams`.
    fn params(&self, scale: f32) -> Vec<u64> {
        pack_words(&[
            self.batch as u32,
            self.seq as u32,
            self.heads as u32,
            self.kv_heads as u32,
            scale.to_bits(),
            self.window,
            0,
            0,
        ])
    }

    fn grid(&self, heads: usize) -> (u32, u32, u32) {
        (
            self.seq.div_ceil(TILE) as u32,
            heads as u32,
            self.batch as u32,
        )
    }
}

/// Output `[batch, seq, heads, head_dim]` and log-sum-exp `[batch, heads, seq]`.
fn forward_primitive(
    d: Dims,
    scale: f32,
    q: &CudaPrimitive,
    k: &CudaPrimitive,
    v: &CudaPrimitive,
    mask: &CudaPrimitive,
) -> (CudaPrimitive, CudaPrimitive) {
    let out = empty_f32(q, vec![d.batch, d.seq, d.heads, d.head_dim]);
    let lse = empty_f32(q, vec![d.batch, d.heads, d.seq]);
    d.kernel("verl_attention_forward").launch(
        &q.client,
        d.grid(d.heads),
        &[q, k, v, mask, &out, &lse],
        d.params(scale),
    );
    (out, lse)
}

/// `t` as a contiguous bf16 tensor, the kernels' operand (one cast, which also makes it
/// contiguous, where the f32 path copied it).
fn bf16_operand(t: CudaPrimitive) -> CudaPrimitive {
    into_contiguous(cast(t, DType::BF16))
}

/// What the backward needs: the inputs (bf16), the output and its log-sum-exp.
#[derive(Debug, Clone)]
struct Saved {
    d: Dims,
    scale: f32,
    q: CudaPrimitive,
    k: CudaPrimitive,
    v: CudaPrimitive,
    mask: CudaPrimitive,
    out: CudaPrimitive,
    lse: CudaPrimitive,
}

/// Gradients of q, k and v for the output's gradient `dout`.
fn backward_primitive(s: &Saved, dout: CudaPrimitive) -> [CudaPrimitive; 3] {
    let d = s.d;
    let dout = bf16_operand(dout);
    let dq = empty_f32(&s.q, vec![d.batch, d.seq, d.heads, d.head_dim]);
    let delta = empty_f32(&s.q, vec![d.batch, d.heads, d.seq]);
    // Per query head; each group's heads are summed below.
    let dk = empty_f32(&s.q, vec![d.batch, d.seq, d.heads, d.head_dim]);
    let dv = empty_f32(&s.q, vec![d.batch, d.seq, d.heads, d.head_dim]);
    let client = &s.q.client;
    d.kernel("verl_attention_backward_dq").launch(
        client,
        d.grid(d.heads),
        &[
            &s.q, &s.k, &s.v, &s.mask, &s.out, &dout, &s.lse, &dq, &delta,
        ],
        d.params(s.scale),
    );
    d.kernel("verl_attention_backward_dkv").launch(
        client,
        d.grid(d.heads),
        &[&s.q, &s.k, &s.v, &s.mask, &dout, &s.lse, &delta, &dk, &dv],
        d.params(s.scale),
    );
    [dq, per_kv_head(d, dk), per_kv_head(d, dv)]
}

/// dk or dv per query head `[batch, seq, heads, head_dim]` summed over each kv head's group
/// (`verl_attention_group_sum`, the heads added in order): `[batch, seq, kv_heads, head_dim]`.
fn per_kv_head(d: Dims, g: CudaPrimitive) -> CudaPrimitive {
    if d.heads == d.kv_heads {
        return g;
    }
    let out = empty_f32(&g, vec![d.batch, d.seq, d.kv_heads, d.head_dim]);
    let units = d.batch * d.seq * d.kv_heads * d.head_dim / 4;
    CudaSource {
        block: GROUP_SUM_THREADS,
        shared_bytes: 0,
        ..d.kernel("verl_attention_group_sum")
    }
    .launch(
        &g.client,
        (units.div_ceil(GROUP_SUM_THREADS as usize) as u32, 1, 1),
        &[&g, &out],
        d.params(0.0),
    );
    out
}

#[derive(Debug)]
struct AttentionBackward;

impl Backward<CudaBackend, 3> for AttentionBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<CudaBackend>(&ops.node);
        let parents = ops.parents;
        if parents.iter().all(Option::is_none) {
            return;
        }
        let g = backward_primitive(&ops.state, dout);
        for (parent, grad) in parents.into_iter().zip(g) {
            if let Some(node) = parent {
                grads.register::<CudaBackend>(node.id, grad);
            }
        }
    }
}

/// The inputs handed back when the kernel does not apply.
pub type NotApplied<B> = (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>);

fn contiguous<const D: usize>(t: Tensor<CudaBackend, D>) -> CudaPrimitive {
    into_contiguous(t.into_primitive().tensor())
}

fn wrap<const D: usize>(p: CudaPrimitive) -> Tensor<CudaBackend, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// Whether the fused kernel is on and takes heads of `head_dim`.
pub fn applies(head_dim: usize) -> bool {
    SWITCH.enabled() && supports_head_dim(head_dim)
}

/// The launch's sizes when the kernel takes these operands.
fn dims_of<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    key_mask: Option<&Tensor<B, 2>>,
) -> Option<Dims> {
    let [batch, seq, heads, head_dim] = q.dims();
    let [kb, ks, kv_heads, kd] = k.dims();
    let fits = applies(head_dim)
        && [kb, ks, kd] == [batch, seq, head_dim]
        && v.dims() == k.dims()
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && seq > 0
        // The grid is (query tiles, heads, batch): y and z may not pass 65 535.
        && (1..=65_535).contains(&heads)
        && (1..=65_535).contains(&batch)
        && [q.dtype(), k.dtype(), v.dtype()]
            .iter()
            .all(|t| *t == DType::F32)
        // The kernel reads the keys' mask as dense f32 [batch, seq].
        && key_mask.is_none_or(|m| m.dtype() == DType::F32 && m.dims() == [batch, seq]);
    fits.then_some(Dims {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
        window: 0,
    })
}

/// Causal attention of `q` `[batch, seq, heads, head_dim]` over `k`, `v`
/// `[batch, seq, kv_heads, head_dim]` (f32; query head `h` reads kv head
/// `h / (heads / kv_heads)`), scores scaled by `scores.scale` and within its sliding window;
/// `key_mask` `[batch, seq]` (1 = token) masks padded keys, a padded query attending to itself. Returns `[batch, seq, heads,
/// head_dim]` f32 by the forward kernel (inference); otherwise the inputs come back for the
/// decomposed path.
pub fn attention(
    q: Tensor<CudaBackend, 4>,
    k: Tensor<CudaBackend, 4>,
    v: Tensor<CudaBackend, 4>,
    key_mask: Option<Tensor<CudaBackend, 2>>,
    scores: FusedScores,
) -> Result<Tensor<CudaBackend, 4>, NotApplied<CudaBackend>> {
    let Some(d) = dims_of(&q, &k, &v, key_mask.as_ref()) else {
        return Err((q, k, v));
    };
    let (d, scale) = (d.with_window(scores.window), scores.scale);
    let mask = key_mask.unwrap_or_else(|| Tensor::ones([d.batch, d.seq], &q.device()));
    let operand = |t: Tensor<CudaBackend, 4>| bf16_operand(t.into_primitive().tensor());
    let (out, _) = forward_primitive(
        d,
        scale,
        &operand(q),
        &operand(k),
        &operand(v),
        &contiguous(mask),
    );
    Ok(wrap::<4>(out))
}

/// [`attention`] under autodiff, differentiable in q, k and v by the backward kernels.
pub fn attention_tracked<C: CheckpointStrategy>(
    q: Tensor<Autodiff<CudaBackend, C>, 4>,
    k: Tensor<Autodiff<CudaBackend, C>, 4>,
    v: Tensor<Autodiff<CudaBackend, C>, 4>,
    key_mask: Option<Tensor<Autodiff<CudaBackend, C>, 2>>,
    scores: FusedScores,
) -> Result<Tensor<Autodiff<CudaBackend, C>, 4>, NotApplied<Autodiff<CudaBackend, C>>> {
    let Some(d) = dims_of(&q, &k, &v, key_mask.as_ref()) else {
        return Err((q, k, v));
    };
    let (d, scale) = (d.with_window(scores.window), scores.scale);
    let mask = match key_mask {
        Some(m) => m.inner(),
        None => Tensor::ones([d.batch, d.seq], &q.device()),
    };
    let (q, k, v) = (
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
    );
    let (qp, kp, vp) = (
        bf16_operand(q.primitive.clone()),
        bf16_operand(k.primitive.clone()),
        bf16_operand(v.primitive.clone()),
    );
    let mask = contiguous(mask);
    let (out, lse) = forward_primitive(d, scale, &qp, &kp, &vp, &mask);
    let saved = Saved {
        d,
        scale,
        q: qp,
        k: kp,
        v: vp,
        mask,
        out: out.clone(),
        lse,
    };
    Ok(record(AttentionBackward, [&q, &k, &v], saved, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest head size must fit the H100's 227 KiB of shared memory per block.
    #[test]
    fn shared_memory_fits_hopper() {
        for d in [16, 64, 128] {
            for entry in [
                "verl_attention_forward",
                "verl_attention_backward_dq",
                "verl_attention_backward_dkv",
            ] {
                let bytes = shared_bytes(entry, d);
                assert!(
                    bytes <= 227 * 1024,
                    "{entry} at head_dim {d}: {bytes} bytes"
                );
            }
        }
        assert_eq!(shared_bytes("verl_attention_forward", 64), 46_336);
    }

    #[test]
    fn head_dims() {
        assert!(supports_head_dim(64) && supports_head_dim(128) && supports_head_dim(16));
        assert!(!supports_head_dim(0) && !supports_head_dim(72) && !supports_head_dim(256));
    }
}

//! Fused RMSNorm (`norm.cu`): one kernel forward (saving each row's reciprocal RMS) and one
//! backward (the input's gradient and per-block partial sums of the weight's), in place of
//! burn's ~7 operations forward and ~15 backward per norm: two norms per decoder layer make
//! this one of the step's larger sources of launches.
//!
//! It applies to f32 rows. The fallback, and every other backend, is
//! `crate::ops::reference::rms_norm`'s chain of burn operations, which `verl bench kernels`
//! compares this kernel against (output and both gradients, odd sizes).

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, record, CudaPrimitive, KernelSwitch};

/// The kernels after the shared bf16 rounding (`bf16_round.cuh`).
const SOURCE: &str = concat!(include_str!("bf16_round.cuh"), include_str!("norm.cu"));
/// Threads per block and rows per backward block, as in `norm.cu`.
const THREADS: u32 = 256;
const ROWS_PER_BLOCK: usize = 16;
/// The backward keeps one block's weight gradient in shared memory.
const MAX_HIDDEN: usize = 16_384;

/// Whether the fused kernel is used where it applies: on unless `VERL_NORM=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_NORM");

#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    hidden: usize,
    eps: f32,
}

impl Dims {
    fn kernel(&self, entry: &'static str, shared_bytes: usize) -> CudaSource {
        CudaSource {
            entry,
            text: SOURCE,
            defines: Vec::new(),
            block: THREADS,
            shared_bytes,
        }
    }

    fn params(&self) -> Vec<u64> {
        pack_words(&[self.rows as u32, self.hidden as u32, self.eps.to_bits(), 0])
    }

    fn blocks_backward(&self) -> usize {
        self.rows.div_ceil(ROWS_PER_BLOCK)
    }
}

/// `y` `[rows, hidden]` and `rstd` `[rows]`.
fn forward_primitive(
    d: Dims,
    x: &CudaPrimitive,
    w: &CudaPrimitive,
) -> (CudaPrimitive, CudaPrimitive) {
    let y = empty_f32(x, vec![d.rows, d.hidden]);
    let rstd = empty_f32(x, vec![d.rows]);
    d.kernel("verl_rms_norm_forward", 0).launch(
        &x.client,
        (d.rows as u32, 1, 1),
        &[x, w, &y, &rstd],
        d.params(),
    );
    (y, rstd)
}

#[derive(Debug, Clone)]
struct Saved {
    d: Dims,
    x: CudaPrimitive,
    w: CudaPrimitive,
    rstd: CudaPrimitive,
}

/// `dx` `[rows, hidden]` and `dw` `[hidden]`.
fn backward_primitive(s: &Saved, dy: CudaPrimitive) -> (CudaPrimitive, CudaPrimitive) {
    let d = s.d;
    let dy = into_contiguous(dy);
    let dx = empty_f32(&s.x, vec![d.rows, d.hidden]);
    let blocks = d.blocks_backward();
    let partial = empty_f32(&s.x, vec![blocks, d.hidden]);
    d.kernel("verl_rms_norm_backward", d.hidden * 4).launch(
        &s.x.client,
        (blocks as u32, 1, 1),
        &[&s.x, &s.w, &s.rstd, &dy, &dx, &partial],
        d.params(),
    );
    // The partials' column sums in two launches (burn's sum over the first dimension gives
    // each column to one thread); burn's where the column-sum kernel is switched off.
    if super::bias::SWITCH.enabled() {
        return (dx, super::bias::sum_rows(partial));
    }
    let dw = Tensor::<CudaBackend, 2>::from_primitive(TensorPrimitive::Float(partial))
        .sum_dim(0)
        .reshape([d.hidden]);
    (dx, dw.into_primitive().tensor())
}

#[derive(Debug)]
struct NormBackward;

impl Backward<CudaBackend, 2> for NormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<CudaBackend>(&ops.node);
        let [x_node, w_node] = ops.parents;
        if x_node.is_none() && w_node.is_none() {
            return;
        }
        let (dx, dw) = backward_primitive(&ops.state, dy);
        if let Some(node) = x_node {
            grads.register::<CudaBackend>(node.id, dx);
        }
        if let Some(node) = w_node {
            grads.register::<CudaBackend>(node.id, dw);
        }
    }
}

/// What [`rms_norm`] hands back when it does not apply.
pub type NotApplied<B, const D: usize> = (Tensor<B, D>, Tensor<B, 1>);

/// The launch's sizes when the kernel takes f32 `x` `[..., hidden]` and `weight` `[hidden]`.
fn applies<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Option<Dims> {
    let dims = x.dims();
    let hidden = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let fits = SWITCH.enabled()
        && hidden > 0
        && hidden <= MAX_HIDDEN
        && rows > 0
        && rows < (1 << 31)
        && weight.dims() == [hidden]
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32;
    fits.then_some(Dims {
        rows,
        hidden,
        eps: eps as f32,
    })
}

/// `x / sqrt(mean(x², last dim) + eps) · weight` by the forward kernel, or the inputs back.
pub fn rms_norm<const D: usize>(
    x: Tensor<CudaBackend, D>,
    weight: Tensor<CudaBackend, 1>,
    eps: f64,
) -> Result<Tensor<CudaBackend, D>, NotApplied<CudaBackend, D>> {
    let Some(d) = applies(&x, &weight, eps) else {
        return Err((x, weight));
    };
    let dims = x.dims();
    let x = into_contiguous(x.reshape([d.rows, d.hidden]).into_primitive().tensor());
    let w = into_contiguous(weight.into_primitive().tensor());
    let (y, _) = forward_primitive(d, &x, &w);
    let y = Tensor::<CudaBackend, 2>::from_primitive(TensorPrimitive::Float(y));
    Ok(y.reshape(dims))
}

/// [`rms_norm`] under autodiff, differentiable in both inputs by the backward kernel.
pub fn rms_norm_tracked<C: CheckpointStrategy, const D: usize>(
    x: Tensor<Autodiff<CudaBackend, C>, D>,
    weight: Tensor<Autodiff<CudaBackend, C>, 1>,
    eps: f64,
) -> Result<Tensor<Autodiff<CudaBackend, C>, D>, NotApplied<Autodiff<CudaBackend, C>, D>> {
    let Some(d) = applies(&x, &weight, eps) else {
        return Err((x, weight));
    };
    let dims = x.dims();
    Ok(norm_autodiff(d, x.reshape([d.rows, d.hidden]), weight).reshape(dims))
}

/// What [`add_rms_norm_bf16`] hands back when it does not apply.
pub type AddNormNotApplied<B> = (Tensor<B, 2>, Option<Tensor<B, 2>>, Tensor<B, 1>);

/// A decode step's residual sum and the next norm in one launch: `s = h + delta` (`h` itself
/// without `delta`) and `rms_norm(s) · weight` rounded to bf16 (the next products' operand),
/// for f32 `h`, `delta` `[rows, hidden]` and `weight` `[hidden]`: `(s, y)`. Otherwise the
/// inputs come back (the caller adds, norms and casts).
#[allow(clippy::type_complexity)]
pub fn add_rms_norm_bf16(
    h: Tensor<CudaBackend, 2>,
    delta: Option<Tensor<CudaBackend, 2>>,
    weight: Tensor<CudaBackend, 1>,
    eps: f64,
) -> Result<(Tensor<CudaBackend, 2>, Tensor<CudaBackend, 2>), AddNormNotApplied<CudaBackend>> {
    let [rows, hidden] = h.dims();
    let applies = SWITCH.enabled()
        && hidden > 0
        && rows > 0
        && rows < (1 << 31)
        && weight.dims() == [hidden]
        && h.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && delta
            .as_ref()
            .is_none_or(|d| d.dims() == [rows, hidden] && d.dtype() == DType::F32);
    if !applies {
        return Err((h, delta, weight));
    }
    let prim = |t: Tensor<CudaBackend, 2>| into_contiguous(t.into_primitive().tensor());
    let w = into_contiguous(weight.into_primitive().tensor());
    let h = prim(h);
    let add = delta.is_some();
    let (delta, sum) = match delta {
        Some(d) => (prim(d), empty_f32(&h, vec![rows, hidden])),
        // Not read or written without a delta.
        None => (h.clone(), h.clone()),
    };
    let y = super::empty_of(&h, vec![rows, hidden], DType::BF16);
    CudaSource::plain("verl_add_rms_norm_bf16", SOURCE, THREADS).launch(
        &h.client,
        (rows as u32, 1, 1),
        &[&h, &delta, &w, &sum, &y],
        pack_words(&[
            rows as u32,
            hidden as u32,
            (eps as f32).to_bits(),
            add as u32,
        ]),
    );
    let wrap =
        |p: CudaPrimitive| Tensor::<CudaBackend, 2>::from_primitive(TensorPrimitive::Float(p));
    Ok((wrap(sum), wrap(y)))
}

fn norm_autodiff<C: CheckpointStrategy>(
    d: Dims,
    x: Tensor<Autodiff<CudaBackend, C>, 2>,
    w: Tensor<Autodiff<CudaBackend, C>, 1>,
) -> Tensor<Autodiff<CudaBackend, C>, 2> {
    let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
    let (xp, wp) = (
        into_contiguous(x.primitive.clone()),
        into_contiguous(w.primitive.clone()),
    );
    let (y, rstd) = forward_primitive(d, &xp, &wp);
    let saved = Saved {
        d,
        x: xp,
        w: wp,
        rstd,
    };
    record(NormBackward, [&x, &w], saved, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backward's shared memory (one f32 per column; cubecl raises the kernel's limit past
    /// the default 48 KiB) stays within what every GPU since Volta allows, and the launch
    /// shape covers every row.
    #[test]
    fn backward_shared_memory_fits() {
        const { assert!(MAX_HIDDEN * 4 <= 96 * 1024) };
        let d = Dims {
            rows: 33,
            hidden: 896,
            eps: 1e-6,
        };
        assert_eq!(d.blocks_backward(), 3);
        assert_eq!(d.params().len(), 2);
    }
}

//! Fused rotary position embedding (`rope.cu`): one element-wise kernel forward and one
//! backward per tensor, in place of burn's negate, concatenate, two products and a sum (and
//! their gradients), applied to q and k in every attention layer.
//!
//! It applies on burn-cuda to f32 `x` `[batch, seq, heads, dim]` with tables
//! `[batch, seq, 1, dim]` and an even `dim`. The fallback, and every other backend, is
//! [`crate::layers::RotaryEmbedding::apply`]'s burn operations, which `verl bench kernels`
//! compares this kernel against (output and gradient, odd sizes).

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

const SOURCE: &str = include_str!("rope.cu");
/// Threads per block, as in `rope.cu`.
const THREADS: u32 = 256;

/// Whether the fused kernel is used where it applies: on unless `VERL_ROPE=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_ROPE");

/// `[batch · seq, heads, dim]`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    heads: usize,
    dim: usize,
}

/// Rotates contiguous `x` by the tables (the backward's rotation when `backward`), into a new
/// tensor of `x`'s shape.
fn launch(
    d: Dims,
    backward: bool,
    x: &CudaPrimitive,
    cos: &CudaPrimitive,
    sin: &CudaPrimitive,
) -> CudaPrimitive {
    let y = empty_f32(x, x.meta.shape().to_vec());
    let n = d.rows * d.heads * d.dim;
    CudaSource {
        entry: "verl_rope",
        text: SOURCE,
        defines: vec![("BACKWARD", backward as u32)],
        block: THREADS,
        shared_bytes: 0,
    }
    .launch(
        &x.client,
        (n.div_ceil(THREADS as usize) as u32, 1, 1),
        &[x, cos, sin, &y],
        pack_words(&[d.rows as u32, d.heads as u32, d.dim as u32, 0]),
    );
    y
}

#[derive(Debug, Clone)]
struct Saved {
    d: Dims,
    cos: CudaPrimitive,
    sin: CudaPrimitive,
}

#[derive(Debug)]
struct RopeBackward;

impl Backward<CudaBackend, 1> for RopeBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = into_contiguous(grads.consume::<CudaBackend>(&ops.node));
        if let [Some(node)] = ops.parents {
            let s = ops.state;
            grads.register::<CudaBackend>(node.id, launch(s.d, true, &dy, &s.cos, &s.sin));
        }
    }
}

/// The launch's sizes when the kernel takes f32 `x` `[batch, seq, heads, dim]` and tables
/// `[batch, seq, 1, dim]`.
fn applies<B: Backend>(x: &Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Option<Dims> {
    let [b, t, heads, dim] = x.dims();
    let n = b * t * heads * dim;
    let fits = SWITCH.enabled()
        && n > 0
        && n < (1 << 31)
        && dim.is_multiple_of(2)
        && cos.dims() == [b, t, 1, dim]
        && sin.dims() == [b, t, 1, dim]
        && [x.dtype(), cos.dtype(), sin.dtype()]
            .iter()
            .all(|d| *d == DType::F32);
    fits.then_some(Dims {
        rows: b * t,
        heads,
        dim,
    })
}

fn table(t: Tensor<CudaBackend, 4>) -> CudaPrimitive {
    into_contiguous(t.into_primitive().tensor())
}

/// `x · cos + rotate_half(x) · sin` for `x` `[batch, seq, heads, dim]` and tables
/// `[batch, seq, 1, dim]` by the forward kernel; otherwise `x` comes back.
pub fn rope(
    x: Tensor<CudaBackend, 4>,
    cos: &Tensor<CudaBackend, 4>,
    sin: &Tensor<CudaBackend, 4>,
) -> Result<Tensor<CudaBackend, 4>, Tensor<CudaBackend, 4>> {
    let Some(d) = applies(&x, cos, sin) else {
        return Err(x);
    };
    let xp = into_contiguous(x.into_primitive().tensor());
    let y = launch(d, false, &xp, &table(cos.clone()), &table(sin.clone()));
    Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
}

/// [`rope`] under autodiff, differentiable in `x` (the tables are constants: no gradient flows
/// to them).
pub fn rope_tracked<C: CheckpointStrategy>(
    x: Tensor<Autodiff<CudaBackend, C>, 4>,
    cos: &Tensor<Autodiff<CudaBackend, C>, 4>,
    sin: &Tensor<Autodiff<CudaBackend, C>, 4>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, 4>, Tensor<Autodiff<CudaBackend, C>, 4>> {
    let Some(d) = applies(&x, cos, sin) else {
        return Err(x);
    };
    let (cos, sin) = (table(cos.clone().inner()), table(sin.clone().inner()));
    let x = x.into_primitive().tensor();
    let xp = into_contiguous(x.primitive.clone());
    let y = launch(d, false, &xp, &cos, &sin);
    Ok(record(RopeBackward, [&x], Saved { d, cos, sin }, y))
}

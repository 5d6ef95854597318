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
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{downcast, empty_f32, record, same, CudaPrimitive, KernelSwitch};

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

/// `x · cos + rotate_half(x) · sin` for `x` `[batch, seq, heads, dim]` and tables
/// `[batch, seq, 1, dim]` (constants: no gradient flows to them), differentiable in `x`, on
/// burn-cuda when the kernel applies; otherwise `x` comes back.
pub fn try_rope<B: Backend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 4>,
    sin: &Tensor<B, 4>,
) -> Result<Tensor<B, 4>, Tensor<B, 4>> {
    let [b, t, heads, dim] = x.dims();
    let n = b * t * heads * dim;
    let applies = SWITCH.enabled()
        && super::is_cuda_or_autodiff::<B>()
        && n > 0
        && n < (1 << 31)
        && dim.is_multiple_of(2)
        && cos.dims() == [b, t, 1, dim]
        && sin.dims() == [b, t, 1, dim]
        && [x.dtype(), cos.dtype(), sin.dtype()]
            .iter()
            .all(|d| *d == DType::F32);
    if !applies {
        return Err(x);
    }
    let d = Dims {
        rows: b * t,
        heads,
        dim,
    };
    let table = |c: &Tensor<B, 4>| -> CudaPrimitive {
        let inner: Tensor<CudaBackend, 4> = match downcast::<_, Tensor<CudaBackend, 4>>(c.clone()) {
            Ok(c) => c,
            Err(c) => same::<_, Tensor<Autodiff<CudaBackend>, 4>>(c).inner(),
        };
        into_contiguous(inner.into_primitive().tensor())
    };
    let (cos, sin) = (table(cos), table(sin));
    let x = match downcast::<_, Tensor<CudaBackend, 4>>(x) {
        Ok(x) => {
            let xp = into_contiguous(x.into_primitive().tensor());
            let y = launch(d, false, &xp, &cos, &sin);
            return Ok(same(Tensor::<CudaBackend, 4>::from_primitive(
                TensorPrimitive::Float(y),
            )));
        }
        Err(x) => x,
    };
    let x: Tensor<Autodiff<CudaBackend>, 4> = same(x);
    let x = x.into_primitive().tensor();
    let xp = into_contiguous(x.primitive.clone());
    let y = launch(d, false, &xp, &cos, &sin);
    Ok(same(record::<_, 1, 4>(
        RopeBackward,
        [&x],
        Saved { d, cos, sin },
        y,
    )))
}

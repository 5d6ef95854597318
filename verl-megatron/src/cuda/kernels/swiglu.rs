//! Fused SwiGLU gate (`swiglu.cu`): `silu(gate) · up` in one element-wise kernel forward and
//! one backward (both gradients), in place of burn's sigmoid, products and their gradients.
//!
//! It applies on burn-cuda to f32 tensors of one shape. The fallback, and every other backend,
//! is `silu(gate) * up` in burn operations ([`crate::models::mlp::SwiGlu`]), which
//! `verl bench kernels` compares this kernel against (output and both gradients, odd sizes).

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

/// The kernels after the shared bf16 rounding (`bf16_round.cuh`).
const SOURCE: &str = concat!(include_str!("bf16_round.cuh"), include_str!("swiglu.cu"));
/// Threads per block, as in `swiglu.cu`.
const THREADS: u32 = 256;

/// Whether the fused kernel is used where it applies: on unless `VERL_SWIGLU=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_SWIGLU");

fn launch(entry: &'static str, n: usize, buffers: &[&CudaPrimitive]) {
    CudaSource {
        entry,
        text: SOURCE,
        defines: Vec::new(),
        block: THREADS,
        shared_bytes: 0,
    }
    .launch(
        &buffers[0].client,
        (n.div_ceil(THREADS as usize) as u32, 1, 1),
        buffers,
        pack_words(&[n as u32, 0]),
    );
}

fn forward_primitive(g: &CudaPrimitive, u: &CudaPrimitive) -> CudaPrimitive {
    let out = empty_f32(g, g.meta.shape().to_vec());
    launch(
        "verl_swiglu_forward",
        g.meta.shape().num_elements(),
        &[g, u, &out],
    );
    out
}

#[derive(Debug, Clone)]
struct Saved {
    g: CudaPrimitive,
    u: CudaPrimitive,
}

#[derive(Debug)]
struct SwigluBackward;

impl Backward<CudaBackend, 2> for SwigluBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = into_contiguous(grads.consume::<CudaBackend>(&ops.node));
        let [g_node, u_node] = ops.parents;
        if g_node.is_none() && u_node.is_none() {
            return;
        }
        let Saved { g, u } = ops.state;
        let shape = g.meta.shape().to_vec();
        let (dg, du) = (empty_f32(&g, shape.clone()), empty_f32(&g, shape));
        launch(
            "verl_swiglu_backward",
            g.meta.shape().num_elements(),
            &[&g, &u, &dout, &dg, &du],
        );
        if let Some(node) = g_node {
            grads.register::<CudaBackend>(node.id, dg);
        }
        if let Some(node) = u_node {
            grads.register::<CudaBackend>(node.id, du);
        }
    }
}

/// `silu(gate) · up` for f32 tensors of one shape, differentiable in both, on burn-cuda when
/// the kernel applies; otherwise the inputs come back for burn's operations.
pub fn try_swiglu<B: Backend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Result<Tensor<B, D>, (Tensor<B, D>, Tensor<B, D>)> {
    let n = gate.shape().num_elements();
    let applies = SWITCH.enabled()
        && super::is_cuda_or_autodiff::<B>()
        && gate.dims() == up.dims()
        && n > 0
        && n < (1 << 31)
        && gate.dtype() == DType::F32
        && up.dtype() == DType::F32;
    if !applies {
        return Err((gate, up));
    }
    let gate = match downcast::<_, Tensor<CudaBackend, D>>(gate) {
        Ok(g) => {
            let u: Tensor<CudaBackend, D> = same(up);
            let out = forward_primitive(
                &into_contiguous(g.into_primitive().tensor()),
                &into_contiguous(u.into_primitive().tensor()),
            );
            return Ok(same(Tensor::<CudaBackend, D>::from_primitive(
                TensorPrimitive::Float(out),
            )));
        }
        Err(g) => g,
    };
    match downcast::<_, Tensor<Autodiff<CudaBackend>, D>>(gate) {
        Ok(g) => Ok(same(swiglu_autodiff(g, same(up)))),
        Err(g) => Err((g, up)),
    }
}

/// A decode step's `silu(gate) · up` from the fused gate/up product `gu` `[rows, 2 · inter]`
/// (gate columns first, f32), rounded to bf16 for the down projection: `[rows, inter]` bf16 in
/// one launch, on plain burn-cuda; otherwise `gu` comes back (the caller splits it and takes
/// [`try_swiglu`]'s path and a cast).
pub fn try_swiglu_packed_bf16<B: Backend>(gu: Tensor<B, 2>) -> Result<Tensor<B, 2>, Tensor<B, 2>> {
    let [rows, width] = gu.dims();
    let inter = width / 2;
    let applies = SWITCH.enabled()
        && super::is_cuda::<B>()
        && width.is_multiple_of(2)
        && rows * inter > 0
        && rows * width < (1 << 31)
        && gu.dtype() == DType::F32;
    if !applies {
        return Err(gu);
    }
    let gu: Tensor<CudaBackend, 2> = same(gu);
    let gu = into_contiguous(gu.into_primitive().tensor());
    let out = super::empty_of(&gu, vec![rows, inter], DType::BF16);
    CudaSource {
        entry: "verl_swiglu_packed_bf16",
        text: SOURCE,
        defines: Vec::new(),
        block: THREADS,
        shared_bytes: 0,
    }
    .launch(
        &gu.client,
        ((rows * inter).div_ceil(THREADS as usize) as u32, 1, 1),
        &[&gu, &out],
        pack_words(&[rows as u32, inter as u32]),
    );
    Ok(same(Tensor::<CudaBackend, 2>::from_primitive(
        TensorPrimitive::Float(out),
    )))
}

fn swiglu_autodiff<const D: usize>(
    g: Tensor<Autodiff<CudaBackend>, D>,
    u: Tensor<Autodiff<CudaBackend>, D>,
) -> Tensor<Autodiff<CudaBackend>, D> {
    let (g, u) = (g.into_primitive().tensor(), u.into_primitive().tensor());
    let (gp, up) = (
        into_contiguous(g.primitive.clone()),
        into_contiguous(u.primitive.clone()),
    );
    let out = forward_primitive(&gp, &up);
    record(SwigluBackward, [&g, &u], Saved { g: gp, u: up }, out)
}

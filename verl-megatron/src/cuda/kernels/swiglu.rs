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
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, record, CudaPrimitive, KernelSwitch};

/// The kernels after the shared bf16 rounding (`bf16_round.cuh`).
const SOURCE: &str = concat!(include_str!("bf16_round.cuh"), include_str!("swiglu.cu"));
/// Threads per block, as in `swiglu.cu`.
const THREADS: u32 = 256;

/// Whether the fused kernel is used where it applies: on unless `VERL_SWIGLU=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_SWIGLU");

fn launch(entry: &'static str, n: usize, buffers: &[&CudaPrimitive]) {
    CudaSource::plain(entry, SOURCE, THREADS).launch(
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

/// Whether the kernel takes `gate` and `up` (f32, one shape).
fn applies<B: Backend, const D: usize>(gate: &Tensor<B, D>, up: &Tensor<B, D>) -> bool {
    let n = gate.shape().num_elements();
    SWITCH.enabled()
        && gate.dims() == up.dims()
        && n > 0
        && n < (1 << 31)
        && gate.dtype() == DType::F32
        && up.dtype() == DType::F32
}

/// The inputs handed back.
pub type NotApplied<B, const D: usize> = (Tensor<B, D>, Tensor<B, D>);

/// `silu(gate) · up` for f32 tensors of one shape by the forward kernel; otherwise the inputs
/// come back for burn's operations.
pub fn swiglu<const D: usize>(
    gate: Tensor<CudaBackend, D>,
    up: Tensor<CudaBackend, D>,
) -> Result<Tensor<CudaBackend, D>, NotApplied<CudaBackend, D>> {
    if !applies(&gate, &up) {
        return Err((gate, up));
    }
    let out = forward_primitive(
        &into_contiguous(gate.into_primitive().tensor()),
        &into_contiguous(up.into_primitive().tensor()),
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// [`swiglu`] under autodiff, differentiable in both inputs by the backward kernel.
pub fn swiglu_tracked<C: CheckpointStrategy, const D: usize>(
    gate: Tensor<Autodiff<CudaBackend, C>, D>,
    up: Tensor<Autodiff<CudaBackend, C>, D>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, D>, NotApplied<Autodiff<CudaBackend, C>, D>> {
    if !applies(&gate, &up) {
        return Err((gate, up));
    }
    let (g, u) = (gate.into_primitive().tensor(), up.into_primitive().tensor());
    let (gp, up) = (
        into_contiguous(g.primitive.clone()),
        into_contiguous(u.primitive.clone()),
    );
    let out = forward_primitive(&gp, &up);
    Ok(record(
        SwigluBackward,
        [&g, &u],
        Saved { g: gp, u: up },
        out,
    ))
}

/// A decode step's `silu(gate) · up` from the fused gate/up product `gu` `[rows, 2 · inter]`
/// (gate columns first, f32), rounded to bf16 for the down projection: `[rows, inter]` bf16 in
/// one launch; otherwise `gu` comes back (the caller splits it and takes [`swiglu`]'s path and
/// a cast).
pub fn swiglu_packed_bf16(
    gu: Tensor<CudaBackend, 2>,
) -> Result<Tensor<CudaBackend, 2>, Tensor<CudaBackend, 2>> {
    let [rows, width] = gu.dims();
    let inter = width / 2;
    let applies = SWITCH.enabled()
        && width.is_multiple_of(2)
        && rows * inter > 0
        && rows * width < (1 << 31)
        && gu.dtype() == DType::F32;
    if !applies {
        return Err(gu);
    }
    let gu = into_contiguous(gu.into_primitive().tensor());
    let out = super::empty_of(&gu, vec![rows, inter], DType::BF16);
    CudaSource::plain("verl_swiglu_packed_bf16", SOURCE, THREADS).launch(
        &gu.client,
        ((rows * inter).div_ceil(THREADS as usize) as u32, 1, 1),
        &[&gu, &out],
        pack_words(&[rows as u32, inter as u32]),
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

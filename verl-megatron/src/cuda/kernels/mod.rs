//! Kernels of our own on burn-cuda's stream (`#[cube]` kernels, CUDA C++ through a `CubeTask`,
//! and cubek's matmul with fixed strategies), one module per family. Each is launched through
//! the `CubeTensor`'s own client, so it is ordered with burn's operations with no host
//! synchronisation. Each entry point takes burn-cuda tensors (plain, or under autodiff for the
//! `*_tracked` ones) and hands its inputs back where it does not apply (a dtype, a size, its
//! switch); [`super::ops`] then runs the plain chain of `crate::ops::reference`, which
//! `verl bench kernels` compares each kernel against on a GPU. This module knows no model or
//! worker type: the values it exchanges are `crate::ops`'.

pub mod adamw;
pub mod attention;
pub mod bias;
pub mod collectives;
pub mod decode_attention;
pub mod decode_gemm;
pub mod decode_wgmma;
pub mod gemm;
pub mod host_copy;
pub mod norm;
pub mod rope;
pub mod sampling;
pub mod source;
pub mod sum_squares;
pub mod swiglu;
pub mod vocab;

use std::sync::atomic::{AtomicU8, Ordering};

use burn::backend::Autodiff;
use burn::prelude::Tensor;
use burn::tensor::{DType, TensorPrimitive};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::ops::{Backward, OpsKind};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;

use verl_core::backend::CudaBackend;

/// burn-cuda's float tensor primitive.
pub type CudaPrimitive = burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>;

/// An on/off switch for one kernel family, read from an environment variable the first time
/// (`VAR=decomposed` turns the kernel off) and settable for the process (benchmarks compare
/// a kernel with its fallback).
pub struct KernelSwitch {
    /// 0: not read yet, 1: off, 2: on.
    state: AtomicU8,
    var: &'static str,
}

impl KernelSwitch {
    pub const fn new(var: &'static str) -> Self {
        Self {
            state: AtomicU8::new(0),
            var,
        }
    }

    /// Whether the kernel is on.
    pub fn enabled(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = std::env::var(self.var).as_deref() != Ok("decomposed");
                self.set(on);
                on
            }
            1 => false,
            _ => true,
        }
    }

    /// Turns the kernel on or off for the process.
    pub fn set(&self, on: bool) {
        self.state.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }
}

/// Streaming multiprocessors of `on`'s device (132, an H100's, where the driver does not say):
/// what grid sizes are chosen against.
pub(crate) fn multiprocessors(on: &CudaPrimitive) -> usize {
    on.client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132) as usize
}

/// A new contiguous f32 tensor of `shape` on `like`'s device and stream, uninitialised.
pub(crate) fn empty_f32(like: &CudaPrimitive, shape: Vec<usize>) -> CudaPrimitive {
    empty_of(like, shape, DType::F32)
}

/// A product's sizes `(m, k, n)`: `lhs` `[.., m, k]` times `rhs` `[.., k, n]`.
pub(crate) fn product_dims(lhs: &CudaPrimitive, rhs: &CudaPrimitive) -> (usize, usize, usize) {
    let (ls, rs) = (lhs.meta.shape(), rhs.meta.shape());
    let nd = ls.num_dims();
    (ls[nd - 2], ls[nd - 1], rs[rs.num_dims() - 1])
}

/// The row pitch of a product's result `out` (`[.., m, n]`).
pub(crate) fn row_pitch(out: &CudaPrimitive) -> usize {
    let strides = out.meta.strides();
    strides[strides.len() - 2]
}

/// A new contiguous tensor of `dtype` and `shape` on `like`'s device and stream, uninitialised.
pub(crate) fn empty_of(like: &CudaPrimitive, shape: Vec<usize>, dtype: DType) -> CudaPrimitive {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        dtype,
    )
}

/// burn-cuda's float tensor primitive under autodiff (the values and their graph node; the
/// same type whatever the checkpointing strategy).
pub(crate) type AutodiffPrimitive = burn::tensor::ops::FloatTensor<Autodiff<CudaBackend>>;

/// `output`, computed by our kernel from `parents`, as a node of burn's autodiff graph whose
/// backward is `op` (given `state` when some parent is tracked).
pub(crate) fn record<C: CheckpointStrategy, Op, const N: usize, const D: usize>(
    op: Op,
    parents: [&AutodiffPrimitive; N],
    state: Op::State,
    output: CudaPrimitive,
) -> Tensor<Autodiff<CudaBackend, C>, D>
where
    Op: Backward<CudaBackend, N>,
{
    let prep = op.prepare::<C>(parents.map(|p| p.node.clone()));
    let output = match prep.compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

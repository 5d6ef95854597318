//! A bias added to every row, whose gradient (the output gradient summed over rows) is two
//! launches of `bias.cu`'s column sum instead of burn's reduction over the first dimension,
//! which gives each column to one thread of one or two blocks: the q/k/v biases and the
//! RMSNorm weight gradients of the 1.5B step's backward spent 13 % of its GPU time there
//! (docs/PERFORMANCE.md).
//!
//! It applies on `Autodiff<CudaBackend>` to f32 operands (the linear layers add their bias to
//! the f32 product). The fallback, and every other backend, is burn's broadcast add
//! (`crate::ops::reference::add_bias`), which `verl bench kernels` compares this against.

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::DType;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, record, CudaPrimitive, KernelSwitch};

const SOURCE: &str = include_str!("bias.cu");
/// Threads (columns) per block, as in `bias.cu`.
const THREADS: usize = 128;
/// Rows one block adds up in the first pass.
const ROWS_PER_CHUNK: usize = 64;
/// At most this many chunks (the second pass adds that many rows per column).
const MAX_CHUNKS: usize = 1024;

/// Whether the kernel is used where it applies (the linear layers' bias gradients and the fused
/// RMSNorm's weight gradient): on unless `VERL_BIAS=decomposed` in the environment, or
/// `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_BIAS");

/// How `rows` are split into chunks for the first pass: (chunks, rows per chunk).
fn chunking(rows: usize) -> (usize, usize) {
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).clamp(1, MAX_CHUNKS);
    (chunks, rows.div_ceil(chunks))
}

/// One launch: the sums of `rows` rows of `x` `[rows, cols]` per chunk of rows, `[chunks, cols]`
/// (one chunk when `whole`).
fn sum_pass(x: &CudaPrimitive, rows: usize, cols: usize, whole: bool) -> CudaPrimitive {
    let (chunks, per_chunk) = if whole { (1, rows) } else { chunking(rows) };
    let partial = empty_f32(x, vec![chunks, cols]);
    CudaSource::plain("verl_sum_rows", SOURCE, THREADS as u32).launch(
        &x.client,
        (cols.div_ceil(THREADS) as u32, chunks as u32, 1),
        &[x, &partial],
        pack_words(&[rows as u32, cols as u32, per_chunk as u32, 0]),
    );
    partial
}

/// The column sums `[cols]` of an f32 matrix `[rows, cols]` (made contiguous first), in at most
/// two launches; the rows are added in a fixed order, so the result does not vary run to run.
pub fn sum_rows(x: CudaPrimitive) -> CudaPrimitive {
    let x = into_contiguous(x);
    let shape = x.meta.shape().to_vec();
    let (rows, cols) = (shape[0], shape[1]);
    let mut sums = sum_pass(&x, rows, cols, false);
    // The chunks' sums (at most MAX_CHUNKS rows) in one more launch.
    let chunks = sums.meta.shape()[0];
    if chunks > 1 {
        sums = sum_pass(&sums, chunks, cols, true);
    }
    CudaBackend::float_reshape(sums, [cols].into())
}

#[derive(Debug)]
struct BiasBackward;

impl Backward<CudaBackend, 2> for BiasBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<CudaBackend>(&ops.node);
        let [y_node, b_node] = ops.parents;
        if let Some(node) = b_node {
            grads.register::<CudaBackend>(node.id, sum_rows(dout.clone()));
        }
        if let Some(node) = y_node {
            grads.register::<CudaBackend>(node.id, dout);
        }
    }
}

/// The operands handed back.
pub type NotApplied<B> = (Tensor<B, 2>, Tensor<B, 1>);

/// `y + b` with `b` added to every row of `y` `[rows, cols]`, for f32 operands under autodiff,
/// the bias's gradient summed by [`sum_rows`]; otherwise the operands come back for burn's
/// broadcast add. (Without autodiff there is no gradient to sum: burn's add is the whole job.)
pub fn add_bias_tracked<C: CheckpointStrategy>(
    y: Tensor<Autodiff<CudaBackend, C>, 2>,
    b: Tensor<Autodiff<CudaBackend, C>, 1>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, 2>, NotApplied<Autodiff<CudaBackend, C>>> {
    let [rows, cols] = y.dims();
    let applies = SWITCH.enabled()
        && b.dims() == [cols]
        && rows > 0
        && cols > 0
        && rows < (1 << 31)
        && cols < (1 << 31)
        && y.dtype() == DType::F32
        && b.dtype() == DType::F32;
    if !applies {
        return Err((y, b));
    }
    let (y, b) = (y.into_primitive().tensor(), b.into_primitive().tensor());
    let row = CudaBackend::float_reshape(b.primitive.clone(), [1, cols].into());
    let out = CudaBackend::float_add(y.primitive.clone(), row);
    Ok(record(BiasBackward, [&y, &b], (), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_row_within_the_launch_limits() {
        for rows in [1, 63, 64, 65, 2044, 8192, 65_536, 1 << 24] {
            let (chunks, per) = chunking(rows);
            assert!((1..=MAX_CHUNKS).contains(&chunks), "{rows}");
            assert!(chunks * per >= rows && (chunks - 1) * per < rows, "{rows}");
        }
        assert_eq!(chunking(8192), (128, 64));
        assert_eq!(chunking(10), (1, 10));
    }
}

//! Sums of squares of many f32 tensors in few launches (`sum_squares.cu`): the gradient norm
//! reads every parameter's gradient, and burn spends a square and a reduction (two to three
//! launches) on each of the ~300 tensors of a model, with a host-side launch cost that made the
//! optimizer phase host-bound. Here 16 tensors go to each launch, with any row pitch (no copy
//! of burn-cuda's padded rows), and each launch writes per-block partial sums that the host
//! adds in a fixed order.
//!
//! It applies on burn-cuda to f32 tensors (a matrix as it is, any other rank as rows of its
//! last dimension). The fallback, and every other backend, is the square-and-sum per tensor of
//! `crate::ops::reference::sums_of_squares` (the CPU default's gradient norm), which
//! `verl bench kernels` compares this kernel against.

use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, CudaPrimitive, KernelSwitch};

const SOURCE: &str = include_str!("sum_squares.cu");
/// Tensors per launch and threads per block, as in `sum_squares.cu`.
const TENSORS: usize = 16;
const THREADS: u32 = 256;
/// Blocks per tensor: enough to spread the largest gradient (the embedding's) over the GPU
/// with enough loads in flight (about two blocks of 256 threads per multiprocessor).
const BLOCKS: usize = 256;

/// Whether the kernel is used where it applies: on unless `VERL_SUM_SQUARES=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_SUM_SQUARES");

/// `(rows, cols, row stride)` of a matrix whose rows are contiguous (copied first otherwise).
fn as_rows(p: CudaPrimitive) -> (CudaPrimitive, [u32; 3]) {
    let (shape, strides) = (p.meta.shape().to_vec(), p.meta.strides().to_vec());
    let (rows, cols) = (shape[0], shape[1]);
    if strides[1] == 1 && strides[0] >= cols {
        let stride = strides[0];
        (p, [rows as u32, cols as u32, stride as u32])
    } else {
        (into_contiguous(p), [rows as u32, cols as u32, cols as u32])
    }
}

/// The sum of the squares of each tensor's elements (f64, in order), or `None` when the kernel
/// does not apply (another backend, another dtype, or a tensor too large for its indexing).
pub fn sums_of_squares(tensors: &[Tensor<CudaBackend, 2>]) -> Option<Vec<f64>> {
    if !SWITCH.enabled() || tensors.is_empty() {
        return None;
    }
    let fits = |t: &Tensor<CudaBackend, 2>| {
        let [r, c] = t.dims();
        t.dtype() == DType::F32 && r < (1 << 31) && c < (1 << 31)
    };
    if !tensors.iter().all(fits) {
        return None;
    }
    let mut partials = Vec::new();
    for chunk in tensors.chunks(TENSORS) {
        let mut buffers = Vec::with_capacity(TENSORS);
        let mut shapes = Vec::with_capacity(TENSORS);
        for t in chunk {
            let (p, dims) = as_rows(t.clone().into_primitive().tensor());
            buffers.push(p);
            shapes.push(dims);
        }
        // Unused slots repeat the first buffer with no rows.
        while buffers.len() < TENSORS {
            buffers.push(buffers[0].clone());
            shapes.push([0, 0, 0]);
        }
        let out = empty_f32(&buffers[0], vec![TENSORS * BLOCKS]);
        let mut words = Vec::with_capacity(3 * TENSORS + 2);
        for field in 0..3 {
            words.extend(shapes.iter().map(|s| s[field]));
        }
        words.extend([BLOCKS as u32, 0]);
        let mut args: Vec<&CudaPrimitive> = buffers.iter().collect();
        args.push(&out);
        CudaSource::plain("verl_sum_squares", SOURCE, THREADS).launch(
            &out.client,
            (BLOCKS as u32, TENSORS as u32, 1),
            &args,
            pack_words(&words),
        );
        partials.push(Tensor::<CudaBackend, 1>::from_primitive(
            TensorPrimitive::Float(out),
        ));
    }
    // One transfer for every partial sum.
    let values = Tensor::cat(partials, 0).into_data().to_vec::<f32>().ok()?;
    let sums = values
        .chunks(BLOCKS)
        .take(tensors.len())
        .map(|blocks| blocks.iter().map(|&v| v as f64).sum())
        .collect();
    Some(sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's parameter struct: rows, columns and strides of 16 slots, then the block
    /// count, packed two words to a `u64`.
    #[test]
    fn parameters_fill_the_struct() {
        let words = 3 * TENSORS + 2;
        assert_eq!(pack_words(&vec![0; words]).len(), words / 2);
    }
}

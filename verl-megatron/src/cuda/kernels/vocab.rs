//! Fused vocabulary statistics (`vocab.cu`): per row of logits `[rows, vocab]`, the max `m`,
//! `s = Σ exp(x − m)`, the label's logit `p` and `w = Σ exp(x − m)·x`, in one read of the
//! logits, with a backward that writes the logits' gradient in one pass. Log-probabilities and
//! entropy follow from these four numbers per row (and shards of a vocabulary-parallel head
//! combine them), so no `[rows, vocab]` intermediate is ever made: burn's
//! `log_softmax` + `gather` chain reads and writes the logits about a dozen times and keeps
//! several f32 copies of them for its backward.
//!
//! It applies on burn-cuda to f32 or bf16 logits. The fallback, and every other backend, is
//! the chain of burn operations in `models::vocab_parallel`, which `verl bench kernels`
//! compares this kernel against (log-probs, entropy and the logits' gradient, odd sizes,
//! labels outside the shard).

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{DType, IntDType, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{record, CudaPrimitive, KernelSwitch};

const SOURCE: &str = include_str!("vocab.cu");
/// Threads per block and elements per backward thread, as in `vocab.cu`.
const STATS_THREADS: u32 = 512;
const BACKWARD_THREADS: u32 = 256;
const BACKWARD_UNROLL: usize = 8;

/// Whether the fused kernel is used where it applies: on unless `VERL_VOCAB=decomposed` in the
/// environment, or `SWITCH.set(false)` (benchmarks compare the kernel with its fallback).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_VOCAB");

/// A launch's shape and the logits' dtype.
#[derive(Debug, Clone, Copy)]
struct Dims {
    rows: usize,
    vocab: usize,
    bf16: bool,
}

impl Dims {
    fn kernel(&self, entry: &'static str, block: u32) -> CudaSource {
        CudaSource {
            entry,
            text: SOURCE,
            defines: vec![("LOGITS_BF16", self.bf16 as u32)],
            block,
            shared_bytes: 0,
        }
    }

    fn params(&self, ld: usize, ld_grad: usize) -> Vec<u64> {
        pack_words(&[
            self.rows as u32,
            self.vocab as u32,
            ld as u32,
            ld_grad as u32,
        ])
    }
}

/// Row stride of a 2-D primitive whose last dimension is contiguous.
fn row_stride(p: &CudaPrimitive) -> usize {
    p.meta.strides()[0]
}

/// Whether a 2-D primitive's rows are contiguous (any row stride): else it is copied first.
fn rows_contiguous(p: CudaPrimitive) -> CudaPrimitive {
    let strides = p.meta.strides();
    let shape = p.meta.shape();
    if strides[1] == 1 && strides[0] >= shape[1] {
        p
    } else {
        into_contiguous(p)
    }
}

fn stats_primitive(d: Dims, logits: &CudaPrimitive, labels: &CudaPrimitive) -> CudaPrimitive {
    let stats = empty_device_contiguous_dtype(
        logits.client.clone(),
        logits.device.clone(),
        [d.rows, 4].into(),
        DType::F32,
    );
    d.kernel("verl_vocab_stats", STATS_THREADS).launch(
        &logits.client,
        (d.rows as u32, 1, 1),
        &[logits, labels, &stats],
        d.params(row_stride(logits), 0),
    );
    stats
}

/// What the backward needs.
#[derive(Debug, Clone)]
struct Saved {
    d: Dims,
    logits: CudaPrimitive,
    labels: CudaPrimitive,
    stats: CudaPrimitive,
}

fn backward_primitive(s: &Saved, grad: CudaPrimitive) -> CudaPrimitive {
    let d = s.d;
    let grad = into_contiguous(grad);
    let dx = empty_device_contiguous_dtype(
        s.logits.client.clone(),
        s.logits.device.clone(),
        [d.rows, d.vocab].into(),
        s.logits.dtype,
    );
    let chunk = BACKWARD_THREADS as usize * BACKWARD_UNROLL;
    d.kernel("verl_vocab_stats_backward", BACKWARD_THREADS)
        .launch(
            &s.logits.client,
            (d.rows as u32, d.vocab.div_ceil(chunk) as u32, 1),
            &[&s.logits, &s.labels, &s.stats, &grad, &dx],
            d.params(row_stride(&s.logits), row_stride(&dx)),
        );
    dx
}

#[derive(Debug)]
struct StatsBackward;

impl Backward<CudaBackend, 1> for StatsBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<CudaBackend>(&ops.node);
        if let [Some(node)] = ops.parents {
            grads.register::<CudaBackend>(node.id, backward_primitive(&ops.state, grad));
        }
    }
}

/// What [`vocab_stats`] hands back when it does not apply.
pub type NotApplied<B> = (Tensor<B, 2>, Tensor<B, 1, Int>);

/// The launch's sizes when the kernel takes `logits` `[rows, vocab]` (f32 or bf16) and
/// `labels` `[rows]`.
fn dims_of<B: Backend>(logits: &Tensor<B, 2>, labels: &Tensor<B, 1, Int>) -> Option<Dims> {
    let [rows, vocab] = logits.dims();
    let bf16 = match logits.dtype() {
        DType::F32 => false,
        DType::BF16 => true,
        _ => return None,
    };
    // The backward's grid is (rows, vocabulary chunks): y may not pass 65 535.
    let chunks = vocab.div_ceil(BACKWARD_THREADS as usize * BACKWARD_UNROLL);
    let fits = rows > 0 && vocab > 0 && rows < (1 << 31) && chunks <= 65_535;
    (SWITCH.enabled() && fits && labels.dims() == [rows]).then_some(Dims { rows, vocab, bf16 })
}

fn labels_i32(labels: Tensor<CudaBackend, 1, Int>) -> CudaPrimitive {
    into_contiguous(labels.cast(IntDType::I32).into_primitive())
}

/// Per-row `[m, s, p, w]` (`[rows, 4]`, f32) of `logits` `[rows, vocab]` (f32 or bf16) for
/// `labels` `[rows]` (an index into this shard, or negative when the label lies outside it:
/// then `p` is 0); see the module documentation. By the statistics kernel when it applies;
/// otherwise the inputs come back.
pub fn vocab_stats(
    logits: Tensor<CudaBackend, 2>,
    labels: Tensor<CudaBackend, 1, Int>,
) -> Result<Tensor<CudaBackend, 2>, NotApplied<CudaBackend>> {
    let Some(d) = dims_of(&logits, &labels) else {
        return Err((logits, labels));
    };
    let x = rows_contiguous(logits.into_primitive().tensor());
    let stats = stats_primitive(d, &x, &labels_i32(labels));
    Ok(Tensor::from_primitive(TensorPrimitive::Float(stats)))
}

/// [`vocab_stats`] under autodiff: differentiable in the logits through `s`, `p` and `w` (`m`
/// must be used as a constant), the gradient written by the backward kernel in one pass.
pub fn vocab_stats_tracked<C: CheckpointStrategy>(
    logits: Tensor<Autodiff<CudaBackend, C>, 2>,
    labels: Tensor<Autodiff<CudaBackend, C>, 1, Int>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, 2>, NotApplied<Autodiff<CudaBackend, C>>> {
    let Some(d) = dims_of(&logits, &labels) else {
        return Err((logits, labels));
    };
    // Labels are integers: under autodiff their values are the inner backend's.
    let labels = labels_i32(labels.inner());
    let x = logits.into_primitive().tensor();
    let xp = rows_contiguous(x.primitive.clone());
    let stats = stats_primitive(d, &xp, &labels);
    let saved = Saved {
        d,
        logits: xp,
        labels,
        stats: stats.clone(),
    };
    Ok(record(StatsBackward, [&x], saved, stats))
}

//! Every row of a logits matrix sampled in one launch of `sampling.cu` (one block per row):
//! the rollout engine's decode step reads back 16 bytes per row instead of the whole
//! vocabulary's logits. The semantics and the host reference are in [`crate::sampling`]; the
//! fallback is the engine's host sampler, which gets the logits back.

use burn::prelude::*;
use burn::tensor::{DType, TensorData, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, CudaPrimitive, KernelSwitch};
use crate::ops::{RowSampling, SampledToken, ShardDraw};

const SOURCE: &str = include_str!("sampling.cu");
/// Threads per block (one block per row), as in `sampling.cu`.
const THREADS: u32 = 1024;

/// Whether the kernel samples where it applies: on unless `VERL_SAMPLING=decomposed`.
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_SAMPLING");

/// Whether a rollout tp group samples from its vocabulary shards (`verl_sample_shard`): on
/// unless `VERL_SAMPLE_SHARDS=decomposed`, which gathers the logits for the whole-row kernel.
pub static SHARD_SWITCH: KernelSwitch = KernelSwitch::new("VERL_SAMPLE_SHARDS");

/// Whether few rows are sampled in pieces of their vocabulary (one block a piece, see
/// [`pieces`]): on unless `VERL_SAMPLE_PIECES=decomposed`, which keeps one block a row.
pub static PIECES_SWITCH: KernelSwitch = KernelSwitch::new("VERL_SAMPLE_PIECES");

/// Columns a piece of a row holds at least.
const MIN_PIECE: usize = 4096;

/// Pieces each of `rows` rows over `vocab` columns is sampled in on a GPU of `sms`
/// multiprocessors: one block a row leaves all but `rows` multiprocessors idle and each block
/// walks the whole row, its loads one after another, so few rows are split until there are
/// about two blocks a multiprocessor, each piece at least [`MIN_PIECE`] columns.
pub fn pieces(rows: usize, vocab: usize, sms: usize) -> usize {
    (2 * sms)
        .div_ceil(rows.max(1))
        .min(vocab / MIN_PIECE)
        .clamp(1, 64)
}

/// The 8 words `sampling.cu`'s `RowParams` reads for a row.
fn row_words(r: &RowSampling) -> [u32; 8] {
    [
        r.temperature.to_bits(),
        r.top_k as u32,
        r.top_p.to_bits(),
        r.min_p.to_bits(),
        r.seed as u32,
        (r.seed >> 32) as u32,
        r.step,
        0,
    ]
}

/// The rows' `RowParams` on the device.
fn row_params(rows: &[RowSampling], device: &Device<CudaBackend>) -> CudaPrimitive {
    let words: Vec<f32> = rows
        .iter()
        .flat_map(row_words)
        .map(f32::from_bits)
        .collect();
    let n = words.len();
    Tensor::<CudaBackend, 1>::from_data(TensorData::new(words, [n]), device)
        .into_primitive()
        .tensor()
}

/// Samples each row of f32 `logits` `[rows, vocab]` (the draw `crate::sampling` documents);
/// the logits come back where the kernel does not apply.
pub fn sample(
    logits: Tensor<CudaBackend, 2>,
    rows: &[RowSampling],
) -> Result<Vec<SampledToken>, Tensor<CudaBackend, 2>> {
    let [n, vocab] = logits.dims();
    let applies = SWITCH.enabled()
        && n == rows.len()
        && n > 0
        && n < (1 << 31)
        && vocab > 0
        && vocab < (1 << 31)
        && logits.dtype() == DType::F32;
    if !applies {
        return Err(logits);
    }
    let device = logits.device();
    let x = into_contiguous(logits.into_primitive().tensor());
    let params = row_params(rows, &device);
    let split = pieces(n, vocab, super::multiprocessors(&x));
    if split > 1 && PIECES_SWITCH.enabled() && rows.iter().all(|r| r.draws_from_shards(vocab)) {
        return Ok(sample_in_pieces(x, params, rows, split));
    }
    let out = empty_f32(&x, vec![n, 4]);
    CudaSource::plain("verl_sample_rows", SOURCE, THREADS).launch(
        &x.client,
        (n as u32, 1, 1),
        &[&x, &params, &out],
        pack_words(&[n as u32, vocab as u32, vocab as u32, 0]),
    );
    crate::host_reads::note(1);
    let values = Tensor::<CudaBackend, 2>::from_primitive(TensorPrimitive::Float(out))
        .into_data()
        .to_vec::<f32>()
        .expect("an f32 tensor reads as f32");
    Ok(values
        .chunks(4)
        .map(|o| SampledToken {
            token: o[0].to_bits(),
            log_prob: o[1],
            entropy: o[2],
            kept: o[3] as u32,
        })
        .collect())
}

/// Rows with no top-k or top-p sampled as `split` shards of their own vocabulary each
/// (`verl_row_max` and `verl_sample_shard` over pieces of the row), the pieces' draws combined
/// on the host as a tensor-parallel group's are ([`crate::sampling::combine_shard_draws`]): the
/// same token as the whole-row kernel, the log-prob and entropy up to the order of a sum.
fn sample_in_pieces(
    x: CudaPrimitive,
    params: CudaPrimitive,
    rows: &[RowSampling],
    split: usize,
) -> Vec<SampledToken> {
    let (n, vocab) = (rows.len(), x.meta.shape()[1]);
    let chunk = vocab.div_ceil(split);
    let split = vocab.div_ceil(chunk);
    let maxima = empty_f32(&x, vec![n, split]);
    let grid = (n as u32, split as u32, 1);
    CudaSource::plain("verl_row_max", SOURCE, THREADS).launch(
        &x.client,
        grid,
        &[&x, &maxima],
        pack_words(&[n as u32, vocab as u32, vocab as u32, chunk as u32]),
    );
    let out = empty_f32(&x, vec![n, split, ShardDraw::WORDS]);
    CudaSource::plain("verl_sample_shard", SOURCE, THREADS).launch(
        &x.client,
        grid,
        &[&x, &maxima, &params, &out],
        pack_words(&[n as u32, vocab as u32, vocab as u32, 0, chunk as u32, 0]),
    );
    crate::host_reads::note(1);
    let words = Tensor::<CudaBackend, 3>::from_primitive(TensorPrimitive::Float(out))
        .into_data()
        .to_vec::<f32>()
        .expect("an f32 tensor reads as f32");
    crate::sampling::combine_rows(&words, split, rows)
}

/// Each row's largest value among its first `valid` columns (see `FusedOps::row_max`), by
/// `verl_row_max`; burn's `max_dim` where the kernel does not apply.
pub fn row_max(logits: Tensor<CudaBackend, 2>, valid: usize) -> Tensor<CudaBackend, 1> {
    let [n, width] = logits.dims();
    let applies = SWITCH.enabled()
        && n > 0
        && n < (1 << 31)
        && valid > 0
        && valid <= width
        && width < (1 << 31)
        && logits.dtype() == DType::F32;
    if !applies {
        return crate::ops::reference::row_max(logits, valid);
    }
    let x = into_contiguous(logits.into_primitive().tensor());
    let out = empty_f32(&x, vec![n]);
    CudaSource::plain("verl_row_max", SOURCE, THREADS).launch(
        &x.client,
        (n as u32, 1, 1),
        &[&x, &out],
        pack_words(&[n as u32, valid as u32, width as u32, 0]),
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Each row's [`ShardDraw`] over a vocabulary shard (see `FusedOps::sample_shard`), by
/// `verl_sample_shard`: `[rows, ShardDraw::WORDS]` on the device, nothing read back. The host
/// draw where the kernel does not apply.
pub fn sample_shard(
    logits: Tensor<CudaBackend, 2>,
    row_max: Tensor<CudaBackend, 1>,
    rows: &[RowSampling],
    (vocab_start, valid): (usize, usize),
) -> Tensor<CudaBackend, 2> {
    let [n, width] = logits.dims();
    let applies = SWITCH.enabled()
        && n == rows.len()
        && n > 0
        && n < (1 << 31)
        && valid <= width
        && width < (1 << 31)
        && vocab_start + valid < (1 << 31)
        && logits.dtype() == DType::F32
        && row_max.dtype() == DType::F32;
    if !applies {
        return crate::ops::reference::sample_shard(logits, row_max, rows, (vocab_start, valid));
    }
    let device = logits.device();
    let x = into_contiguous(logits.into_primitive().tensor());
    let m = into_contiguous(row_max.into_primitive().tensor());
    let params = row_params(rows, &device);
    let out = empty_f32(&x, vec![n, ShardDraw::WORDS]);
    CudaSource::plain("verl_sample_shard", SOURCE, THREADS).launch(
        &x.client,
        (n as u32, 1, 1),
        &[&x, &m, &params, &out],
        pack_words(&[
            n as u32,
            valid as u32,
            width as u32,
            vocab_start as u32,
            0,
            0,
        ]),
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words line up with `sampling.cu`'s `RowParams` (8 words, seed split low / high).
    #[test]
    fn row_words_follow_the_kernel_struct() {
        let w = row_words(&RowSampling {
            temperature: 0.5,
            top_k: -1,
            top_p: 0.9,
            min_p: 0.0,
            seed: 0x1234_5678_9abc_def0,
            step: 7,
        });
        assert_eq!(w[0], 0.5f32.to_bits());
        assert_eq!(w[1], u32::MAX);
        assert_eq!(w[4..7], [0x9abc_def0, 0x1234_5678, 7]);
        assert!(SOURCE.contains("#define THREADS 1024"));
    }

    /// Few rows are split until about two blocks a multiprocessor; many rows, or a small
    /// vocabulary, keep one block a row.
    #[test]
    fn few_rows_are_sampled_in_pieces() {
        assert_eq!(pieces(1, 151_936, 132), 37);
        assert_eq!(pieces(64, 151_936, 132), 5);
        assert_eq!(pieces(264, 151_936, 132), 1);
        assert_eq!(pieces(1, 1000, 132), 1);
        assert_eq!(pieces(1, 1 << 20, 132), 64);
    }
}

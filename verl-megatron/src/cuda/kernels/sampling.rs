//! Every row of a logits matrix sampled in one launch of `sampling.cu` (one block per row):
//! the rollout engine's decode step reads back 16 bytes per row instead of the whole
//! vocabulary's logits. The semantics and the host reference are in [`crate::sampling`]; the
//! fallback is the engine's host sampler, which gets the logits back.

use burn::prelude::*;
use burn::tensor::{DType, TensorData, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use verl_core::backend::CudaBackend;

use super::source::{pack_words, CudaSource};
use super::{empty_f32, KernelSwitch};
use crate::ops::{RowSampling, SampledToken};

const SOURCE: &str = include_str!("sampling.cu");
/// Threads per block (one block per row), as in `sampling.cu`.
const THREADS: u32 = 1024;

/// Whether the kernel samples where it applies: on unless `VERL_SAMPLING=decomposed`.
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_SAMPLING");

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
    let words: Vec<f32> = rows
        .iter()
        .flat_map(row_words)
        .map(f32::from_bits)
        .collect();
    let params = Tensor::<CudaBackend, 1>::from_data(TensorData::new(words, [n * 8]), &device)
        .into_primitive()
        .tensor();
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
}

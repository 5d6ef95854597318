//! A random init seeded per tensor name, drawn in parallel and only where a rank needs it.
//!
//! Each tensor's values are one stream of the ChaCha12 generator (rand's `StdRng`) seeded by
//! the tensor's name and the init seed; element `i` is a Box–Muller normal of the stream's
//! words `4i..4i + 4` (two `f64` uniforms). ChaCha is a counter-based generator, so a thread
//! can seek to any element: host threads draw disjoint runs, and a tensor-parallel rank draws
//! only its shard. The values are those of drawing the whole tensor in order on one thread
//! (tested below), so layouts and thread counts never change a model's weights.

use std::collections::HashMap;

use burn::prelude::*;
use burn::tensor::TensorData;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;

use super::load::TensorSource;
use crate::error::MegatronError;
use crate::hf::checkpoint::dims;
use crate::parallel::ParallelBackend;

/// Random initialisation, seeded per tensor name; shapes from the architecture's tensor table.
pub(super) struct RandomInit<'a, B: Backend> {
    pub shapes: HashMap<String, Vec<usize>>,
    pub std: f64,
    pub seed: u64,
    pub device: &'a B::Device,
    /// What norm weights start at: 1, or 0 where the scale is 1 + w (Gemma).
    pub norm_weight: f32,
}

impl<B: ParallelBackend> RandomInit<'_, B> {
    fn shape(&self, name: &str) -> Result<&Vec<usize>, MegatronError> {
        self.shapes
            .get(name)
            .ok_or_else(|| MegatronError::UnknownWeight { name: name.into() })
    }

    /// `values` on the device as a tensor of `shape`, through the backend's bulk upload.
    fn upload<const D: usize>(&self, values: Vec<f32>, shape: &[usize]) -> Tensor<B, D> {
        let flat = [values.len()];
        B::upload_flat(TensorData::new(values, flat), self.device).reshape(dims::<D>(shape))
    }

    /// The values of `runs` (element ranges of the whole tensor, in order) of tensor `name`.
    fn values(&self, name: &str, runs: &[(usize, usize)]) -> Vec<f32> {
        let n = runs.iter().map(|r| r.1).sum();
        if name.ends_with("norm.weight") {
            vec![self.norm_weight; n]
        } else if name.ends_with(".bias") || name.ends_with("e_score_correction_bias") {
            vec![0.0; n]
        } else {
            draw_runs(stream_seed(name, self.seed), self.std, runs)
        }
    }
}

impl<B: ParallelBackend> TensorSource<B> for RandomInit<'_, B> {
    fn load<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, MegatronError> {
        let shape = self.shape(name)?;
        let values = self.values(name, &[(0, shape.iter().product())]);
        Ok(self.upload(values, shape))
    }

    /// Draws only the shard's elements.
    fn load_part<const D: usize>(
        &self,
        name: &str,
        dim: usize,
        part: (usize, usize),
    ) -> Result<Tensor<B, D>, MegatronError> {
        let shape = self.shape(name)?;
        if dim >= shape.len() || part.0 + part.1 > shape[dim] {
            let mut wanted = shape.clone();
            wanted.resize(dim + 1, 0);
            wanted[dim] = part.0 + part.1;
            return Err(MegatronError::WeightShape {
                name: name.into(),
                expected: shape.clone(),
                found: wanted,
            });
        }
        let values = self.values(name, &part_runs(shape, dim, part));
        let mut narrowed = shape.clone();
        narrowed[dim] = part.1;
        Ok(self.upload(values, &narrowed))
    }
}

/// The stream of tensor `name`: FNV-1a of the name mixed with the seed (order-independent).
fn stream_seed(name: &str, seed: u64) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    h ^ seed
}

/// The element runs `(start, len)` of a row-major tensor of `shape` that `(start, len)` along
/// `dim` covers: one run per index of the dimensions before `dim`.
fn part_runs(shape: &[usize], dim: usize, (start, len): (usize, usize)) -> Vec<(usize, usize)> {
    let inner: usize = shape[dim + 1..].iter().product();
    let outer: usize = shape[..dim].iter().product();
    (0..outer)
        .map(|o| ((o * shape[dim] + start) * inner, len * inner))
        .filter(|r| r.1 > 0)
        .collect()
}

/// Words of the stream one element takes: two `u64`s for Box–Muller's two uniforms.
const WORDS_PER_ELEMENT: u128 = 4;

/// N(0, std²) values of the elements in `runs` of stream `seed`, by host threads each drawing
/// a stretch of elements from its own position in the stream.
fn draw_runs(seed: u64, std: f64, runs: &[(usize, usize)]) -> Vec<f32> {
    let n: usize = runs.iter().map(|r| r.1).sum();
    let mut out = vec![0f32; n];
    // Per-thread stretches of at least this many elements: a seek costs a ChaCha block.
    const MIN_STRETCH: usize = 1 << 16;
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1)
        .min(n.div_ceil(MIN_STRETCH))
        .max(1);
    let per = n.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (t, slot) in out.chunks_mut(per).enumerate() {
            s.spawn(move || fill_stretch(seed, std, runs, t * per, slot));
        }
    });
    out
}

/// Fills `slot` with the elements `from..from + slot.len()` of the concatenated `runs`.
fn fill_stretch(seed: u64, std: f64, runs: &[(usize, usize)], from: usize, slot: &mut [f32]) {
    let mut rng = ChaCha12Rng::seed_from_u64(seed);
    let mut skipped = 0;
    let mut filled = 0;
    let mut at_word = None;
    for &(start, len) in runs {
        if filled == slot.len() {
            break;
        }
        // This run's part inside [from, from + slot.len()).
        let lo = from.max(skipped);
        let hi = (from + slot.len()).min(skipped + len);
        if lo < hi {
            let first = start + (lo - skipped);
            let word = first as u128 * WORDS_PER_ELEMENT;
            if at_word != Some(word) {
                rng.set_word_pos(word);
            }
            for v in &mut slot[filled..filled + (hi - lo)] {
                *v = normal(&mut rng, std);
            }
            filled += hi - lo;
            at_word = Some((first + hi - lo) as u128 * WORDS_PER_ELEMENT);
        }
        skipped += len;
    }
}

/// One Box–Muller normal (four words of the stream).
fn normal(rng: &mut ChaCha12Rng, std: f64) -> f32 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    (z * std) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;

    /// The whole tensor drawn in order on one thread, as the init always drew it.
    fn in_order(seed: u64, std: f64, n: usize) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                let u2: f64 = rng.random();
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (z * std) as f32
            })
            .collect()
    }

    #[test]
    fn threaded_draws_equal_one_thread_in_order() {
        let n = 3 * (1 << 16) + 17;
        let want = in_order(42, 0.02, n);
        assert_eq!(draw_runs(42, 0.02, &[(0, n)]), want);
        // A stretch that starts mid-block of the generator.
        let mut slot = vec![0f32; 1000];
        fill_stretch(42, 0.02, &[(0, n)], 12_345, &mut slot);
        assert_eq!(slot, want[12_345..13_345]);
    }

    #[test]
    fn a_shard_is_the_whole_tensors_slice() {
        let shape = [6, 5, 7];
        let n: usize = shape.iter().product();
        let whole = in_order(7, 1.0, n);
        for dim in 0..3 {
            for (start, len) in [(0, 2), (1, 3), (shape[dim] - 1, 1), (0, shape[dim])] {
                let got = draw_runs(7, 1.0, &part_runs(&shape, dim, (start, len)));
                let want: Vec<f32> = (0..n)
                    .filter(|&i| {
                        let index = [i / 35, (i / 7) % 5, i % 7];
                        (start..start + len).contains(&index[dim])
                    })
                    .map(|i| whole[i])
                    .collect();
                assert_eq!(got, want, "dim {dim}, part ({start}, {len})");
            }
        }
    }

    #[test]
    fn a_thread_starting_inside_a_shards_runs_draws_its_elements() {
        // A dim-1 shard of [40, 3000]: 40 runs of 1000; a thread's stretch starting in the
        // middle of the 7th run and ending inside the 12th, as the threaded draw splits it.
        let shape = [40, 3000];
        let runs = part_runs(&shape, 1, (1000, 1000));
        let whole = in_order(3, 0.5, 40 * 3000);
        let want: Vec<f32> = runs
            .iter()
            .flat_map(|&(start, len)| whole[start..start + len].to_vec())
            .collect();
        let mut slot = vec![0f32; 4_321];
        fill_stretch(3, 0.5, &runs, 6_500, &mut slot);
        assert_eq!(slot, want[6_500..6_500 + 4_321]);
    }

    #[test]
    fn streams_differ_by_name_and_seed() {
        assert_ne!(stream_seed("a.weight", 1), stream_seed("b.weight", 1));
        assert_ne!(stream_seed("a.weight", 1), stream_seed("a.weight", 2));
    }
}

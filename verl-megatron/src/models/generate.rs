//! A plain cache-less generation loop, for trying a checkpoint (`verl generate`). The rollout
//! engine in `verl-rollout` is the fast, batched path.

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::CausalLm;
use crate::parallel::ParallelBackend;

/// Sampling settings of [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 is greedy.
    pub temperature: f64,
    pub seed: u64,
    pub eos_token_ids: Vec<u32>,
}

/// Generates up to `max_new_tokens` after `prompt`, stopping after an EOS id; returns the new ids.
/// Each step recomputes the whole sequence (no KV cache).
pub fn generate<B: ParallelBackend>(
    model: &CausalLm<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    device: &B::Device,
) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(options.seed);
    let mut seq: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let mut out = Vec::new();
    for _ in 0..options.max_new_tokens {
        let ids =
            Tensor::<B, 2, Int>::from_data(TensorData::new(seq.clone(), [1, seq.len()]), device);
        let logits = model.forward(ids, None, None);
        let [_, t, v] = logits.dims();
        let last: Vec<f64> = logits
            .narrow(1, t - 1, 1)
            .reshape([v])
            .to_data()
            .iter::<f64>()
            .collect();
        let next = if options.temperature <= 0.0 {
            last.iter()
                .enumerate()
                .fold(
                    (0, f64::MIN),
                    |best, (i, &x)| if x > best.1 { (i, x) } else { best },
                )
                .0
        } else {
            let max = last.iter().copied().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = last
                .iter()
                .map(|x| ((x - max) / options.temperature).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let mut u = rng.random::<f64>() * total;
            weights
                .iter()
                .position(|w| {
                    u -= w;
                    u <= 0.0
                })
                .unwrap_or(v - 1)
        } as u32;
        out.push(next);
        seq.push(next as i64);
        if options.eos_token_ids.contains(&next) {
            break;
        }
    }
    out
}

//! Choosing the next token from logits, as vLLM / SGLang do for verl's rollout settings:
//! temperature scaling, then min-p, then top-k, then top-p (nucleus) filtering, then a draw from
//! the renormalised distribution. Temperature 0 is greedy. Each request owns a seeded generator,
//! so a run is reproducible whatever the batch composition.
//!
//! This is the host sampler (the CPU default, and any backend without a sampling kernel). On
//! burn-cuda the engine samples on the device instead (`verl_megatron::sampling`): the same
//! distribution from the request's [`Sampler::stream_seed`], drawn by the Gumbel-max trick, so
//! the same seed gives other tokens there than here.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings (verl's `rollout.temperature`, `top_k`, `top_p`, seed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f64,
    /// Keep the k most likely tokens; -1 or 0: off.
    pub top_k: i64,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p; 1: off.
    pub top_p: f64,
    /// Keep tokens at least `min_p` times as likely as the most likely one; 0: off.
    pub min_p: f64,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

/// A sampling setting that cannot work, named by field.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplingError {
    #[error("sampling `{field}` = {value}: {message}")]
    Invalid {
        field: &'static str,
        value: String,
        message: &'static str,
    },
}

impl SamplingParams {
    /// Checks the ranges before any generation starts.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if self.temperature.is_nan() || self.temperature < 0.0 {
            return Err(SamplingError::Invalid {
                field: "temperature",
                value: self.temperature.to_string(),
                message: "must be ≥ 0 (0 is greedy)",
            });
        }
        if self.top_k < -1 {
            return Err(SamplingError::Invalid {
                field: "top_k",
                value: self.top_k.to_string(),
                message: "must be -1 or 0 (off) or a positive count",
            });
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::Invalid {
                field: "min_p",
                value: self.min_p.to_string(),
                message: "must be in [0, 1] (0 is off)",
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::Invalid {
                field: "top_p",
                value: self.top_p.to_string(),
                message: "must be in (0, 1]",
            });
        }
        Ok(())
    }

    /// The distribution tokens are drawn from (after temperature, min-p, top-k and top-p), for
    /// temperature > 0. Masked-out tokens get probability 0.
    pub fn distribution(&self, logits: &[f32]) -> Vec<f64> {
        let t = self.temperature.max(f64::MIN_POSITIVE);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut p: Vec<f64> = logits
            .iter()
            .map(|&x| ((x as f64 - max) / t).exp())
            .collect();
        let n = p.len();
        // Most likely first; ties by index so the result is deterministic.
        let by_prob = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
        // Sorting the whole vocabulary every token would dominate decode time: top-k only
        // partitions, and only top-p sorts (the kept set).
        let mut kept: Option<Vec<usize>> = None;
        if self.min_p > 0.0 {
            // p is relative to the most likely token (which has 1).
            kept = Some((0..n).filter(|&i| p[i] >= self.min_p).collect());
        }
        let candidates = kept.as_ref().map_or(n, Vec::len);
        if self.top_k > 0 && (self.top_k as usize) < candidates {
            let k = self.top_k as usize;
            let mut order: Vec<usize> = kept.take().unwrap_or_else(|| (0..n).collect());
            order.select_nth_unstable_by(k - 1, by_prob);
            order.truncate(k);
            kept = Some(order);
        }
        if self.top_p < 1.0 {
            let mut order = kept.unwrap_or_else(|| (0..n).collect());
            order.sort_unstable_by(by_prob);
            let total: f64 = order.iter().map(|&i| p[i]).sum();
            let mut acc = 0.0;
            let mut count = 0;
            for &i in &order {
                acc += p[i] / total;
                count += 1;
                if acc >= self.top_p {
                    break;
                }
            }
            order.truncate(count.max(1));
            kept = Some(order);
        }
        if let Some(order) = kept {
            let mut keep = vec![false; n];
            order.iter().for_each(|&i| keep[i] = true);
            p.iter_mut()
                .zip(keep)
                .filter(|(_, k)| !k)
                .for_each(|(x, _)| *x = 0.0);
        }
        let total: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= total);
        p
    }
}

/// A request's sampler: its settings and its own random stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// The stream's seed, from (params.seed, request).
    stream_seed: u64,
}

impl Sampler {
    /// A sampler for request `request` of a run seeded with `params.seed`: requests get
    /// independent, reproducible streams.
    pub fn new(params: SamplingParams, request: u64) -> Result<Self, SamplingError> {
        params.validate()?;
        // SplitMix64 of (seed, request) decorrelates neighbouring request ids.
        let mut z = params.seed ^ request.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Ok(Self {
            params,
            rng: StdRng::seed_from_u64(z),
            stream_seed: z,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The seed of this request's random stream: what the device sampler hashes with the draw's
    /// step and the token id.
    pub fn stream_seed(&self) -> u64 {
        self.stream_seed
    }

    /// The next token and its log-probability under the sampling distribution.
    pub fn sample(&mut self, logits: &[f32]) -> (u32, f64) {
        if self.params.temperature == 0.0 {
            let best = logits
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
                .0;
            return (best as u32, 0.0);
        }
        let p = self.params.distribution(logits);
        let mut u: f64 = self.rng.random();
        let mut last = 0;
        for (i, &pi) in p.iter().enumerate() {
            if pi == 0.0 {
                continue;
            }
            last = i;
            if u < pi {
                return (i as u32, pi.ln());
            }
            u -= pi;
        }
        (last as u32, p[last].ln())
    }
}

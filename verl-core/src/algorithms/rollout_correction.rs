//! Rollout–training mismatch correction (verl's `algorithm.rollout_correction`, decoupled
//! mode): the rollout samples with one numeric path (bf16 on GPUs, its own batch layout) and
//! training recomputes the old log-probs with another, so the samples are slightly off-policy
//! for the policy PPO thinks produced them. From each token's `log_ratio = old_log_prob −
//! rollout_log_prob`:
//!
//! - **Truncated importance sampling** (`rollout_is`): per token `w = exp(log_ratio)`, or per
//!   sequence `w = exp(Σ log_ratio)` on every token; clamped to ±20 in log space, then
//!   truncated above at `rollout_is_threshold`, optionally divided by its batch mean. The policy
//!   losses multiply each token's loss by `w` (`rollout_is_weights`).
//! - **Rejection sampling** (`rollout_rs`): tokens or whole sequences whose divergence
//!   statistic leaves its bounds are dropped from `response_mask`. Statistics: `k1 = −log_ratio`
//!   (bounds `lower_upper` as ratios, log taken), `k2 = ½·log_ratio²`, `k3 = exp(log_ratio) − 1 −
//!   log_ratio` (an upper bound), per token (`token_*`) or per sequence (`seq_sum_*`,
//!   `seq_mean_*`, `seq_max_*`); several options all have to keep a token.
//!
//! Weights are computed on the mask before rejection, as verl's are. Metrics go under
//! `rollout_corr/`.
//!
//! ```
//! use burn::tensor::{Tensor, TensorData};
//! use verl_core::algorithms::rollout_correction::{rollout_correction, RolloutCorrection};
//! use verl_core::backend::CpuBackend as B;
//! let d = Default::default();
//! let t = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [1, 2]), &d);
//! // Training is twice as likely as the rollout on token 0, 8× on token 1 (truncated to 2).
//! let old = t(vec![0.5f32.ln(), 0.8f32.ln()]);
//! let rollout = t(vec![0.25f32.ln(), 0.1f32.ln()]);
//! let correction = RolloutCorrection::parse(Some("token"), 2.0, false, None, None).unwrap();
//! let out = rollout_correction(old, rollout, t(vec![1.0, 1.0]), &correction).unwrap();
//! let w: Vec<f32> = out.weights.unwrap().into_data().to_vec().unwrap();
//! assert!((w[0] - 2.0).abs() < 1e-5 && (w[1] - 2.0).abs() < 1e-5);
//! ```

use std::collections::BTreeMap;

use burn::prelude::*;

use super::host::Host2;
use crate::error::AlgorithmError;

type Result<T> = std::result::Result<T, AlgorithmError>;

/// How importance weights are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsLevel {
    Token,
    Sequence,
}

/// A rejection statistic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsStatistic {
    K1,
    K2,
    K3,
}

/// Over what a rejection statistic is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsScope {
    Token,
    SeqSum,
    SeqMean,
    SeqMax,
}

/// One rejection criterion: keep where `lower ≤ statistic ≤ upper`.
#[derive(Debug, Clone, PartialEq)]
pub struct RsOption {
    pub name: String,
    pub scope: RsScope,
    pub statistic: RsStatistic,
    pub lower: f64,
    pub upper: f64,
}

/// A parsed `algorithm.rollout_correction`.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrection {
    pub is_level: Option<IsLevel>,
    pub is_threshold: f64,
    pub batch_normalize: bool,
    pub rejection: Vec<RsOption>,
}

fn invalid(message: String) -> AlgorithmError {
    AlgorithmError::Invalid {
        algorithm: "rollout_correction".into(),
        message,
    }
}

impl RolloutCorrection {
    /// From verl's keys: `rollout_is` (`token` / `sequence` / none), `rollout_is_threshold`,
    /// `rollout_is_batch_normalize`, `rollout_rs` (comma-separated options) and
    /// `rollout_rs_threshold` (one threshold for every option, or one per option,
    /// comma-separated; a k1 option's is `lower_upper`, or `u` for `1/u_u`).
    pub fn parse(
        rollout_is: Option<&str>,
        is_threshold: f64,
        batch_normalize: bool,
        rollout_rs: Option<&str>,
        rs_threshold: Option<&str>,
    ) -> Result<Self> {
        let is_level = match rollout_is {
            None => None,
            Some("token") => Some(IsLevel::Token),
            Some("sequence") => Some(IsLevel::Sequence),
            Some(other) => {
                return Err(invalid(format!(
                    "rollout_is = `{other}`: use token, sequence or null"
                )))
            }
        };
        if !(is_threshold > 0.0 && is_threshold.is_finite()) {
            return Err(invalid(format!(
                "rollout_is_threshold = {is_threshold}: must be a positive number"
            )));
        }
        let rejection = match rollout_rs {
            None => Vec::new(),
            Some(options) => parse_rejection(options, rs_threshold)?,
        };
        Ok(Self {
            is_level,
            is_threshold,
            batch_normalize,
            rejection,
        })
    }

    /// Whether it changes anything.
    pub fn is_active(&self) -> bool {
        self.is_level.is_some() || !self.rejection.is_empty()
    }
}

/// verl's parsing: options deduplicated (the first of a repeated one kept), empty threshold
/// entries dropped, then one threshold for all or one per (distinct) option. One deliberate
/// difference: a k1 bound whose lower end lies above its upper one (a single k1 threshold
/// below 1 gives 1/u > u) is refused naming it, where verl accepts it and rejects every token.
fn parse_rejection(options: &str, thresholds: Option<&str>) -> Result<Vec<RsOption>> {
    let mut names: Vec<&str> = Vec::new();
    for name in options.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let thresholds = thresholds.ok_or_else(|| {
        invalid(format!(
            "rollout_rs = `{options}` needs rollout_rs_threshold"
        ))
    })?;
    let specs: Vec<&str> = thresholds
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if specs.is_empty() {
        return Err(invalid(format!(
            "rollout_rs_threshold = `{thresholds}`: no threshold in it"
        )));
    }
    if specs.len() != 1 && specs.len() != names.len() {
        return Err(invalid(format!(
            "rollout_rs_threshold = `{thresholds}`: one threshold, or one per option of `{options}`"
        )));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let spec = specs[if specs.len() == 1 { 0 } else { i }];
            parse_option(name, spec)
        })
        .collect()
}

fn parse_option(name: &str, spec: &str) -> Result<RsOption> {
    let (scope, stat) = name.rsplit_once('_').ok_or_else(|| unknown_option(name))?;
    let scope = match scope {
        "token" => RsScope::Token,
        "seq_sum" => RsScope::SeqSum,
        "seq_mean" => RsScope::SeqMean,
        "seq_max" => RsScope::SeqMax,
        _ => return Err(unknown_option(name)),
    };
    let statistic = match stat {
        "k1" if scope != RsScope::SeqMax => RsStatistic::K1,
        "k2" => RsStatistic::K2,
        "k3" => RsStatistic::K3,
        _ => return Err(unknown_option(name)),
    };
    let number = |s: &str| -> Result<f64> {
        s.trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| {
                invalid(format!(
                    "rollout_rs_threshold for {name}: `{spec}` is not a positive number"
                ))
            })
    };
    let (lower, upper) = match statistic {
        // k1 bounds are ratios; the statistic is a log-ratio.
        RsStatistic::K1 => {
            let (lo, hi) = match spec.split_once('_') {
                Some((lo, hi)) => (number(lo)?, number(hi)?),
                None => {
                    let u = number(spec)?;
                    (1.0 / u, u)
                }
            };
            if lo > hi {
                return Err(invalid(format!(
                    "rollout_rs_threshold for {name}: lower {lo} above upper {hi}"
                )));
            }
            (lo.ln(), hi.ln())
        }
        _ => (f64::NEG_INFINITY, number(spec)?),
    };
    Ok(RsOption {
        name: name.to_string(),
        scope,
        statistic,
        lower,
        upper,
    })
}

fn unknown_option(name: &str) -> AlgorithmError {
    invalid(format!(
        "rollout_rs option `{name}`: use token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 or seq_max_k2/k3"
    ))
}

/// What the correction gives: the weights (with `rollout_is`), the mask after rejection and
/// the `rollout_corr/` metrics.
#[derive(Debug, Clone)]
pub struct CorrectionOutput<B: Backend> {
    pub weights: Option<Tensor<B, 2>>,
    pub response_mask: Tensor<B, 2>,
    pub metrics: BTreeMap<String, f64>,
}

/// Applies `correction` to a batch's `old_log_probs` (training's recompute) and
/// `rollout_log_probs` (the sampler's), `[batch, response]` under `response_mask`. A batch
/// whose responses are all empty changes nothing and logs zeros (a deliberate difference:
/// verl raises, and one empty batch would stop a run).
pub fn rollout_correction<B: Backend>(
    old_log_probs: Tensor<B, 2>,
    rollout_log_probs: Tensor<B, 2>,
    response_mask: Tensor<B, 2>,
    correction: &RolloutCorrection,
) -> Result<CorrectionOutput<B>> {
    let dims = old_log_probs.dims();
    for (what, d) in [
        ("rollout_log_probs", rollout_log_probs.dims()),
        ("response_mask", response_mask.dims()),
    ] {
        if d != dims {
            return Err(AlgorithmError::Shape {
                what: format!("rollout_correction: {what}"),
                expected: dims.to_vec(),
                found: d.to_vec(),
            });
        }
    }
    let device = old_log_probs.device();
    let old = Host2::from_tensor(&old_log_probs);
    let rollout = Host2::from_tensor(&rollout_log_probs);
    let mask = Host2::from_tensor(&response_mask);
    let mut ratio = Host2::zeros(old.rows, old.cols);
    for (r, (o, l)) in ratio
        .data
        .iter_mut()
        .zip(old.data.iter().zip(&rollout.data))
    {
        *r = (o - l).clamp(-20.0, 20.0);
    }
    let mut metrics = mismatch_metrics(&old, &rollout, &mask);
    // Sequence weights sum the raw log-ratios and clamp the sum, as verl does (clamping each
    // token first would cap a sequence at ±20 per token, not in all).
    let raw = Host2 {
        rows: old.rows,
        cols: old.cols,
        data: old
            .data
            .iter()
            .zip(&rollout.data)
            .map(|(o, l)| o - l)
            .collect(),
    };
    let weights = correction
        .is_level
        .map(|level| importance_weights((&ratio, &raw), &mask, level, correction, &mut metrics));
    // As verl: each option judges the original mask on its own, and a token stays only if
    // every option keeps it (applying them in turn would let an earlier rejection change a
    // later option's sequence statistic).
    let mut kept = mask.clone();
    for option in &correction.rejection {
        let keep = option_keep(&ratio, &mask, option);
        option_metrics(&mask, &keep, option, &mut metrics);
        for (k, o) in kept.data.iter_mut().zip(&keep.data) {
            *k *= o;
        }
    }
    let (tokens, dropped) = mask
        .data
        .iter()
        .zip(&kept.data)
        .fold((0.0, 0.0), |(n, d), (m, k)| (n + m, d + m - k));
    metrics.insert(
        "rollout_corr/rollout_rs_masked_fraction".into(),
        dropped / tokens.max(1.0),
    );
    let rows_dropped = (0..mask.rows)
        .filter(|&r| mask.row_sum(r) > 0.0 && kept.row_sum(r) < mask.row_sum(r))
        .count();
    metrics.insert(
        "rollout_corr/rollout_rs_seq_masked_fraction".into(),
        rows_dropped as f64 / mask.rows.max(1) as f64,
    );
    Ok(CorrectionOutput {
        weights: weights.map(|w| w.to_tensor(&device)),
        response_mask: kept.to_tensor(&device),
        metrics,
    })
}

/// Masked mean of `values` over `mask`, as verl's `masked_mean` (the count plus 1e-8).
fn masked_mean(values: &[f64], mask: &[f64]) -> f64 {
    let n: f64 = mask.iter().sum();
    values.iter().zip(mask).map(|(v, m)| v * m).sum::<f64>() / (n + 1e-8)
}

/// Truncated importance weights (on the mask before rejection), with their metrics.
fn importance_weights(
    (ratio, raw): (&Host2, &Host2),
    mask: &Host2,
    level: IsLevel,
    correction: &RolloutCorrection,
    metrics: &mut BTreeMap<String, f64>,
) -> Host2 {
    let thr = correction.is_threshold;
    let mut w = Host2::zeros(ratio.rows, ratio.cols);
    // Each sequence's summed log-ratio (0 for an empty one), verl's sequence-level statistic.
    let seq_log: Vec<f64> = (0..raw.rows)
        .map(|r| (0..raw.cols).map(|c| raw.at(r, c) * mask.at(r, c)).sum())
        .collect();
    for (r, &seq) in seq_log.iter().enumerate() {
        for c in 0..ratio.cols {
            let log_w = match level {
                IsLevel::Token => ratio.at(r, c),
                IsLevel::Sequence => seq.clamp(-20.0, 20.0),
            };
            w.set(r, c, log_w.exp() * mask.at(r, c));
        }
    }
    // Before truncation, as verl's.
    let valid: Vec<f64> = w
        .data
        .iter()
        .zip(&mask.data)
        .filter(|(_, m)| **m > 0.0)
        .map(|(v, _)| *v)
        .collect();
    let mean = masked_mean(&w.data, &mask.data);
    let frac = |f: &dyn Fn(f64) -> bool| {
        valid.iter().filter(|v| f(**v)).count() as f64 / valid.len().max(1) as f64
    };
    // Effective sample size of the weights clamped to [1/thr, thr], normalised to mean 1.
    let clamped: Vec<f64> = valid.iter().map(|v| v.clamp(1.0 / thr, thr)).collect();
    let cm = clamped.iter().sum::<f64>() / clamped.len().max(1) as f64;
    // The spread of the clamped weights too, as verl takes it (E[w²] − E[w]², none for one
    // token): unclamped, one outlier's e^20 would swamp it.
    let std = if clamped.len() > 1 {
        let m2 = clamped.iter().map(|v| v * v).sum::<f64>() / clamped.len() as f64;
        (m2 - cm * cm).max(0.0).sqrt()
    } else {
        0.0
    };
    let ess = 1.0
        / (clamped.iter().map(|v| (v / cm).powi(2)).sum::<f64>() / clamped.len().max(1) as f64)
            .max(1e-12);
    let prefix = "rollout_corr/rollout_is";
    // Token level: over the valid tokens' weights. Sequence level, as verl: over every
    // sequence's summed log-ratio (an empty sequence's is 0), the maximum's exponent capped at
    // 20, fractions counting sequences.
    let (max, min, high, low) = match level {
        IsLevel::Token => (
            valid.iter().copied().fold(f64::MIN, f64::max),
            valid.iter().copied().fold(f64::MAX, f64::min),
            frac(&|v| v > thr),
            frac(&|v| v < 1.0 / thr),
        ),
        IsLevel::Sequence => {
            let rows = seq_log.len().max(1) as f64;
            let share =
                |f: &dyn Fn(f64) -> bool| seq_log.iter().filter(|s| f(**s)).count() as f64 / rows;
            (
                seq_log
                    .iter()
                    .copied()
                    .fold(f64::MIN, f64::max)
                    .min(20.0)
                    .exp(),
                seq_log.iter().copied().fold(f64::MAX, f64::min).exp(),
                share(&|s| s > thr.ln()),
                share(&|s| s < (1.0 / thr).ln()),
            )
        }
    };
    for (k, v) in [
        ("mean", mean),
        ("max", max),
        ("min", min),
        ("std", std),
        ("eff_sample_size", ess),
        ("ratio_fraction_high", high),
        ("ratio_fraction_low", low),
    ] {
        metrics.insert(
            format!("{prefix}_{k}"),
            if valid.is_empty() { 0.0 } else { v },
        );
    }
    // verl's per-sequence view: each sequence's mean weight (an empty one's 0), its spread
    // (the sample standard deviation), extremes, the largest distance from 1, and the shares
    // of sequences beyond the threshold.
    let seq_means: Vec<f64> = (0..w.rows)
        .map(|r| (0..w.cols).map(|c| w.at(r, c)).sum::<f64>() / (mask.row_sum(r) + 1e-8))
        .collect();
    if !seq_means.is_empty() {
        let n = seq_means.len() as f64;
        let m = seq_means.iter().sum::<f64>() / n;
        let sd = if seq_means.len() > 1 {
            (seq_means.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        let share =
            |f: &dyn Fn(f64) -> bool| seq_means.iter().filter(|x| f(**x)).count() as f64 / n;
        for (k, v) in [
            ("mean", m),
            ("std", sd),
            ("max", seq_means.iter().copied().fold(f64::MIN, f64::max)),
            ("min", seq_means.iter().copied().fold(f64::MAX, f64::min)),
            (
                "max_deviation",
                seq_means
                    .iter()
                    .map(|x| (x - 1.0).abs())
                    .fold(0.0, f64::max),
            ),
            ("fraction_high", share(&|x| x > thr)),
            ("fraction_low", share(&|x| x < 1.0 / thr)),
        ] {
            metrics.insert(format!("{prefix}_seq_{k}"), v);
        }
    }
    for v in &mut w.data {
        *v = v.min(thr);
    }
    if correction.batch_normalize {
        let norm = match level {
            IsLevel::Token => masked_mean(&w.data, &mask.data),
            IsLevel::Sequence => {
                let rows: Vec<f64> = (0..w.rows)
                    .filter(|&r| mask.row_sum(r) > 0.0)
                    .map(|r| {
                        (0..w.cols).map(|c| w.at(r, c) * mask.at(r, c)).sum::<f64>()
                            / mask.row_sum(r)
                    })
                    .collect();
                rows.iter().sum::<f64>() / rows.len().max(1) as f64
            }
        };
        if norm > 1e-8 {
            w.data.iter_mut().for_each(|v| *v /= norm);
        }
        metrics.insert(format!("{prefix}_batch_norm_factor"), norm);
    }
    w
}

/// 1 where `option` keeps a token, 0 where it rejects it: each token's statistic (token
/// options) or its sequence's (sum, mean or max over the sequence's tokens of `mask`; an empty
/// sequence's max is 0) inside the option's bounds. Judged on `mask` alone, as verl judges
/// each option.
fn option_keep(ratio: &Host2, mask: &Host2, option: &RsOption) -> Host2 {
    let stat = |lr: f64| match option.statistic {
        RsStatistic::K1 => -lr,
        RsStatistic::K2 => 0.5 * lr * lr,
        RsStatistic::K3 => lr.exp() - 1.0 - lr,
    };
    let inside = |s: f64| option.lower <= s && s <= option.upper;
    let mut keep = Host2::zeros(ratio.rows, ratio.cols);
    for r in 0..ratio.rows {
        let valid: Vec<usize> = (0..ratio.cols).filter(|&c| mask.at(r, c) > 0.0).collect();
        let stats: Vec<f64> = valid.iter().map(|&c| stat(ratio.at(r, c))).collect();
        let n = stats.len().max(1) as f64;
        let sequence = match option.scope {
            RsScope::Token => None,
            RsScope::SeqSum => Some(stats.iter().sum::<f64>()),
            RsScope::SeqMean => Some(stats.iter().sum::<f64>() / n),
            RsScope::SeqMax if stats.is_empty() => Some(0.0),
            RsScope::SeqMax => Some(stats.iter().copied().fold(f64::MIN, f64::max)),
        };
        for c in 0..ratio.cols {
            let s = sequence.unwrap_or_else(|| stat(ratio.at(r, c)));
            keep.set(r, c, if inside(s) { 1.0 } else { 0.0 });
        }
    }
    keep
}

/// verl's per-option metrics: the share of `mask`'s tokens the option rejects, and of its
/// non-empty sequences that lose a token to it.
fn option_metrics(
    mask: &Host2,
    keep: &Host2,
    option: &RsOption,
    metrics: &mut BTreeMap<String, f64>,
) {
    let tokens: f64 = mask.data.iter().sum();
    let dropped: f64 = mask
        .data
        .iter()
        .zip(&keep.data)
        .map(|(m, k)| m * (1.0 - k))
        .sum();
    let valid = (0..mask.rows).filter(|&r| mask.row_sum(r) > 0.0);
    let (rows, hit) = valid.fold((0usize, 0usize), |(n, h), r| {
        let lost = (0..mask.cols).any(|c| mask.at(r, c) > 0.0 && keep.at(r, c) == 0.0);
        (n + 1, h + usize::from(lost))
    });
    let name = &option.name;
    metrics.insert(
        format!("rollout_corr/rollout_rs_{name}_masked_fraction"),
        dropped / tokens.max(1.0),
    );
    metrics.insert(
        format!("rollout_corr/rollout_rs_{name}_seq_masked_fraction"),
        if rows == 0 {
            0.0
        } else {
            hit as f64 / rows as f64
        },
    );
}

/// The off-policy diagnostics as verl's `compute_offpolicy_metrics` takes them: KL (direct and
/// k3) between the rollout and training policies on the sampled tokens; each sequence's mean
/// log-prob under both (an empty sequence's is 0, so its perplexity 1, counted as verl counts
/// it), their perplexities, log-perplexities and differences; χ² per token and per sequence.
fn mismatch_metrics(old: &Host2, rollout: &Host2, mask: &Host2) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    let diff: Vec<f64> = rollout
        .data
        .iter()
        .zip(&old.data)
        .map(|(r, o)| r - o)
        .collect();
    m.insert("rollout_corr/kl".into(), masked_mean(&diff, &mask.data));
    let k3: Vec<f64> = diff.iter().map(|d| (-d).exp() - 1.0 + d).collect();
    m.insert("rollout_corr/k3_kl".into(), masked_mean(&k3, &mask.data));
    let row_mean = |lp: &Host2| -> Vec<f64> {
        (0..lp.rows)
            .map(|r| {
                (0..lp.cols)
                    .map(|c| lp.at(r, c) * mask.at(r, c))
                    .sum::<f64>()
                    / (mask.row_sum(r) + 1e-8)
            })
            .collect()
    };
    let (train, roll) = (row_mean(old), row_mean(rollout));
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let each = |v: &[f64], f: fn(f64) -> f64| v.iter().map(|x| f(*x)).collect::<Vec<_>>();
    m.insert(
        "rollout_corr/training_ppl".into(),
        mean(&each(&train, |x| (-x).exp())),
    );
    m.insert("rollout_corr/training_log_ppl".into(), -mean(&train));
    m.insert(
        "rollout_corr/rollout_ppl".into(),
        mean(&each(&roll, |x| (-x).exp())),
    );
    m.insert("rollout_corr/rollout_log_ppl".into(), -mean(&roll));
    // log(training ppl / rollout ppl) per sequence.
    let d: Vec<f64> = roll.iter().zip(&train).map(|(r, t)| r - t).collect();
    m.insert("rollout_corr/log_ppl_diff".into(), mean(&d));
    m.insert(
        "rollout_corr/log_ppl_abs_diff".into(),
        mean(&each(&d, f64::abs)),
    );
    let (lo, hi) = d
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), x| {
            (l.min(*x), h.max(*x))
        });
    if !d.is_empty() {
        m.insert("rollout_corr/log_ppl_diff_max".into(), hi);
        m.insert("rollout_corr/log_ppl_diff_min".into(), lo);
    }
    m.insert("rollout_corr/ppl_ratio".into(), mean(&each(&d, f64::exp)));
    // χ² of the ratio ρ = π_train/π_rollout: E[ρ²] − 1 per token, E[(Πρ)²] − 1 per sequence
    // (log-ratios clamped to ±20, a sequence's as a sum).
    let w2: Vec<f64> = diff
        .iter()
        .map(|d| (2.0 * (-d).clamp(-20.0, 20.0)).exp())
        .collect();
    m.insert(
        "rollout_corr/chi2_token".into(),
        masked_mean(&w2, &mask.data) - 1.0,
    );
    let seq_w2: Vec<f64> = (0..mask.rows)
        .map(|r| {
            let sum: f64 = (0..mask.cols)
                .map(|c| -(rollout.at(r, c) - old.at(r, c)) * mask.at(r, c))
                .sum();
            (2.0 * sum.clamp(-20.0, 20.0)).exp()
        })
        .collect();
    m.insert("rollout_corr/chi2_seq".into(), mean(&seq_w2) - 1.0);
    m
}

/// The off-policy diagnostics (`rollout_corr/kl`, `k3_kl`, perplexities, χ²) of `log_probs`
/// against the rollout's, as verl's actors log them for each micro-batch of an update
/// (`compute_rollout_corr_metrics_from_logprobs`): the current policy, as it moves, against
/// the sampler. The same figures [`rollout_correction`] reports for the old log-probs.
pub fn offpolicy_metrics<B: Backend>(
    log_probs: &Tensor<B, 2>,
    rollout_log_probs: &Tensor<B, 2>,
    response_mask: &Tensor<B, 2>,
) -> BTreeMap<String, f64> {
    mismatch_metrics(
        &Host2::from_tensor(log_probs),
        &Host2::from_tensor(rollout_log_probs),
        &Host2::from_tensor(response_mask),
    )
}

/// verl's debug metrics of the rollout against training's recompute
/// (`verl.utils.debug.metrics.calculate_debug_metrics`, logged every step the rollout returns
/// its log-probs): over the valid tokens, the largest, mean and (sample) spread of
/// |π_train − π_rollout| in probability, and the Pearson correlation of the two
/// probabilities. Empty when no token is valid (verl raises there); a correlation with no
/// spread in either is NaN, as torch's.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::rollout_correction::rollout_probs_diff_metrics;
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let lp = Tensor::<B, 2>::from_floats([[0.5f32.ln(), 0.25f32.ln()]], &d);
/// let rollout = Tensor::<B, 2>::from_floats([[0.5f32.ln(), 0.5f32.ln()]], &d);
/// let m = rollout_probs_diff_metrics(&lp, &rollout, &Tensor::ones([1, 2], &d));
/// assert!((m["training/rollout_probs_diff_max"] - 0.25).abs() < 1e-6);
/// assert!((m["training/rollout_probs_diff_mean"] - 0.125).abs() < 1e-6);
/// ```
pub fn rollout_probs_diff_metrics<B: Backend>(
    old_log_probs: &Tensor<B, 2>,
    rollout_log_probs: &Tensor<B, 2>,
    response_mask: &Tensor<B, 2>,
) -> BTreeMap<String, f64> {
    let old = Host2::from_tensor(old_log_probs);
    let rollout = Host2::from_tensor(rollout_log_probs);
    let mask = Host2::from_tensor(response_mask);
    let pairs: Vec<(f64, f64)> = (0..old.data.len())
        .filter(|&i| mask.data[i] != 0.0)
        .map(|i| (old.data[i].exp(), rollout.data[i].exp()))
        .collect();
    let mut m = BTreeMap::new();
    if pairs.is_empty() {
        return m;
    }
    let n = pairs.len() as f64;
    let diff: Vec<f64> = pairs.iter().map(|(a, b)| (a - b).abs()).collect();
    let mean = diff.iter().sum::<f64>() / n;
    let std = (diff.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    let (ma, mb) = (
        pairs.iter().map(|p| p.0).sum::<f64>() / n,
        pairs.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let cov: f64 = pairs.iter().map(|(a, b)| (a - ma) * (b - mb)).sum();
    let va: f64 = pairs.iter().map(|(a, _)| (a - ma).powi(2)).sum();
    let vb: f64 = pairs.iter().map(|(_, b)| (b - mb).powi(2)).sum();
    let pearson = cov / (va * vb).sqrt();
    m.insert("training/rollout_probs_diff_valid".into(), 1.0);
    m.insert(
        "training/rollout_probs_diff_max".into(),
        diff.iter().copied().fold(f64::MIN, f64::max),
    );
    m.insert("training/rollout_probs_diff_mean".into(), mean);
    m.insert("training/rollout_probs_diff_std".into(), std);
    m.insert("training/rollout_actor_probs_pearson_corr".into(), pearson);
    m
}

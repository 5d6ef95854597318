//! The next token of every row of a logits matrix, chosen where the logits are: on burn-cuda
//! one kernel launch samples every row and only the tokens, their log-probs and entropies come
//! to the host (`cuda::kernels::sampling`); other backends get the logits back and sample on
//! the host (the rollout engine's `Sampler`).
//!
//! The device draw is the Gumbel-max trick over the filtered distribution, with noise from a
//! counter-based hash of (row seed, step, token id), so a request's tokens do not depend on its
//! batch mates or on which slot it decodes in. [`reference_sample`] is the same draw on the host:
//! the GPU check compares the kernel with it token for token, and the tests here check that it
//! draws from the distribution the host sampler draws from.
//!
//! ```
//! use verl_megatron::sampling::{reference_sample, RowSampling};
//! let greedy = RowSampling { temperature: 0.0, ..RowSampling::default() };
//! let pick = reference_sample(&[0.5, 2.0, -1.0], &greedy);
//! assert_eq!(pick.token, 1);
//! assert!(pick.log_prob < 0.0 && pick.entropy > 0.0);
//! ```

use burn::prelude::*;

use crate::ops::FusedOps;
use crate::parallel::{Collective, ParallelBackend, TpGroup};

pub use crate::ops::{RowSampling, SampledToken, ShardDraw};

/// Samples every row of `logits` `[rows, vocab]` (f32) on the device, `rows[i]` for row `i`;
/// the logits come back where no kernel applies (every backend but burn-cuda, the kernel
/// switched off with `VERL_SAMPLING=decomposed`).
pub fn sample_rows<B: FusedOps>(
    logits: Tensor<B, 2>,
    rows: &[RowSampling],
) -> Result<Vec<SampledToken>, Tensor<B, 2>> {
    B::sample(logits, rows)
}

/// The logit's order-preserving unsigned key (larger float, larger key).
fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform in (0, 1) behind token `i`'s Gumbel noise at draw `step` of stream `seed` (24
/// bits, as the kernel computes it).
pub fn uniform(seed: u64, step: u32, i: u32) -> f32 {
    let z = mix64(seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(step as u64 + 1)));
    let z = mix64(z ^ 0xD1B5_4A32_D192_ED03u64.wrapping_mul(i as u64 + 1));
    ((z >> 40) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

/// A probability relative to the most likely token, in the 40-bit fixed point the top-p select
/// adds up (integer sums do not depend on the order they are added in).
fn fixed_mass(s: f32) -> u64 {
    (s.exp() as f64 * (1u64 << 40) as f64 + 0.5) as u64
}

/// The kernel's draw for one row, on the host: the same filters, thresholds and noise.
pub fn reference_sample(x: &[f32], p: &RowSampling) -> SampledToken {
    let v = x.len();
    let (mut top, mut m) = (0usize, f32::NEG_INFINITY);
    for (i, &xi) in x.iter().enumerate() {
        if xi > m {
            (top, m) = (i, xi);
        }
    }
    let greedy = p.is_greedy();
    let inv_t = if greedy { 1.0 } else { 1.0 / p.temperature };
    let s = |i: usize| (x[i] - m) * inv_t;
    let (mut z, mut zs) = (0f32, 0f32);
    for i in 0..v {
        let e = s(i).exp();
        z += e;
        zs += e * s(i);
    }
    let log_z = z.ln();
    let (mut token, mut kept) = (top, 1u32);
    if !greedy {
        let min_s = if p.min_p > 0.0 {
            p.min_p.ln()
        } else {
            f32::NEG_INFINITY
        };
        let mut order: Vec<usize> = (0..v).filter(|&i| s(i) >= min_s).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(order_key(x[i])));
        let mut threshold = 0u32;
        if p.top_k > 0 && (p.top_k as usize) < order.len() {
            threshold = order_key(x[order[p.top_k as usize - 1]]);
        }
        if p.top_p < 1.0 {
            let candidates: Vec<usize> = order
                .iter()
                .copied()
                .filter(|&i| order_key(x[i]) >= threshold)
                .collect();
            let total: u64 = candidates.iter().map(|&i| fixed_mass(s(i))).sum();
            let need = ((p.top_p as f64 * total as f64).ceil() as u64).max(1);
            let mut acc = 0u64;
            for &i in &candidates {
                acc += fixed_mass(s(i));
                if acc >= need {
                    threshold = threshold.max(order_key(x[i]));
                    break;
                }
            }
        }
        let (mut best, mut best_score) = (top, f32::NEG_INFINITY);
        kept = 0;
        for (i, &xi) in x.iter().enumerate() {
            if s(i) >= min_s && order_key(xi) >= threshold {
                let g = -(-uniform(p.seed, p.step, i as u32).ln()).ln();
                if s(i) + g > best_score {
                    (best, best_score) = (i, s(i) + g);
                }
                kept += 1;
            }
        }
        token = best;
    }
    SampledToken {
        token: token as u32,
        log_prob: s(token) - log_z,
        entropy: log_z - zs / z,
        kept,
    }
}

/// Samples every row of a vocabulary-parallel logits shard without gathering the vocabulary:
/// `logits` `[rows, width]` (f32) holds ids `vocab_start..` of a `vocab`-id vocabulary (columns
/// past `vocab` are padding). The group agrees on each row's maximum (an all-reduce of `rows`
/// values), each rank draws its best candidate and its softmax pieces relative to that maximum
/// ([`FusedOps::sample_shard`]), and the `rows × 8` words per rank are gathered and combined
/// ([`combine_shard_draws`]): the same tokens as [`sample_rows`] on the whole row, with the
/// log-prob and entropy equal up to the order of a sum. The logits come back when a row ranks
/// the whole vocabulary (top-k or top-p: [`RowSampling::draws_from_shards`]). A collective
/// over `tp`: every rank of the group calls it with the same rows.
pub fn sample_vocab_parallel<B: ParallelBackend>(
    logits: Tensor<B, 2>,
    rows: &[RowSampling],
    tp: &TpGroup,
    (vocab_start, vocab): (usize, usize),
) -> Result<Vec<SampledToken>, Tensor<B, 2>> {
    let [n, width] = logits.dims();
    if n != rows.len() || n == 0 || !rows.iter().all(|r| r.draws_from_shards(vocab)) {
        return Err(logits);
    }
    let valid = vocab.saturating_sub(vocab_start).min(width);
    let local_max = B::row_max(logits.clone(), valid);
    let row_max = tp.collective(local_max, Collective::AllReduceMax);
    let mine = B::sample_shard(logits, row_max, rows, (vocab_start, valid));
    let all = tp.collective(mine, Collective::AllGather(1));
    crate::host_reads::note(1);
    let words: Vec<f32> = all
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 after convert");
    Ok(combine_rows(&words, tp.size, rows))
}

/// Each row's token from its shards' draws, laid out as `words` `[rows, parts,
/// ShardDraw::WORDS]` with the parts in vocabulary order ([`combine_shard_draws`] per row): a
/// tensor-parallel group's gathered shards, or one GPU's pieces of each row.
pub fn combine_rows(words: &[f32], parts: usize, rows: &[RowSampling]) -> Vec<SampledToken> {
    words
        .chunks(parts * ShardDraw::WORDS)
        .zip(rows)
        .map(|(row, p)| {
            let draws: Vec<ShardDraw> = row
                .chunks(ShardDraw::WORDS)
                .map(ShardDraw::from_words)
                .collect();
            combine_shard_draws(&draws, p)
        })
        .collect()
}

/// A row's token from its shards' draws ([`ShardDraw`], in rank order), as the whole-row kernel
/// chooses it: the best candidate (larger score, then smaller id), or when no shard kept one
/// (filters that leave nothing, infinite logits) the largest logit; its log-prob against the
/// summed normaliser; the entropy; the tokens kept (1 when greedy).
pub fn combine_shard_draws(parts: &[ShardDraw], p: &RowSampling) -> SampledToken {
    // Larger value, then smaller id; NaN never wins (the kernels' `better`).
    let better = |a: Option<(f32, u32)>, b: (f32, u32)| match a {
        _ if b.1 == u32::MAX => a,
        None => Some(b),
        Some(a) if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) => Some(b),
        a => a,
    };
    let greedy = p.is_greedy();
    let mut best: Option<(f32, u32)> = None;
    let mut top: Option<(f32, u32)> = None;
    for d in parts {
        best = better(best, (d.score, d.token));
        top = better(top, (d.top, d.top_token));
    }
    let s_of = |token: u32| parts.iter().find(|d| d.token == token).map(|d| d.s_token);
    let (token, s_token) = match (best, top) {
        (Some((_, t)), _) => (t, s_of(t).unwrap_or(f32::NAN)),
        // The largest logit is the row's maximum: its s is 0 (NaN when infinite).
        (None, Some((x, t))) => (t, if x.is_finite() { 0.0 } else { f32::NAN }),
        (None, None) => (u32::MAX, f32::NAN),
    };
    let z: f32 = parts.iter().map(|d| d.z).sum();
    let zs: f32 = parts.iter().map(|d| d.zs).sum();
    let log_z = z.ln();
    SampledToken {
        token,
        log_prob: s_token - log_z,
        entropy: log_z - zs / z,
        kept: if greedy {
            1
        } else {
            parts.iter().map(|d| d.kept).sum()
        },
    }
}

/// One shard's [`ShardDraw`] on the host, as the kernel computes it: `x` holds ids
/// `vocab_start..vocab_start + x.len()`, and `row_max` is the whole row's maximum.
pub fn reference_shard_draw(
    x: &[f32],
    vocab_start: u32,
    row_max: f32,
    p: &RowSampling,
) -> ShardDraw {
    let greedy = p.is_greedy();
    let inv_t = if greedy { 1.0 } else { 1.0 / p.temperature };
    let min_s = if !greedy && p.min_p > 0.0 {
        p.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let mut d = ShardDraw {
        score: f32::NEG_INFINITY,
        token: u32::MAX,
        z: 0.0,
        zs: 0.0,
        kept: 0,
        s_token: f32::NEG_INFINITY,
        top: f32::NEG_INFINITY,
        top_token: u32::MAX,
    };
    // Ids rise along the shard, so only a first value can win a tie (against "none"), and a
    // NaN never wins: the kernel's `better`.
    let wins = |value: f32, best: f32, none: bool| value > best || (none && value == best);
    for (i, &xi) in x.iter().enumerate() {
        let s = (xi - row_max) * inv_t;
        let e = s.exp();
        d.z += e;
        d.zs += e * s;
        let id = vocab_start + i as u32;
        if wins(xi, d.top, d.top_token == u32::MAX) {
            (d.top, d.top_token) = (xi, id);
        }
        if !greedy && s >= min_s {
            d.kept += 1;
            let score = s - (-uniform(p.seed, p.step, id).ln()).ln();
            if wins(score, d.score, d.token == u32::MAX) {
                (d.score, d.token, d.s_token) = (score, id, s);
            }
        }
    }
    if greedy && d.top_token != u32::MAX {
        d.score = d.top;
        d.token = d.top_token;
        d.s_token = (d.top - row_max) * inv_t;
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The distribution the filters leave, computed the plain way (sort, cut, renormalise).
    fn filtered(x: &[f32], p: &RowSampling) -> Vec<f64> {
        let t = p.temperature as f64;
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = x.iter().map(|&v| ((v as f64 - m) / t).exp()).collect();
        let mut keep: Vec<usize> = (0..x.len()).filter(|&i| w[i] >= p.min_p as f64).collect();
        keep.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            keep.truncate(p.top_k as usize);
        }
        if p.top_p < 1.0 {
            let total: f64 = keep.iter().map(|&i| w[i]).sum();
            let mut acc = 0.0;
            let mut n = 0;
            for &i in &keep {
                acc += w[i] / total;
                n += 1;
                if acc >= p.top_p as f64 - 1e-9 {
                    break;
                }
            }
            keep.truncate(n);
        }
        let total: f64 = keep.iter().map(|&i| w[i]).sum();
        let mut out = vec![0.0; x.len()];
        keep.iter().for_each(|&i| out[i] = w[i] / total);
        out
    }

    #[test]
    fn greedy_takes_the_first_largest_and_reports_the_full_softmax() {
        let x = [1.0f32, 3.0, 3.0, -2.0];
        let got = reference_sample(
            &x,
            &RowSampling {
                temperature: 0.0,
                ..Default::default()
            },
        );
        assert_eq!(got.token, 1);
        let lse = x.iter().map(|v| (v - 3.0).exp()).sum::<f32>().ln();
        assert!((got.log_prob - (0.0 - lse)).abs() < 1e-6);
        assert_eq!(got.kept, 1);
    }

    /// Hand-checked: logits ln(4), ln(2), ln(1), ln(1) are probabilities .5 .25 .125 .125;
    /// top-p 0.7 keeps the first two, top-k 2 the first two and top-k 3 all four (the third and
    /// fourth tie), min-p 0.3 those ≥ 0.15.
    #[test]
    fn filters_keep_the_hand_checked_sets() {
        let x = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
        let kept = |p: RowSampling| reference_sample(&x, &p).kept;
        let base = RowSampling::default();
        assert_eq!(kept(base), 4);
        assert_eq!(kept(RowSampling { top_p: 0.7, ..base }), 2);
        assert_eq!(kept(RowSampling { top_k: 2, ..base }), 2);
        assert_eq!(kept(RowSampling { top_k: 3, ..base }), 4);
        assert_eq!(kept(RowSampling { min_p: 0.3, ..base }), 2);
        assert_eq!(kept(RowSampling { top_p: 0.5, ..base }), 1);
    }

    /// Draws over many steps follow the filtered distribution (chi-square, 1 000 draws).
    #[test]
    fn draws_follow_the_filtered_distribution() {
        // Distinct logits (with ties, top-k keeps every tied token).
        let x: Vec<f32> = (0..12).map(|i| ((i * 7) % 12) as f32 * 0.3 - 1.5).collect();
        for p in [
            RowSampling::default(),
            RowSampling {
                temperature: 0.7,
                top_k: 5,
                ..Default::default()
            },
            RowSampling {
                temperature: 1.3,
                top_p: 0.8,
                min_p: 0.05,
                seed: 9,
                ..Default::default()
            },
        ] {
            let want = filtered(&x, &p);
            let n = 1000;
            let mut counts = vec![0usize; x.len()];
            for step in 0..n {
                let t = reference_sample(&x, &RowSampling { step, ..p }).token;
                counts[t as usize] += 1;
            }
            let mut chi2 = 0.0;
            let mut cells = 0;
            for (c, q) in counts.iter().zip(&want) {
                if *q == 0.0 {
                    assert_eq!(*c, 0, "a filtered-out token was drawn ({p:?})");
                    continue;
                }
                let e = q * n as f64;
                chi2 += (*c as f64 - e).powi(2) / e;
                cells += 1;
            }
            // Far above the 99.9 % quantile for ≤ 11 degrees of freedom (31.3).
            assert!(chi2 < 40.0, "chi2 {chi2} over {cells} cells ({p:?})");
        }
    }

    /// Hand-checked: logits ln 4, ln 2, 0, 0 (probabilities .5 .25 .125 .125) in two shards of
    /// two. Greedy takes id 0 with log-prob ln .5; each shard's normaliser is relative to the
    /// row's maximum ln 4: 1 + .5 and .25 + .25.
    #[test]
    fn two_shards_give_the_hand_checked_draw() {
        let x = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
        let greedy = RowSampling {
            temperature: 0.0,
            ..RowSampling::default()
        };
        let m = 4f32.ln();
        let parts = [
            reference_shard_draw(&x[..2], 0, m, &greedy),
            reference_shard_draw(&x[2..], 2, m, &greedy),
        ];
        assert!((parts[0].z - 1.5).abs() < 1e-6 && (parts[1].z - 0.5).abs() < 1e-6);
        assert_eq!((parts[0].token, parts[1].token), (0, 2));
        let got = combine_shard_draws(&parts, &greedy);
        assert_eq!((got.token, got.kept), (0, 1));
        assert!((got.log_prob - 0.5f32.ln()).abs() < 1e-6);
        // H = -Σ p ln p = .5 ln 2 + .25 ln 4 + 2 · .125 ln 8.
        let h = 0.5 * 2f32.ln() + 0.25 * 4f32.ln() + 0.25 * 8f32.ln();
        assert!((got.entropy - h).abs() < 1e-6, "{}", got.entropy);
    }

    /// Shards that keep nothing (all below min-p, or no valid id) do not win the draw.
    #[test]
    fn a_shard_with_no_candidate_never_wins() {
        let p = RowSampling {
            min_p: 0.5,
            seed: 3,
            ..RowSampling::default()
        };
        let x = [5.0f32, 0.0, -1.0, -2.0];
        let parts = [
            reference_shard_draw(&x[..1], 0, 5.0, &p),
            reference_shard_draw(&x[1..], 1, 5.0, &p),
            reference_shard_draw(&[], 4, 5.0, &p),
        ];
        assert_eq!(
            (parts[1].token, parts[1].kept, parts[2].token),
            (u32::MAX, 0, u32::MAX)
        );
        let got = combine_shard_draws(&parts, &p);
        assert_eq!((got.token, got.kept), (0, 1));
        assert_eq!(got.token, reference_sample(&x, &p).token);
    }

    /// Degenerate rows choose as the whole-row kernel does (worked from `sampling.cu`): an
    /// infinite logit is the greedy token, and the token when min-p then keeps nothing (the
    /// kernel falls back to its largest logit); a row of `-inf` gives its first id, greedy or
    /// not (nothing passes, the fallback again); a NaN never wins.
    #[test]
    fn infinite_and_nan_logits_choose_as_the_whole_row_kernel() {
        let draw = |x: &[f32], cut: usize, p: &RowSampling| {
            let m = x
                .iter()
                .copied()
                .filter(|v| !v.is_nan())
                .fold(f32::NEG_INFINITY, f32::max);
            let parts = [
                reference_shard_draw(&x[..cut], 0, m, p),
                reference_shard_draw(&x[cut..], cut as u32, m, p),
            ];
            combine_shard_draws(&parts, p)
        };
        let greedy = RowSampling {
            temperature: 0.0,
            ..RowSampling::default()
        };
        let min_p = RowSampling {
            min_p: 0.1,
            seed: 5,
            ..RowSampling::default()
        };
        let inf = [1.0, 2.0, f32::INFINITY, 3.0];
        assert_eq!(draw(&inf, 2, &greedy).token, 2);
        let got = draw(&inf, 2, &min_p);
        assert_eq!((got.token, got.kept), (2, 0));
        let none = [f32::NEG_INFINITY; 4];
        assert_eq!(draw(&none, 2, &greedy).token, 0);
        assert_eq!(draw(&none, 1, &min_p).token, 0);
        assert_eq!(draw(&none, 3, &RowSampling::default()).token, 0);
        let nan = [f32::NAN, 1.0, f32::NAN, 0.5];
        assert_eq!(draw(&nan, 1, &greedy).token, 1);
        assert_eq!(
            reference_shard_draw(&[f32::NAN, 1.0], 0, 1.0, &greedy).token,
            1
        );
    }

    /// The group path on simulated ranks (threads): an odd vocabulary padded to three shards,
    /// every row's token equal to the whole-row draw, and rows with top-p or top-k refused
    /// (their logits come back for gathering).
    #[test]
    fn vocab_parallel_sampling_on_three_ranks_matches_the_whole_row() {
        use crate::parallel::LocalCommunicator;
        use std::sync::Arc;
        use verl_core::backend::CpuBackend;
        use verl_core::traits::Communicator;
        let (rows, vocab, tp) = (6usize, 23usize, 3usize);
        let width = vocab.div_ceil(tp);
        let x: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 37 % 101) as f32 / 13.0).sin() * 4.0)
            .collect();
        let params: Vec<RowSampling> = (0..rows)
            .map(|r| RowSampling {
                temperature: [0.0, 1.0, 0.7, 1.6, 1.0, 0.0][r],
                min_p: [0.0, 0.0, 0.1, 0.0, 0.3, 0.0][r],
                seed: 11 + r as u64,
                step: r as u32 * 5,
                ..RowSampling::default()
            })
            .collect();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalCommunicator::group(tp)
                .into_iter()
                .map(|c| {
                    let (x, params) = (&x, &params);
                    s.spawn(move || {
                        let group =
                            TpGroup::new(Arc::new(c) as Arc<dyn Communicator<CpuBackend>>, false);
                        let start = group.rank * width;
                        // This rank's columns, padded past the vocabulary with large values
                        // that must be ignored.
                        let shard: Vec<f32> = (0..rows)
                            .flat_map(|r| {
                                (start..start + width).map(move |v| {
                                    if v < vocab {
                                        x[r * vocab + v]
                                    } else {
                                        99.0
                                    }
                                })
                            })
                            .collect();
                        let logits = Tensor::<CpuBackend, 2>::from_data(
                            burn::tensor::TensorData::new(shard, [rows, width]),
                            &Default::default(),
                        );
                        let got =
                            sample_vocab_parallel(logits.clone(), params, &group, (start, vocab))
                                .expect("no top-k or top-p");
                        let mut top_p = params.clone();
                        top_p[2].top_p = 0.9;
                        let refused = sample_vocab_parallel(logits, &top_p, &group, (start, vocab));
                        (got, refused.is_err())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect()
        });
        for (rank, (got, refused)) in results.iter().enumerate() {
            assert!(refused, "rank {rank} drew a top-p row from shards");
            for (r, g) in got.iter().enumerate() {
                let want = reference_sample(&x[r * vocab..(r + 1) * vocab], &params[r]);
                assert_eq!(
                    (g.token, g.kept),
                    (want.token, want.kept),
                    "rank {rank} row {r}"
                );
                assert!(
                    (g.log_prob - want.log_prob).abs() < 1e-5,
                    "{g:?} vs {want:?}"
                );
                assert!((g.entropy - want.entropy).abs() < 1e-5, "{g:?} vs {want:?}");
            }
        }
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// The kept set is what sorting and cutting keeps (ties aside: distinct logits here),
        /// and the drawn token is in it.
        #[test]
        fn kept_set_matches_the_plain_filter(
            raw in proptest::collection::btree_set(-400i32..400, 2..40),
            t in 0.3f32..2.0, k in 0i32..12, top_p in 0.05f32..1.0, min_p in 0.0f32..0.5,
            seed: u64,
        ) {
            let x: Vec<f32> = raw.iter().map(|&v| v as f32 / 37.0).collect();
            let top_p = if top_p > 0.97 { 1.0 } else { top_p };
            let p = RowSampling { temperature: t, top_k: k, top_p, min_p, seed, step: 3 };
            let want = filtered(&x, &p);
            let got = reference_sample(&x, &p);
            let plain = want.iter().filter(|q| **q > 0.0).count() as u32;
            // Fixed-point masses may move the top-p cut by one token at an exact boundary.
            prop_assert!(got.kept.abs_diff(plain) <= 1, "kept {} vs {}", got.kept, plain);
            prop_assert!(want[got.token as usize] > 0.0 || got.kept != plain);
            prop_assert!(got.log_prob <= 1e-6 && got.entropy >= -1e-6);
        }

        /// Any split of a row into shards, combined, draws the whole row's token (ties
        /// included: logits on a coarse grid), keeps as many, and gives its log-prob and
        /// entropy up to the order of a sum.
        #[test]
        fn shards_combine_to_the_whole_row_draw(
            raw in proptest::collection::vec(-40i32..40, 1..60),
            cuts in proptest::collection::vec(0usize..60, 0..4),
            t in prop_oneof![Just(0.0f32), 0.3f32..2.0],
            min_p in prop_oneof![Just(0.0f32), 0.0f32..0.6],
            seed: u64, step in 0u32..1000,
        ) {
            let x: Vec<f32> = raw.iter().map(|&v| v as f32 / 8.0).collect();
            let p = RowSampling { temperature: t, min_p, seed, step, ..RowSampling::default() };
            let mut bounds: Vec<usize> = cuts.iter().map(|c| c % (x.len() + 1)).collect();
            bounds.extend([0, x.len()]);
            bounds.sort_unstable();
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let parts: Vec<ShardDraw> = bounds
                .windows(2)
                .map(|w| reference_shard_draw(&x[w[0]..w[1]], w[0] as u32, m, &p))
                .collect();
            let got = combine_shard_draws(&parts, &p);
            let want = reference_sample(&x, &p);
            prop_assert_eq!((got.token, got.kept), (want.token, want.kept));
            prop_assert!((got.log_prob - want.log_prob).abs() < 1e-4, "{:?} vs {:?}", got, want);
            prop_assert!((got.entropy - want.entropy).abs() < 1e-4, "{:?} vs {:?}", got, want);
        }
    }
}

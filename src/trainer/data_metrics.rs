//! verl's per-step data metrics (`compute_data_metrics` and `compute_timing_metrics` in verl's
//! `metric_utils.py`) over host copies of the step's columns: scores, rewards, advantages,
//! returns and values over the response tokens, the value function's explained variance, the
//! response and prompt lengths, and the time per token of each phase.

/// Mean, max and min of `values` where `mask` is set (`None` when nothing is).
pub(crate) fn masked_stats(values: &[f64], mask: &[bool]) -> Option<(f64, f64, f64)> {
    let mut n = 0usize;
    let (mut sum, mut hi, mut lo) = (0.0, f64::MIN, f64::MAX);
    for (&v, _) in values.iter().zip(mask).filter(|(_, &m)| m) {
        n += 1;
        sum += v;
        hi = hi.max(v);
        lo = lo.min(v);
    }
    (n > 0).then(|| (sum / n as f64, hi, lo))
}

/// The unbiased variance (torch's `var`) of `values` where `mask` is set.
fn masked_var(values: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = values.clone().count();
    if n < 2 {
        return f64::NAN;
    }
    let mean = values.clone().sum::<f64>() / n as f64;
    values.map(|v| (v - mean) * (v - mean)).sum::<f64>() / (n - 1) as f64
}

/// verl's `critic/vf_explained_var`: `1 - var(returns - values) / (var(returns) + 1e-5)` over
/// the response tokens.
pub(crate) fn explained_variance(returns: &[f64], values: &[f64], mask: &[bool]) -> f64 {
    let valid = |v: &'_ [f64]| {
        v.iter()
            .zip(mask)
            .filter(|(_, &m)| m)
            .map(|(&x, _)| x)
            .collect::<Vec<_>>()
    };
    let (r, v) = (valid(returns), valid(values));
    let diff = masked_var(r.iter().zip(&v).map(|(a, b)| a - b));
    1.0 - diff / (masked_var(r.iter().copied()) + 1e-5)
}

/// Mean, max, min and the fraction at `limit` of `lengths` (response or prompt lengths).
pub(crate) fn length_stats(lengths: &[f64], limit: f64) -> (f64, f64, f64, f64) {
    let n = lengths.len().max(1) as f64;
    let mean = lengths.iter().sum::<f64>() / n;
    let hi = lengths.iter().copied().fold(0.0, f64::max);
    let lo = lengths.iter().copied().fold(f64::MAX, f64::min);
    let clipped = lengths.iter().filter(|&&l| l >= limit).count() as f64 / n;
    (mean, hi, if lengths.is_empty() { 0.0 } else { lo }, clipped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// By hand: values 1, 5, -2, 7 with the third masked out.
    #[test]
    fn masked_stats_by_hand() {
        let s = masked_stats(&[1.0, 5.0, -2.0, 7.0], &[true, true, false, true]).unwrap();
        assert_eq!(s, (13.0 / 3.0, 7.0, 1.0));
        assert!(masked_stats(&[1.0], &[false]).is_none());
    }

    /// By hand: returns 1, 2, 3, 4 and values 1, 2, 3, 3 (the last masked out in one case).
    #[test]
    fn explained_variance_by_hand() {
        let r = [1.0, 2.0, 3.0, 4.0];
        // Perfect values: nothing left unexplained.
        let all = [true; 4];
        assert!((explained_variance(&r, &r, &all) - 1.0).abs() < 1e-12);
        // Residuals 0, 0, 0, 1: var 0.25 (unbiased); var(returns) = 5/3.
        let v = [1.0, 2.0, 3.0, 3.0];
        let want = 1.0 - 0.25 / (5.0 / 3.0 + 1e-5);
        assert!((explained_variance(&r, &v, &all) - want).abs() < 1e-12);
        // Masked out, the bad token does not count.
        let first3 = [true, true, true, false];
        assert!((explained_variance(&r, &v, &first3) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn length_stats_by_hand() {
        assert_eq!(
            length_stats(&[4.0, 8.0, 8.0, 2.0], 8.0),
            (5.5, 8.0, 2.0, 0.5)
        );
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Masked statistics equal those of the kept values alone, and lie in order.
        #[test]
        fn masked_stats_equal_the_kept_values(
            pairs in proptest::collection::vec((-100.0f64..100.0, any::<bool>()), 0..50)
        ) {
            let (values, mask): (Vec<f64>, Vec<bool>) = pairs.into_iter().unzip();
            let kept: Vec<f64> = values.iter().zip(&mask).filter(|(_, &m)| m).map(|(&v, _)| v).collect();
            match masked_stats(&values, &mask) {
                None => prop_assert!(kept.is_empty()),
                Some((mean, hi, lo)) => {
                    let want = kept.iter().sum::<f64>() / kept.len() as f64;
                    prop_assert!((mean - want).abs() < 1e-9);
                    prop_assert!(lo <= mean + 1e-9 && mean <= hi + 1e-9);
                    prop_assert!(kept.contains(&hi) && kept.contains(&lo));
                }
            }
        }
    }
}

//! Rollout correction: truncated importance weights and rejection masks from
//! `rollout_log_probs` vs `old_log_probs`.

use burn::tensor::{Tensor, TensorData};
use proptest::prelude::*;
use verl_core::algorithms::rollout_correction::{rollout_correction, RolloutCorrection};
use verl_core::backend::CpuBackend as B;

fn t2(v: &[Vec<f64>]) -> Tensor<B, 2> {
    let (r, c) = (v.len(), v[0].len());
    let flat: Vec<f32> = v.iter().flatten().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(flat, [r, c]), &Default::default())
}

fn host(t: Tensor<B, 2>) -> Vec<Vec<f64>> {
    let [_, c] = t.dims();
    let v: Vec<f64> = t.into_data().iter::<f64>().collect();
    v.chunks(c).map(<[f64]>::to_vec).collect()
}

type Rows = Vec<Vec<f64>>;

/// (old, rollout, mask): log-probs in (−4, −0.01), right-padded rows of at least one token.
fn batch() -> impl Strategy<Value = (Rows, Rows, Rows)> {
    (1usize..5, 1usize..6).prop_flat_map(|(rows, len)| {
        (
            prop::collection::vec(prop::collection::vec(-4.0f64..-0.01, len), rows),
            prop::collection::vec(prop::collection::vec(-4.0f64..-0.01, len), rows),
            prop::collection::vec(1usize..=len, rows),
        )
            .prop_map(move |(old, rollout, lens)| {
                let mask = lens
                    .iter()
                    .map(|&l| (0..len).map(|t| f64::from(u8::from(t < l))).collect())
                    .collect();
                (old, rollout, mask)
            })
    })
}

fn correction(level: &str, rs: Option<&str>, threshold: Option<&str>) -> RolloutCorrection {
    RolloutCorrection::parse(Some(level), 2.0, false, rs, threshold).unwrap()
}

proptest! {
    // A fixed seed: the same cases on every run (the fuzz tests explore).
    #![proptest_config(proptest::prelude::ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Weights lie in [0, threshold], are 0 at padding, and a sequence's are one value.
    #[test]
    fn weights_are_bounded_masked_and_per_sequence((old, rollout, mask) in batch(), seq in any::<bool>()) {
        let level = if seq { "sequence" } else { "token" };
        let out = rollout_correction(t2(&old), t2(&rollout), t2(&mask), &correction(level, None, None)).unwrap();
        let w = host(out.weights.unwrap());
        for (wr, mr) in w.iter().zip(&mask) {
            for (&x, &m) in wr.iter().zip(mr) {
                prop_assert!((0.0..=2.0 + 1e-6).contains(&x), "{x}");
                if m == 0.0 { prop_assert_eq!(x, 0.0); }
            }
            if seq {
                let live: Vec<f64> = wr.iter().zip(mr).filter(|(_, m)| **m > 0.0).map(|(x, _)| *x).collect();
                prop_assert!(live.iter().all(|x| (x - live[0]).abs() < 1e-6));
            }
        }
        prop_assert_eq!(host(out.response_mask), mask);
    }

    /// Equal log-probs: weights 1 on every token, nothing rejected by any criterion.
    #[test]
    fn equal_log_probs_change_nothing((old, _, mask) in batch(), seq in any::<bool>()) {
        let level = if seq { "sequence" } else { "token" };
        let rs = "token_k1,seq_sum_k1,seq_mean_k2,seq_max_k3,token_k3";
        let c = correction(level, Some(rs), Some("1.001"));
        let out = rollout_correction(t2(&old), t2(&old), t2(&mask), &c).unwrap();
        prop_assert_eq!(host(out.weights.unwrap()), mask.clone());
        prop_assert_eq!(host(out.response_mask), mask);
        prop_assert_eq!(out.metrics["rollout_corr/rollout_rs_masked_fraction"], 0.0);
    }
}

/// By hand: token 1 of row 0 is 4× likelier under training (k1 = −ln 4), row 1 matches.
/// `token_k1` with bounds 0.5_2 drops that token alone; `seq_sum_k1` drops all of row 0;
/// sequence IS gives row 0 the truncated weight 2 (raw 4) and row 1 weight 1.
#[test]
fn rejection_and_sequence_weights_by_hand() {
    let old = vec![vec![-1.0, -1.0], vec![-2.0, -3.0]];
    let rollout = vec![vec![-1.0, -1.0 - 4f64.ln()], vec![-2.0, -3.0]];
    let mask = vec![vec![1.0, 1.0], vec![1.0, 1.0]];
    let run = |rs: &str| {
        let c = RolloutCorrection::parse(Some("sequence"), 2.0, false, Some(rs), Some("0.5_2"))
            .unwrap();
        rollout_correction(t2(&old), t2(&rollout), t2(&mask), &c).unwrap()
    };
    let token = run("token_k1");
    assert_eq!(
        host(token.response_mask),
        vec![vec![1.0, 0.0], vec![1.0, 1.0]]
    );
    assert!((token.metrics["rollout_corr/rollout_rs_masked_fraction"] - 0.25).abs() < 1e-9);
    let w = host(token.weights.unwrap());
    assert!(
        w[0].iter().all(|x| (x - 2.0).abs() < 1e-5) && w[1].iter().all(|x| (x - 1.0).abs() < 1e-5),
        "{w:?}"
    );
    assert!(
        (token.metrics["rollout_corr/rollout_is_max"] - 4.0).abs() < 1e-4,
        "before truncation"
    );
    let seq = run("seq_sum_k1");
    assert_eq!(
        host(seq.response_mask),
        vec![vec![0.0, 0.0], vec![1.0, 1.0]]
    );
    assert!((seq.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] - 0.5).abs() < 1e-9);
}

/// Several rejection options judge the original mask each, and a token stays only if every
/// option keeps it (verl's combined mask). Row 0's last token has log-ratio 2 (k2 = 2): token_k2
/// (upper 0.5) rejects that token; seq_mean_k2 (upper 0.3) sees the row's mean k2 of 0.5 over
/// all four tokens and rejects the whole row. Applied in turn, the second option would have
/// seen only the three tokens the first kept (mean 0) and kept them.
#[test]
fn rejection_options_each_judge_the_original_mask() {
    let old = vec![vec![-1.0; 4], vec![-1.0; 4]];
    let rollout = vec![vec![-1.0, -1.0, -1.0, -3.0], vec![-1.0; 4]];
    let mask = vec![vec![1.0; 4], vec![1.0; 4]];
    let c = RolloutCorrection::parse(
        None,
        2.0,
        false,
        Some("token_k2,seq_mean_k2"),
        Some("0.5,0.3"),
    )
    .unwrap();
    let out = rollout_correction(t2(&old), t2(&rollout), t2(&mask), &c).unwrap();
    assert_eq!(host(out.response_mask), vec![vec![0.0; 4], vec![1.0; 4]]);
    let m = &out.metrics;
    for (key, want) in [
        ("rollout_corr/rollout_rs_token_k2_masked_fraction", 0.125),
        ("rollout_corr/rollout_rs_token_k2_seq_masked_fraction", 0.5),
        ("rollout_corr/rollout_rs_seq_mean_k2_masked_fraction", 0.5),
        (
            "rollout_corr/rollout_rs_seq_mean_k2_seq_masked_fraction",
            0.5,
        ),
        ("rollout_corr/rollout_rs_masked_fraction", 0.5),
        ("rollout_corr/rollout_rs_seq_masked_fraction", 0.5),
    ] {
        assert!((m[key] - want).abs() < 1e-12, "{key}: {} vs {want}", m[key]);
    }
}

/// `rollout_is_std` is the spread of the weights clamped to [1/threshold, threshold], as verl
/// takes it: token weights 4, 1, 1, 1/4 with threshold 2 clamp to 2, 1, 1, 1/2 (mean 1.125,
/// E[w²] = 1.5625, std = √(1.5625 − 1.265625) = 0.544862…).
#[test]
fn the_weights_spread_is_taken_after_clamping() {
    let old = vec![vec![-1.0, -1.0], vec![-1.0, -1.0]];
    let rollout = vec![vec![-1.0 - 4f64.ln(), -1.0], vec![-1.0, -1.0 + 4f64.ln()]];
    let mask = vec![vec![1.0, 1.0], vec![1.0, 1.0]];
    let c = RolloutCorrection::parse(Some("token"), 2.0, false, None, None).unwrap();
    let out = rollout_correction(t2(&old), t2(&rollout), t2(&mask), &c).unwrap();
    let std = out.metrics["rollout_corr/rollout_is_std"];
    assert!((std - (1.5625f64 - 1.265625).sqrt()).abs() < 1e-6, "{std}");
    // verl's per-sequence view of the untruncated weights: row means 2.5 and 0.625.
    for (key, want) in [
        ("rollout_corr/rollout_is_seq_mean", 1.5625),
        ("rollout_corr/rollout_is_seq_std", 1.875 / 2f64.sqrt()),
        ("rollout_corr/rollout_is_seq_max", 2.5),
        ("rollout_corr/rollout_is_seq_min", 0.625),
        ("rollout_corr/rollout_is_seq_max_deviation", 1.5),
        ("rollout_corr/rollout_is_seq_fraction_high", 0.5),
        ("rollout_corr/rollout_is_seq_fraction_low", 0.0),
    ] {
        let got = out.metrics[key];
        assert!((got - want).abs() < 1e-6, "{key}: {got} vs {want}");
    }
}

/// Sequence-level weights as verl takes them: the sum of the raw per-token log-ratios, clamped
/// as a sum (25 and −10 give e^15, where clamping each token first gave e^10), and the
/// sequence statistics over every sequence, an empty one's log-ratio 0: the max e^15, the min
/// e^0, and one of the two sequences over the threshold.
#[test]
fn sequence_weights_sum_raw_log_ratios_and_count_sequences() {
    let old = vec![vec![-1.0, -1.0], vec![-1.0, -1.0]];
    let rollout = vec![vec![-26.0, 9.0], vec![-1.0, -1.0]];
    let mask = vec![vec![1.0, 1.0], vec![0.0, 0.0]];
    let c = RolloutCorrection::parse(Some("sequence"), 2.0, false, None, None).unwrap();
    let out = rollout_correction(t2(&old), t2(&rollout), t2(&mask), &c).unwrap();
    let m = &out.metrics;
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    assert!(
        rel(m["rollout_corr/rollout_is_max"], 15f64.exp()) < 1e-9,
        "{m:?}"
    );
    assert!(rel(m["rollout_corr/rollout_is_min"], 1.0) < 1e-12, "{m:?}");
    assert_eq!(m["rollout_corr/rollout_is_ratio_fraction_high"], 0.5);
    assert_eq!(m["rollout_corr/rollout_is_ratio_fraction_low"], 0.0);
    // Truncated to the threshold for training, the padding's 0.
    assert_eq!(
        host(out.weights.unwrap()),
        vec![vec![2.0, 2.0], vec![0.0, 0.0]]
    );
}

/// The off-policy metrics as verl's `compute_offpolicy_metrics` takes them, an empty sequence
/// counted with mean log-prob 0 (perplexity 1); expected values worked with verl's formulas
/// (masked means over the count plus 1e-8) in f64 from the same inputs.
#[test]
fn off_policy_metrics_are_verls() {
    let old = vec![
        vec![-1.0, -2.0, -0.5],
        vec![-1.5, -7.0, -7.0],
        vec![-3.0, -3.0, -3.0],
    ];
    let rollout = vec![
        vec![-1.2, -1.5, -0.5],
        vec![-1.0, -9.0, -9.0],
        vec![-4.0, -4.0, -4.0],
    ];
    let mask = vec![
        vec![1.0, 1.0, 1.0],
        vec![1.0, 0.0, 0.0],
        vec![0.0, 0.0, 0.0],
    ];
    let c = RolloutCorrection::parse(Some("token"), 2.0, false, None, None).unwrap();
    let out = rollout_correction(t2(&old), t2(&rollout), t2(&mask), &c).unwrap();
    for (key, want) in [
        ("rollout_corr/training_ppl", 2.897653177926006),
        ("rollout_corr/training_log_ppl", 0.8888888825925928),
        ("rollout_corr/kl", 0.19999999950000003),
        ("rollout_corr/k3_kl", 0.05861601924981914),
        ("rollout_corr/rollout_ppl", 2.207986512608977),
        ("rollout_corr/rollout_log_ppl", 0.6888888843703705),
        ("rollout_corr/log_ppl_diff", 0.19999999822222223),
        ("rollout_corr/log_ppl_abs_diff", 0.19999999822222223),
        ("rollout_corr/log_ppl_diff_max", 0.49999999500000014),
        ("rollout_corr/log_ppl_diff_min", 0.0),
        ("rollout_corr/ppl_ratio", 1.2512973933879263),
        ("rollout_corr/chi2_token", -0.19310410702120095),
        ("rollout_corr/chi2_seq", -0.3611029742448437),
    ] {
        let got = out.metrics[key];
        // The inputs pass through f32 tensors: agreement to f32 rounding.
        assert!(
            (got - want).abs() < 2e-6 * want.abs().max(1.0),
            "{key}: {got} vs {want}"
        );
    }
}

/// Options and thresholds parse as verl parses them: a repeated option counts once (so two
/// thresholds for it are one too many), empty threshold entries are dropped; a k1 threshold
/// whose lower end would lie above its upper one (a single value below 1) is refused, a
/// deliberate difference (verl accepts it and rejects every token).
#[test]
fn rejection_settings_parse_as_verls() {
    let parse =
        |rs: &str, thr: &str| RolloutCorrection::parse(None, 2.0, false, Some(rs), Some(thr));
    let c = parse("token_k1,token_k1", "0.5_2").unwrap();
    assert_eq!(c.rejection.len(), 1);
    assert!(parse("token_k1,token_k1", "0.5_2,0.4_3").is_err());
    let c = parse("token_k2,seq_max_k3", "0.5,0.2,").unwrap();
    assert_eq!(c.rejection.len(), 2);
    assert_eq!(c.rejection[1].upper, 0.2);
    let e = parse("token_k1", "0.5").unwrap_err().to_string();
    assert!(e.contains("lower") && e.contains("upper"), "{e}");
    assert!(parse("token_k2", ",").is_err());
}

/// Bad settings are refused by key.
#[test]
fn bad_settings_name_the_key() {
    let err =
        |r: Result<RolloutCorrection, verl_core::error::AlgorithmError>| r.unwrap_err().to_string();
    assert!(err(RolloutCorrection::parse(
        Some("tok"),
        2.0,
        false,
        None,
        None
    ))
    .contains("rollout_is"));
    assert!(err(RolloutCorrection::parse(None, 0.0, false, None, None))
        .contains("rollout_is_threshold"));
    assert!(err(RolloutCorrection::parse(
        None,
        2.0,
        false,
        Some("seq_max_k1"),
        Some("2")
    ))
    .contains("seq_max_k1"));
    assert!(err(RolloutCorrection::parse(
        None,
        2.0,
        false,
        Some("token_k2"),
        None
    ))
    .contains("rollout_rs_threshold"));
    assert!(err(RolloutCorrection::parse(
        None,
        2.0,
        false,
        Some("token_k1,token_k2"),
        Some("1,2,3")
    ))
    .contains("one per option"));
}

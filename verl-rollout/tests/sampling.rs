//! The sampler: matches its target distribution (chi-square, fixed seed), filters exactly, is
//! reproducible per request, and refuses bad settings by field.

use proptest::prelude::*;
use verl_rollout::{Sampler, SamplingError, SamplingParams};

const LOGITS: [f32; 6] = [2.0, 1.5, 0.3, 0.0, -1.0, -3.0];

fn counts(params: SamplingParams, draws: usize) -> Vec<usize> {
    let mut s = Sampler::new(params, 0).unwrap();
    let mut c = vec![0; LOGITS.len()];
    for _ in 0..draws {
        c[s.sample(&LOGITS).0 as usize] += 1;
    }
    c
}

/// Pearson's statistic over the tokens with non-zero target probability.
fn chi_square(c: &[usize], p: &[f64], draws: usize) -> (f64, usize) {
    let mut stat = 0.0;
    let mut cells = 0;
    for (&o, &pi) in c.iter().zip(p) {
        if pi > 0.0 {
            let e = pi * draws as f64;
            stat += (o as f64 - e).powi(2) / e;
            cells += 1;
        } else {
            assert_eq!(o, 0, "a filtered-out token was sampled");
        }
    }
    (stat, cells - 1)
}

#[test]
fn samples_follow_the_target_distribution() {
    // 99.9% critical values of chi-square for 1..=5 degrees of freedom.
    let critical = [10.83, 13.82, 16.27, 18.47, 20.52];
    let draws = 40_000;
    for params in [
        SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            seed: 3,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 3,
            seed: 5,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_p: 0.8,
            seed: 9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 2.0,
            top_k: 4,
            top_p: 0.9,
            min_p: 0.0,
            seed: 11,
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 5,
            min_p: 0.1,
            seed: 13,
            ..Default::default()
        },
    ] {
        let p = params.distribution(&LOGITS);
        let (stat, dof) = chi_square(&counts(params, draws), &p, draws);
        assert!(
            stat < critical[dof - 1],
            "{params:?}: chi-square {stat:.2} with {dof} dof"
        );
    }
}

#[test]
fn filtering_by_hand() {
    // Temperature 1: softmax of LOGITS; top-k 2 keeps tokens 0 and 1, renormalised.
    let p = SamplingParams {
        top_k: 2,
        ..Default::default()
    }
    .distribution(&LOGITS);
    let (a, b) = (2.0f64.exp(), 1.5f64.exp());
    assert!((p[0] - a / (a + b)).abs() < 1e-12 && (p[1] - b / (a + b)).abs() < 1e-12);
    assert!(p[2..].iter().all(|&x| x == 0.0));
    // top-p keeps the smallest prefix reaching p: token 0 alone has ~0.47, so p=0.4 keeps only it.
    let p = SamplingParams {
        top_p: 0.4,
        ..Default::default()
    }
    .distribution(&LOGITS);
    assert_eq!(p[0], 1.0);
    // Greedy ignores the random stream.
    let mut s = Sampler::new(
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        7,
    )
    .unwrap();
    assert_eq!(s.sample(&LOGITS).0, 0);
}

proptest! {
    // A fixed seed: the same cases on every run (the fuzz tests explore).
    #![proptest_config(proptest::prelude::ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..proptest::prelude::ProptestConfig::default()
    })]

    #[test]
    fn distributions_are_normalised_and_respect_top_k(
        logits in prop::collection::vec(-5.0f32..5.0, 1..40),
        t in 0.1f64..3.0,
        k in -1i64..10,
        top_p in 0.05f64..1.0,
    ) {
        let p = SamplingParams { temperature: t, top_k: k, top_p, min_p: 0.0, seed: 0 }.distribution(&logits);
        prop_assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let kept = p.iter().filter(|&&x| x > 0.0).count();
        prop_assert!(kept >= 1);
        if k > 0 {
            prop_assert!(kept <= k as usize);
        }
    }

    #[test]
    fn a_request_is_reproducible_and_requests_differ(seed in any::<u64>()) {
        let params = SamplingParams { temperature: 1.0, seed, ..Default::default() };
        let run = |req| { let mut s = Sampler::new(params, req).unwrap(); (0..32).map(|_| s.sample(&LOGITS).0).collect::<Vec<_>>() };
        prop_assert_eq!(run(1), run(1));
        prop_assert_ne!(run(1), run(2));
    }
}

#[test]
fn bad_settings_are_refused_by_field() {
    let bad = |p: SamplingParams| match Sampler::new(p, 0).unwrap_err() {
        SamplingError::Invalid { field, .. } => field,
    };
    assert_eq!(
        bad(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }),
        "temperature"
    );
    assert_eq!(
        bad(SamplingParams {
            top_k: -2,
            ..Default::default()
        }),
        "top_k"
    );
    assert_eq!(
        bad(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }),
        "top_p"
    );
    assert_eq!(
        bad(SamplingParams {
            top_p: 1.5,
            ..Default::default()
        }),
        "top_p"
    );
}

/// Hand-checked min-p: logits ln 4, ln 2, 0, 0 are probabilities .5 .25 .125 .125; min-p 0.3
/// keeps tokens at least 0.3 × 0.5 = 0.15 likely (the first two, renormalised to 2/3, 1/3), and
/// min-p applies before top-p (0.6 of the kept mass: the first token alone, 2/3 ≥ 0.6).
#[test]
fn min_p_keeps_tokens_relative_to_the_most_likely() {
    let logits = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
    let p = SamplingParams {
        min_p: 0.3,
        ..Default::default()
    }
    .distribution(&logits);
    let want = [2.0 / 3.0, 1.0 / 3.0, 0.0, 0.0];
    for (a, b) in p.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{p:?}");
    }
    let p = SamplingParams {
        min_p: 0.3,
        top_p: 0.6,
        ..Default::default()
    }
    .distribution(&logits);
    assert_eq!(p, vec![1.0, 0.0, 0.0, 0.0]);
    let bad = SamplingParams {
        min_p: 1.5,
        ..Default::default()
    };
    assert!(matches!(
        Sampler::new(bad, 0),
        Err(SamplingError::Invalid { field: "min_p", .. })
    ));
}

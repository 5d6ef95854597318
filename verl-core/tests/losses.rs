//! Policy losses, KL penalties, the value loss, aggregation and logits utilities: naive-loop
//! equivalence, masking, clipping bounds and gradients (under autodiff), hand-checked numbers.

// The reference implementations below are deliberately naive index loops.
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use proptest::prelude::*;
use verl_core::algorithms::kl::{
    kl_full, kl_penalty, AdaptiveKlController, KlController, KlPenalty,
};
use verl_core::algorithms::logits::{entropy_from_logits, log_probs_from_logits};
use verl_core::algorithms::policy_loss::{
    PolicyLossInput, PolicyLossParams, PolicyLossRegistry, BUILTIN_POLICY_LOSSES,
};
use verl_core::algorithms::reward::apply_kl_penalty;
use verl_core::algorithms::value::value_loss;
use verl_core::algorithms::{agg_loss, AggScale, LossAggMode};
use verl_core::backend::CpuBackend;

type B = Autodiff<CpuBackend>;

fn t2(v: &[Vec<f64>]) -> Tensor<B, 2> {
    let (r, c) = (v.len(), v[0].len());
    let flat: Vec<f32> = v.iter().flatten().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(flat, [r, c]), &Default::default())
}

fn flat<const D: usize>(t: &Tensor<B, D>) -> Vec<f64> {
    t.to_data().iter::<f64>().collect()
}

/// A gradient (an inner-backend tensor) as a flat vector.
fn gflat<const D: usize>(t: Tensor<CpuBackend, D>) -> Vec<f64> {
    t.to_data().iter::<f64>().collect()
}

fn s(t: Tensor<B, 1>) -> f64 {
    flat(&t)[0]
}

/// Random (old_log_prob, log_prob, advantages, mask), right-padded, every row non-empty.
fn inputs() -> impl Strategy<Value = [Vec<Vec<f64>>; 4]> {
    (1usize..5, 1usize..6).prop_flat_map(|(rows, len)| {
        (
            prop::collection::vec(prop::collection::vec(-3.0f64..-0.05, len), rows),
            prop::collection::vec(prop::collection::vec(-0.6f64..0.6, len), rows),
            prop::collection::vec(prop::collection::vec(-2.0f64..2.0, len), rows),
            prop::collection::vec(1usize..=len, rows),
        )
            .prop_map(move |(old, delta, adv, lens)| {
                let new: Vec<Vec<f64>> = old
                    .iter()
                    .zip(&delta)
                    .map(|(o, d)| o.iter().zip(d).map(|(a, b)| a + b).collect())
                    .collect();
                let mask = lens
                    .iter()
                    .map(|&l| (0..len).map(|t| f64::from(u8::from(t < l))).collect())
                    .collect();
                [old, new, adv, mask]
            })
    })
}

fn input(x: &[Vec<Vec<f64>>; 4]) -> PolicyLossInput<B> {
    PolicyLossInput::new(t2(&x[0]), t2(&x[1]), t2(&x[2]), t2(&x[3]))
}

/// Naive dual-clip PPO per token, token-mean.
fn naive_vanilla(x: &[Vec<Vec<f64>>; 4], p: PolicyLossParams) -> (f64, f64, f64, f64) {
    let (mut sum, mut n, mut clip, mut lower, mut kl) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for i in 0..x[0].len() {
        for t in 0..x[0][i].len() {
            if x[3][i][t] == 0.0 {
                continue;
            }
            let (lr, a) = ((x[1][i][t] - x[0][i][t]).clamp(-20.0, 20.0), x[2][i][t]);
            let r = lr.exp();
            let l1 = -a * r;
            let l2 = -a * r.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high);
            let c1 = l1.max(l2);
            let l3 = -a * p.clip_ratio_c;
            let loss = if a < 0.0 { c1.min(l3) } else { c1 };
            sum += loss;
            n += 1.0;
            clip += f64::from(u8::from(l2 > l1));
            lower += f64::from(u8::from(c1 > l3 && a < 0.0));
            kl += -lr;
        }
    }
    (sum / n, clip / n, kl / n, lower / n)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 40,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    #[test]
    fn vanilla_equals_the_naive_loop(x in inputs(), low in 0.05f64..0.4, high in 0.05f64..0.4) {
        let mut inp = input(&x);
        inp.params.clip_ratio_low = low;
        inp.params.clip_ratio_high = high;
        let out = PolicyLossRegistry::<B>::new().compute("vanilla", &inp).unwrap();
        let (loss, clip, kl, lower) = naive_vanilla(&x, inp.params);
        prop_assert!((s(out.loss) - loss).abs() < 1e-4 * (1.0 + loss.abs()));
        prop_assert!((out.pg_clipfrac - clip).abs() < 1e-5);
        prop_assert!((out.ppo_kl - kl).abs() < 1e-4);
        prop_assert!((out.pg_clipfrac_lower - lower).abs() < 1e-5);
    }

    #[test]
    fn clipped_tokens_get_no_gradient(x in inputs()) {
        let mut inp = input(&x);
        let lp = inp.log_prob.clone().require_grad();
        inp.log_prob = lp.clone();
        let out = PolicyLossRegistry::<B>::new().compute("vanilla", &inp).unwrap();
        let grads = out.loss.backward();
        let g = gflat(lp.grad(&grads).unwrap());
        let p = inp.params;
        let mut k = 0;
        for i in 0..x[0].len() {
            for t in 0..x[0][i].len() {
                let r = (x[1][i][t] - x[0][i][t]).exp();
                let a = x[2][i][t];
                let clipped_up = a > 0.0 && r > 1.0 + p.clip_ratio_high + 1e-4;
                let clipped_down = a < 0.0 && r < 1.0 - p.clip_ratio_low - 1e-4;
                if x[3][i][t] == 0.0 || clipped_up || clipped_down {
                    prop_assert!(g[k].abs() < 1e-7, "token ({}, {}) is clipped or masked but has gradient {}", i, t, g[k]);
                }
                k += 1;
            }
        }
    }

    #[test]
    fn masked_tokens_never_influence_any_loss(x in inputs(), noise in -1.0f64..1.0) {
        let mut y = x.clone();
        for i in 0..y[0].len() {
            for t in 0..y[0][i].len() {
                if y[3][i][t] == 0.0 {
                    y[0][i][t] += noise;
                    y[1][i][t] -= noise;
                    y[2][i][t] += 3.0 * noise;
                }
            }
        }
        let reg = PolicyLossRegistry::<B>::new();
        for name in BUILTIN_POLICY_LOSSES {
            let a = reg.compute(name, &input(&x)).unwrap();
            let b = reg.compute(name, &input(&y)).unwrap();
            let (la, lb) = (s(a.loss), s(b.loss));
            prop_assert!((la - lb).abs() < 1e-4 * (1.0 + la.abs()), "{}: {} vs {}", name, la, lb);
            prop_assert!((a.pg_clipfrac - b.pg_clipfrac).abs() < 1e-6 && (a.ppo_kl - b.ppo_kl).abs() < 1e-4, "{} metrics read masked tokens", name);
        }
    }

    #[test]
    fn cispo_keeps_gradient_through_clipped_tokens(x in inputs()) {
        let mut inp = input(&x);
        let lp = inp.log_prob.clone().require_grad();
        inp.log_prob = lp.clone();
        let out = PolicyLossRegistry::<B>::new().compute("cispo", &inp).unwrap();
        let g = gflat(lp.grad(&out.loss.backward()).unwrap());
        let n: f64 = x[3].iter().flatten().sum();
        let mut k = 0;
        for i in 0..x[0].len() {
            for t in 0..x[0][i].len() {
                let r = (x[1][i][t] - x[0][i][t]).exp().clamp(0.8, 1.2);
                let expected = -r * x[2][i][t] * x[3][i][t] / n;
                prop_assert!((g[k] - expected).abs() < 1e-4 * (1.0 + expected.abs()));
                k += 1;
            }
        }
    }

    #[test]
    fn aggregation_modes_agree_on_uniform_lengths(rows in 1usize..5, len in 1usize..6, seed in 0u64..1000) {
        let v: Vec<Vec<f64>> = (0..rows).map(|i| (0..len).map(|t| ((seed + (i * len + t) as u64) % 17) as f64 - 8.0).collect()).collect();
        let ones = vec![vec![1.0; len]; rows];
        let agg = |m| s(agg_loss(t2(&v), t2(&ones), m, AggScale::default()));
        let tm = agg(LossAggMode::TokenMean);
        prop_assert!((agg(LossAggMode::SeqMeanTokenMean) - tm).abs() < 1e-4);
        prop_assert!((agg(LossAggMode::SeqMeanTokenSum) - tm * len as f64).abs() < 1e-3);
        prop_assert!((agg(LossAggMode::SeqMeanTokenSumNorm) - tm * rows as f64).abs() < 1e-3);
    }

    #[test]
    fn value_loss_equals_the_naive_loop(x in inputs(), eps in 0.05f64..1.0) {
        // Reuse the random matrices as predictions, returns and old values.
        let (vp, ret, old, m) = (&x[1], &x[2], &x[0], &x[3]);
        let (loss, frac) = value_loss(t2(vp), t2(ret), t2(old), t2(m), eps, LossAggMode::TokenMean, AggScale::default()).unwrap();
        let (mut sum, mut n, mut clipped) = (0.0, 0.0, 0.0);
        for i in 0..vp.len() {
            for t in 0..vp[i].len() {
                if m[i][t] == 0.0 { continue; }
                let c = vp[i][t].clamp(old[i][t] - eps, old[i][t] + eps);
                let (l1, l2) = ((vp[i][t] - ret[i][t]).powi(2), (c - ret[i][t]).powi(2));
                sum += l1.max(l2);
                clipped += f64::from(u8::from(l2 > l1));
                n += 1.0;
            }
        }
        prop_assert!((s(loss) - 0.5 * sum / n).abs() < 1e-4 * (1.0 + sum.abs()));
        prop_assert!((frac - clipped / n).abs() < 1e-6);
    }

    #[test]
    fn kl_estimators_match_their_formulas(x in inputs()) {
        let (lp, rp) = (t2(&x[1]), t2(&x[0]));
        let get = |name: &str| flat(&kl_penalty(lp.clone(), rp.clone(), name.parse::<KlPenalty>().unwrap()));
        let (k1, k2, k3, ab) = (get("kl"), get("mse"), get("low_var_kl"), get("abs"));
        let pairs: Vec<(f64, f64)> = x[1].iter().flatten().copied().zip(x[0].iter().flatten().copied()).collect();
        for (k, (l, r)) in pairs.iter().enumerate() {
            let d = l - r;
            prop_assert!((k1[k] - d).abs() < 1e-5 && (ab[k] - d.abs()).abs() < 1e-5);
            prop_assert!((k2[k] - 0.5 * d * d).abs() < 1e-5);
            prop_assert!((k3[k] - ((-d).exp() + d - 1.0)).abs() < 1e-5);
            prop_assert!(k3[k] >= -1e-7, "k3 is non-negative");
        }
        prop_assert_eq!(get("k1"), k1.clone());
        prop_assert_eq!(get("k3"), k3);
    }
}

#[test]
fn straight_through_kl_has_k3_value_and_k2_gradient() {
    let lp = t2(&[vec![-0.5, -1.0]]).require_grad();
    let rp = t2(&[vec![-1.5, -0.2]]);
    let st = kl_penalty(lp.clone(), rp.clone(), "k3+".parse().unwrap());
    let k3 = kl_penalty(lp.clone(), rp.clone(), "k3".parse().unwrap());
    assert!(flat(&st)
        .iter()
        .zip(flat(&k3))
        .all(|(a, b)| (a - b).abs() < 1e-6));
    let g = gflat(lp.grad(&st.sum().backward()).unwrap());
    // d/dlp ½(lp − rp)² = lp − rp.
    assert!(
        (g[0] - 1.0).abs() < 1e-5 && (g[1] + 0.8).abs() < 1e-5,
        "{g:?}"
    );
    assert!("full".parse::<KlPenalty>().is_err());
    assert!("k4"
        .parse::<KlPenalty>()
        .unwrap_err()
        .to_string()
        .contains("low_var_kl"));
}

#[test]
fn full_kl_and_logits_by_hand() {
    let d = Default::default();
    // p = (0.5, 0.5), q = (0.25, 0.75): KL = 0.5 ln 2 + 0.5 ln(2/3).
    let p = Tensor::<B, 3>::from_floats([[[0.5f32.ln(), 0.5f32.ln()]]], &d);
    let q = Tensor::<B, 3>::from_floats([[[0.25f32.ln(), 0.75f32.ln()]]], &d);
    let expected = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
    assert!((flat(&kl_full(p, q))[0] - expected).abs() < 1e-6);

    let logits = Tensor::<B, 3>::from_floats([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]], &d);
    let labels = Tensor::<B, 2, Int>::from_ints([[2, 0]], &d);
    let lp = flat(&log_probs_from_logits(logits.clone(), labels));
    let z = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
    assert!((lp[0] - (3.0 - z)).abs() < 1e-5 && (lp[1] - (1.0f64 / 3.0).ln()).abs() < 1e-5);
    let h = flat(&entropy_from_logits(logits));
    assert!((h[1] - 3f64.ln()).abs() < 1e-5, "uniform entropy is ln V");
    let pr: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|x| (x - z).exp()).collect();
    assert!((h[0] + pr.iter().map(|p| p * p.ln()).sum::<f64>()).abs() < 1e-5);
}

#[test]
fn policy_losses_by_hand_at_ratio_one() {
    // log π = log π_old: r = 1 everywhere. Two sequences, lengths 2 and 1.
    let old = vec![vec![-1.0, -2.0], vec![-0.5, -0.5]];
    let adv = vec![vec![1.0, 3.0], vec![-2.0, 0.0]];
    let mask = vec![vec![1.0, 1.0], vec![1.0, 0.0]];
    let x = [old.clone(), old.clone(), adv, mask];
    let reg = PolicyLossRegistry::<B>::new();
    let loss = |name: &str| s(reg.compute(name, &input(&x)).unwrap().loss);
    // vanilla / cispo: −mean A over 3 tokens = −(1 + 3 − 2)/3.
    assert!((loss("vanilla") + 2.0 / 3.0).abs() < 1e-6);
    // GSPO and geo-mean: −mean over sequences of mean_t A = −(2 + (−2))/2 = 0.
    assert!(loss("gspo").abs() < 1e-6 && loss("geo_mean").abs() < 1e-6);
    // GPG: −mean(log π·A) = −((−1)(1) + (−2)(3) + (−0.5)(−2))/3 = 6/3 = 2.
    assert!((loss("gpg") - 2.0).abs() < 1e-6);
    // SAPO: gate(1) = 4/τ·σ(0) = 2/τ, averaged per sequence then over sequences (verl's
    // fixed seq-mean-token-mean): (−(2·1 + 2·3)/2 − (2/1.05)·(−2)) / 2.
    let sapo = (-(2.0 + 6.0) / 2.0 + 4.0 / 1.05) / 2.0;
    assert!((loss("sapo") - sapo).abs() < 1e-5);
    assert!(
        (loss("cispo") - (1.0 + 6.0 - 1.0) / 3.0).abs() < 1e-6,
        "cispo: −mean(A·log π)"
    );
}

#[test]
fn dual_clip_bounds_negative_advantage_losses() {
    // r = e^2 ≈ 7.39 with A = −1: PPO loss would be 7.39; dual-clip caps it at c·|A| = 3.
    let x = [
        vec![vec![-3.0]],
        vec![vec![-1.0]],
        vec![vec![-1.0]],
        vec![vec![1.0]],
    ];
    let out = PolicyLossRegistry::<B>::new()
        .compute("vanilla", &input(&x))
        .unwrap();
    assert!((s(out.loss) - 3.0).abs() < 1e-6);
    assert_eq!(out.pg_clipfrac_lower, 1.0);
    let mut bad = input(&x);
    bad.params.clip_ratio_c = 1.0;
    assert!(PolicyLossRegistry::<B>::new()
        .compute("vanilla", &bad)
        .is_err());
}

#[test]
fn clip_cov_and_kl_cov_touch_a_bounded_number_of_tokens() {
    let rows = 4;
    let old: Vec<Vec<f64>> = (0..rows)
        .map(|i| {
            (0..8)
                .map(|t| -0.1 - 0.05 * ((i * 8 + t) % 7) as f64)
                .collect()
        })
        .collect();
    let new: Vec<Vec<f64>> = old
        .iter()
        .map(|r| r.iter().map(|v| v + 0.01).collect())
        .collect();
    let adv: Vec<Vec<f64>> = (0..rows)
        .map(|i| {
            (0..8)
                .map(|t| if (i + t) % 3 == 0 { 4.0 } else { -1.0 })
                .collect()
        })
        .collect();
    let mask = vec![vec![1.0; 8]; rows];
    let x = [old, new, adv, mask];
    let mut inp = input(&x);
    inp.params.clip_cov_ratio = 0.1; // 3 of 32 tokens at most
    inp.params.clip_cov_lb = -10.0;
    inp.params.clip_cov_ub = 10.0;
    let out = PolicyLossRegistry::<B>::new()
        .compute("clip_cov", &inp)
        .unwrap();
    assert!(
        (out.pg_clipfrac - 3.0 / 32.0).abs() < 1e-6,
        "{}",
        out.pg_clipfrac
    );
    // Same seed, same choice.
    let again = PolicyLossRegistry::<B>::new()
        .compute("clip_cov", &inp)
        .unwrap();
    assert_eq!(s(out.loss), s(again.loss));

    inp.params.kl_cov_ratio = 0.1;
    inp.params.ppo_kl_coef = 1.0;
    let kl = PolicyLossRegistry::<B>::new()
        .compute("kl_cov", &inp)
        .unwrap();
    let plain = PolicyLossRegistry::<B>::new().compute("gpg", &inp).unwrap();
    assert!(s(kl.loss).is_finite() && s(plain.loss).is_finite());
    assert!(
        (kl.ppo_kl - 0.01).abs() < 1e-5,
        "ppo_kl reports mean |log r|"
    );
}

#[test]
fn in_reward_kl_penalty_and_adaptive_controller() {
    let scores = t2(&[vec![0.0, 1.0]]);
    let old = t2(&[vec![-1.0, -1.0]]);
    let reference = t2(&[vec![-1.5, -1.0]]);
    let mask = t2(&[vec![1.0, 1.0]]);
    let mut ctrl = AdaptiveKlController {
        value: 0.1,
        target: 0.1,
        horizon: 100.0,
    };
    let (rewards, metrics) = apply_kl_penalty(
        scores,
        old,
        reference,
        mask,
        &mut ctrl,
        "kl".parse().unwrap(),
    )
    .unwrap();
    assert!(flat(&rewards)
        .iter()
        .zip([-0.05, 1.0])
        .all(|(a, b)| (a - b).abs() < 1e-6));
    let m = metrics.reduce();
    assert!(
        (m["actor/reward_kl_penalty"] - 0.25).abs() < 1e-6
            && m["actor/reward_kl_penalty_coeff"] == 0.1
    );
    // KL 0.25 vs target 0.1: error clipped to +0.2; β = 0.1·(1 + 0.2·1/100).
    assert!((ctrl.value() - 0.1 * 1.002).abs() < 1e-12);
}

#[test]
fn registry_lists_verl_names_and_refuses_unknown_ones() {
    let mut reg = PolicyLossRegistry::<B>::new();
    let mut names = reg.names();
    names.sort();
    let mut builtin = BUILTIN_POLICY_LOSSES.to_vec();
    builtin.sort();
    assert_eq!(names, builtin);
    assert!(reg
        .get("ppo")
        .err()
        .unwrap()
        .to_string()
        .contains("vanilla"));
    reg.register("zero", |x: &PolicyLossInput<B>| {
        Ok(verl_core::algorithms::policy_loss::PolicyLossOutput {
            loss: x.log_prob.clone().sum() * 0.0,
            pg_clipfrac: 0.0,
            ppo_kl: 0.0,
            pg_clipfrac_lower: 0.0,
        })
    });
    assert!(reg.get("zero").is_ok());
    let x = [
        vec![vec![-1.0, -1.0]],
        vec![vec![-1.0]],
        vec![vec![1.0]],
        vec![vec![1.0]],
    ];
    assert!(reg
        .compute(
            "vanilla",
            &PolicyLossInput::new(t2(&x[0]), t2(&x[1]), t2(&x[2]), t2(&x[3]))
        )
        .unwrap_err()
        .to_string()
        .contains("old_log_prob"));
    assert!("mean".parse::<LossAggMode>().is_err());
}

proptest! {
    // A fixed seed: the same cases on every run (the fuzz tests explore).
    #![proptest_config(proptest::prelude::ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Importance weights of 1 leave every loss as it was; weights of 2 double every loss
    /// (token losses are linear in them; geo_mean's sequence weight is their geometric mean).
    #[test]
    fn rollout_is_weights_scale_every_loss(x in inputs()) {
        let reg = PolicyLossRegistry::<B>::new();
        let ones: Vec<Vec<f64>> = x[0].iter().map(|r| vec![1.0; r.len()]).collect();
        let twos: Vec<Vec<f64>> = x[0].iter().map(|r| vec![2.0; r.len()]).collect();
        for name in ["vanilla", "gspo", "sapo", "gpg", "geo_mean", "cispo"] {
            let plain = s(reg.compute(name, &input(&x)).unwrap().loss);
            let one = s(reg.compute(name, &input(&x).with_rollout_is_weights(t2(&ones))).unwrap().loss);
            let two = s(reg.compute(name, &input(&x).with_rollout_is_weights(t2(&twos))).unwrap().loss);
            prop_assert!((plain - one).abs() <= 1e-5 * plain.abs().max(1.0), "{name}: {plain} vs {one}");
            prop_assert!((2.0 * plain - two).abs() <= 1e-4 * plain.abs().max(1.0), "{name}: 2·{plain} vs {two}");
        }
    }
}

/// A hand-checked weighted loss at ratio 1: vanilla's token losses −A, weighted (0.5, 2; 1),
/// token-mean over 3 tokens: −(0.5·1 + 2·3 − 1·2)/3 = −1.5. SAPO reports no clip fraction even
/// with ratios far outside the band.
#[test]
fn weighted_vanilla_by_hand_and_sapo_reports_no_clip() {
    let old = vec![vec![-1.0, -2.0], vec![-0.5, -0.5]];
    let adv = vec![vec![1.0, 3.0], vec![-2.0, 0.0]];
    let mask = vec![vec![1.0, 1.0], vec![1.0, 0.0]];
    let reg = PolicyLossRegistry::<B>::new();
    let w = t2(&[vec![0.5, 2.0], vec![1.0, 7.0]]);
    let x = [old.clone(), old.clone(), adv.clone(), mask.clone()];
    let loss = s(reg
        .compute("vanilla", &input(&x).with_rollout_is_weights(w))
        .unwrap()
        .loss);
    assert!((loss + 1.5).abs() < 1e-6, "{loss}");
    let far: Vec<Vec<f64>> = old
        .iter()
        .map(|r| r.iter().map(|v| v + 1.0).collect())
        .collect();
    let out = reg.compute("sapo", &input(&[old, far, adv, mask])).unwrap();
    assert_eq!((out.pg_clipfrac, out.pg_clipfrac_lower), (0.0, 0.0));
    assert!(out.ppo_kl < -0.9, "ppo_kl still measured: {}", out.ppo_kl);
}

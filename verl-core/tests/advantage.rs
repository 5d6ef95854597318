//! Advantage estimators: each equals a naive loop written here, masked tokens never matter,
//! group invariants hold, and hand-checked numbers.

// The reference implementations below are deliberately naive index loops.
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use burn::tensor::{Tensor, TensorData};
use proptest::prelude::*;
use verl_core::algorithms::advantage::{AdvantageInput, AdvantageRegistry, BUILTIN_ESTIMATORS};
use verl_core::backend::CpuBackend as B;
use verl_core::error::AlgorithmError;

fn t2(v: &[Vec<f64>]) -> Tensor<B, 2> {
    let (r, c) = (v.len(), v[0].len());
    let flat: Vec<f32> = v.iter().flatten().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(flat, [r, c]), &Default::default())
}

fn host(t: &Tensor<B, 2>) -> Vec<Vec<f64>> {
    let [_, c] = t.dims();
    let v: Vec<f64> = t.to_data().iter::<f64>().collect();
    v.chunks(c).map(<[f64]>::to_vec).collect()
}

fn close(a: &[Vec<f64>], b: &[Vec<f64>], tol: f64) -> bool {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

/// Random batch: `groups` prompts × `n` samples, lengths 1..=len (right-padded masks).
fn batch() -> impl Strategy<Value = (Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<String>)> {
    (1usize..4, 2usize..5, 2usize..6).prop_flat_map(|(groups, n, len)| {
        let rows = groups * n;
        (
            prop::collection::vec(prop::collection::vec(-2.0f64..2.0, len), rows),
            prop::collection::vec(prop::collection::vec(-1.0f64..1.0, len), rows),
            prop::collection::vec(1usize..=len, rows),
        )
            .prop_map(move |(r, v, lens)| {
                let mask: Vec<Vec<f64>> = lens
                    .iter()
                    .map(|&l| (0..len).map(|t| f64::from(u8::from(t < l))).collect())
                    .collect();
                let uid: Vec<String> = (0..groups * n).map(|i| format!("p{}", i / n)).collect();
                (r, v, mask, uid)
            })
    })
}

fn seq_scores(r: &[Vec<f64>], m: &[Vec<f64>]) -> Vec<f64> {
    r.iter()
        .zip(m)
        .map(|(rr, mm)| rr.iter().zip(mm).map(|(a, b)| a * b).sum())
        .collect()
}

fn groups(uid: &[String]) -> Vec<Vec<usize>> {
    let mut g: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, u) in uid.iter().enumerate() {
        match g.iter_mut().find(|(k, _)| k == u) {
            Some((_, v)) => v.push(i),
            None => g.push((u.clone(), vec![i])),
        }
    }
    g.into_iter().map(|(_, v)| v).collect()
}

fn tile(a: &[f64], m: &[Vec<f64>]) -> Vec<Vec<f64>> {
    a.iter()
        .zip(m)
        .map(|(x, mm)| mm.iter().map(|k| x * k).collect())
        .collect()
}

fn whiten(x: &[Vec<f64>], m: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let pairs: Vec<(f64, f64)> = x
        .iter()
        .flatten()
        .copied()
        .zip(m.iter().flatten().copied())
        .collect();
    let n: f64 = pairs.iter().map(|p| p.1).sum();
    let mean = pairs.iter().map(|(v, k)| v * k).sum::<f64>() / n;
    let var = pairs
        .iter()
        .map(|(v, k)| (v - mean).powi(2) * k)
        .sum::<f64>()
        / (n - 1.0);
    x.iter()
        .zip(m)
        .map(|(r, mm)| {
            r.iter()
                .zip(mm)
                .map(|(v, k)| (v - mean) / (var + 1e-8).sqrt() * k)
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 40,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    #[test]
    fn gae_equals_the_explicit_discounted_sum((r, v, m, _) in batch(), gamma in 0.5f64..1.0, lam in 0.5f64..1.0) {
        let input = AdvantageInput::new(t2(&r), t2(&m)).with_values(t2(&v)).with_gamma_lam(gamma, lam);
        let (adv, ret) = AdvantageRegistry::<B>::new().compute("gae", &input).unwrap();
        // Naive: A_t = Σ_l (γλ)^l δ_{t+l} over the row's valid prefix (V after the end is 0).
        let raw: Vec<Vec<f64>> = r.iter().zip(&v).zip(&m).map(|((rr, vv), mm)| {
            let len = mm.iter().filter(|&&k| k > 0.0).count();
            (0..rr.len()).map(|t| {
                if t >= len { return 0.0; }
                (t..len).map(|k| {
                    let next = if k + 1 < len { vv[k + 1] } else { 0.0 };
                    (gamma * lam).powi((k - t) as i32) * (rr[k] + gamma * next - vv[k])
                }).sum()
            }).collect()
        }).collect();
        let expected_ret: Vec<Vec<f64>> = raw.iter().zip(&v).zip(&m).map(|((a, vv), mm)| a.iter().zip(vv).zip(mm).map(|((x, y), k)| (x + y) * k).collect()).collect();
        prop_assert!(close(&host(&ret), &expected_ret, 1e-4));
        prop_assert!(close(&host(&adv), &whiten(&raw, &m), 1e-3));
    }

    #[test]
    fn gae_with_unit_gamma_lambda_is_reward_to_go_minus_value((r, v, m, _) in batch()) {
        let input = AdvantageInput::new(t2(&r), t2(&m)).with_values(t2(&v));
        let (_, ret) = AdvantageRegistry::<B>::new().compute("gae", &input).unwrap();
        let ret = host(&ret);
        for i in 0..r.len() {
            for t in 0..r[i].len() {
                if m[i][t] == 0.0 { continue; }
                let to_go: f64 = (t..r[i].len()).map(|k| r[i][k] * m[i][k]).sum();
                // returns − V = reward-to-go − V
                prop_assert!((ret[i][t] - to_go).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn group_estimators_equal_naive_loops((r, _v, m, uid) in batch(), norm in any::<bool>()) {
        let s = seq_scores(&r, &m);
        let gs = groups(&uid);
        let reg = AdvantageRegistry::<B>::new();
        let mut input = AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid);
        input.norm_adv_by_std_in_grpo = norm;

        let mut grpo = vec![0.0; s.len()];
        let mut rloo = vec![0.0; s.len()];
        let mut opo = vec![0.0; s.len()];
        let mut gpg = vec![0.0; s.len()];
        let mut rpp = vec![0.0; s.len()];
        let mut passk = vec![0.0; s.len()];
        let alpha = s.len() as f64 / s.iter().filter(|&&x| x != 0.0).count().max(1) as f64;
        for g in &gs {
            let n = g.len() as f64;
            let mean = g.iter().map(|&i| s[i]).sum::<f64>() / n;
            let std = (g.iter().map(|&i| (s[i] - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
            let lens: Vec<f64> = g.iter().map(|&i| m[i].iter().sum()).collect();
            let opo_base = g.iter().zip(&lens).map(|(&i, l)| l * s[i]).sum::<f64>() / lens.iter().sum::<f64>();
            for &i in g {
                grpo[i] = if norm { (s[i] - mean) / (std + 1e-6) } else { s[i] - mean };
                let others: f64 = g.iter().filter(|&&j| j != i).map(|&j| s[j]).sum::<f64>() / (n - 1.0);
                rloo[i] = s[i] - others;
                opo[i] = s[i] - opo_base;
                gpg[i] = alpha * (s[i] - mean);
                rpp[i] = s[i] - mean;
            }
            let best = *g.iter().max_by(|&&a, &&b| s[a].total_cmp(&s[b]).then(b.cmp(&a))).unwrap();
            let second = g.iter().filter(|&&j| j != best).map(|&j| s[j]).fold(f64::MIN, f64::max);
            passk[best] = (s[best] - second) / if norm { std + 1e-6 } else { 1.0 };
        }
        for (name, expected, tol) in [("grpo", tile(&grpo, &m), 1e-3), ("rloo", tile(&rloo, &m), 1e-4), ("opo", tile(&opo, &m), 1e-4), ("gpg", tile(&gpg, &m), 1e-4), ("grpo_passk", tile(&passk, &m), 1e-3)] {
            let (adv, ret) = reg.compute(name, &input).unwrap();
            prop_assert!(close(&host(&adv), &expected, tol), "{} differs from the naive loop", name);
            prop_assert!(close(&host(&ret), &expected, tol));
        }
        let (adv, _) = reg.compute("reinforce_plus_plus_baseline", &input).unwrap();
        prop_assert!(close(&host(&adv), &whiten(&tile(&rpp, &m), &m), 1e-3));
    }

    #[test]
    fn grpo_groups_sum_to_zero_and_equal_rewards_give_zero((r, _v, m, uid) in batch()) {
        let (adv, _) = AdvantageRegistry::<B>::new().compute("grpo", &AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid)).unwrap();
        let a: Vec<f64> = host(&adv).iter().map(|row| row.iter().copied().find(|x| *x != 0.0).unwrap_or(0.0)).collect();
        for g in groups(&uid) {
            prop_assert!(g.iter().map(|&i| a[i]).sum::<f64>().abs() < 1e-3);
        }
        // Every sample of a prompt scoring the same: nothing to learn from that prompt.
        let same: Vec<Vec<f64>> = m.iter().map(|mm| (0..mm.len()).map(|t| if t == 0 { 0.7 } else { 0.0 }).collect()).collect();
        let (adv, _) = AdvantageRegistry::<B>::new().compute("grpo", &AdvantageInput::new(t2(&same), t2(&m)).with_index(&uid)).unwrap();
        prop_assert!(host(&adv).iter().flatten().all(|x| x.abs() < 1e-3));
    }

    #[test]
    fn masked_tokens_never_influence_any_estimator((r, v, m, uid) in batch(), noise in -50.0f64..50.0) {
        let poke = |x: &[Vec<f64>]| -> Vec<Vec<f64>> { x.iter().zip(&m).map(|(row, mm)| row.iter().zip(mm).map(|(a, k)| if *k == 0.0 { a + noise } else { *a }).collect()).collect() };
        let lp: Vec<Vec<f64>> = v.iter().map(|row| row.iter().map(|x| -x.abs() - 0.1).collect()).collect();
        let sp: Vec<Vec<f64>> = v.iter().map(|row| row.iter().map(|x| x * x * 0.5).collect()).collect();
        let base_b = Tensor::<B, 1>::from_floats([0.3f32].repeat(r.len()).as_slice(), &Default::default());
        let make = |r: &[Vec<f64>], v: &[Vec<f64>], lp: &[Vec<f64>], sp: &[Vec<f64>]| {
            let mut i = AdvantageInput::new(t2(r), t2(&m)).with_index(&uid).with_values(t2(v));
            i.old_log_probs = Some(t2(lp));
            i.sum_pi_squared = Some(t2(sp));
            i.reward_baselines = Some(base_b.clone());
            i
        };
        let reg = AdvantageRegistry::<B>::new();
        for name in BUILTIN_ESTIMATORS {
            let (a1, _) = reg.compute(name, &make(&r, &v, &lp, &sp)).unwrap();
            let (a2, _) = reg.compute(name, &make(&poke(&r), &poke(&v), &poke(&lp), &poke(&sp))).unwrap();
            prop_assert!(close(&host(&a1), &host(&a2), 1e-4), "{} reads masked tokens", name);
            prop_assert!(host(&a1).iter().flatten().zip(m.iter().flatten()).all(|(a, k)| *k > 0.0 || *a == 0.0), "{} leaves masked tokens non-zero", name);
        }
    }
}

#[test]
fn gae_by_hand() {
    // r = [0, 1], V = [0.5, 0.2], γ = 0.9, λ = 0.8:
    // t=1: δ = 1 − 0.2 = 0.8, A = 0.8; t=0: δ = 0.9·0.2 − 0.5 = −0.32, A = −0.32 + 0.72·0.8 = 0.256.
    let input = AdvantageInput::new(t2(&[vec![0.0, 1.0]]), t2(&[vec![1.0, 1.0]]))
        .with_values(t2(&[vec![0.5, 0.2]]))
        .with_gamma_lam(0.9, 0.8);
    let (adv, ret) = AdvantageRegistry::<B>::new()
        .compute("gae", &input)
        .unwrap();
    assert!(close(&host(&ret), &[vec![0.756, 1.0]], 1e-6));
    // Whitened over 2 tokens: mean 0.528, unbiased std 0.3847 → ∓0.7071.
    assert!(close(
        &host(&adv),
        &[vec![
            -std::f64::consts::FRAC_1_SQRT_2,
            std::f64::consts::FRAC_1_SQRT_2
        ]],
        1e-4
    ));
}

#[test]
fn remax_reinforce_and_otb_by_hand() {
    let reg = AdvantageRegistry::<B>::new();
    let mut input = AdvantageInput::new(t2(&[vec![1.0, 2.0, 0.0]]), t2(&[vec![1.0, 1.0, 0.0]]));
    input.reward_baselines = Some(Tensor::from_floats([0.5], &Default::default()));
    let (adv, ret) = reg.compute("remax", &input).unwrap();
    assert!(close(&host(&ret), &[vec![3.0, 2.0, 0.0]], 1e-6));
    assert!(close(&host(&adv), &[vec![2.5, 1.5, 0.0]], 1e-6));

    let input = AdvantageInput::new(t2(&[vec![1.0, 2.0, 5.0]]), t2(&[vec![1.0, 1.0, 0.0]]))
        .with_gamma_lam(0.5, 1.0);
    let (_, ret) = reg.compute("reinforce_plus_plus", &input).unwrap();
    // Masked token 2 resets the return: G1 = 2, G0 = 1 + 0.5·2 = 2.
    assert!(close(&host(&ret), &[vec![2.0, 2.0, 0.0]], 1e-6));

    // OTB with a group of two whose weights are equal reduces to a per-position group mean.
    let uid = vec!["a".to_string(), "a".to_string()];
    let mut input = AdvantageInput::new(
        t2(&[vec![0.0, 1.0], vec![0.0, 3.0]]),
        t2(&[vec![1.0, 1.0], vec![1.0, 1.0]]),
    )
    .with_index(&uid);
    input.old_log_probs = Some(t2(&[vec![-1.0, -1.0], vec![-1.0, -1.0]]));
    input.sum_pi_squared = Some(t2(&[vec![0.2, 0.2], vec![0.2, 0.2]]));
    let (adv, _) = reg.compute("optimal_token_baseline", &input).unwrap();
    assert!(close(
        &host(&adv),
        &[vec![-1.0, -1.0], vec![1.0, 1.0]],
        1e-4
    ));
}

/// verl's `tir_optimal_token_baseline`, worked by hand: π = 0.5 and Σπ² = 0.5 everywhere, so
/// each trained token adds 1 − 2·0.5 + 0.5 = 0.5 to W.
#[test]
fn tir_optimal_token_baseline_by_hand() {
    let reg = AdvantageRegistry::<B>::new();
    let ln_half = 0.5f64.ln();
    let with = |r: &[Vec<f64>], m: &[Vec<f64>], uid: &[String], zero_tail: bool, name: &str| {
        let mut input = AdvantageInput::new(t2(r), t2(m)).with_index(uid);
        input.old_log_probs = Some(t2(&vec![vec![ln_half; m[0].len()]; m.len()]));
        input.sum_pi_squared = Some(t2(&vec![vec![0.5; m[0].len()]; m.len()]));
        input.handle_zero_tail = zero_tail;
        reg.compute(name, &input).unwrap()
    };
    // Two turns with a masked tool output between them (row 0), against one turn (row 1).
    // Trained tokens in order: row 0 cols [0, 1, 4], R = [1, 1, 1]; row 1 cols [0, 1, 2],
    // R = [2, 2, 2]; W = [0.5, 1.0, 1.5] for both. Baseline at every position k:
    // (1·W + 2·W) / (2·W) = 1.5, so −0.5 on row 0 and +0.5 on row 1.
    let uid: Vec<String> = ["a", "a"].map(String::from).into();
    let r = [vec![0.0, 0.0, 0.0, 0.0, 1.0], vec![0.0, 0.0, 2.0, 0.0, 0.0]];
    let m = [vec![1.0, 1.0, 0.0, 0.0, 1.0], vec![1.0, 1.0, 1.0, 0.0, 0.0]];
    let (adv, ret) = with(&r, &m, &uid, false, "tir_optimal_token_baseline");
    assert!(close(
        &host(&adv),
        &[
            vec![-0.5, -0.5, 0.0, 0.0, -0.5],
            vec![0.5, 0.5, 0.5, 0.0, 0.0]
        ],
        1e-6
    ));
    assert!(close(
        &host(&ret),
        &[vec![1.0; 5], vec![2.0, 2.0, 2.0, 0.0, 0.0]],
        1e-6
    ));
    // By column instead (`optimal_token_baseline`), column 2 has row 1 alone (baseline 2,
    // advantage 0) and column 4 row 0 alone: the turns do not line up.
    let (otb, _) = with(&r, &m, &uid, false, "optimal_token_baseline");
    assert!(close(
        &host(&otb),
        &[
            vec![-0.5, -0.5, 0.0, 0.0, 0.0],
            vec![0.5, 0.5, 0.0, 0.0, 0.0]
        ],
        1e-6
    ));

    // The zero tail (always on), an empty response, a group of one. Group b: A trains 4
    // tokens (R = 1 each, W = 0.5, 1, 1.5, 2), B 2 tokens (R = 1, W = 0.5, 1), C none (left
    // out). Baselines 1 at every position, but A is the one longest member: from the second
    // longest length (2) on, its baseline is 0 and its advantage its return. Group c (one
    // member) keeps its returns.
    let uid: Vec<String> = ["b", "b", "b", "c"].map(String::from).into();
    let r = [
        vec![0.0, 0.0, 0.0, 1.0, 0.0],
        vec![0.0, 1.0, 0.0, 0.0, 0.0],
        vec![5.0, 5.0, 5.0, 5.0, 5.0],
        vec![0.0, 3.0, 0.0, 0.0, 0.0],
    ];
    let m = [
        vec![1.0, 1.0, 1.0, 1.0, 0.0],
        vec![1.0, 1.0, 0.0, 0.0, 0.0],
        vec![0.0; 5],
        vec![1.0, 1.0, 0.0, 0.0, 0.0],
    ];
    let want = [
        vec![0.0, 0.0, 1.0, 1.0, 0.0],
        vec![0.0; 5],
        vec![0.0; 5],
        vec![3.0, 3.0, 0.0, 0.0, 0.0],
    ];
    let (tir, _) = with(&r, &m, &uid, false, "tir_optimal_token_baseline");
    assert!(close(&host(&tir), &want, 1e-6), "{:?}", host(&tir));
    // With no gaps it is the optimal token baseline with the zero tail handled.
    let (otb, _) = with(&r, &m, &uid, true, "optimal_token_baseline");
    assert!(close(&host(&otb), &want, 1e-6), "{:?}", host(&otb));
}

#[test]
fn registry_names_errors_and_extension() {
    let mut reg = AdvantageRegistry::<B>::new();
    let mut names = reg.names();
    names.sort();
    let mut builtin = BUILTIN_ESTIMATORS.to_vec();
    builtin.sort();
    assert_eq!(names, builtin);
    let input = AdvantageInput::new(t2(&[vec![1.0]]), t2(&[vec![1.0]]));
    let err = reg.compute("grpo_v2", &input).unwrap_err();
    assert!(
        matches!(err, AlgorithmError::UnknownName { .. }) && err.to_string().contains("rloo"),
        "{err}"
    );
    assert!(matches!(
        reg.compute("gae", &input),
        Err(AlgorithmError::MissingInput {
            input: "values",
            ..
        })
    ));
    assert!(matches!(
        reg.compute("grpo", &input),
        Err(AlgorithmError::MissingInput { .. })
    ));
    let bad = AdvantageInput::new(t2(&[vec![1.0, 2.0]]), t2(&[vec![1.0]]));
    assert!(matches!(
        reg.compute("grpo", &bad),
        Err(AlgorithmError::Shape { .. })
    ));

    // A user estimator, by name, like verl's register_adv_est.
    reg.register("score_only", |x: &AdvantageInput<'_, B>| {
        Ok((x.token_level_rewards.clone(), x.token_level_rewards.clone()))
    });
    let (a, _) = reg.compute("score_only", &input).unwrap();
    assert_eq!(host(&a), vec![vec![1.0]]);
}

#[test]
fn group_estimators_by_hand() {
    // One prompt, three samples scoring 1, 0, 2; lengths 1, 2, 1.
    let r = vec![vec![1.0, 0.0], vec![0.0, 0.0], vec![2.0, 0.0]];
    let m = vec![vec![1.0, 0.0], vec![1.0, 1.0], vec![1.0, 0.0]];
    let uid = vec!["q".to_string(); 3];
    let reg = AdvantageRegistry::<B>::new();
    let first = |name: &str, norm: bool| -> Vec<f64> {
        let mut input = AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid);
        input.norm_adv_by_std_in_grpo = norm;
        host(&reg.compute(name, &input).unwrap().0)
            .iter()
            .map(|row| row[0])
            .collect()
    };
    // Mean 1, unbiased std 1.
    assert!(close(&[first("grpo", true)], &[vec![0.0, -1.0, 1.0]], 1e-5));
    assert!(close(
        &[first("grpo", false)],
        &[vec![0.0, -1.0, 1.0]],
        1e-6
    ));
    // RLOO: s − mean(others): 1 − 1 = 0, 0 − 1.5, 2 − 0.5.
    assert!(close(&[first("rloo", true)], &[vec![0.0, -1.5, 1.5]], 1e-6));
    // OPO: baseline Σ|y|·s / Σ|y| = (1 + 0 + 2) / 4 = 0.75.
    assert!(close(
        &[first("opo", true)],
        &[vec![0.25, -0.75, 1.25]],
        1e-6
    ));
    // GPG: α = 3 samples / 2 non-zero = 1.5; 1.5·(s − 1).
    assert!(close(&[first("gpg", true)], &[vec![0.0, -1.5, 1.5]], 1e-6));
    // pass@k: only the best (2) gets best − second = 1, over std + ε = 1.
    assert!(close(
        &[first("grpo_passk", true)],
        &[vec![0.0, 0.0, 1.0]],
        1e-5
    ));
    // The sample's advantage covers its whole response: row 1 has two tokens.
    let (adv, _) = reg
        .compute(
            "rloo",
            &AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid),
        )
        .unwrap();
    assert!(close(
        &host(&adv),
        &[vec![0.0, 0.0], vec![-1.5, -1.5], vec![1.5, 0.0]],
        1e-6
    ));
}

#[test]
fn masked_statistics_by_hand() {
    use verl_core::algorithms::masked::{masked_mean, masked_var, masked_whiten};
    let v = t2(&[vec![1.0, 3.0, 100.0]]);
    let m = t2(&[vec![1.0, 1.0, 0.0]]);
    let scalar = |t: Tensor<B, 1>| t.to_data().iter::<f64>().next().unwrap();
    assert!((scalar(masked_mean(v.clone(), m.clone())) - 2.0).abs() < 1e-6);
    // Unmasked {1, 3}: biased var 1, unbiased 2.
    assert!((scalar(masked_var(v.clone(), m.clone(), false)) - 1.0).abs() < 1e-6);
    assert!((scalar(masked_var(v.clone(), m.clone(), true)) - 2.0).abs() < 1e-6);
    let w = host(&(masked_whiten(v.clone(), m.clone(), true) * m.clone()));
    let s = 1.0 / 2f64.sqrt();
    assert!(close(&w, &[vec![-s, s, 0.0]], 1e-5));
    let shifted = host(&(masked_whiten(v, m.clone(), false) * m));
    assert!(close(&shifted, &[vec![2.0 - s, 2.0 + s, 0.0]], 1e-5));
}

/// On an f64 backend the estimators' results stay f64: a reward difference of 1e-12, lost in
/// f32, still separates the two samples' advantages.
#[test]
fn advantages_keep_the_backends_float_type() {
    type B64 = burn_ndarray::NdArray<f64>;
    let device = Default::default();
    let rewards =
        Tensor::<B64, 2>::from_data(TensorData::new(vec![1.0 + 1e-12, 1.0], [2, 1]), &device);
    let mask = Tensor::<B64, 2>::ones([2, 1], &device);
    let uid = vec!["p".to_string(), "p".to_string()];
    let mut input = AdvantageInput::new(rewards, mask).with_index(&uid);
    input.norm_adv_by_std_in_grpo = false;
    let (adv, _) = AdvantageRegistry::<B64>::new()
        .compute("grpo", &input)
        .unwrap();
    assert_eq!(adv.dtype(), burn::tensor::DType::F64);
    let adv: Vec<f64> = adv.into_data().to_vec().unwrap();
    assert!(
        (adv[0] - 0.5e-12).abs() < 1e-15 && (adv[1] + adv[0]).abs() < 1e-18,
        "{adv:?}"
    );
}

/// verl's two vectorised registrations and the plain ones on the cases where they differ: a
/// prompt sampled once (RLOO keeps its score, `rloo_vectorized` gives 0), a group whose scores
/// are equal (`grpo_vectorized` floors the variance at ε: 0 / (√ε + ε) = 0, no blow-up), and
/// `grpo_vectorized` normalising by std even with `norm_adv_by_std_in_grpo` off. GPG divides
/// by `f_norm`. GAE is 0 at padding (advantages and returns).
#[test]
fn vectorised_registrations_f_norm_and_gae_padding_by_hand() {
    let reg = AdvantageRegistry::<B>::new();
    let r = vec![vec![3.0], vec![1.0], vec![2.0], vec![5.0], vec![5.0]];
    let m = vec![vec![1.0]; 5];
    let uid: Vec<String> = ["a", "b", "b", "c", "c"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let run = |name: &str, norm: bool| {
        let mut input = AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid);
        input.norm_adv_by_std_in_grpo = norm;
        host(&reg.compute(name, &input).unwrap().0).concat()
    };
    assert!(close(
        &[run("rloo", true)],
        &[vec![3.0, -1.0, 1.0, 0.0, 0.0]],
        1e-6
    ));
    assert!(close(
        &[run("rloo_vectorized", true)],
        &[vec![0.0, -1.0, 1.0, 0.0, 0.0]],
        1e-6
    ));
    // Group b: mean 1.5, unbiased std √0.5.
    let z = 0.5 / (0.5f64.sqrt() + 1e-6);
    assert!(close(
        &[run("grpo_vectorized", false)],
        &[vec![3.0 / (1.0 + 1e-6), -z, z, 0.0, 0.0]],
        1e-5
    ));
    assert!(close(
        &[run("grpo", false)],
        &[vec![3.0, -0.5, 0.5, 0.0, 0.0]],
        1e-6
    ));
    let mut input = AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid);
    input.f_norm = 2.0;
    let gpg = host(&reg.compute("gpg", &input).unwrap().0).concat();
    // α = 5 / 5 non-zero = 1; group a (alone): mean 0 → 3 / 2.
    assert!(
        (gpg[0] - 1.5).abs() < 1e-6 && (gpg[2] - 0.25).abs() < 1e-6,
        "{gpg:?}"
    );
    let rewards = vec![vec![0.0, 1.0, 0.0]];
    let mask = vec![vec![1.0, 1.0, 0.0]];
    let values = vec![vec![0.5, 0.25, 9.0]];
    let input = AdvantageInput::new(t2(&rewards), t2(&mask)).with_values(t2(&values));
    let (adv, ret) = reg.compute("gae", &input).unwrap();
    assert_eq!((host(&adv)[0][2], host(&ret)[0][2]), (0.0, 0.0));
}

/// Optimal token baseline: importance weights of 1 change nothing; `handle_zero_tail` gives
/// the one longest trajectory its return past the second longest, where otherwise its own
/// return is its baseline (advantage 0).
#[test]
fn optimal_token_baseline_weights_and_zero_tail_by_hand() {
    let reg = AdvantageRegistry::<B>::new();
    let r = vec![vec![1.0, 0.0, 0.0], vec![0.0, 0.0, 2.0]];
    let m = vec![vec![1.0, 0.0, 0.0], vec![1.0, 1.0, 1.0]];
    let lp = vec![vec![-1.0, -1.0, -1.0], vec![-0.5, -0.7, -0.2]];
    let sp = vec![vec![0.3, 0.3, 0.3], vec![0.4, 0.2, 0.5]];
    let uid: Vec<String> = vec!["g".into(), "g".into()];
    let base = || {
        let mut x = AdvantageInput::new(t2(&r), t2(&m)).with_index(&uid);
        x.old_log_probs = Some(t2(&lp));
        x.sum_pi_squared = Some(t2(&sp));
        x
    };
    let plain = host(&reg.compute("optimal_token_baseline", &base()).unwrap().0);
    let mut weighted = base();
    weighted.rollout_is_weights = Some(t2(&[vec![1.0; 3], vec![1.0; 3]]));
    let same = host(&reg.compute("optimal_token_baseline", &weighted).unwrap().0);
    assert!(close(&plain, &same, 1e-9));
    // Past token 0 only the long trajectory is valid: its baseline is its own return.
    assert!(
        plain[1][1].abs() < 1e-6 && plain[1][2].abs() < 1e-6,
        "{plain:?}"
    );
    let mut tail = base();
    tail.handle_zero_tail = true;
    let tail = host(&reg.compute("optimal_token_baseline", &tail).unwrap().0);
    // Returns-to-go of the long one: 2 at t = 1 and t = 2.
    assert!(
        (tail[1][1] - 2.0).abs() < 1e-6 && (tail[1][2] - 2.0).abs() < 1e-6,
        "{tail:?}"
    );
    assert!(close(&[tail[0].clone()], &[plain[0].clone()], 1e-9));
}

//! The fused-operations seam on the CPU default: the reference chains by hand and by their
//! invariants, and `Autodiff<B>`'s routing of the differentiable operations (values and
//! gradients equal burn's own autodiff of the same chain).

use burn::prelude::*;
use burn::tensor::{DType, Distribution, Int, TensorData};
use proptest::prelude::*;
use verl_core::backend::{CpuAutodiff, CpuBackend};
use verl_megatron::ops::{reference, AdamWHyper, AdamWStep, FusedOps};

type B = CpuBackend;
type A = CpuAutodiff;

fn values<const D: usize, K: Backend>(t: Tensor<K, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

fn tensor<const D: usize>(data: Vec<f32>, shape: [usize; D]) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(data, shape), &Default::default())
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

#[test]
fn rms_norm_by_hand() {
    // Row [3, 4]: mean of squares 12.5; row [1, -1]: 1. Weights [1, 2].
    let x = tensor(vec![3.0, 4.0, 1.0, -1.0], [2, 2]);
    let w = tensor(vec![1.0, 2.0], [2]);
    let y = values(B::rms_norm(x, w, 0.0));
    let r = 12.5f32.sqrt();
    assert!(close(&y, &[3.0 / r, 8.0 / r, 1.0, -2.0], 1e-6), "{y:?}");
}

#[test]
fn rotary_by_hand() {
    // One head of 4: pairs (x0, x2) and (x1, x3) rotate by their angles.
    let x = tensor(vec![1.0, 2.0, 3.0, 4.0], [1, 1, 1, 4]);
    let (a, b) = (0.5f32, 1.25f32);
    let cos = tensor(vec![a.cos(), b.cos(), a.cos(), b.cos()], [1, 1, 1, 4]);
    let sin = tensor(vec![a.sin(), b.sin(), a.sin(), b.sin()], [1, 1, 1, 4]);
    let y = values(B::rotary(x, &cos, &sin));
    let expected = [
        1.0 * a.cos() - 3.0 * a.sin(),
        2.0 * b.cos() - 4.0 * b.sin(),
        3.0 * a.cos() + 1.0 * a.sin(),
        4.0 * b.cos() + 2.0 * b.sin(),
    ];
    assert!(close(&y, &expected, 1e-6), "{y:?} vs {expected:?}");
}

#[test]
fn swiglu_and_bias_by_hand() {
    let gate = tensor(vec![0.0, 1.0, -2.0], [1, 3]);
    let up = tensor(vec![5.0, 2.0, 3.0], [1, 3]);
    let silu = |g: f32| g / (1.0 + (-g).exp());
    let y = values(B::swiglu(gate, up));
    assert!(
        close(&y, &[0.0, 2.0 * silu(1.0), 3.0 * silu(-2.0)], 1e-6),
        "{y:?}"
    );
    let y = values(B::add_bias(
        tensor(vec![1.0, 2.0, 3.0, 4.0], [2, 2]),
        tensor(vec![10.0, 20.0], [2]),
    ));
    assert_eq!(y, vec![11.0, 22.0, 13.0, 24.0]);
}

#[test]
fn sums_of_squares_by_hand() {
    let sums = B::sums_of_squares(vec![
        tensor(vec![1.0, 2.0, 3.0, 4.0], [2, 2]),
        tensor(vec![-3.0], [1, 1]),
    ]);
    assert_eq!(sums, vec![30.0, 9.0]);
    assert!(B::sums_of_squares(Vec::new()).is_empty());
}

/// The decode step's fused forms are the add, the norm and the cast, and the halves' SwiGLU
/// and the cast.
#[test]
fn decode_forms_compose_the_training_operations() {
    let device = Default::default();
    let h = Tensor::<B, 2>::random([3, 8], Distribution::Normal(0.0, 1.0), &device);
    let d = Tensor::<B, 2>::random([3, 8], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<B, 1>::random([8], Distribution::Normal(1.0, 0.1), &device);
    let (s, y) = B::add_rms_norm_bf16(h.clone(), Some(d.clone()), w.clone(), 1e-6);
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(values(s.clone()), values(h.clone() + d));
    let expected = B::rms_norm(s, w.clone(), 1e-6).cast(burn::tensor::FloatDType::BF16);
    assert_eq!(values(y), values(expected));
    let (s, _) = B::add_rms_norm_bf16(h.clone(), None, w, 1e-6);
    assert_eq!(values(s), values(h));

    let gu = Tensor::<B, 2>::random([2, 6], Distribution::Normal(0.0, 1.0), &device);
    let y = B::swiglu_packed_bf16(gu.clone());
    assert_eq!(y.dims(), [2, 3]);
    let expected = B::swiglu(gu.clone().narrow(1, 0, 3), gu.narrow(1, 3, 3))
        .cast(burn::tensor::FloatDType::BF16);
    assert_eq!(values(y), values(expected));
}

/// The CPU default has no caller-side kernels: each hands its inputs back untouched.
#[test]
fn caller_side_kernels_are_absent_on_the_cpu() {
    let device = Default::default();
    assert!(!B::fused_attention_applies(64) && !A::fused_attention_applies(64));
    assert!(!B::vocab_stats_applies() && !B::decode_attention_applies(14, 2, 64));
    let q = Tensor::<B, 4>::ones([1, 2, 2, 4], &device);
    let scores = verl_megatron::ops::FusedScores::plain(4);
    let back = B::fused_attention(q.clone(), q.clone(), q.clone(), None, scores);
    assert!(matches!(back, Err((a, _, _)) if values(a.clone()) == values(q.clone())));
    let logits = Tensor::<B, 2>::ones([2, 3], &device);
    let labels = Tensor::<B, 1, Int>::zeros([2], &device);
    assert!(B::vocab_stats(logits, labels).is_err());
    assert!(B::sample(Tensor::<B, 2>::ones([1, 3], &device), &[Default::default()]).is_err());
}

/// The device-side tables (burn-cuda's path) equal the host's on the CPU, where both run f32
/// products and f32 cos / sin.
#[test]
fn rotary_tables_on_device_equal_the_host_tables() {
    let inv_freq: Vec<f64> = (0..8)
        .map(|i| 1.0 / 10_000f64.powf(i as f64 / 8.0))
        .collect();
    let positions = Tensor::<B, 2, Int>::from_data(
        TensorData::new((0..12i64).map(|p| p * 37).collect::<Vec<_>>(), [2, 6]),
        &Default::default(),
    );
    let (c0, s0) = reference::rotary_tables(&inv_freq, &positions);
    let (c1, s1) = reference::rotary_tables_on_device(&inv_freq, &positions);
    assert_eq!(c0.dims(), [2, 1, 6, 16]);
    assert!(close(&values(c1), &values(c0), 1e-5));
    assert!(close(&values(s1), &values(s0), 1e-5));
    // Autodiff's tables are the inner backend's, as constants.
    let (ca, _) = A::rotary_tables(&inv_freq, &Tensor::from_inner(positions.clone()));
    assert!(!ca.is_require_grad());
    assert_eq!(
        values(ca.inner()),
        values(B::rotary_tables(&inv_freq, &positions).0)
    );
}

/// `Autodiff<B>` runs each differentiable operation through `B`'s hook: the values and
/// gradients are burn's autodiff of the reference chain.
#[test]
fn autodiff_routes_through_the_hooks() {
    let device = Default::default();
    let x = Tensor::<B, 3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<B, 1>::random([8], Distribution::Normal(1.0, 0.2), &device);
    let probe = Tensor::<B, 3>::random([2, 3, 8], Distribution::Normal(0.0, 1.0), &device);
    let run = |through_trait: bool| {
        let xa = Tensor::<A, 3>::from_inner(x.clone()).require_grad();
        let wa = Tensor::<A, 1>::from_inner(w.clone()).require_grad();
        let y = if through_trait {
            let n = A::rms_norm(xa.clone(), wa.clone(), 1e-6);
            A::swiglu(n.clone(), n)
        } else {
            let n = reference::rms_norm(xa.clone(), wa.clone(), 1e-6);
            reference::swiglu(n.clone(), n)
        };
        let grads = (y.clone() * Tensor::from_inner(probe.clone()))
            .sum()
            .backward();
        (
            values(y.inner()),
            values(xa.grad(&grads).expect("x grad")),
            values(wa.grad(&grads).expect("w grad")),
        )
    };
    assert_eq!(run(true), run(false));
}

/// The reference AdamW step is the documented formula, element by element.
#[test]
fn adamw_reference_by_hand() {
    let hyper = AdamWHyper {
        beta_1: 0.9,
        beta_2: 0.99,
        epsilon: 1e-8,
        weight_decay: 0.1,
    };
    let s = AdamWStep::new(&hyper, 0.01, 0.5, 1);
    let (p, m1, m2) = B::adamw_step(
        tensor(vec![1.0, -2.0], [2]),
        tensor(vec![4.0, 2.0], [2]),
        None,
        &s,
    );
    // g = 0.5·grad = [2, 1]; m1 = 0.1·g, m2 = 0.01·g²; bias-corrected: g and g², step ±1.
    assert!(close(&values(m1), &[0.2, 0.1], 1e-6));
    assert!(close(&values(m2), &[0.04, 0.01], 1e-6));
    let decay = 1.0 - 0.01 * 0.1;
    assert!(close(
        &values(p),
        &[decay - 0.01, -2.0 * decay - 0.01],
        1e-6
    ));
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    /// With unit weights and no epsilon every normed row has a root mean square of 1, whatever
    /// the rows' scale.
    #[test]
    fn rms_norm_rows_have_unit_rms(rows in 1usize..5, hidden in 1usize..17, scale in 0.01f32..100.0, seed in 0u64..1000) {
        let device = Default::default();
        B::seed(&device, seed);
        let x = Tensor::<B, 2>::random([rows, hidden], Distribution::Normal(0.0, 1.0), &device) * scale + 1e-3;
        let y = B::rms_norm(x, Tensor::ones([hidden], &device), 0.0);
        let ms = values(y.powf_scalar(2.0).mean_dim(1));
        prop_assert!(ms.iter().all(|m| (m - 1.0).abs() < 1e-4), "{:?}", ms);
    }

    /// A rotation keeps each (x_i, x_{i + d/2}) pair's length.
    #[test]
    fn rotary_preserves_pair_lengths(half in 1usize..9, angle in -10.0f32..10.0, seed in 0u64..1000) {
        let device = Default::default();
        B::seed(&device, seed);
        let d = 2 * half;
        let x = Tensor::<B, 4>::random([1, 1, 3, d], Distribution::Normal(0.0, 1.0), &device);
        let cos = Tensor::<B, 4>::full([1, 1, 1, d], angle.cos(), &device);
        let sin = Tensor::<B, 4>::full([1, 1, 1, d], angle.sin(), &device);
        let y = B::rotary(x.clone(), &cos, &sin);
        let pair_norms = |t: Tensor<B, 4>| {
            let sq = t.powf_scalar(2.0);
            values(sq.clone().narrow(3, 0, half) + sq.narrow(3, half, half))
        };
        prop_assert!(close(&pair_norms(y), &pair_norms(x), 1e-5));
    }

    /// SwiGLU is `g · sigmoid(g) · u` element by element (the naive loop), so its sign is
    /// up's where gate is positive and the opposite where gate is negative.
    #[test]
    fn swiglu_equals_the_naive_loop(pairs in proptest::collection::vec((-8.0f32..8.0, -8.0f32..8.0), 1..20)) {
        let (g, u): (Vec<f32>, Vec<f32>) = pairs.iter().copied().unzip();
        let n = g.len();
        let y = values(B::swiglu(tensor(g.clone(), [n]), tensor(u.clone(), [n])));
        for i in 0..n {
            let naive = g[i] / (1.0 + (-g[i]).exp()) * u[i];
            prop_assert!((y[i] - naive).abs() <= 1e-5 * (1.0 + naive.abs()), "{} vs {}", y[i], naive);
            if naive.abs() > 1e-6 {
                prop_assert_eq!(y[i].signum(), g[i].signum() * u[i].signum());
            }
        }
    }
}

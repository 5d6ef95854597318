//! Rollout correction's bypass mode: the rollout's log-probs as the old ones, PPO-clip or
//! REINFORCE with the correction applied inside the loss (verl's
//! `compute_policy_loss_bypass_mode`), worked by hand.

use burn::backend::Autodiff;
use burn::tensor::{Tensor, TensorData};
use verl_core::algorithms::bypass::{bypass_mode_loss, BypassLoss, BypassMode};
use verl_core::algorithms::policy_loss::{reinforce, vanilla, PolicyLossInput};
use verl_core::algorithms::rollout_correction::RolloutCorrection;
use verl_core::backend::CpuBackend;

type B = Autodiff<CpuBackend>;

fn row(v: &[f64]) -> Tensor<B, 2> {
    let flat: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    Tensor::from_data(TensorData::new(flat, [1, v.len()]), &Default::default())
}

fn flat(t: Tensor<CpuBackend, 2>) -> Vec<f64> {
    t.into_data().iter::<f64>().collect()
}

fn mode(loss: BypassLoss, rs: Option<&str>, rs_threshold: Option<&str>) -> BypassMode {
    BypassMode {
        loss,
        correction: RolloutCorrection::parse(Some("token"), 2.0, false, rs, rs_threshold).unwrap(),
    }
}

/// Rollout log-probs −1 each; the current policy's ratios to them are 3, 1 and 1/4.
fn current() -> Vec<f64> {
    vec![-1.0 + 3f64.ln(), -1.0, -1.0 - 4f64.ln()]
}

#[test]
fn reinforce_applies_truncated_weights_and_their_gradient_is_detached() {
    let lp = row(&current()).require_grad();
    let x = PolicyLossInput::new(
        row(&[-1.0; 3]),
        lp.clone(),
        row(&[1.0, 2.0, 3.0]),
        row(&[1.0; 3]),
    );
    let (out, metrics) = bypass_mode_loss(&x, &mode(BypassLoss::Reinforce, None, None)).unwrap();
    // Weights truncated above at 2: [2, 1, 0.25]. Token-mean of −A·log π·w.
    let c = current();
    let want = (-(c[0] * 2.0) - 2.0 * c[1] - 3.0 * c[2] * 0.25) / 3.0;
    let loss = out.loss.clone().into_scalar() as f64;
    assert!((loss - want).abs() < 1e-5, "{loss} vs {want}");
    // ppo_kl: mean of log π_rollout − log π = −(ln 3 − ln 4) / 3.
    assert!((out.ppo_kl - (4f64.ln() - 3f64.ln()) / 3.0).abs() < 1e-6);
    assert_eq!((out.pg_clipfrac, out.pg_clipfrac_lower), (0.0, 0.0));
    // The weights are constants: d loss / d log π = −A·w / 3.
    let g = flat(lp.grad(&out.loss.backward()).unwrap());
    for (got, want) in g.iter().zip([-2.0 / 3.0, -2.0 / 3.0, -0.25]) {
        assert!((got - want).abs() < 1e-6, "{g:?}");
    }
    // verl's metric is the mean before truncation.
    assert!((metrics["rollout_corr/rollout_is_mean"] - (3.0 + 1.0 + 0.25) / 3.0).abs() < 1e-5);
    assert!(metrics.contains_key("rollout_corr/kl"));
}

#[test]
fn rejection_removes_tokens_from_the_policy_loss_only() {
    // token_k1 with threshold 2 keeps ratios in [1/2, 2]: only the middle token.
    let x = PolicyLossInput::new(
        row(&[-1.0; 3]),
        row(&current()),
        row(&[1.0, 2.0, 3.0]),
        row(&[1.0; 3]),
    );
    let m = mode(BypassLoss::Reinforce, Some("token_k1"), Some("2.0"));
    let (out, metrics) = bypass_mode_loss(&x, &m).unwrap();
    // Token-mean over the one kept token: −2·(−1)·1 = 2.
    assert!((out.loss.into_scalar() as f64 - 2.0).abs() < 1e-6);
    // Its log π equals the rollout's: no divergence left.
    assert!(out.ppo_kl.abs() < 1e-7);
    assert!((metrics["rollout_corr/rollout_rs_masked_fraction"] - 2.0 / 3.0).abs() < 1e-6);
}

#[test]
fn ppo_clip_is_vanilla_against_the_rollout_without_weights() {
    let x = PolicyLossInput::new(
        row(&[-1.0; 3]),
        row(&current()),
        row(&[1.0, -2.0, 3.0]),
        row(&[1.0, 1.0, 0.0]),
    );
    let (out, metrics) = bypass_mode_loss(&x, &mode(BypassLoss::PpoClip, None, None)).unwrap();
    // rollout_is = token is set, but PPO's clipped ratio already bounds the off-policy ratio:
    // no weights, the same loss as vanilla PPO with old = rollout.
    let plain = vanilla(&x).unwrap();
    let (a, b) = (
        out.loss.into_scalar() as f64,
        plain.loss.into_scalar() as f64,
    );
    assert!((a - b).abs() < 1e-7, "{a} vs {b}");
    assert_eq!(out.pg_clipfrac, plain.pg_clipfrac);
    // By hand: ratios [3, 1]; A = [1, −2], ε = 0.2: max(−3, −1.2) = −1.2 and 2, mean 0.4.
    assert!((a - 0.4).abs() < 1e-6);
    // The weights were still computed, for the metrics.
    assert!(metrics.contains_key("rollout_corr/rollout_is_mean"));
    // REINFORCE without any correction is −A·log π.
    let r = reinforce(&x).unwrap().loss.into_scalar() as f64;
    let c = current();
    assert!((r - (-c[0] + 2.0 * c[1]) / 2.0).abs() < 1e-6);
}

#[test]
fn loss_types_parse_as_verls() {
    assert_eq!(
        "ppo_clip".parse::<BypassLoss>().unwrap(),
        BypassLoss::PpoClip
    );
    assert_eq!(
        "reinforce".parse::<BypassLoss>().unwrap(),
        BypassLoss::Reinforce
    );
    let e = "ppo_clip_bypass"
        .parse::<BypassLoss>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("ppo_clip") && e.contains("reinforce"), "{e}");
}

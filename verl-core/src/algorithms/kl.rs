//! KL estimators between the policy and the reference (Schulman's k1/k2/k3), their
//! straight-through `+` variants, the full-distribution KL, and the in-reward KL controllers.

use std::str::FromStr;

use burn::prelude::*;

use crate::error::AlgorithmError;

/// A per-token KL estimator, as verl names them (`kl_loss_type`, `algorithm.kl_penalty`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlType {
    /// k1 = log π − log π_ref ("kl", "k1").
    K1,
    /// |log π − log π_ref| ("abs").
    Abs,
    /// k2 = ½(log π − log π_ref)² ("mse", "k2").
    K2,
    /// k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1, with verl's clamps
    /// ("low_var_kl", "k3").
    K3,
}

/// A parsed KL type: the estimator and whether it is straight-through (`+`: the estimator's
/// value, k2's gradient). In a config it is the name (`low_var_kl`, `k3+`, ...).
///
/// ```
/// use verl_core::algorithms::kl::{KlPenalty, KlType};
/// let k: KlPenalty = "k3+".parse().unwrap();
/// assert_eq!((k.kind, k.straight_through), (KlType::K3, true));
/// assert_eq!(k.to_string(), "low_var_kl+");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KlPenalty {
    pub kind: KlType,
    pub straight_through: bool,
}

impl KlPenalty {
    /// k1, verl's default in-reward penalty (`kl`).
    pub const K1: Self = Self {
        kind: KlType::K1,
        straight_through: false,
    };
    /// k3, verl's default KL loss (`low_var_kl`).
    pub const LOW_VAR_KL: Self = Self {
        kind: KlType::K3,
        straight_through: false,
    };
}

impl std::fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.kind {
            KlType::K1 => "kl",
            KlType::Abs => "abs",
            KlType::K2 => "mse",
            KlType::K3 => "low_var_kl",
        };
        write!(f, "{name}{}", if self.straight_through { "+" } else { "" })
    }
}

impl TryFrom<String> for KlPenalty {
    type Error = AlgorithmError;
    fn try_from(s: String) -> Result<Self, AlgorithmError> {
        s.parse()
    }
}

impl From<KlPenalty> for String {
    fn from(k: KlPenalty) -> String {
        k.to_string()
    }
}

impl FromStr for KlPenalty {
    type Err = AlgorithmError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (base, straight_through) = match s.strip_suffix('+') {
            Some(b) => (b, true),
            None => (s, false),
        };
        let kind = match base {
            "kl" | "k1" => KlType::K1,
            "abs" => KlType::Abs,
            "mse" | "k2" => KlType::K2,
            "low_var_kl" | "k3" => KlType::K3,
            "full" => {
                return Err(AlgorithmError::Invalid {
                    algorithm: "kl_penalty".into(),
                    message: "`full` needs the full-vocabulary log-probs: call `kl_full` instead of a per-token estimator".into(),
                })
            }
            _ => {
                return Err(AlgorithmError::UnknownName {
                    kind: "kl type",
                    name: s.into(),
                    known: "kl, k1, abs, mse, k2, low_var_kl, k3, full, and the `+` variants (e.g. k3+)".into(),
                })
            }
        };
        Ok(Self {
            kind,
            straight_through,
        })
    }
}

fn forward<B: Backend>(
    logprob: Tensor<B, 2>,
    ref_logprob: Tensor<B, 2>,
    kind: KlType,
) -> Tensor<B, 2> {
    match kind {
        KlType::K1 => logprob - ref_logprob,
        KlType::Abs => (logprob - ref_logprob).abs(),
        KlType::K2 => (logprob - ref_logprob).powf_scalar(2.0) * 0.5,
        KlType::K3 => {
            let kl = (ref_logprob - logprob).clamp(-20.0, 20.0);
            (kl.clone().exp() - kl - 1.0).clamp(-10.0, 10.0)
        }
    }
}

/// Per-token KL estimate `[batch, len]` (unmasked: multiply by the response mask).
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::kl::kl_penalty;
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let lp = Tensor::<B, 2>::from_floats([[-1.0]], &d);
/// let rp = Tensor::<B, 2>::from_floats([[-2.0]], &d);
/// let k3 = kl_penalty(lp, rp, "low_var_kl".parse()?).into_scalar();
/// assert!((k3 - ((-1.0f32).exp() + 1.0 - 1.0)).abs() < 1e-6); // e^{-1} − (−1) − 1
/// # Ok::<(), verl_core::error::AlgorithmError>(())
/// ```
pub fn kl_penalty<B: Backend>(
    logprob: Tensor<B, 2>,
    ref_logprob: Tensor<B, 2>,
    penalty: KlPenalty,
) -> Tensor<B, 2> {
    if !penalty.straight_through {
        return forward(logprob, ref_logprob, penalty.kind);
    }
    let value = forward(logprob.clone(), ref_logprob.clone(), penalty.kind).detach();
    let k2 = forward(logprob, ref_logprob, KlType::K2);
    k2.clone() - k2.detach() + value
}

/// Exact KL(π ‖ π_ref) per position from full-vocabulary log-probs `[batch, len, vocab]`:
/// Σ_v π(v)·(log π(v) − log π_ref(v)).
pub fn kl_full<B: Backend>(logprobs: Tensor<B, 3>, ref_logprobs: Tensor<B, 3>) -> Tensor<B, 2> {
    (logprobs.clone().exp() * (logprobs - ref_logprobs))
        .sum_dim(2)
        .squeeze_dim(2)
}

/// The coefficient β of the in-reward KL penalty.
pub trait KlController: Send {
    fn value(&self) -> f64;
    /// Updates β from the observed KL over `n_steps` samples.
    fn update(&mut self, current_kl: f64, n_steps: usize);
    /// Sets β (restoring a checkpoint); a fixed controller keeps its configured value.
    fn restore(&mut self, value: f64);
}

/// A constant β.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FixedKlController {
    pub kl_coef: f64,
}

impl KlController for FixedKlController {
    fn value(&self) -> f64 {
        self.kl_coef
    }
    fn update(&mut self, _current_kl: f64, _n_steps: usize) {}
    fn restore(&mut self, _value: f64) {}
}

/// Ziegler et al. (2019, arXiv:1909.08593): β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveKlController {
    pub value: f64,
    pub target: f64,
    pub horizon: f64,
}

impl KlController for AdaptiveKlController {
    fn value(&self) -> f64 {
        self.value
    }
    fn update(&mut self, current_kl: f64, n_steps: usize) {
        let error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
        self.value *= 1.0 + error * n_steps as f64 / self.horizon;
    }
    fn restore(&mut self, value: f64) {
        self.value = value;
    }
}

/// The controller `algorithm.kl_ctrl` describes.
pub fn kl_controller(
    cfg: &crate::config::KlCtrlConfig,
) -> Result<Box<dyn KlController>, AlgorithmError> {
    match cfg.kind.as_str() {
        "fixed" => Ok(Box::new(FixedKlController {
            kl_coef: cfg.kl_coef,
        })),
        "adaptive" => {
            if cfg.horizon == 0 || cfg.target_kl <= 0.0 {
                return Err(AlgorithmError::Invalid {
                    algorithm: "adaptive kl_ctrl".into(),
                    message: "horizon and target_kl must be positive".into(),
                });
            }
            Ok(Box::new(AdaptiveKlController {
                value: cfg.kl_coef,
                target: cfg.target_kl,
                horizon: cfg.horizon as f64,
            }))
        }
        other => Err(AlgorithmError::UnknownName {
            kind: "kl_ctrl.type",
            name: other.into(),
            known: "fixed, adaptive".into(),
        }),
    }
}

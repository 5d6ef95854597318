//! Policy losses, registered under verl's names (`actor.policy_loss.loss_mode`).
//!
//! Each takes a [`PolicyLossInput`] of `[batch, len]` tensors and returns the scalar loss (with
//! gradient through `log_prob`) and its metrics: `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`.

use std::sync::Arc;

use burn::prelude::*;
use burn::tensor::TensorData;

use super::aggregation::{agg_loss, AggScale, LossAggMode};
use super::host::{scalar, Host2};
use super::masked::masked_mean;
use super::registry::NamedRegistry;
use super::same_shape;
use crate::error::AlgorithmError;

type Result<T> = std::result::Result<T, AlgorithmError>;

/// Hyper-parameters of the policy losses (verl's actor and `policy_loss` keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossParams {
    pub clip_ratio_low: f64,
    pub clip_ratio_high: f64,
    /// Dual-clip constant c > 1 (vanilla PPO).
    pub clip_ratio_c: f64,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// SAPO gate temperatures for positive and negative advantages.
    pub tau_pos: f64,
    pub tau_neg: f64,
    /// Seed of Clip-Cov's random choice among candidate tokens.
    pub seed: u64,
}

impl Default for PolicyLossParams {
    fn default() -> Self {
        Self {
            clip_ratio_low: 0.2,
            clip_ratio_high: 0.2,
            clip_ratio_c: 3.0,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
            tau_pos: 1.0,
            tau_neg: 1.05,
            seed: 0,
        }
    }
}

/// Inputs of a policy loss.
#[derive(Debug, Clone)]
pub struct PolicyLossInput<B: Backend> {
    pub old_log_prob: Tensor<B, 2>,
    /// Current log-probs; gradients flow through this.
    pub log_prob: Tensor<B, 2>,
    pub advantages: Tensor<B, 2>,
    pub response_mask: Tensor<B, 2>,
    pub loss_agg_mode: LossAggMode,
    pub agg_scale: AggScale,
    pub params: PolicyLossParams,
    /// verl's `rollout_is_weights` (rollout correction's truncated importance weights, no
    /// gradient): multiply each token's loss before aggregation (geo_mean: their geometric
    /// mean multiplies each sequence's loss).
    pub rollout_is_weights: Option<Tensor<B, 2>>,
}

impl<B: Backend> PolicyLossInput<B> {
    /// Token-mean aggregation and default parameters.
    pub fn new(
        old_log_prob: Tensor<B, 2>,
        log_prob: Tensor<B, 2>,
        advantages: Tensor<B, 2>,
        response_mask: Tensor<B, 2>,
    ) -> Self {
        Self {
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode: LossAggMode::TokenMean,
            agg_scale: AggScale::default(),
            params: PolicyLossParams::default(),
            rollout_is_weights: None,
        }
    }

    /// With rollout correction's importance weights ([`Self::rollout_is_weights`]).
    pub fn with_rollout_is_weights(mut self, weights: Tensor<B, 2>) -> Self {
        self.rollout_is_weights = Some(weights);
        self
    }

    fn check(&self, name: &str) -> Result<()> {
        let d = self.log_prob.dims();
        same_shape(
            &format!("{name}: old_log_prob"),
            &d,
            &self.old_log_prob.dims(),
        )?;
        same_shape(&format!("{name}: advantages"), &d, &self.advantages.dims())?;
        if let Some(w) = &self.rollout_is_weights {
            same_shape(&format!("{name}: rollout_is_weights"), &d, &w.dims())?;
        }
        same_shape(
            &format!("{name}: response_mask"),
            &d,
            &self.response_mask.dims(),
        )
    }

    /// Each token's loss times its importance weight, when there are weights.
    fn weighted(&self, losses: Tensor<B, 2>) -> Tensor<B, 2> {
        match &self.rollout_is_weights {
            Some(w) => losses * w.clone().detach(),
            None => losses,
        }
    }

    fn agg(&self, losses: Tensor<B, 2>) -> Tensor<B, 1> {
        self.agg_as(losses, self.loss_agg_mode)
    }

    /// [`Self::agg`] in `mode` whatever the configured one (GSPO and SAPO fix theirs).
    fn agg_as(&self, losses: Tensor<B, 2>, mode: LossAggMode) -> Tensor<B, 1> {
        agg_loss(
            self.weighted(losses),
            self.response_mask.clone(),
            mode,
            self.agg_scale,
        )
    }

    /// log π − log π_old, clamped to ±20 as verl does before exponentiating.
    fn neg_kl(&self) -> Tensor<B, 2> {
        (self.log_prob.clone() - self.old_log_prob.clone()).clamp(-20.0, 20.0)
    }

    fn mean(&self, t: Tensor<B, 2>) -> f64 {
        scalar(masked_mean(t, self.response_mask.clone()))
    }
}

/// A policy loss's value and metrics.
#[derive(Debug, Clone)]
pub struct PolicyLossOutput<B: Backend> {
    pub loss: Tensor<B, 1>,
    pub pg_clipfrac: f64,
    pub ppo_kl: f64,
    pub pg_clipfrac_lower: f64,
}

/// A built-in loss as a plain function.
type BuiltinLoss<B> = fn(&PolicyLossInput<B>) -> Result<PolicyLossOutput<B>>;

/// A loss as stored in the registry.
pub type PolicyLossFn<B> = Arc<DynPolicyLoss<B>>;

/// The unsized policy-loss type.
pub type DynPolicyLoss<B> =
    dyn Fn(&PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> + Send + Sync;

/// Vanilla PPO-clip (Schulman et al. 2017) with dual-clip (Ye et al. 2020, arXiv:1912.09729):
/// L = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), and for A < 0 additionally min(·, −A·c).
pub fn vanilla<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("vanilla")?;
    let p = x.params;
    if p.clip_ratio_c <= 1.0 {
        return Err(AlgorithmError::Invalid {
            algorithm: "vanilla".into(),
            message: format!("clip_ratio_c must be > 1, got {}", p.clip_ratio_c),
        });
    }
    let neg_kl = x.neg_kl();
    let ratio = neg_kl.clone().exp();
    let adv = x.advantages.clone();
    let l1 = -adv.clone() * ratio.clone();
    let l2 = -adv.clone() * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high);
    let clip1 = l1.clone().max_pair(l2.clone());
    let pg_clipfrac = x.mean(l2.greater(l1).float());
    let l3 = -adv.clone() * p.clip_ratio_c;
    let clip2 = l3.clone().min_pair(clip1.clone());
    let negative = adv.lower_elem(0.0);
    let pg_clipfrac_lower = x.mean(clip1.clone().greater(l3).float() * negative.clone().float());
    let losses = clip1.mask_where(negative, clip2);
    Ok(PolicyLossOutput {
        loss: x.agg(losses),
        pg_clipfrac,
        ppo_kl: x.mean(-neg_kl),
        pg_clipfrac_lower,
    })
}

/// REINFORCE with rollout correction's importance weights (verl's
/// `compute_policy_loss_reinforce`, the loss of bypass mode's `loss_type: reinforce`):
/// L = agg(−A · log π · w), with `old_log_prob` the rollout's log-probs and `w` the (detached)
/// `rollout_is_weights`, 1 without them. No ratio and no clipping (`pg_clipfrac` 0); `ppo_kl`
/// is the masked mean of log π_rollout − log π, unclamped as verl's.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::policy_loss::{reinforce, PolicyLossInput};
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let t = |v: [[f32; 2]; 1]| Tensor::<B, 2>::from_floats(v, &d);
/// // log π = [−1, −2], A = [1, 2]: token-mean of [1·1, 2·2] = 2.5.
/// let x = PolicyLossInput::new(t([[-1.5, -2.0]]), t([[-1.0, -2.0]]), t([[1.0, 2.0]]), t([[1.0, 1.0]]));
/// let out = reinforce(&x)?;
/// assert!((out.loss.into_scalar() - 2.5).abs() < 1e-6);
/// assert!((out.ppo_kl - (-0.25)).abs() < 1e-6);
/// # Ok::<(), verl_core::error::AlgorithmError>(())
/// ```
pub fn reinforce<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("reinforce")?;
    let losses = -x.advantages.clone() * x.log_prob.clone();
    Ok(PolicyLossOutput {
        loss: x.agg(losses),
        pg_clipfrac: 0.0,
        ppo_kl: x.mean(x.old_log_prob.clone() - x.log_prob.clone()),
        pg_clipfrac_lower: 0.0,
    })
}

/// GSPO (Zheng et al. 2025, arXiv:2507.18071): a sequence-level ratio s = exp(mean_t log r_t)
/// whose value is shared by the sequence's tokens while each token keeps its own gradient;
/// clipped as PPO. Always aggregated seq-mean-token-mean, as verl does.
pub fn gspo<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("gspo")?;
    let p = x.params;
    let mask = x.response_mask.clone();
    let neg_kl = x.log_prob.clone() - x.old_log_prob.clone();
    let len = mask.clone().sum_dim(1).clamp_min(1.0);
    let seq_kl = (neg_kl.clone() * mask.clone()).sum_dim(1) / len;
    let lp = x.log_prob.clone();
    let log_ratio = (lp.clone() - lp.detach() + seq_kl.detach()).clamp_max(10.0);
    let ratio = log_ratio.exp();
    let adv = x.advantages.clone();
    let l1 = -adv.clone() * ratio.clone();
    let l2 = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high);
    let losses = l1.clone().max_pair(l2.clone());
    let loss = x.agg_as(losses, LossAggMode::SeqMeanTokenMean);
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: x.mean(l2.greater(l1).float()),
        ppo_kl: x.mean(-neg_kl),
        pg_clipfrac_lower: 0.0,
    })
}

/// SAPO (soft adaptive policy optimisation): a smooth gate f(r) = σ(τ(r − 1))·4/τ replaces the
/// hard clip, with τ = `tau_pos` for A > 0 and `tau_neg` otherwise; L = −f(r)·A, averaged as
/// `seq-mean-token-mean` whatever `loss_agg_mode` says (as verl's). Having no clip, it reports
/// clip fractions of 0 (as verl's).
pub fn sapo<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("sapo")?;
    let p = x.params;
    let neg_kl = x.neg_kl();
    let ratio = neg_kl.clone().exp();
    let adv = x.advantages.clone();
    let tau = adv.clone().greater_elem(0.0).float() * (p.tau_pos - p.tau_neg) + p.tau_neg;
    let gate = burn::tensor::activation::sigmoid(tau.clone() * (ratio.clone() - 1.0)) * 4.0 / tau;
    let losses = -gate * adv;
    // As verl: SAPO always averages tokens within a sequence, then sequences, and has no clip,
    // so it reports no clip fraction.
    Ok(PolicyLossOutput {
        loss: x.agg_as(losses, LossAggMode::SeqMeanTokenMean),
        pg_clipfrac: 0.0,
        ppo_kl: x.mean(-neg_kl),
        pg_clipfrac_lower: 0.0,
    })
}

/// GPG policy loss (arXiv:2504.02546): plain policy gradient −log π·A.
pub fn gpg<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("gpg")?;
    let losses = -x.log_prob.clone() * x.advantages.clone();
    Ok(PolicyLossOutput {
        loss: x.agg(losses),
        pg_clipfrac: 0.0,
        ppo_kl: 0.0,
        pg_clipfrac_lower: 0.0,
    })
}

/// Token-wise covariance of advantage and log-prob (both centred by their masked means), on host.
/// Both are centred by their mean over the unmasked tokens (Clip-Cov and KL-Cov share this).
fn covariance<B: Backend>(x: &PolicyLossInput<B>) -> (Host2, Host2) {
    let adv = Host2::from_tensor(&x.advantages);
    let lp = Host2::from_tensor(&x.log_prob.clone().detach());
    let m = Host2::from_tensor(&x.response_mask);
    // No unmasked token: nothing is a candidate, so any finite centre will do.
    let n: f64 = m.data.iter().sum::<f64>().max(1.0);
    let mean = |h: &Host2| h.data.iter().zip(&m.data).map(|(v, k)| v * k).sum::<f64>() / n;
    let (ma, ml) = (mean(&adv), mean(&lp));
    let cov = Host2 {
        data: adv
            .data
            .iter()
            .zip(&lp.data)
            .map(|(a, l)| (a - ma) * (l - ml))
            .collect(),
        rows: adv.rows,
        cols: adv.cols,
    };
    (cov, m)
}

/// Clip-Cov (Cui et al. 2025, arXiv:2505.22617): PPO-clip, plus the gradient of a few tokens whose
/// advantage–log-prob covariance lies in (lb, ub) is dropped: `clip_cov_ratio` of the valid
/// tokens (at least one), chosen at random among the candidates not already clipped.
pub fn clip_cov<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("clip_cov")?;
    let p = x.params;
    let neg_kl = x.log_prob.clone() - x.old_log_prob.clone();
    let ratio = neg_kl.clone().exp();
    let adv = x.advantages.clone();
    let l1 = -adv.clone() * ratio.clone();
    let l2 = -adv * ratio.clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high);
    let clipped = Host2::from_tensor(&l2.clone().greater(l1.clone()).float());
    let (cov, m) = covariance(x);
    let valid: f64 = m.data.iter().sum();
    let clip_num = ((p.clip_cov_ratio * valid) as usize).max(1);
    let mut candidates: Vec<usize> = (0..cov.data.len())
        .filter(|&k| {
            m.data[k] > 0.0
                && clipped.data[k] == 0.0
                && cov.data[k] > p.clip_cov_lb
                && cov.data[k] < p.clip_cov_ub
        })
        .collect();
    // A seeded Fisher–Yates shuffle keeps the choice reproducible.
    let mut state = p.seed ^ 0x9E37_79B9_7F4A_7C15;
    for i in (1..candidates.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        candidates.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let mut corr = vec![1.0f32; cov.data.len()];
    for &k in candidates.iter().take(clip_num) {
        corr[k] = 0.0;
    }
    let corr = Tensor::<B, 2>::from_data(
        TensorData::new(corr, [cov.rows, cov.cols]),
        &x.log_prob.device(),
    );
    let pg_clipfrac = x.mean(corr.clone().lower_elem(0.5).float());
    let losses = l1.max_pair(l2) * corr;
    Ok(PolicyLossOutput {
        loss: x.agg(losses),
        pg_clipfrac,
        ppo_kl: x.mean(-neg_kl),
        pg_clipfrac_lower: 0.0,
    })
}

/// KL-Cov (arXiv:2505.22617): unclipped −A·r, plus a KL penalty `ppo_kl_coef`·|log r| on the
/// `kl_cov_ratio` fraction (at least one) of valid tokens with the largest covariance.
/// `ppo_kl` reports the mean |log r|.
pub fn kl_cov<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("kl_cov")?;
    let p = x.params;
    let neg_kl = x.log_prob.clone() - x.old_log_prob.clone();
    let abs_kl = neg_kl.clone().abs();
    let ratio = neg_kl.exp();
    let base = -x.advantages.clone() * ratio;
    let (cov, m) = covariance(x);
    let mut valid: Vec<usize> = (0..cov.data.len()).filter(|&k| m.data[k] > 0.0).collect();
    let mut select = vec![0.0f32; cov.data.len()];
    if !valid.is_empty() && p.kl_cov_ratio > 0.0 {
        let take = ((valid.len() as f64 * p.kl_cov_ratio) as usize).max(1);
        valid.sort_by(|&a, &b| cov.data[b].total_cmp(&cov.data[a]));
        for &k in valid.iter().take(take) {
            select[k] = 1.0;
        }
    }
    let select = Tensor::<B, 2>::from_data(
        TensorData::new(select, [cov.rows, cov.cols]),
        &x.log_prob.device(),
    );
    let losses = base + select * abs_kl.clone() * p.ppo_kl_coef;
    Ok(PolicyLossOutput {
        loss: x.agg(losses),
        pg_clipfrac: 0.0,
        ppo_kl: x.mean(abs_kl),
        pg_clipfrac_lower: 0.0,
    })
}

/// GMPO / geo-mean (Zhao et al. 2025, arXiv:2507.20673): the sequence ratio is the geometric mean
/// of token ratios, each clipped in log space to [−ε_low, ε_high] on the pessimistic side for the
/// sign of A; L = mean over sequences of −Ā·exp(mean_t clipped log r).
pub fn geo_mean<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("geo_mean")?;
    let p = x.params;
    let mask = x.response_mask.clone();
    let neg_kl = x.log_prob.clone() - x.old_log_prob.clone();
    let sgn = x.advantages.clone().sign();
    let clamped = neg_kl.clone().clamp(-p.clip_ratio_low, p.clip_ratio_high);
    let min = (sgn.clone() * neg_kl.clone()).min_pair(sgn.clone() * clamped.clone());
    let pessimistic = sgn * min;
    let len = mask.clone().sum_dim(1) + 1e-8;
    let ratio = ((pessimistic * mask.clone()).sum_dim(1) / len.clone()).exp();
    let seq_adv = (x.advantages.clone() * mask.clone()).sum_dim(1) / len.clone();
    let mut seq_loss = -seq_adv * ratio;
    if let Some(w) = &x.rollout_is_weights {
        // One weight per sequence: the tokens' geometric mean.
        let log_w = (w.clone().detach() + 1e-10).log() * mask;
        seq_loss = seq_loss * (log_w.sum_dim(1) / len).exp();
    }
    let loss = seq_loss.mean();
    let was_clipped = neg_kl.clone().not_equal(clamped).float();
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: x.mean(was_clipped.clone() * x.advantages.clone().greater_elem(0.0).float()),
        ppo_kl: x.mean(-neg_kl),
        pg_clipfrac_lower: x.mean(was_clipped * x.advantages.clone().lower_elem(0.0).float()),
    })
}

/// CISPO (MiniMax-M1, arXiv:2506.13585): L = −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π. The clip acts
/// on the (stopped) importance weight, so clipped tokens still get a gradient.
pub fn cispo<B: Backend>(x: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
    x.check("cispo")?;
    let p = x.params;
    let neg_kl = x.neg_kl();
    let ratio = neg_kl.clone().exp().detach();
    let clipped = ratio
        .clone()
        .clamp(1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high);
    let pg_clipfrac = x.mean(ratio.not_equal(clipped.clone()).float());
    let losses = -clipped * x.advantages.clone() * x.log_prob.clone();
    Ok(PolicyLossOutput {
        loss: x.agg(losses),
        pg_clipfrac,
        ppo_kl: x.mean(-neg_kl),
        pg_clipfrac_lower: 0.0,
    })
}

/// verl's built-in policy-loss names.
pub const BUILTIN_POLICY_LOSSES: [&str; 8] = [
    "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo",
];

/// Policy losses by name; [`PolicyLossRegistry::new`] holds verl's built-ins.
pub struct PolicyLossRegistry<B: Backend> {
    losses: NamedRegistry<DynPolicyLoss<B>>,
}

impl<B: Backend> Default for PolicyLossRegistry<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> PolicyLossRegistry<B> {
    pub fn new() -> Self {
        let mut r = Self {
            losses: NamedRegistry::new("policy loss"),
        };
        let builtins: [(&str, BuiltinLoss<B>); 8] = [
            ("vanilla", vanilla),
            ("gspo", gspo),
            ("sapo", sapo),
            ("gpg", gpg),
            ("clip_cov", clip_cov),
            ("kl_cov", kl_cov),
            ("geo_mean", geo_mean),
            ("cispo", cispo),
        ];
        for (name, f) in builtins {
            r.register(name, f);
        }
        r
    }

    /// Adds (or replaces) a loss.
    pub fn register(
        &mut self,
        name: &str,
        f: impl Fn(&PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> + Send + Sync + 'static,
    ) {
        self.losses.insert(name, Arc::new(f));
    }

    /// Registered names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.losses.names()
    }

    /// The loss called `name`.
    pub fn get(&self, name: &str) -> Result<PolicyLossFn<B>> {
        self.losses.get(name)
    }

    /// Runs the loss called `name`.
    pub fn compute(&self, name: &str, input: &PolicyLossInput<B>) -> Result<PolicyLossOutput<B>> {
        (self.get(name)?)(input)
    }
}

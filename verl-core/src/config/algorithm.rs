use serde::{Deserialize, Serialize};

use crate::algorithms::kl::KlPenalty;

/// `algorithm.kl_ctrl`: the controller of the in-reward KL coefficient.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlConfig {
    /// `fixed` or `adaptive`.
    #[serde(rename = "type")]
    pub kind: String,
    pub kl_coef: f64,
    pub horizon: u64,
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        Self {
            kind: "fixed".into(),
            kl_coef: 0.001,
            horizon: 10000,
            target_kl: 0.1,
        }
    }
}

/// `algorithm`: advantage estimation and the in-reward KL penalty.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    pub gamma: f64,
    pub lam: f64,
    /// `gae`, `grpo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `rloo`, `remax`,
    /// `opo`, `gpg`, `grpo_passk`, `optimal_token_baseline`, or a registered name.
    pub adv_estimator: String,
    /// GRPO: divide by the group's std (`false` gives Dr.GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    pub use_kl_in_reward: bool,
    /// The in-reward KL estimator: `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`, or a
    /// straight-through `+` variant.
    pub kl_penalty: KlPenalty,
    pub kl_ctrl: KlCtrlConfig,
    pub use_pf_ppo: bool,
    /// Rollout–training mismatch correction
    /// ([`crate::algorithms::rollout_correction`]).
    pub rollout_correction: RolloutCorrectionConfig,
}

/// `algorithm.rollout_correction` (verl's keys; off by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutCorrectionConfig {
    /// `token`, `sequence`, or `null` (no importance weights).
    pub rollout_is: Option<String>,
    /// Weights are truncated above at this.
    pub rollout_is_threshold: f64,
    /// Divide the weights by their batch mean.
    pub rollout_is_batch_normalize: bool,
    /// Rejection criteria, comma-separated (`token_k1`, `seq_mean_k3`, ...), or `null`.
    pub rollout_rs: Option<String>,
    /// One threshold for every criterion or one per criterion (a number, or `lower_upper`
    /// for k1 ones).
    pub rollout_rs_threshold: Option<serde_json::Value>,
    /// verl's bypass mode: the rollout's log-probs are the old ones (no old-log-prob pass),
    /// and the correction runs in the actor's loss ([`crate::algorithms::bypass`]).
    pub bypass_mode: bool,
    /// The bypass mode's loss (`ppo_clip`, `reinforce`).
    pub loss_type: String,
}

impl Default for RolloutCorrectionConfig {
    fn default() -> Self {
        Self {
            rollout_is: None,
            rollout_is_threshold: 2.0,
            rollout_is_batch_normalize: false,
            rollout_rs: None,
            rollout_rs_threshold: None,
            bypass_mode: false,
            loss_type: "ppo_clip".into(),
        }
    }
}

impl RolloutCorrectionConfig {
    /// Bypass mode's settings when `bypass_mode` is on; an error names the key to fix.
    pub fn bypass(
        &self,
    ) -> Result<Option<crate::algorithms::bypass::BypassMode>, crate::error::ConfigError> {
        let loss = self.bypass_loss()?;
        Ok(match self.bypass_mode {
            true => Some(crate::algorithms::bypass::BypassMode {
                loss,
                correction: self.parsed()?,
            }),
            false => None,
        })
    }

    /// `loss_type` parsed (checked whatever the mode: a typo is refused before a run).
    pub fn bypass_loss(
        &self,
    ) -> Result<crate::algorithms::bypass::BypassLoss, crate::error::ConfigError> {
        self.loss_type
            .parse()
            .map_err(
                |e: crate::error::AlgorithmError| crate::error::ConfigError::Invalid {
                    key: "algorithm.rollout_correction.loss_type".into(),
                    value: self.loss_type.clone(),
                    message: e.to_string(),
                    fix: "set it to ppo_clip (PPO's clipped ratio against the rollout) or \
                          reinforce (REINFORCE with the truncated importance weights)"
                        .into(),
                },
            )
    }

    /// The parsed correction; an error names the key to fix.
    pub fn parsed(
        &self,
    ) -> Result<crate::algorithms::rollout_correction::RolloutCorrection, crate::error::ConfigError>
    {
        let threshold = self.rollout_rs_threshold.as_ref().map(|v| match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        });
        crate::algorithms::rollout_correction::RolloutCorrection::parse(
            self.rollout_is.as_deref(),
            self.rollout_is_threshold,
            self.rollout_is_batch_normalize,
            self.rollout_rs.as_deref(),
            threshold.as_deref(),
        )
        .map_err(|e| crate::error::ConfigError::Invalid {
            key: "algorithm.rollout_correction".into(),
            value: format!("{self:?}"),
            message: e.to_string(),
            fix: "see the rollout_is / rollout_rs keys in README's Algorithms section".into(),
        })
    }
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            adv_estimator: "gae".into(),
            norm_adv_by_std_in_grpo: true,
            use_kl_in_reward: false,
            kl_penalty: KlPenalty::K1,
            kl_ctrl: KlCtrlConfig::default(),
            use_pf_ppo: false,
            rollout_correction: RolloutCorrectionConfig::default(),
        }
    }
}

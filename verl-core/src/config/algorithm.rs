use serde::{Deserialize, Serialize};

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
    /// `kl`, `abs`, `mse`, `low_var_kl`, `full` (and `k1`, `k2`, `k3`, `+` variants).
    pub kl_penalty: String,
    pub kl_ctrl: KlCtrlConfig,
    pub use_pf_ppo: bool,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            adv_estimator: "gae".into(),
            norm_adv_by_std_in_grpo: true,
            use_kl_in_reward: false,
            kl_penalty: "kl".into(),
            kl_ctrl: KlCtrlConfig::default(),
            use_pf_ppo: false,
        }
    }
}

use std::collections::BTreeMap;

use serde_json::Value;

use crate::Result;

/// What a rule-based reward sees of one sample (verl's `compute_score` arguments).
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    pub data_source: &'a str,
    pub solution_str: &'a str,
    pub ground_truth: &'a str,
    pub extra_info: &'a Value,
}

/// A score and optional named extras (logged as `reward_extra_info`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewardScore {
    pub score: f64,
    pub extra: BTreeMap<String, f64>,
    /// The answer the response gives, where the reward function reports one (verl's `pred`
    /// entry, e.g. math_dapo's): validation's majority vote (`maj@N`) counts them.
    pub pred: Option<String>,
}

impl From<f64> for RewardScore {
    fn from(score: f64) -> Self {
        Self {
            score,
            ..Default::default()
        }
    }
}

/// A rule-based reward. Any `Fn(&RewardInput) -> f64` is one.
///
/// ```
/// use verl_core::traits::{RewardFn, RewardInput};
/// let exact = |x: &RewardInput| if x.solution_str.trim() == x.ground_truth { 1.0 } else { 0.0 };
/// let input = RewardInput { data_source: "toy", solution_str: " 42", ground_truth: "42", extra_info: &serde_json::Value::Null };
/// assert_eq!(exact.compute_score(&input)?.score, 1.0);
/// # Ok::<(), verl_core::Error>(())
/// ```
pub trait RewardFn: Send + Sync {
    fn compute_score(&self, input: &RewardInput<'_>) -> Result<RewardScore>;
}

impl<F: Fn(&RewardInput<'_>) -> f64 + Send + Sync> RewardFn for F {
    fn compute_score(&self, input: &RewardInput<'_>) -> Result<RewardScore> {
        Ok(self(input).into())
    }
}

/// A reward computed for a whole batch at once, possibly asynchronously (a reward served over
/// the network, a model scoring a batch): one score per input, in order.
///
/// ```
/// use verl_core::traits::{BatchRewardFn, RewardInput, RewardScore};
/// struct Length;
/// #[async_trait::async_trait]
/// impl BatchRewardFn for Length {
///     async fn score_batch(&self, inputs: &[RewardInput<'_>]) -> verl_core::Result<Vec<RewardScore>> {
///         Ok(inputs.iter().map(|x| RewardScore::from(x.solution_str.len() as f64)).collect())
///     }
/// }
/// let input = RewardInput { data_source: "toy", solution_str: "abc", ground_truth: "", extra_info: &serde_json::Value::Null };
/// let scores = futures::executor::block_on(Length.score_batch(&[input]))?;
/// assert_eq!(scores[0].score, 3.0);
/// # Ok::<(), verl_core::Error>(())
/// ```
#[async_trait::async_trait]
pub trait BatchRewardFn: Send + Sync {
    async fn score_batch(&self, inputs: &[RewardInput<'_>]) -> Result<Vec<RewardScore>>;
}

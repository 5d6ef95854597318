//! How a run scores responses: the rule-based scorers of each row's `data_source`, or the
//! embedding program's reward function.

use std::sync::Arc;

use verl_core::traits::{BatchRewardFn, RewardFn, RewardInput, RewardScore};

use crate::tasks::ArithmeticTask;

/// How a run scores responses.
#[derive(Clone, Default)]
pub enum Scorer {
    /// The rule-based scorer of each row's `data_source` (the built-in task's, or verl's
    /// `default_compute_score` ones).
    #[default]
    Rules,
    /// One call per response.
    PerSample(Arc<dyn RewardFn>),
    /// One call per batch, awaited.
    Batched(Arc<dyn BatchRewardFn>),
}

impl Scorer {
    /// Whether a row of `data_source` can be scored.
    pub fn knows(&self, data_source: &str) -> bool {
        match self {
            Scorer::Rules => {
                data_source == ArithmeticTask::DATA_SOURCE
                    || verl_core::reward_score::default_compute_score(data_source, "", "").is_some()
            }
            _ => true,
        }
    }

    /// One score per input.
    pub async fn score(&self, inputs: &[RewardInput<'_>]) -> verl_core::Result<Vec<f64>> {
        Ok(self
            .score_full(inputs)
            .await?
            .into_iter()
            .map(|s| s.score)
            .collect())
    }

    /// One score per input, with the extras the function returned beside it (a dict result's
    /// other numbers, verl's `reward_extra_info`).
    pub async fn score_full(
        &self,
        inputs: &[RewardInput<'_>],
    ) -> verl_core::Result<Vec<RewardScore>> {
        match self {
            Scorer::Rules => Ok(inputs
                .iter()
                .map(|x| {
                    if x.data_source == ArithmeticTask::DATA_SOURCE {
                        return ArithmeticTask::score(x.solution_str, x.ground_truth).into();
                    }
                    verl_core::reward_score::default_compute_score(
                        x.data_source,
                        x.solution_str,
                        x.ground_truth,
                    )
                    .unwrap_or(0.0)
                    .into()
                })
                .collect()),
            Scorer::PerSample(f) => inputs.iter().map(|x| f.compute_score(x)).collect(),
            Scorer::Batched(f) => {
                let scores = f.score_batch(inputs).await?;
                if scores.len() != inputs.len() {
                    return Err(verl_core::Error::backend(
                        "reward",
                        format!(
                            "the batched reward returned {} scores for {} responses",
                            scores.len(),
                            inputs.len()
                        ),
                    ));
                }
                Ok(scores)
            }
        }
    }
}

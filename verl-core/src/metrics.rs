//! [`Metrics`]: named scalar series a worker returns and the trainer reduces (mean, as verl's
//! `reduce_metrics` does; the largest value for peaks such as `perf/max_memory_allocated_gb`;
//! the sum for the rollout's counts, which each rollout group reports for its share).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Named lists of values; [`Metrics::reduce`] averages each list, except that a peak
/// (a key whose last-but-one or last segment starts with `max_`, as `perf/max_memory_allocated_gb`
/// or `perf/max_memory_allocated_gb/update_actor`) keeps its largest value: the peak of a step
/// over ranks and phases is their maximum; and a count in [`SUMMED`] adds up: each rollout
/// group reports the tokens and sequences of its own share of the prompts, so a run over
/// several groups logs what one rank would.
///
/// ```
/// use verl_core::Metrics;
/// let mut m = Metrics::default();
/// m.push("actor/pg_loss", 1.0);
/// m.push("actor/pg_loss", 3.0);
/// m.push("perf/max_memory_allocated_gb", 1.0);
/// m.push("perf/max_memory_allocated_gb", 3.0);
/// assert_eq!(m.reduce()["actor/pg_loss"], 2.0);
/// assert_eq!(m.reduce()["perf/max_memory_allocated_gb"], 3.0);
/// m.push("rollout/generated_tokens", 10.0);
/// m.push("rollout/generated_tokens", 12.0);
/// assert_eq!(m.reduce()["rollout/generated_tokens"], 22.0);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics(pub BTreeMap<String, Vec<f64>>);

impl Metrics {
    /// Appends one value to `key`'s series.
    pub fn push(&mut self, key: impl Into<String>, value: f64) {
        self.0.entry(key.into()).or_default().push(value);
    }

    /// Appends every series of `other`.
    pub fn extend(&mut self, other: Metrics) {
        for (k, v) in other.0 {
            self.0.entry(k).or_default().extend(v);
        }
    }

    /// `other`'s series in place of any of the same name here (a Python dict's `update`, as
    /// verl merges a later phase's metrics over an earlier one's).
    pub fn replace_with(&mut self, other: Metrics) {
        self.0.extend(other.0);
    }

    /// Mean of each series, or its maximum for a peak (empty series are left out).
    pub fn reduce(&self) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| {
                let value = if is_peak(k) {
                    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                } else if SUMMED.contains(&k.as_str()) {
                    v.iter().sum::<f64>()
                } else {
                    v.iter().sum::<f64>() / v.len() as f64
                };
                (k.clone(), value)
            })
            .collect()
    }
}

/// Counts that add up over the ranks reporting them (one per rollout group).
pub const SUMMED: &[&str] = &[
    "rollout/prompt_tokens",
    "rollout/generated_tokens",
    "rollout/peak_batch",
];

/// Whether `key` names a peak (`…/max_…` or `…/max_…/<phase>`), reduced by its maximum.
fn is_peak(key: &str) -> bool {
    let parts: Vec<&str> = key.split('/').collect();
    parts.len() >= 2
        && parts[1..]
            .iter()
            .rev()
            .take(2)
            .any(|p| p.starts_with("max_"))
}

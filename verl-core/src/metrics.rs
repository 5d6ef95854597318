//! [`Metrics`]: named scalar series a worker returns and the trainer reduces (mean), as verl's
//! `reduce_metrics` does.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Named lists of values; [`Metrics::reduce`] averages each list.
///
/// ```
/// use verl_core::Metrics;
/// let mut m = Metrics::default();
/// m.push("actor/pg_loss", 1.0);
/// m.push("actor/pg_loss", 3.0);
/// assert_eq!(m.reduce()["actor/pg_loss"], 2.0);
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

    /// Mean of each series (empty series are left out).
    pub fn reduce(&self) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.clone(), v.iter().sum::<f64>() / v.len() as f64))
            .collect()
    }
}

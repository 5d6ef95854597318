//! Validation metrics as verl reports them (`process_validation_metrics` in verl's
//! `metric_utils`, sectioned as its trainer's `_val_metrics_update`): for each data source and
//! variable (the reward and every reward extra), over each prompt's N responses, `mean@N` and
//! for N > 1 `std@N` and bootstrap estimates `best@k` / `worst@k` (and `maj@k` where responses
//! report a `pred`) for k = 2, 4, 8, … below N and N itself, each the mean over prompts.
//!
//! The bootstrap draws its indices as numpy's legacy generator does after `np.random.seed(42)`
//! (MT19937, bounded integers by masked rejection): the same resamples as verl's, so the
//! figures are verl's up to summation order (numpy sums pairwise, this in order: ~1e-15;
//! `tests` below hold values numpy computed).
//!
//! ```
//! use verl::trainer::val_metrics::{validation_metrics, ValSample};
//! let sample = |prompt, reward| ValSample {
//!     source: "gsm8k",
//!     prompt,
//!     values: vec![("reward", reward)],
//!     pred: None,
//! };
//! let m = validation_metrics(&[sample(0, 1.0), sample(0, 0.0), sample(1, 1.0), sample(1, 1.0)]);
//! assert_eq!(m["val-core/gsm8k/reward/mean@2"], 0.75);
//! assert_eq!(m["val-aux/gsm8k/reward/std@2"], 0.25); // 0.5 and 0, averaged
//! assert!(m.contains_key("val-core/gsm8k/reward/best@2/mean"));
//! assert!(m.contains_key("val-aux/gsm8k/reward/worst@2/std"));
//! ```

use std::collections::{BTreeMap, HashMap};

/// One validation response: its prompt (responses of one prompt share the index), its data
/// source, its variables (`reward` and the reward extras) and its answer (`pred`), if the
/// reward function reports one.
#[derive(Debug, Clone, PartialEq)]
pub struct ValSample<'a> {
    pub source: &'a str,
    pub prompt: usize,
    pub values: Vec<(&'a str, f64)>,
    pub pred: Option<&'a str>,
}

/// A [`ValSample`] that owns its text (what validation collects over its batches).
#[derive(Debug, Clone, PartialEq)]
pub struct ValRecord {
    pub source: String,
    pub prompt: usize,
    pub values: Vec<(String, f64)>,
    pub pred: Option<String>,
}

impl ValRecord {
    pub fn sample(&self) -> ValSample<'_> {
        ValSample {
            source: &self.source,
            prompt: self.prompt,
            values: self.values.iter().map(|(n, v)| (n.as_str(), *v)).collect(),
            pred: self.pred.as_deref(),
        }
    }
}

/// Bootstrap resamples per estimate, and the seed verl gives numpy before each.
const BOOTSTRAP_SAMPLES: usize = 1000;
const BOOTSTRAP_SEED: u32 = 42;

/// verl's metrics of `samples`, named `val-core/<source>/<variable>/<metric>` for the core
/// variable's (`acc` where the source reports it, else `reward`) mean, best and majority
/// figures at the largest N, `val-aux/…` for the rest.
pub fn validation_metrics(samples: &[ValSample<'_>]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (source, variables) in per_source(samples) {
        let core = if variables.iter().any(|(name, _)| *name == "acc") {
            "acc"
        } else {
            "reward"
        };
        for (name, metrics) in variables {
            let n_max = metrics
                .keys()
                .filter_map(|m| {
                    m.split('@')
                        .nth(1)?
                        .split('/')
                        .next()?
                        .parse::<usize>()
                        .ok()
                })
                .max()
                .unwrap_or(1);
            for (metric, value) in metrics {
                let headline = ["mean", "maj", "best"]
                    .iter()
                    .any(|p| metric.starts_with(p));
                let section = if name == core && headline && metric.contains(&format!("@{n_max}")) {
                    "val-core"
                } else {
                    "val-aux"
                };
                out.insert(format!("{section}/{source}/{name}/{metric}"), value);
            }
        }
    }
    out
}

/// Each source's variables (in order of first appearance) and their metrics, averaged over
/// the source's prompts.
#[allow(clippy::type_complexity)]
fn per_source<'a>(
    samples: &[ValSample<'a>],
) -> Vec<(&'a str, Vec<(&'a str, BTreeMap<String, f64>)>)> {
    // source -> prompt -> responses, in order of first appearance (verl's dicts).
    let mut sources: Vec<(&str, Vec<(usize, Vec<&ValSample<'a>>)>)> = Vec::new();
    // Where each source and each (source, prompt) sits in those lists: one lookup a sample,
    // not a scan (a validation set holds thousands of prompts).
    let mut source_at: HashMap<&str, usize> = HashMap::new();
    let mut prompt_at: HashMap<(&str, usize), usize> = HashMap::new();
    for s in samples {
        let at = *source_at.entry(s.source).or_insert_with(|| {
            sources.push((s.source, Vec::new()));
            sources.len() - 1
        });
        let prompts = &mut sources[at].1;
        let p = *prompt_at.entry((s.source, s.prompt)).or_insert_with(|| {
            prompts.push((s.prompt, Vec::new()));
            prompts.len() - 1
        });
        prompts[p].1.push(s);
    }
    sources
        .into_iter()
        .map(|(source, prompts)| {
            // variable -> metric -> one value per prompt
            let mut per_var: Vec<(&str, BTreeMap<String, Vec<f64>>)> = Vec::new();
            for (_, responses) in &prompts {
                for (name, metrics) in prompt_metrics(responses) {
                    let at = match per_var.iter().position(|(n, _)| *n == name) {
                        Some(i) => i,
                        None => {
                            per_var.push((name, BTreeMap::new()));
                            per_var.len() - 1
                        }
                    };
                    for (metric, value) in metrics {
                        per_var[at].1.entry(metric).or_default().push(value);
                    }
                }
            }
            let variables = per_var
                .into_iter()
                .map(|(name, metrics)| {
                    let means = metrics.into_iter().map(|(m, v)| (m, mean(&v))).collect();
                    (name, means)
                })
                .collect();
            (source, variables)
        })
        .collect()
}

/// One prompt's metrics per variable.
fn prompt_metrics<'a>(responses: &[&ValSample<'a>]) -> Vec<(&'a str, BTreeMap<String, f64>)> {
    let mut names: Vec<&str> = Vec::new();
    for r in responses {
        for (name, _) in &r.values {
            if !names.contains(name) {
                names.push(name);
            }
        }
    }
    let preds: Vec<Option<&str>> = responses.iter().map(|r| r.pred).collect();
    let has_pred = preds.iter().any(Option::is_some);
    names
        .into_iter()
        .map(|name| {
            let values: Vec<f64> = responses
                .iter()
                .filter_map(|r| r.values.iter().find(|(n, _)| *n == name).map(|(_, v)| *v))
                .collect();
            let n = values.len();
            let mut m = BTreeMap::new();
            m.insert(format!("mean@{n}"), mean(&values));
            if n > 1 {
                m.insert(format!("std@{n}"), std(&values));
                for k in subset_sizes(n) {
                    let [(best_mean, best_std), (worst_mean, worst_std)] = bootstrap(
                        n,
                        k,
                        [&|idx: &[usize]| best(&values, idx), &|idx: &[usize]| {
                            worst(&values, idx)
                        }],
                    );
                    m.insert(format!("best@{k}/mean"), best_mean);
                    m.insert(format!("best@{k}/std"), best_std);
                    m.insert(format!("worst@{k}/mean"), worst_mean);
                    m.insert(format!("worst@{k}/std"), worst_std);
                    if has_pred && preds.len() == n {
                        let [(maj_mean, maj_std)] =
                            bootstrap(n, k, [&|idx: &[usize]| majority(&values, &preds, idx)]);
                        m.insert(format!("maj@{k}/mean"), maj_mean);
                        m.insert(format!("maj@{k}/std"), maj_std);
                    }
                }
            }
            (name, m)
        })
        .collect()
}

/// verl's subset sizes for N responses: 2, 4, 8, … below N, then N (none for N = 1).
pub fn subset_sizes(n: usize) -> Vec<usize> {
    if n <= 1 {
        return Vec::new();
    }
    let mut sizes: Vec<usize> = std::iter::successors(Some(2usize), |k| Some(k * 2))
        .take_while(|&k| k < n)
        .collect();
    sizes.push(n);
    sizes
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// numpy's `np.std` (population: divides by the count).
fn std(values: &[f64]) -> f64 {
    let m = mean(values);
    mean(&values.iter().map(|v| (v - m) * (v - m)).collect::<Vec<_>>()).sqrt()
}

fn best(values: &[f64], idx: &[usize]) -> f64 {
    idx.iter()
        .map(|&i| values[i])
        .fold(f64::NEG_INFINITY, f64::max)
}

fn worst(values: &[f64], idx: &[usize]) -> f64 {
    idx.iter().map(|&i| values[i]).fold(f64::INFINITY, f64::min)
}

/// verl's `calc_maj_val`: the value of the first response giving the answer most responses
/// give (ties: the answer seen first).
fn majority(values: &[f64], preds: &[Option<&str>], idx: &[usize]) -> f64 {
    // (answer, count, first value), in order of first appearance.
    let mut votes: Vec<(Option<&str>, usize, f64)> = Vec::new();
    for &i in idx {
        match votes.iter_mut().find(|(p, _, _)| *p == preds[i]) {
            Some(v) => v.1 += 1,
            None => votes.push((preds[i], 1, values[i])),
        }
    }
    let top = votes.iter().map(|v| v.1).max().unwrap_or(0);
    votes.iter().find(|v| v.1 == top).map_or(f64::NAN, |v| v.2)
}

/// A statistic of a subset of the responses, given their indices.
type Reduce<'f> = &'f dyn Fn(&[usize]) -> f64;

/// verl's `bootstrap_metric` over the indices `0..n`: `BOOTSTRAP_SAMPLES` subsets of `k`
/// indices drawn with replacement (numpy's draws after seeding with 42), each reduced by every
/// function; each function's mean and (population) standard deviation over the subsets.
fn bootstrap<const F: usize>(n: usize, k: usize, reduce: [Reduce<'_>; F]) -> [(f64, f64); F] {
    let mut rng = NumpyLegacyRandom::seeded(BOOTSTRAP_SEED);
    let draws: Vec<Vec<usize>> = (0..BOOTSTRAP_SAMPLES)
        .map(|_| (0..k).map(|_| rng.below(n as u32) as usize).collect())
        .collect();
    reduce.map(|f| {
        let results: Vec<f64> = draws.iter().map(|idx| f(idx)).collect();
        (mean(&results), std(&results))
    })
}

/// numpy's legacy `RandomState(seed).shuffle(items)` (Fisher–Yates from the end, each swap
/// partner a masked draw from `0..=i`): the order verl's validation-generation sample takes.
pub fn numpy_shuffle<T>(items: &mut [T], seed: u32) {
    let mut rng = NumpyLegacyRandom::seeded(seed);
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u32 + 1) as usize;
        items.swap(i, j);
    }
}

/// The validation samples verl's `trainer.log_val_generations = n` logs: every
/// `(input, output, score)` sorted by input, shuffled as numpy's `RandomState(42)` shuffles
/// them, the first `n`.
pub fn generations_to_log(
    mut samples: Vec<(String, String, f64)>,
    n: usize,
) -> Vec<(String, String, f64)> {
    samples.sort_by(|a, b| a.0.cmp(&b.0));
    numpy_shuffle(&mut samples, BOOTSTRAP_SEED);
    samples.truncate(n);
    samples
}

/// numpy's legacy `RandomState` as `np.random.seed(s)` leaves it, for `randint` /
/// `choice(n, replace=True)`: 32-bit MT19937 words, each bounded draw masked to the range's
/// bit width and redrawn until it falls inside (`random_bounded_uint64_fill`, masked).
pub struct NumpyLegacyRandom(rand_mt::Mt);

impl NumpyLegacyRandom {
    pub fn seeded(seed: u32) -> Self {
        Self(rand_mt::Mt::new(seed))
    }

    /// A draw from `0..n` (`n` ≥ 1).
    pub fn below(&mut self, n: u32) -> u32 {
        let max = n.saturating_sub(1);
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16] {
            mask |= mask >> shift;
        }
        loop {
            let v = self.0.next_u32() & mask;
            if v <= max {
                return v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `np.random.seed(42); np.random.choice(4, size=(2, 4))` and `choice(3, size=(2, 3))`.
    #[test]
    fn draws_are_numpys() {
        let mut r = NumpyLegacyRandom::seeded(42);
        let got: Vec<u32> = (0..8).map(|_| r.below(4)).collect();
        assert_eq!(got, [2, 3, 0, 2, 2, 3, 0, 0]);
        let mut r = NumpyLegacyRandom::seeded(42);
        let got: Vec<u32> = (0..6).map(|_| r.below(3)).collect();
        assert_eq!(got, [2, 0, 2, 2, 0, 0]);
    }

    /// `x = list(range(10)); np.random.RandomState(42).shuffle(x)`, and the sample verl logs.
    #[test]
    fn shuffles_are_numpys() {
        let mut x: Vec<u32> = (0..10).collect();
        numpy_shuffle(&mut x, 42);
        assert_eq!(x, [8, 1, 5, 0, 7, 2, 9, 4, 3, 6]);
        let samples: Vec<(String, String, f64)> = (0..10)
            .rev()
            .map(|i| (format!("q{i}"), format!("a{i}"), i as f64))
            .collect();
        let picked = generations_to_log(samples, 3);
        let inputs: Vec<&str> = picked.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(inputs, ["q8", "q1", "q5"]);
    }

    #[test]
    fn subset_sizes_are_verls() {
        assert!(subset_sizes(1).is_empty());
        assert_eq!(subset_sizes(2), [2]);
        assert_eq!(subset_sizes(3), [2, 3]);
        assert_eq!(subset_sizes(8), [2, 4, 8]);
        assert_eq!(subset_sizes(12), [2, 4, 8, 12]);
    }

    /// Two sources: "a" with two prompts of four responses reporting `acc` and a `pred`, "b"
    /// with one prompt of three responses and the reward only. Every figure as verl's
    /// `process_validation_metrics` computed it under numpy 2.4 (and its sections as verl's
    /// trainer names them).
    #[test]
    fn figures_and_sections_are_verls() {
        let reward = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 0.0, 1.0, 0.3, 0.9, 0.1];
        let acc = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
        let pred = ["7", "3", "3", "7", "1", "2", "2", "5"];
        let samples: Vec<ValSample<'_>> = (0..11)
            .map(|i| ValSample {
                source: if i < 8 { "a" } else { "b" },
                prompt: i / 4,
                values: if i < 8 {
                    vec![("reward", reward[i]), ("acc", acc[i])]
                } else {
                    vec![("reward", reward[i])]
                },
                pred: pred.get(i).copied(),
            })
            .collect();
        let m = validation_metrics(&samples);
        let want: &[(&str, f64)] = &[
            ("val-core/a/acc/best@4/mean", 0.8055000000000001),
            ("val-core/a/acc/best@4/std", 0.3631433846049895),
            ("val-aux/a/acc/best@2/mean", 0.587),
            ("val-aux/a/acc/best@2/std", 0.467804861887568),
            ("val-core/a/acc/maj@4/mean", 0.353),
            ("val-core/a/acc/maj@4/std", 0.4468385187859255),
            ("val-aux/a/acc/maj@2/mean", 0.386),
            ("val-aux/a/acc/maj@2/std", 0.46626423370459236),
            ("val-core/a/acc/mean@4", 0.375),
            ("val-aux/a/acc/std@4", 0.46650635094610965),
            ("val-aux/a/acc/worst@2/mean", 0.1665),
            ("val-aux/a/acc/worst@2/std", 0.33799682748026033),
            ("val-aux/a/acc/worst@4/mean", 0.043000000000000003),
            ("val-aux/a/acc/worst@4/std", 0.1687418280582031),
            ("val-aux/a/reward/best@2/mean", 0.6775),
            ("val-aux/a/reward/best@2/std", 0.36292714363168777),
            ("val-aux/a/reward/best@4/mean", 0.8556250000000001),
            ("val-aux/a/reward/best@4/std", 0.2558595422652157),
            ("val-aux/a/reward/maj@2/mean", 0.475875),
            ("val-aux/a/reward/maj@2/std", 0.41147334964854504),
            ("val-aux/a/reward/maj@4/mean", 0.44825000000000004),
            ("val-aux/a/reward/maj@4/std", 0.39756376532386617),
            ("val-aux/a/reward/mean@4", 0.46875),
            ("val-aux/a/reward/std@4", 0.41220900328165),
            ("val-aux/a/reward/worst@2/mean", 0.260375),
            ("val-aux/a/reward/worst@2/std", 0.32583163706768836),
            ("val-aux/a/reward/worst@4/mean", 0.11174999999999999),
            ("val-aux/a/reward/worst@4/std", 0.20166645758001348),
            ("val-aux/b/reward/best@2/mean", 0.6054),
            ("val-aux/b/reward/best@2/std", 0.3274917403538599),
            ("val-core/b/reward/best@3/mean", 0.7142000000000002),
            ("val-core/b/reward/best@3/std", 0.28649321108884934),
            ("val-core/b/reward/mean@3", 0.43333333333333335),
            ("val-aux/b/reward/std@3", 0.33993463423951903),
            ("val-aux/b/reward/worst@2/mean", 0.2596),
            ("val-aux/b/reward/worst@2/std", 0.24732132944814933),
            ("val-aux/b/reward/worst@3/mean", 0.1902),
            ("val-aux/b/reward/worst@3/std", 0.1788405994174701),
        ];
        assert_eq!(m.len(), want.len(), "{m:#?}");
        for (name, value) in want {
            let got = m
                .get(*name)
                .unwrap_or_else(|| panic!("{name} missing: {m:#?}"));
            assert!((got - value).abs() <= 1e-12, "{name}: {got} vs {value}");
        }
    }

    /// One response per prompt: only `mean@1`, in the core section.
    #[test]
    fn a_single_response_reports_its_mean_only() {
        let samples: Vec<ValSample<'_>> = [0.0, 1.0, 1.0]
            .iter()
            .enumerate()
            .map(|(prompt, &r)| ValSample {
                source: "s",
                prompt,
                values: vec![("reward", r)],
                pred: None,
            })
            .collect();
        let m = validation_metrics(&samples);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!((m["val-core/s/reward/mean@1"] - 2.0 / 3.0).abs() < 1e-15);
    }
}

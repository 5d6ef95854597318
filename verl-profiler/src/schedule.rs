//! Which training steps a profiler captures, as verl's trainer decides it: a capture per listed
//! step, or with `profile_continuous_steps` one capture per run of consecutive listed steps.

use std::collections::BTreeSet;
use std::ops::RangeInclusive;

/// The steps of `global_profiler.steps` and how they group into captures.
///
/// ```
/// use verl_profiler::CapturePlan;
/// let plan = CapturePlan::new(&[1, 2, 5], true);
/// assert_eq!(plan.captures(), vec![1..=2, 5..=5]);
/// assert!(plan.starts_at(1) && !plan.starts_at(2) && plan.stops_after(2));
/// let each = CapturePlan::new(&[1, 2, 5], false);
/// assert_eq!(each.captures().len(), 3);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapturePlan {
    steps: BTreeSet<u64>,
    continuous: bool,
}

impl CapturePlan {
    pub fn new(steps: &[u64], continuous: bool) -> Self {
        Self {
            steps: steps.iter().copied().collect(),
            continuous,
        }
    }

    /// Whether `step` is profiled at all.
    pub fn profiles(&self, step: u64) -> bool {
        self.steps.contains(&step)
    }

    /// Whether a capture begins before `step` (verl: this step is profiled and, in continuous
    /// mode, the previous one was not).
    pub fn starts_at(&self, step: u64) -> bool {
        self.profiles(step) && !(self.continuous && step > 0 && self.profiles(step - 1))
    }

    /// Whether the capture ends after `step` (this step is profiled and, in continuous mode,
    /// the next one is not).
    pub fn stops_after(&self, step: u64) -> bool {
        self.profiles(step) && !(self.continuous && self.profiles(step + 1))
    }

    /// Every capture's steps, in order.
    pub fn captures(&self) -> Vec<RangeInclusive<u64>> {
        let mut out: Vec<RangeInclusive<u64>> = Vec::new();
        for &s in &self.steps {
            match out.last_mut() {
                Some(r) if self.continuous && *r.end() + 1 == s => *r = *r.start()..=s,
                _ => out.push(s..=s),
            }
        }
        out
    }

    /// The name a capture of `steps` goes by in file names: `step3` or `step3-5`.
    pub fn label(steps: &RangeInclusive<u64>) -> String {
        if steps.start() == steps.end() {
            format!("step{}", steps.start())
        } else {
            format!("step{}-{}", steps.start(), steps.end())
        }
    }
}

/// Whether a role's profiler covers `rank` (verl: `enable`, then `all_ranks` or `ranks`).
pub fn covers_rank(enable: bool, all_ranks: bool, ranks: &[usize], rank: usize) -> bool {
    enable && (all_ranks || ranks.contains(&rank))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Starts and stops pair up into exactly the planned captures, walking the steps as
        /// the trainer does; every profiled step lies in one capture, no other step does.
        #[test]
        fn starts_and_stops_walk_the_captures(
            steps in prop::collection::vec(1u64..40, 0..12),
            continuous in any::<bool>(),
        ) {
            let plan = CapturePlan::new(&steps, continuous);
            let mut walked = Vec::new();
            let mut open: Option<u64> = None;
            for step in 1..=45 {
                if plan.starts_at(step) {
                    prop_assert!(open.is_none());
                    open = Some(step);
                }
                prop_assert_eq!(open.is_some(), plan.profiles(step));
                if plan.stops_after(step) {
                    let start = open.take().expect("a stop follows a start");
                    walked.push(start..=step);
                }
            }
            prop_assert!(open.is_none());
            prop_assert_eq!(&walked, &plan.captures());
            let covered: usize = walked.iter().map(|r| (r.end() - r.start() + 1) as usize).sum();
            let distinct: BTreeSet<u64> = steps.iter().copied().collect();
            prop_assert_eq!(covered, distinct.len());
            if !continuous {
                prop_assert_eq!(walked.len(), distinct.len());
            }
        }
    }

    #[test]
    fn ranks_are_chosen_as_verl_does() {
        assert!(!covers_rank(false, true, &[], 0));
        assert!(covers_rank(true, true, &[], 3));
        assert!(covers_rank(true, false, &[0, 2], 2));
        assert!(!covers_rank(true, false, &[0, 2], 1));
        assert_eq!(CapturePlan::label(&(4..=4)), "step4");
        assert_eq!(CapturePlan::label(&(4..=6)), "step4-6");
    }
}

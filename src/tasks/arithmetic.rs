//! Multi-digit addition, `"47+38="` → `"85"`: the synthetic task `verl train` learns by default.
//!
//! Verifiable (exact match), cheap to generate, hard enough that a tiny model trained from
//! scratch gets it only partly right after a short supervised warm-up, so RL has room to help.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A character-level tokenizer: id 0 is padding, 1 is EOS, then one id per character.
#[derive(Debug, Clone, PartialEq)]
pub struct CharTokenizer {
    chars: Vec<char>,
}

impl CharTokenizer {
    pub const PAD: u32 = 0;
    pub const EOS: u32 = 1;

    /// Digits, `+`, `-`, `*`, `=` and space.
    pub fn arithmetic() -> Self {
        Self {
            chars: "0123456789+-*= ".chars().collect(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.chars.len() + 2
    }

    /// Ids of `text`; a character outside the alphabet is an error naming it.
    ///
    /// ```
    /// use verl::tasks::CharTokenizer;
    /// let tok = CharTokenizer::arithmetic();
    /// let ids = tok.encode("12+7=")?;
    /// assert_eq!(tok.decode(&ids), "12+7=");
    /// # Ok::<(), String>(())
    /// ```
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        text.chars()
            .map(|c| {
                self.chars
                    .iter()
                    .position(|&x| x == c)
                    .map(|i| i as u32 + 2)
                    .ok_or_else(|| format!("character {c:?} is not in the tokenizer's alphabet"))
            })
            .collect()
    }

    /// Text of `ids` up to the first EOS, padding skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .take_while(|&&t| t != Self::EOS)
            .filter(|&&t| t >= 2)
            .filter_map(|&t| self.chars.get(t as usize - 2))
            .collect()
    }
}

/// One problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub prompt: String,
    pub answer: String,
}

/// Addition of two numbers of 1..=`digits` digits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArithmeticTask {
    pub digits: u32,
}

impl ArithmeticTask {
    pub const DATA_SOURCE: &'static str = "verl_rs/arithmetic";

    /// The task a `data.train_files` value names: `builtin:addition` (2 digits) or
    /// `builtin:addition:<digits>`.
    ///
    /// ```
    /// use verl::tasks::ArithmeticTask;
    /// assert_eq!(ArithmeticTask::from_spec("builtin:addition:3")?.digits, 3);
    /// assert!(ArithmeticTask::from_spec("builtin:sorting").is_err());
    /// # Ok::<(), String>(())
    /// ```
    pub fn from_spec(spec: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "data.train_files = {spec:?}: the built-in tasks are `builtin:addition` and \
                 `builtin:addition:<digits>` (1 to 9 digits)"
            )
        };
        let rest = spec.strip_prefix("builtin:addition").ok_or_else(bad)?;
        let digits = match rest {
            "" => 2,
            r => r
                .strip_prefix(':')
                .and_then(|d| d.parse().ok())
                .filter(|d| (1..=9).contains(d))
                .ok_or_else(bad)?,
        };
        Ok(Self { digits })
    }

    /// `count` problems drawn with `seed` (train and validation sets use different seeds).
    pub fn problems(&self, count: usize, seed: u64) -> Vec<Problem> {
        let mut rng = StdRng::seed_from_u64(seed);
        let max = 10u64.pow(self.digits);
        (0..count)
            .map(|_| {
                let (a, b) = (rng.random_range(0..max), rng.random_range(0..max));
                Problem {
                    prompt: format!("{a}+{b}="),
                    answer: (a + b).to_string(),
                }
            })
            .collect()
    }

    /// 1 for the exact answer (surrounding spaces ignored), 0 otherwise.
    ///
    /// ```
    /// use verl::tasks::ArithmeticTask;
    /// assert_eq!(ArithmeticTask::score("85", "85"), 1.0);
    /// assert_eq!(ArithmeticTask::score("86", "85"), 0.0);
    /// assert_eq!(ArithmeticTask::score("", "85"), 0.0);
    /// ```
    pub fn score(solution: &str, ground_truth: &str) -> f64 {
        if solution.trim() == ground_truth.trim() {
            1.0
        } else {
            0.0
        }
    }
}

impl verl_rollout::Detokenizer for CharTokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        CharTokenizer::decode(self, ids)
    }
}

//! Stop strings: a response ends at the token that completes one of them (vLLM's `stop`).
//!
//! The engine works in token ids, so stop strings need the text of the tokens: a
//! [`Detokenizer`] (the model's tokenizer; [`verl_megatron::hf::HfTokenizer`] is one). After
//! each new token the tail of the response is decoded with and without it; a stop string found
//! in the first and not in the second was completed by that token. The tail is a few tokens
//! longer than the longest stop string has characters, so a string split over tokens (or a
//! character split over byte-level tokens) is still seen whole. As with stop ids, the
//! completing token is kept as the response's last token: the policy is trained on what it
//! generated.

use std::sync::Arc;

/// Token ids to text, for matching stop strings.
pub trait Detokenizer: Send + Sync {
    /// The text of `ids` (special tokens skipped).
    fn decode(&self, ids: &[u32]) -> String;
}

impl Detokenizer for verl_megatron::hf::HfTokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        // A failed decode (an id outside the vocabulary) matches no stop string.
        verl_megatron::hf::HfTokenizer::decode(self, ids).unwrap_or_default()
    }
}

/// Extra tokens decoded beyond the longest stop string's length in characters: room for
/// characters split over several byte-level tokens.
const SLACK_TOKENS: usize = 4;

/// The stop strings of an engine, with the detokenizer that reads them.
#[derive(Clone)]
pub struct StopStrings {
    strings: Vec<String>,
    detokenizer: Arc<dyn Detokenizer>,
    /// Tokens decoded per check.
    window: usize,
}

impl StopStrings {
    /// `None` when there is no stop string.
    pub fn new(strings: &[String], detokenizer: Arc<dyn Detokenizer>) -> Option<Self> {
        let longest = strings.iter().map(|s| s.chars().count()).max()?;
        Some(Self {
            strings: strings.to_vec(),
            detokenizer,
            window: longest + SLACK_TOKENS,
        })
    }

    /// Whether the last token of `tokens` completes a stop string.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use verl_rollout::stop::{Detokenizer, StopStrings};
    /// // Each id is one letter: 0 = 'a', 1 = 'b', ...
    /// struct Letters;
    /// impl Detokenizer for Letters {
    ///     fn decode(&self, ids: &[u32]) -> String {
    ///         ids.iter().map(|&i| char::from(b'a' + i as u8)).collect()
    ///     }
    /// }
    /// let stop = StopStrings::new(&["cd".to_string()], Arc::new(Letters)).unwrap();
    /// assert!(!stop.completed_by_last(&[0, 2])); // "ac"
    /// assert!(stop.completed_by_last(&[0, 2, 3])); // "acd"
    /// assert!(!stop.completed_by_last(&[0, 2, 3, 4])); // "acde": completed earlier
    /// ```
    pub fn completed_by_last(&self, tokens: &[u32]) -> bool {
        let Some(last) = tokens.len().checked_sub(1) else {
            return false;
        };
        let start = tokens.len().saturating_sub(self.window);
        let with = self.detokenizer.decode(&tokens[start..]);
        if !self.strings.iter().any(|s| with.contains(s.as_str())) {
            return false;
        }
        let without = self.detokenizer.decode(&tokens[start..last]);
        self.strings
            .iter()
            .any(|s| with.contains(s.as_str()) && !without.contains(s.as_str()))
    }
}

impl std::fmt::Debug for StopStrings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopStrings")
            .field("strings", &self.strings)
            .field("window", &self.window)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    struct Letters;
    impl Detokenizer for Letters {
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter()
                .map(|&i| char::from(b'a' + (i % 26) as u8))
                .collect()
        }
    }

    /// Two-letter tokens: a stop string can start in the middle of one.
    struct Pairs;
    impl Detokenizer for Pairs {
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter()
                .flat_map(|&i| {
                    [
                        char::from(b'a' + (i % 26) as u8),
                        char::from(b'a' + (i / 26 % 26) as u8),
                    ]
                })
                .collect()
        }
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// It first fires at the first token whose prefix text contains the stop string: the
        /// same as searching every prefix's whole text.
        #[test]
        fn fires_exactly_where_the_whole_text_first_contains_a_stop_string(
            tokens in proptest::collection::vec(0u32..676, 1..40),
            stop in "[a-e]{1,3}",
            pairs in any::<bool>(),
        ) {
            let detok: Arc<dyn Detokenizer> = if pairs { Arc::new(Pairs) } else { Arc::new(Letters) };
            let s = StopStrings::new(std::slice::from_ref(&stop), detok.clone()).unwrap();
            let first = (1..=tokens.len()).find(|&n| detok.decode(&tokens[..n]).contains(&stop));
            let fired = (1..=tokens.len()).find(|&n| s.completed_by_last(&tokens[..n]));
            prop_assert_eq!(fired, first);
        }
    }

    #[test]
    fn no_strings_no_checker() {
        assert!(StopStrings::new(&[], Arc::new(Letters)).is_none());
    }
}

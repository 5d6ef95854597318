//! Prefixes kept in the KV cache's slots after their requests finish, for later requests that
//! start with the same tokens: vLLM's automatic prefix caching, on the engine's slots instead of
//! pages.
//!
//! A finished request leaves its keys and values in its slot: the prompt and every response
//! token but the last, which was sampled and never fed. A request admitted to that slot whose
//! prompt starts with some of those tokens keeps them and prefills only the rest, as a chunked
//! prefill continues from a position. Later samples of a prompt that waited for a slot reuse a
//! finished sibling's prompt, and a multi-turn continuation (the last turn's prompt, response
//! and the next user or tool message) reuses the whole conversation so far. The engine forgets
//! every prefix when the weights change or the cache is allocated anew.

/// What a slot holds after its request finished.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    /// The tokens whose keys and values are cached at positions `0..tokens.len()`.
    tokens: Vec<u32>,
    /// When the request finished (larger is more recent): the oldest is given up first.
    stamp: u64,
}

/// The prefixes held by the slots of one cache, by slot.
///
/// ```
/// use verl_rollout::prefix_cache::SlotPrefixes;
/// let mut held = SlotPrefixes::new(2);
/// held.record(1, vec![5, 6, 7, 8]);
/// // A prompt that continues slot 1's tokens keeps all four.
/// assert_eq!(held.choose(&[0, 1], &[5, 6, 7, 8, 9]), (1, 4));
/// // One that diverges after two keeps two; one that shares nothing takes the empty slot.
/// assert_eq!(held.choose(&[0, 1], &[5, 6, 0]), (1, 2));
/// assert_eq!(held.choose(&[0, 1], &[9]), (0, 0));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotPrefixes {
    held: Vec<Option<Held>>,
    clock: u64,
}

/// Tokens `a` and `b` share from their start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SlotPrefixes {
    /// No prefix held, for a cache of `slots` slots.
    pub fn new(slots: usize) -> Self {
        Self {
            held: vec![None; slots],
            clock: 0,
        }
    }

    /// Slots tracked.
    pub fn slots(&self) -> usize {
        self.held.len()
    }

    /// Forgets every prefix (the weights changed, or the cache was allocated anew).
    pub fn clear(&mut self) {
        self.held.iter_mut().for_each(|h| *h = None);
    }

    /// Follows the cache when it keeps only `rows` (in that order): slot `i` of the smaller
    /// cache is old slot `rows[i]`; the others' prefixes are gone with them.
    pub fn keep(&mut self, rows: &[usize]) {
        self.held = rows
            .iter()
            .map(|&r| self.held.get_mut(r).and_then(Option::take))
            .collect();
    }

    /// Slot `slot`'s request finished with `tokens` cached (its prompt and every response
    /// token but the last).
    pub fn record(&mut self, slot: usize, tokens: Vec<u32>) {
        self.clock += 1;
        if let Some(h) = self.held.get_mut(slot) {
            *h = Some(Held {
                tokens,
                stamp: self.clock,
            });
        }
    }

    /// Slot `slot` was given to a request: whatever it held is being overwritten.
    pub fn take(&mut self, slot: usize) {
        if let Some(h) = self.held.get_mut(slot) {
            *h = None;
        }
    }

    /// Tokens slot `slot` holds (0 when none). A decode step writes an idle slot's row at this
    /// position, past what it holds, so the prefix survives steps it sits out.
    pub fn held_len(&self, slot: usize) -> usize {
        self.held
            .get(slot)
            .and_then(Option::as_ref)
            .map_or(0, |h| h.tokens.len())
    }

    /// The free slot (`free`, not empty) for a request with `prompt`, and how many of the
    /// prompt's tokens that slot already holds: the slot holding the longest common prefix
    /// (ties to the earlier in `free`), at most `prompt.len() - 1` tokens so the last prompt
    /// token is fed and gives the first logits. With no common prefix, a slot holding nothing,
    /// else the one whose request finished longest ago.
    pub fn choose(&self, free: &[usize], prompt: &[u32]) -> (usize, usize) {
        let usable = prompt.len().saturating_sub(1);
        let mut best = (free[0], 0);
        for &slot in free {
            let Some(h) = self.held.get(slot).and_then(Option::as_ref) else {
                continue;
            };
            let shared = common_prefix(&h.tokens, prompt).min(usable);
            if shared > best.1 {
                best = (slot, shared);
            }
        }
        if best.1 > 0 {
            return best;
        }
        let age = |slot: usize| {
            self.held
                .get(slot)
                .and_then(Option::as_ref)
                .map_or(0, |h| h.stamp)
        };
        let slot = free
            .iter()
            .copied()
            .min_by_key(|&s| age(s))
            .expect("choose is given a free slot");
        (slot, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_finished_sequence_serves_its_continuations() {
        let mut p = SlotPrefixes::new(3);
        p.record(2, vec![1, 2, 3]);
        assert_eq!(p.held_len(2), 3);
        assert_eq!(p.choose(&[0, 1, 2], &[1, 2, 3, 4, 5]), (2, 3));
        // The whole prompt held: all but its last token are kept.
        assert_eq!(p.choose(&[0, 1, 2], &[1, 2, 3]), (2, 2));
        // Given to a request, the slot holds nothing any more.
        p.take(2);
        assert_eq!(p.held_len(2), 0);
        assert_eq!(p.choose(&[2], &[1, 2, 3, 4]), (2, 0));
    }

    #[test]
    fn without_a_match_the_empty_then_the_oldest_slot_is_given_up() {
        let mut p = SlotPrefixes::new(3);
        p.record(0, vec![7, 7]);
        p.record(1, vec![8, 8]);
        assert_eq!(p.choose(&[0, 1, 2], &[9, 9]), (2, 0));
        assert_eq!(p.choose(&[0, 1], &[9, 9]), (0, 0));
        p.record(0, vec![7, 7, 7]);
        assert_eq!(p.choose(&[0, 1], &[9, 9]), (1, 0));
    }

    #[test]
    fn keeping_rows_follows_the_cache_and_clear_forgets() {
        let mut p = SlotPrefixes::new(4);
        p.record(1, vec![1]);
        p.record(3, vec![3, 3]);
        p.keep(&[3, 0]);
        assert_eq!(p.slots(), 2);
        assert_eq!((p.held_len(0), p.held_len(1)), (2, 0));
        p.clear();
        assert_eq!(p.held_len(0), 0);
    }

    proptest! {
        /// The chosen slot is free; what it keeps is a true common prefix, shorter than the
        /// prompt, and no free slot holds a longer usable one.
        #[test]
        fn the_choice_keeps_the_longest_true_prefix(
            held in proptest::collection::vec(
                proptest::option::of(proptest::collection::vec(0u32..3, 0..8)), 1..6),
            prompt in proptest::collection::vec(0u32..3, 1..10),
            free_mask in proptest::collection::vec(any::<bool>(), 6),
        ) {
            let mut p = SlotPrefixes::new(held.len());
            for (slot, tokens) in held.iter().enumerate() {
                if let Some(t) = tokens {
                    p.record(slot, t.clone());
                }
            }
            let mut free: Vec<usize> =
                (0..held.len()).filter(|&s| free_mask[s]).collect();
            if free.is_empty() {
                free.push(0);
            }
            let (slot, kept) = p.choose(&free, &prompt);
            prop_assert!(free.contains(&slot));
            prop_assert!(kept < prompt.len());
            let tokens = held[slot].clone().unwrap_or_default();
            prop_assert!(kept <= tokens.len() && tokens[..kept] == prompt[..kept]);
            for &s in &free {
                let other = held[s].clone().unwrap_or_default();
                prop_assert!(common_prefix(&other, &prompt).min(prompt.len() - 1) <= kept);
            }
        }
    }
}

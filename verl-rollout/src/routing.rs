//! The experts the rollout's MoE layers chose for every token it cached, by slot and
//! position (router replay R3, verl's `rollout.enable_rollout_routing_replay`): the actor's
//! forwards then route each token as the rollout that sampled it did, so the rollout and
//! training compute the same experts' mixture and their log-probs differ only by kernels.
//!
//! A slot's positions are written as its prompt is prefilled (whole, shared by the samples of
//! one prompt, or in chunks continuing a kept prefix) and as each decode step feeds a token;
//! a finished request's routing is its slot's first `prompt + fed` positions. A kept prefix
//! keeps its routing with its keys and values, so a request resuming from it has all of its
//! positions.

use verl_megatron::models::router_replay::Routing;

/// Per slot, `[position][layer][k]` expert ids (-1 where not recorded: a layer without
/// experts, or a position not fed yet).
#[derive(Debug, Clone)]
pub struct SlotRouting {
    layers: usize,
    k: usize,
    slots: Vec<Vec<i64>>,
}

impl SlotRouting {
    /// Nothing recorded for `slots` slots of a model with `layers` layers routing `k` experts
    /// per token.
    pub fn new(slots: usize, layers: usize, k: usize) -> Self {
        Self {
            layers,
            k,
            slots: vec![Vec::new(); slots],
        }
    }

    /// `(layers, k)`: a position's routing is `layers · k` ids.
    pub fn shape(&self) -> (usize, usize) {
        (self.layers, self.k)
    }

    /// How many slots it tracks.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    fn per_position(&self) -> usize {
        self.layers * self.k
    }

    /// Forgets `slot`'s positions from `len` on (they are about to be written anew).
    pub fn truncate(&mut self, slot: usize, len: usize) {
        let keep = len * self.per_position();
        self.slots[slot].truncate(keep);
    }

    /// Keeps what one forward recorded (`routing`: per layer, `[tokens, k]` in the forward's
    /// token order): token `i` goes to every `(slot, position)` of `targets[i]` (none for
    /// padding or an idle row).
    ///
    /// # Panics
    /// If a layer's list is not `targets.len() · k` ids or names a layer past the model's.
    pub fn record(&mut self, routing: &Routing, targets: &[Vec<(usize, usize)>]) {
        let (k, per) = (self.k, self.per_position());
        for (&layer, chosen) in &routing.layers {
            assert!(
                layer < self.layers,
                "routing of layer {layer} of {}",
                self.layers
            );
            assert_eq!(
                chosen.len(),
                targets.len() * k,
                "layer {layer}: {} ids for {} tokens of top-{k}",
                chosen.len(),
                targets.len()
            );
            for (ids, places) in chosen.chunks(k).zip(targets) {
                for &(slot, pos) in places {
                    let buf = &mut self.slots[slot];
                    if buf.len() < (pos + 1) * per {
                        buf.resize((pos + 1) * per, -1);
                    }
                    let at = pos * per + layer * k;
                    buf[at..at + k].copy_from_slice(ids);
                }
            }
        }
    }

    /// `slot`'s first `len` positions, `[len][layer][k]` (-1 where none was recorded).
    pub fn positions(&self, slot: usize, len: usize) -> Vec<i64> {
        let per = self.per_position();
        let mut out = vec![-1; len * per];
        let have = self.slots[slot].len().min(len * per);
        out[..have].copy_from_slice(&self.slots[slot][..have]);
        out
    }

    /// Keeps the slots `keep` (ascending), renumbered from 0, as the cache keeps them.
    pub fn keep(&mut self, keep: &[usize]) {
        self.slots = keep
            .iter()
            .map(|&s| std::mem::take(&mut self.slots[s]))
            .collect();
    }

    /// Forgets every slot's routing.
    pub fn clear(&mut self) {
        self.slots.iter_mut().for_each(Vec::clear);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn routing(layers: &[(usize, Vec<i64>)]) -> Routing {
        Routing {
            layers: layers.iter().cloned().collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn a_shared_prefill_and_a_decode_step_fill_each_slots_positions() {
        // 3 layers (layer 1 without experts), top-2, 3 slots.
        let mut r = SlotRouting::new(3, 3, 2);
        // One prompt of 2 tokens (right-padded to 3) prefilled for slots 0 and 2.
        let targets = vec![vec![(0, 0), (2, 0)], vec![(0, 1), (2, 1)], vec![]];
        r.record(
            &routing(&[(0, vec![1, 2, 3, 4, 9, 9]), (2, vec![5, 6, 7, 8, 9, 9])]),
            &targets,
        );
        // A decode step: slot 0 at position 2, slot 1 idle, slot 2 at position 2.
        let step = vec![vec![(0, 2)], vec![], vec![(2, 2)]];
        r.record(
            &routing(&[(0, vec![0, 1, 9, 9, 2, 3]), (2, vec![4, 5, 9, 9, 6, 7])]),
            &step,
        );
        assert_eq!(
            r.positions(0, 3),
            [1, 2, -1, -1, 5, 6, 3, 4, -1, -1, 7, 8, 0, 1, -1, -1, 4, 5]
        );
        assert_eq!(
            r.positions(2, 3),
            [1, 2, -1, -1, 5, 6, 3, 4, -1, -1, 7, 8, 2, 3, -1, -1, 6, 7]
        );
        // Slot 1 holds nothing; asking past what is held gives -1.
        assert!(r.positions(1, 2).iter().all(|&x| x == -1));
        assert_eq!(&r.positions(0, 4)[18..], [-1; 6]);
        // Truncating forgets the tail only; keeping renumbers.
        r.truncate(0, 1);
        assert_eq!(&r.positions(0, 2)[..6], [1, 2, -1, -1, 5, 6]);
        assert_eq!(&r.positions(0, 2)[6..], [-1; 6]);
        r.keep(&[2]);
        assert_eq!(r.slots(), 1);
        assert_eq!(r.positions(0, 3)[12..14], [2, 3]);
        r.clear();
        assert!(r.positions(0, 3).iter().all(|&x| x == -1));
    }

    #[test]
    #[should_panic(expected = "ids for")]
    fn a_routing_of_another_token_count_is_refused() {
        let mut r = SlotRouting::new(1, 1, 2);
        r.record(&routing(&[(0, vec![1, 2])]), &[vec![(0, 0)], vec![(0, 1)]]);
    }
}

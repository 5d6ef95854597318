//! Context parallelism: each sequence split over the ranks of the cp group, with Megatron's
//! causal load balancing.
//!
//! A sequence (padded to a multiple of 2·cp) is cut into 2·cp equal chunks; cp rank `i` holds
//! chunks `i` and `2·cp − 1 − i`, so every rank gets one early chunk (few keys to attend to)
//! and one late chunk (many): under a causal mask each rank does the same attention work.
//! Everything per token (embedding, norms, MLP, heads) runs on the rank's own tokens; attention
//! gathers the group's keys and values (the all-gather flavour of Megatron's cp, whose backward
//! reduce-scatters their gradients), and the outputs verl reads (log-probs, values, ...) are
//! gathered back into sequence order at the end of the model.
//!
//! ```
//! use verl_megatron::parallel::ContextSplit;
//! // 8 positions over cp = 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
//! let split = ContextSplit::new(8, 2, 0);
//! assert_eq!(split.local(), vec![0, 1, 6, 7]);
//! assert_eq!(ContextSplit::new(8, 2, 1).local(), vec![2, 3, 4, 5]);
//! assert_eq!(split.gathered_keys(), vec![0, 1, 6, 7, 2, 3, 4, 5]);
//! ```

use std::fmt;
use std::sync::Arc;

use burn::prelude::*;
use verl_core::traits::Communicator;

use super::{ParallelBackend, Region, TpGroup};

/// A rank's context-parallel group as the model holds it (single rank: every operation is the
/// identity).
#[derive(Clone, Default)]
pub struct CpGroup {
    // The region machinery is the tensor-parallel group's, on the cp communicator.
    group: TpGroup,
}

impl fmt::Debug for CpGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CpGroup(rank {} of {})",
            self.group.rank, self.group.size
        )
    }
}

impl CpGroup {
    /// No context parallelism.
    pub fn none() -> Self {
        Self::default()
    }

    /// The group of `comm` (see [`TpGroup::new`] for the backend it must be made for).
    pub fn new<B: Backend>(comm: Arc<dyn Communicator<B>>) -> Self {
        Self {
            group: TpGroup::new(comm, false),
        }
    }

    pub fn rank(&self) -> usize {
        self.group.rank
    }

    pub fn size(&self) -> usize {
        self.group.size
    }

    pub fn is_parallel(&self) -> bool {
        self.group.is_parallel()
    }

    /// The communicator, for the backend it was made for (`None` at cp = 1).
    pub fn comm<B: Backend>(&self) -> Option<Arc<dyn Communicator<B>>> {
        self.group.comm()
    }

    /// `region` on `x` over the cp group (the identity at cp = 1).
    pub fn region<B: ParallelBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        region: Region,
    ) -> Tensor<B, D> {
        self.group.region(x, region)
    }

    /// This rank's split of a sequence of `len` positions (already padded:
    /// [`ContextSplit::padded_len`]).
    pub fn split(&self, len: usize) -> ContextSplit {
        ContextSplit::new(len, self.size(), self.rank())
    }
}

/// Which positions of a sequence one cp rank holds, and in which order the group's keys arrive
/// when gathered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextSplit {
    /// The (padded) sequence length.
    pub len: usize,
    pub cp: usize,
    pub rank: usize,
}

/// How the positions `start..start + len` of a sequence (the response window) are found on
/// the cp ranks and put back in order: each rank takes the window's positions it holds
/// (`local`, padded to `per_rank` with repeats of its first token, whose outputs nobody reads),
/// the group gathers the `cp · per_rank` outputs, and `order` picks the window's positions out
/// of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextWindow {
    /// This rank's local indices (into its own tokens) of its window positions, padded.
    pub local: Vec<usize>,
    pub per_rank: usize,
    /// For each window position, its index among the gathered outputs.
    pub order: Vec<usize>,
    /// Each of `local`'s entries' offset in the window (padding entries 0): which label a
    /// fused head reads for it.
    pub offsets: Vec<usize>,
}

impl ContextSplit {
    /// Rank `rank` of `cp` over `len` positions; `len` must be a multiple of 2·cp.
    pub fn new(len: usize, cp: usize, rank: usize) -> Self {
        assert!(
            cp >= 1 && rank < cp && len.is_multiple_of(2 * cp),
            "a context split of {len} positions over cp = {cp} (rank {rank}) needs a multiple of 2·cp"
        );
        Self { len, cp, rank }
    }

    /// The length a sequence of `len` tokens is padded to: a multiple of 2·cp (each rank two
    /// equal chunks) times `shards` (the sequence-parallel split of each rank's tokens), so a
    /// sequence of any length — shorter than 2·tp·cp included — splits evenly.
    pub fn padded_len(len: usize, cp: usize, shards: usize) -> usize {
        let multiple = if cp > 1 { 2 * cp } else { 1 } * shards.max(1);
        len.div_ceil(multiple).max(1) * multiple
    }

    fn chunk(&self) -> usize {
        self.len / (2 * self.cp)
    }

    /// The positions rank `rank` holds, in its local order (its early chunk, then its late one).
    pub fn positions_of(&self, rank: usize) -> Vec<usize> {
        let c = self.chunk();
        let late = 2 * self.cp - 1 - rank;
        (rank * c..(rank + 1) * c)
            .chain(late * c..(late + 1) * c)
            .collect()
    }

    /// This rank's positions.
    pub fn local(&self) -> Vec<usize> {
        self.positions_of(self.rank)
    }

    /// The positions of the keys all-gathered over the group: rank 0's, then rank 1's, ...
    pub fn gathered_keys(&self) -> Vec<usize> {
        (0..self.cp).flat_map(|r| self.positions_of(r)).collect()
    }

    /// Where the window `start..start + len` is on the ranks ([`ContextWindow`]).
    pub fn window(&self, start: usize, len: usize) -> ContextWindow {
        self.window_at(&(start..start + len).collect::<Vec<_>>())
    }

    /// Where the outputs of `positions` (any positions, repeats allowed: a packed batch's
    /// response positions) are on the ranks ([`ContextWindow`]); entry `j` is computed by the
    /// rank holding `positions[j]`.
    pub fn window_at(&self, positions: &[usize]) -> ContextWindow {
        let c = self.chunk();
        let owner = |p: usize| {
            let chunk = p / c;
            let rank = chunk.min(2 * self.cp - 1 - chunk);
            // Local index: the early chunk first, then the late one.
            let local = if chunk == rank {
                p - rank * c
            } else {
                c + p - chunk * c
            };
            (rank, local)
        };
        let mut held = vec![Vec::new(); self.cp];
        for (j, &p) in positions.iter().enumerate() {
            let (rank, local) = owner(p);
            held[rank].push((j, local));
        }
        let per_rank = held.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut order = vec![0; positions.len()];
        for (r, entries) in held.iter().enumerate() {
            for (k, &(j, _)) in entries.iter().enumerate() {
                order[j] = r * per_rank + k;
            }
        }
        let mine = &held[self.rank];
        let mut local: Vec<usize> = mine.iter().map(|&(_, l)| l).collect();
        let mut offsets: Vec<usize> = mine.iter().map(|&(j, _)| j).collect();
        local.resize(per_rank, 0);
        offsets.resize(per_rank, 0);
        ContextWindow {
            local,
            per_rank,
            order,
            offsets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_position_is_held_once_and_the_causal_work_is_balanced() {
        for cp in [1usize, 2, 3, 4] {
            let len = 8 * cp;
            let mut seen = vec![0; len];
            let mut work = Vec::new();
            for r in 0..cp {
                let held = ContextSplit::new(len, cp, r).local();
                assert_eq!(held.len(), len / cp);
                for &p in &held {
                    seen[p] += 1;
                }
                // Causal attention work: each query attends to the keys up to itself.
                work.push(held.iter().map(|p| p + 1).sum::<usize>());
            }
            assert!(seen.iter().all(|&n| n == 1), "cp={cp}: {seen:?}");
            assert!(work.iter().all(|&w| w == work[0]), "cp={cp}: {work:?}");
        }
    }

    #[test]
    fn a_window_comes_back_in_order_from_the_gathered_outputs() {
        for (len, cp, start, wlen) in [(8, 2, 3, 4), (12, 3, 0, 12), (16, 4, 13, 2), (8, 2, 7, 1)] {
            let windows: Vec<_> = (0..cp)
                .map(|r| ContextSplit::new(len, cp, r))
                .map(|s| (s.local(), s.window(start, wlen)))
                .collect();
            // Each rank's outputs are its positions at its local window indices; gathered in
            // rank order, `order` must read back start..start + wlen.
            let gathered: Vec<usize> = windows
                .iter()
                .flat_map(|(held, w)| w.local.iter().map(|&i| held[i]).collect::<Vec<_>>())
                .collect();
            let order = &windows[0].1.order;
            let back: Vec<usize> = order.iter().map(|&i| gathered[i]).collect();
            assert_eq!(back, (start..start + wlen).collect::<Vec<_>>());
            assert!(windows.iter().all(|(_, w)| &w.order == order));
        }
    }

    #[test]
    fn any_positions_with_repeats_come_back_in_order() {
        let (len, cp) = (16, 2);
        let positions = [15, 0, 3, 3, 9, 15, 4, 12];
        let splits: Vec<_> = (0..cp).map(|r| ContextSplit::new(len, cp, r)).collect();
        let windows: Vec<_> = splits.iter().map(|s| s.window_at(&positions)).collect();
        let gathered: Vec<usize> = splits
            .iter()
            .zip(&windows)
            .flat_map(|(s, w)| w.local.iter().map(|&i| s.local()[i]).collect::<Vec<_>>())
            .collect();
        let back: Vec<usize> = windows[0].order.iter().map(|&i| gathered[i]).collect();
        assert_eq!(back, positions);
        // Each rank's label offsets name the entries it computes.
        for (s, w) in splits.iter().zip(&windows) {
            for (&i, &j) in w.local.iter().zip(&w.offsets) {
                if w.order[j] / w.per_rank == s.rank {
                    assert_eq!(s.local()[i], positions[j]);
                }
            }
        }
    }

    #[test]
    fn short_sequences_pad_to_a_multiple_of_two_cp_times_the_shards() {
        assert_eq!(ContextSplit::padded_len(3, 2, 2), 8);
        assert_eq!(ContextSplit::padded_len(9, 2, 1), 12);
        assert_eq!(ContextSplit::padded_len(7, 1, 2), 8);
        assert_eq!(ContextSplit::padded_len(7, 1, 1), 7);
        assert_eq!(ContextSplit::padded_len(1, 4, 2), 16);
    }
}

//! verl's `trainer.balance_batch`: the rows of a batch reordered so that the equal contiguous
//! chunks the data-parallel ranks receive carry similar numbers of tokens. The slowest rank sets
//! the pace of every collective, and RL batches mix short and long responses.
//!
//! As verl does, the rows are partitioned by Karmarkar–Karp's largest differencing method under
//! the equal-size constraint ([`karmarkar_karp`]); the greedy longest-first split is tried too,
//! and the lighter heaviest chunk of the two wins. Never worse than not reordering: where both
//! would leave a heavier chunk than the batch's own order, the batch keeps its order. verl
//! weighs each row by an attention-aware workload rather than its tokens: [`verl_workload`].
//!
//! ```
//! use verl_core::algorithms::balance::{balanced_order, chunk_sums};
//!
//! // Two ranks; in batch order rank 0 would get 90 + 80 tokens and rank 1 10 + 20.
//! let lens = [90, 80, 10, 20];
//! let order = balanced_order(&lens, 2);
//! assert_eq!(chunk_sums(&lens, &order, 2), [100, 100]);
//! assert_eq!(order, [0, 2, 1, 3]);
//! ```

/// The token count of each of `k` contiguous equal chunks of the rows in `order`.
pub fn chunk_sums(lens: &[usize], order: &[usize], k: usize) -> Vec<usize> {
    let per = order.len() / k.max(1);
    order
        .chunks(per.max(1))
        .take(k)
        .map(|c| c.iter().map(|&i| lens[i]).sum())
        .collect()
}

/// verl's estimate of a row's compute for balancing (`calculate_workload`): the dense layers'
/// share grows with the length, attention's with its square (constants of a 7B model).
pub fn verl_workload(len: usize) -> usize {
    24_576 * len + len * len
}

/// Karmarkar–Karp's largest differencing method for `k` parts of equal size (`weights.len()`
/// a multiple of `k`): the rows sorted by weight are taken `k` at a time as partial partitions;
/// the two partials whose heaviest and lightest parts differ most are merged, pairing one's
/// heaviest part with the other's lightest, until one is left. Each part's rows come in
/// ascending index, the parts in the order of their first rows. `None` when the rows do not
/// split evenly or `k` is 0.
///
/// ```
/// use verl_core::algorithms::balance::karmarkar_karp;
/// // 8, 7, 6, 5, 4, 3 into 3 pairs: 8+3, 7+4, 6+5 = 11 each.
/// let parts = karmarkar_karp(&[8, 7, 6, 5, 4, 3], 3).unwrap();
/// let sums: Vec<usize> = parts.iter().map(|p| p.iter().map(|&i| [8, 7, 6, 5, 4, 3][i]).sum()).collect();
/// assert_eq!(sums, [11, 11, 11]);
/// ```
pub fn karmarkar_karp(weights: &[usize], k: usize) -> Option<Vec<Vec<usize>>> {
    use std::cmp::{Ordering, Reverse};
    use std::collections::BinaryHeap;
    let n = weights.len();
    if k == 0 || !n.is_multiple_of(k) {
        return None;
    }
    /// A partial partition: its `k` parts heaviest first, as (sum, rows).
    struct Partial {
        parts: Vec<(usize, Vec<usize>)>,
        /// Insertion number: the last tie-break, so equal partials pop in a fixed order.
        seq: usize,
    }
    impl Partial {
        fn spread(&self) -> usize {
            self.parts[0].0 - self.parts[self.parts.len() - 1].0
        }
        fn key(&self) -> (usize, usize, Reverse<usize>) {
            (self.spread(), self.parts[0].0, Reverse(self.seq))
        }
        fn sort(&mut self) {
            self.parts
                .sort_by(|a, b| (b.0, b.1.len(), &b.1).cmp(&(a.0, a.1.len(), &a.1)));
        }
    }
    impl PartialEq for Partial {
        fn eq(&self, other: &Self) -> bool {
            self.key() == other.key()
        }
    }
    impl Eq for Partial {}
    impl PartialOrd for Partial {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Partial {
        fn cmp(&self, other: &Self) -> Ordering {
            self.key().cmp(&other.key())
        }
    }
    let mut rows: Vec<usize> = (0..n).collect();
    rows.sort_by_key(|&i| (weights[i], i));
    let mut heap = BinaryHeap::new();
    let mut seq = 0;
    for group in rows.chunks(k) {
        let mut p = Partial {
            parts: group.iter().map(|&i| (weights[i], vec![i])).collect(),
            seq,
        };
        p.sort();
        heap.push(p);
        seq += 1;
    }
    if heap.is_empty() {
        return Some(vec![Vec::new(); k]);
    }
    while heap.len() > 1 {
        let (mut a, b) = (heap.pop()?, heap.pop()?);
        for (i, (sum, items)) in b.parts.into_iter().enumerate() {
            let part = &mut a.parts[k - 1 - i];
            part.0 += sum;
            part.1.extend(items);
        }
        a.sort();
        a.seq = seq;
        seq += 1;
        heap.push(a);
    }
    let mut parts: Vec<Vec<usize>> = heap.pop()?.parts.into_iter().map(|(_, r)| r).collect();
    for p in &mut parts {
        p.sort_unstable();
    }
    // Parts in the order of their first rows: the row order changes no more than it must.
    parts.sort_by_key(|p| p.first().copied().unwrap_or(usize::MAX));
    Some(parts)
}

/// A row order whose `k` contiguous equal chunks (one per data-parallel rank) carry balanced
/// weights (token counts, or [`verl_workload`]s): each rank's rows in ascending index (their
/// batch order), ranks one after another. `lens.len()` must be a multiple of `k` (the dispatch
/// splits evenly); otherwise, or for `k <= 1`, the batch order.
pub fn balanced_order(lens: &[usize], k: usize) -> Vec<usize> {
    let n = lens.len();
    let identity: Vec<usize> = (0..n).collect();
    if k <= 1 || n == 0 || !n.is_multiple_of(k) {
        return identity;
    }
    let per = n / k;
    // Longest first, each to the lightest chunk that still has room (ties: lower index).
    let mut by_length = identity.clone();
    by_length.sort_by_key(|&i| (std::cmp::Reverse(lens[i]), i));
    let mut chunks: Vec<Vec<usize>> = vec![Vec::with_capacity(per); k];
    let mut sums = vec![0usize; k];
    for i in by_length {
        let j = (0..k)
            .filter(|&j| chunks[j].len() < per)
            .min_by_key(|&j| (sums[j], j))
            .expect("n = k·per leaves room until the last row");
        chunks[j].push(i);
        sums[j] += lens[i];
    }
    for c in &mut chunks {
        c.sort_unstable();
    }
    let greedy: Vec<usize> = chunks.into_iter().flatten().collect();
    let heaviest = |order: &[usize]| chunk_sums(lens, order, k).into_iter().max().unwrap_or(0);
    let differenced: Vec<usize> = karmarkar_karp(lens, k)
        .map(|parts| parts.into_iter().flatten().collect())
        .unwrap_or_else(|| identity.clone());
    // The lighter heaviest chunk of the two splits; the batch order if neither beats it.
    let best = if heaviest(&differenced) <= heaviest(&greedy) {
        differenced
    } else {
        greedy
    };
    if heaviest(&best) <= heaviest(&identity) {
        best
    } else {
        identity
    }
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

        #[test]
        fn a_permutation_in_equal_sorted_chunks_never_heavier_than_batch_order(
            k in 1usize..7,
            per in 1usize..9,
            seed in proptest::collection::vec(0usize..2048, 64),
        ) {
            let lens: Vec<usize> = seed[..k * per].to_vec();
            let order = balanced_order(&lens, k);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..k * per).collect::<Vec<_>>());
            for chunk in order.chunks(per) {
                prop_assert!(chunk.windows(2).all(|w| w[0] < w[1]));
            }
            let identity: Vec<usize> = (0..k * per).collect();
            let max = |o: &[usize]| chunk_sums(&lens, o, k).into_iter().max().unwrap();
            prop_assert!(max(&order) <= max(&identity));
            // The tokens are all still there.
            prop_assert_eq!(
                chunk_sums(&lens, &order, k).iter().sum::<usize>(),
                lens.iter().sum::<usize>()
            );
        }
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Karmarkar–Karp's parts: equal sizes, every row once, ascending rows in each part,
        /// and the heaviest part no heavier than the greedy split's or the brute-force bound
        /// allows (at most the lightest possible heaviest part plus the largest weight).
        #[test]
        fn karmarkar_karp_parts_are_equal_sized_and_cover_every_row(
            k in 1usize..6,
            per in 1usize..8,
            seed in proptest::collection::vec(0usize..1000, 48),
        ) {
            let w: Vec<usize> = seed[..k * per].to_vec();
            let parts = karmarkar_karp(&w, k).unwrap();
            prop_assert_eq!(parts.len(), k);
            let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..k * per).collect::<Vec<_>>());
            for p in &parts {
                prop_assert_eq!(p.len(), per);
                prop_assert!(p.windows(2).all(|x| x[0] < x[1]));
            }
            let sums: Vec<usize> = parts.iter().map(|p| p.iter().map(|&i| w[i]).sum()).collect();
            let total: usize = w.iter().sum();
            let largest = w.iter().copied().max().unwrap_or(0);
            prop_assert!(*sums.iter().max().unwrap() <= total.div_ceil(k) + largest);
        }
    }

    #[test]
    fn karmarkar_karp_by_hand() {
        // Two equal parts of 4, 5, 6, 7, 8, 10. Partials (5 | 4), (7 | 6), (10 | 8): the widest
        // (10 | 8) merges first, with the heavier of the two spread-1 partials, (7 | 6):
        // (10+6 | 8+7) = (16 | 15). That merges with (5 | 4): (16+4 | 15+5) = (20 | 20).
        let w = [4, 5, 6, 7, 8, 10];
        let parts = karmarkar_karp(&w, 2).unwrap();
        let sums: Vec<usize> = parts
            .iter()
            .map(|p| p.iter().map(|&i| w[i]).sum())
            .collect();
        assert_eq!(sums, [20, 20]);
        assert_eq!(parts, [vec![0, 2, 5], vec![1, 3, 4]]);
        assert!(karmarkar_karp(&[1, 2, 3], 2).is_none());
        assert_eq!(
            karmarkar_karp(&[], 3).unwrap(),
            vec![Vec::<usize>::new(); 3]
        );
        assert_eq!(verl_workload(100), 24_576 * 100 + 10_000);
    }

    #[test]
    fn uneven_batches_and_one_rank_keep_their_order() {
        assert_eq!(balanced_order(&[5, 1, 9], 2), [0, 1, 2]);
        assert_eq!(balanced_order(&[5, 1, 9], 1), [0, 1, 2]);
        assert!(balanced_order(&[], 4).is_empty());
    }

    #[test]
    fn a_hand_checked_split_of_grpo_lengths() {
        // 8 responses over 4 ranks: in order the chunks carry 300, 30, 220, 50 tokens. The
        // 200-token row needs a partner and the shortest has 10, so 210 is the best any split
        // can do. Karmarkar–Karp: partials (40 | 20 | 10 | 10) and (200 | 120 | 100 | 100)
        // merge heaviest-with-lightest: 200+10, 120+10, 100+20, 100+40, i.e. rows {0, 2},
        // {4, 7}, {3, 5}, {1, 6}, put in the order of their first rows (the greedy split also
        // reaches 210).
        let lens = [200, 100, 10, 20, 120, 100, 40, 10];
        let order = balanced_order(&lens, 4);
        assert_eq!(chunk_sums(&lens, &order, 4), [210, 140, 120, 130]);
        assert_eq!(order, [0, 2, 1, 6, 3, 5, 4, 7]);
    }
}

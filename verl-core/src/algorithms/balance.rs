//! verl's `trainer.balance_batch`: the rows of a batch reordered so that the equal contiguous
//! chunks the data-parallel ranks receive carry similar numbers of tokens. The slowest rank sets
//! the pace of every collective, and RL batches mix short and long responses.
//!
//! verl partitions with Karmarkar–Karp; this is the greedy longest-first rule under the same
//! equal-size constraint, and never worse than not reordering: where the greedy split would
//! leave a heavier chunk than the batch's own order, the batch keeps its order.
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

/// A row order whose `k` contiguous equal chunks (one per data-parallel rank) carry balanced
/// token counts: each rank's rows in ascending index (their batch order), ranks one after
/// another. `lens.len()` must be a multiple of `k` (the dispatch splits evenly); otherwise, or
/// for `k <= 1`, the batch order.
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
    if heaviest(&greedy) <= heaviest(&identity) {
        greedy
    } else {
        identity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
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
        // can do: 200+10, 120+10, 100+40, 100+20.
        let lens = [200, 100, 10, 20, 120, 100, 40, 10];
        let order = balanced_order(&lens, 4);
        assert_eq!(chunk_sums(&lens, &order, 4), [210, 130, 140, 120]);
        assert_eq!(order, [0, 7, 2, 4, 1, 6, 3, 5]);
    }
}

//! Sequence packing (verl's `use_remove_padding`, Megatron's THD layout): a micro-batch's
//! sequences laid end to end in one row with no padding between them, so embedding, norms,
//! projections, MLP / MoE and heads compute real tokens only.
//!
//! A packed row keeps each sequence's own positions (they restart at 0 per sequence, so RoPE
//! sees what it sees padded) and its boundaries, the `cu_seqlens` of varlen attention. Attention
//! is the one operation that mixes tokens: each token attends to the earlier tokens of its own
//! sequence only. Without context parallelism [`crate::models::attention::AttentionMask::packed`]
//! lays each sequence's queries, keys and values in a row of their own for the attention
//! product alone (the fused kernel's layout; a key mask ends each row) and packs the outputs
//! back; with it, the rank's queries attend to the group's keys through a bias that also
//! requires the same sequence.
//!
//! ```
//! use verl_megatron::models::packing::PackedSequences;
//! // Two rows of width 5: row 0 holds tokens at columns 1..5, row 1 at 0..3 (1 = token).
//! let mask = [0., 1., 1., 1., 1., 1., 1., 1., 0., 0.];
//! // The outputs of columns 2..4 of each row: the window.
//! let packed = PackedSequences::new(&mask, 2, 5, (2, 2));
//! assert_eq!(packed.lens, vec![4, 3]);
//! assert_eq!(packed.cu_seqlens(), vec![0, 4, 7]);
//! // Packed token j comes from the flattened [rows · width] index gather[j].
//! assert_eq!(packed.gather, vec![1, 2, 3, 4, 5, 6, 7]);
//! // Row 0's columns 2 and 3 are packed 1 and 2; row 1's column 2 is packed 6, and its
//! // column 3 (padding) reads the row's last token, an output nobody uses.
//! assert_eq!(packed.window, vec![1, 2, 6, 6]);
//! ```

/// Where a padded micro-batch's tokens go in its packed row, and which packed positions its
/// outputs are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedSequences {
    /// Each row's packed tokens, in row order (`cu_seqlens` are their prefix sums). A row with
    /// no token keeps its first column, so every row is a sequence of at least one token.
    pub lens: Vec<usize>,
    /// For each packed token, its index in the padded batch flattened to `[rows · width]`.
    pub gather: Vec<usize>,
    /// For each output position (row-major `[rows, window_len]`), the packed index it is read
    /// from; a padded column reads its row's last token (an output masked downstream).
    pub window: Vec<usize>,
    /// Whether each output position is a token (else it reads a stand-in, and carries no
    /// gradient back).
    pub window_real: Vec<bool>,
    pub rows: usize,
    pub window_len: usize,
}

impl PackedSequences {
    /// The packing of a `[rows, width]` batch whose attention mask is `mask` (row-major, > 0.5 =
    /// token), with outputs read at columns `start..start + len` of every row.
    pub fn new(mask: &[f32], rows: usize, width: usize, (start, len): (usize, usize)) -> Self {
        assert_eq!(mask.len(), rows * width, "a [rows, width] attention mask");
        assert!(start + len <= width, "the output window within the row");
        let mut lens = Vec::with_capacity(rows);
        let mut gather = Vec::new();
        let mut window = Vec::with_capacity(rows * len);
        let mut window_real = Vec::with_capacity(rows * len);
        for r in 0..rows {
            let first = gather.len();
            // Packed index of each column of this row that is a token.
            let mut at = vec![None; width];
            for c in 0..width {
                if mask[r * width + c] > 0.5 {
                    at[c] = Some(gather.len());
                    gather.push(r * width + c);
                }
            }
            if gather.len() == first {
                at[0] = Some(first);
                gather.push(r * width);
            }
            let last = gather.len() - 1;
            lens.push(gather.len() - first);
            window.extend((start..start + len).map(|c| at[c].unwrap_or(last)));
            window_real.extend((start..start + len).map(|c| at[c].is_some()));
        }
        Self {
            lens,
            gather,
            window,
            window_real,
            rows,
            window_len: len,
        }
    }

    /// Tokens in the packed row.
    pub fn tokens(&self) -> usize {
        self.gather.len()
    }

    /// Sequence boundaries: sequence `i` is packed tokens `cu[i]..cu[i + 1]`.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        let mut cu = Vec::with_capacity(self.lens.len() + 1);
        cu.push(0);
        for l in &self.lens {
            cu.push(cu.last().copied().unwrap_or(0) + l);
        }
        cu
    }

    /// The sequence of each of `padded` packed positions: `0..rows` for the packed tokens, and
    /// each position past them (padding up to a length sequence / context parallelism split
    /// evenly) a sequence of its own, so it attends to itself alone.
    pub fn segments(&self, padded: usize) -> Vec<usize> {
        let mut seg: Vec<usize> = self
            .lens
            .iter()
            .enumerate()
            .flat_map(|(i, &l)| std::iter::repeat_n(i, l))
            .collect();
        let n = self.rows;
        seg.extend((seg.len()..padded).map(|p| n + p));
        seg
    }

    /// The attention layout of the packed row padded to `padded` positions: each sequence in a
    /// row of its own, as wide as the longest. Returns `(rows_index, packed_index, width)`:
    /// `rows_index[s · width + c]` is the packed position of sequence `s`'s token `c` (past the
    /// sequence's end: its first token, a key the mask hides); `packed_index[p]` is the slot of
    /// packed position `p` (a position past the packed tokens reads slot 0, an output nothing
    /// reads).
    pub fn attention_rows(&self, padded: usize) -> (Vec<usize>, Vec<usize>, usize) {
        let width = self.lens.iter().copied().max().unwrap_or(1).max(1);
        let mut rows_index = Vec::with_capacity(self.lens.len() * width);
        let mut packed_index = vec![0; padded.max(self.tokens())];
        for (s, (&l, &start)) in self.lens.iter().zip(self.cu_seqlens().iter()).enumerate() {
            for c in 0..width {
                if c < l {
                    packed_index[start + c] = s * width + c;
                    rows_index.push(start + c);
                } else {
                    rows_index.push(start);
                }
            }
        }
        (rows_index, packed_index, width)
    }

    /// For each of `padded` packed positions, the output position that reads it as a token
    /// and 1, or 0 and 0 when none does: how the outputs' gradient goes back to the packed row
    /// (`ParallelBackend::gather_rows`).
    pub fn window_inverse(&self, padded: usize) -> (Vec<usize>, Vec<f32>) {
        let mut inverse = vec![0; padded];
        let mut keep = vec![0.0; padded];
        for (j, (&p, &real)) in self.window.iter().zip(&self.window_real).enumerate() {
            if real {
                inverse[p] = j;
                keep[p] = 1.0;
            }
        }
        (inverse, keep)
    }

    /// The key mask of [`Self::attention_rows`]'s layout, `[sequences · width]` (1 = token).
    pub fn attention_key_mask(&self, width: usize) -> Vec<f32> {
        self.lens
            .iter()
            .flat_map(|&l| (0..width).map(move |c| if c < l { 1.0 } else { 0.0 }))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn masks() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        (1usize..5, 1usize..7).prop_flat_map(|(rows, width)| {
            (
                Just(rows),
                Just(width),
                proptest::collection::vec(prop_oneof![Just(0.0f32), Just(1.0f32)], rows * width),
            )
        })
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Every token is packed once, in row order; the layout round-trips; every window
        /// entry reads its own column where that is a token, else a token of its own row.
        #[test]
        fn packing_keeps_every_token_once((rows, width, mask) in masks(), start in 0usize..3) {
            let start = start.min(width - 1);
            let len = width - start;
            let p = PackedSequences::new(&mask, rows, width, (start, len));
            let tokens: Vec<usize> = (0..rows * width).filter(|&i| mask[i] > 0.5).collect();
            let empty_rows: Vec<usize> = (0..rows)
                .filter(|r| (0..width).all(|c| mask[r * width + c] < 0.5))
                .map(|r| r * width)
                .collect();
            let mut expected: Vec<usize> = tokens.iter().chain(&empty_rows).copied().collect();
            expected.sort();
            prop_assert_eq!(&p.gather, &expected);
            prop_assert_eq!(p.lens.iter().sum::<usize>(), p.tokens());
            prop_assert_eq!(p.window.len(), rows * len);
            let cu = p.cu_seqlens();
            for r in 0..rows {
                for c in start..start + len {
                    let w = p.window[r * len + c - start];
                    prop_assert!(cu[r] <= w && w < cu[r + 1], "row {r} reads its own tokens");
                    if mask[r * width + c] > 0.5 {
                        prop_assert_eq!(p.gather[w], r * width + c);
                    }
                }
            }
            let padded = p.tokens() + 3;
            let (inverse, keep) = p.window_inverse(padded);
            for (j, (&w, &real)) in p.window.iter().zip(&p.window_real).enumerate() {
                if real {
                    prop_assert_eq!(inverse[w], j);
                    prop_assert_eq!(keep[w], 1.0);
                }
            }
            let (rows_index, packed_index, w) = p.attention_rows(padded);
            let key_mask = p.attention_key_mask(w);
            for j in 0..p.tokens() {
                prop_assert_eq!(rows_index[packed_index[j]], j);
                prop_assert!(key_mask[packed_index[j]] > 0.5);
            }
            let seg = p.segments(padded);
            prop_assert_eq!(seg.len(), padded);
            for s in 0..rows {
                prop_assert!(seg[cu[s]..cu[s + 1]].iter().all(|&x| x == s));
            }
        }
    }
}

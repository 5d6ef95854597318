//! The rollout engine's steps over KV caches: prefill (one prompt per slot, shared prefixes,
//! chunks of long prompts) and one decode step for every slot.

use super::forward::{CacheMode, HeadWindow, StageInput};
use super::CausalLm;

use burn::prelude::*;
use burn::tensor::{Int, TensorData};

use crate::layers::precision::{self};
use crate::models::attention::AttentionMask;
use crate::models::kv_cache::{ChunkLayout, KvCache, SlotKvCache};
use crate::parallel::ParallelBackend;

impl<B: ParallelBackend> CausalLm<B> {
    /// Prefills `prompts` into the given slots of `cache` (each from position 0) and returns the
    /// logits of each prompt's last token `[prompts, vocab]`. The prompts run as one
    /// right-padded batch: causal attention never lets a real token see the padding after it, so
    /// a prompt's result does not depend on its batch mates.
    pub fn prefill_slots(
        &self,
        prompts: &[Vec<u32>],
        slots: &[usize],
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        assert_eq!(prompts.len(), slots.len(), "one slot per prompt");
        let targets: Vec<(usize, usize)> = slots.iter().copied().enumerate().collect();
        self.prefill_shared(prompts, &targets, cache)
    }

    /// [`Self::prefill_slots`] where a prompt may fill several slots: each prompt runs once and
    /// its keys and values are written to every slot of `targets` = `(prompt, slot)` pairs (the
    /// `n` samples of one prompt sharing its prefill). Returns each prompt's last-token logits
    /// `[prompts, vocab]`.
    pub fn prefill_shared(
        &self,
        prompts: &[Vec<u32>],
        targets: &[(usize, usize)],
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        assert!(
            targets.iter().all(|&(p, _)| p < prompts.len()),
            "targets name prompts"
        );
        let device = self.device();
        let n = prompts.len();
        let t = prompts.iter().map(Vec::len).max().unwrap_or(0);
        assert!(t > 0 && t <= cache.capacity(), "prompt length 1..=capacity");
        let mut ids = vec![0i64; n * t];
        for (i, p) in prompts.iter().enumerate() {
            for (j, &tok) in p.iter().enumerate() {
                ids[i * t + j] = tok as i64;
            }
        }
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, t]), &device);
        let mut tmp = KvCache {
            layers: (0..self.layers.len()).map(|_| None).collect(),
            len: 0,
        };
        let positions = Tensor::<B, 1, Int>::arange(0..t as i64, &device)
            .unsqueeze_dim::<2>(0)
            .repeat_dim(0, n);
        let rope = self.rope_tables(&positions);
        // Causal over the right-padded prompts: the fused kernel's mask where it applies (no
        // t × t bias or scores), the same bias built on first use elsewhere.
        let mask = AttentionMask::causal(n, t, None, &device);
        let h = self.decoder(
            StageInput::Ids(ids),
            &mask,
            &rope,
            CacheMode::Grow(&mut tmp),
        );
        let sources: Vec<usize> = targets.iter().map(|&(p, _)| p).collect();
        let slots: Vec<usize> = targets.iter().map(|&(_, s)| s).collect();
        let lens: Vec<usize> = sources.iter().map(|&p| prompts[p].len()).collect();
        let starts = vec![0; slots.len()];
        for (l, kv) in tmp.layers.into_iter().enumerate() {
            let (k, v) = kv.expect("every layer cached its keys");
            cache.write_prefix(l, (&sources, &slots, &lens, &starts), k, v);
        }
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        self.last_token_logits(h, &lens)
    }

    /// The logits at each row's last token: `h` `[rows, t, hidden]` with `lens[i]` real tokens
    /// in row `i` (right padding after them); `[rows, vocab]`.
    fn last_token_logits(&self, h: Tensor<B, 3>, lens: &[usize]) -> Tensor<B, 2> {
        let [n, _, hidden] = h.dims();
        let last: Vec<i64> = lens.iter().map(|&l| l as i64 - 1).collect();
        let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(last, [n, 1, 1]), &h.device())
            .repeat_dim(2, hidden);
        let logits = self.head(h.gather(1, idx), HeadWindow::All);
        let vocab = logits.dims()[2];
        logits.reshape([n, vocab])
    }

    /// Continues prefills in chunks (chunked prefill): chunk `i` feeds `tokens` of slot `slot`
    /// from position `start` (the slot holds the prompt's first `start` tokens), writes their
    /// keys and values there and attends to the slot's positions up to each token. Returns
    /// each chunk's last-token logits `[chunks, vocab]`. The chunks run as one right-padded
    /// batch, as [`Self::prefill_slots`]'s prompts do.
    pub fn prefill_chunks(
        &self,
        chunks: &[(usize, usize, &[u32])],
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        let device = self.device();
        let n = chunks.len();
        let t = chunks.iter().map(|c| c.2.len()).max().unwrap_or(0);
        let layout = ChunkLayout {
            slots: chunks.iter().map(|c| c.0).collect(),
            starts: chunks.iter().map(|c| c.1).collect(),
            lens: chunks.iter().map(|c| c.2.len()).collect(),
        };
        let window = layout.window();
        assert!(
            t > 0 && layout.lens.iter().all(|&l| l > 0) && window <= cache.capacity(),
            "chunks of 1..=capacity tokens within the cache"
        );
        let mut ids = vec![0i64; n * t];
        let mut pos = vec![0i64; n * t];
        for (i, &(_, start, tokens)) in chunks.iter().enumerate() {
            for j in 0..t {
                ids[i * t + j] = tokens.get(j).map_or(0, |&x| x as i64);
                // Padding takes the last real position (its rotary angle is never used).
                pos[i * t + j] = (start + j.min(tokens.len() - 1)) as i64;
            }
        }
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, t]), &device);
        let positions = Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [n, t]), &device);
        let rope = self.rope_tables(&positions);
        let mask = AttentionMask::from_host_bias(layout.bias(t), [n, 1, t, window], &device)
            .at_positions(layout.query_positions(t), n, (0..window).collect());
        let h = self.decoder(
            StageInput::Ids(ids),
            &mask,
            &rope,
            CacheMode::Chunk {
                cache,
                chunks: &layout,
            },
        );
        self.last_token_logits(h, &layout.lens)
    }

    /// One decode step for every slot of `cache`: slot `s` feeds `tokens[s]` at position
    /// `positions[s]` (its key and value are written there) and attends to its positions
    /// `0..=positions[s]`. Keys are read from the first `window` positions (`window` > every
    /// position). Returns next-token logits `[slots, vocab]`. An idle slot can pass any token
    /// at any position below the capacity: its output is meaningless, and only that position of
    /// its slot is written (the rollout passes the first position past what the slot keeps
    /// from a finished request).
    pub fn decode_slots(
        &self,
        tokens: &[u32],
        positions: &[usize],
        window: usize,
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        let s = cache.slots();
        assert!(
            tokens.len() == s && positions.len() == s,
            "one token per slot"
        );
        assert!(window <= cache.capacity(), "window within capacity");
        assert!(
            positions.iter().all(|&p| p < window),
            "every slot's position inside the window"
        );
        let device = self.device();
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(tokens.iter().map(|&t| t as i64).collect(), [s, 1]),
            &device,
        );
        let pos = Tensor::<B, 2, Int>::from_data(
            TensorData::new(positions.iter().map(|&p| p as i64).collect(), [s, 1]),
            &device,
        );
        let rope = self.rope_tables(&pos);
        let mask = AttentionMask::decode_step(positions, window, &device);
        // Where the decode kernel applies, the positions go up once for every layer.
        let on_device = self.layers.first().and_then(|l| {
            let a = &l.self_attn;
            B::decode_attention_applies(a.num_heads, a.num_kv_heads, a.head_dim)
                .then(|| SlotKvCache::<B>::step_positions(positions, &device))
        });
        let h = match self.generation() {
            Some(fused) => {
                let _precision = precision::enter(self.compute_dtype);
                let step = (positions, window, on_device.as_ref());
                self.decode_fused(fused, ids, &mask, &rope, cache, step)
            }
            None => {
                let mode = CacheMode::Slots {
                    cache,
                    positions,
                    window,
                    on_device: on_device.as_ref(),
                };
                self.decoder(StageInput::Ids(ids), &mask, &rope, mode)
            }
        };
        let logits = self.head(h, HeadWindow::All);
        let vocab = logits.dims()[2];
        logits.reshape([s, vocab])
    }
}

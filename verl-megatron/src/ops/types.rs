//! The values the kernels exchange with the models, the rollout and the optimizer.

use burn::prelude::*;

/// How one row is sampled: vLLM's order is temperature, then min-p, then top-k, then top-p
/// over what min-p and top-k kept; then one draw from the renormalised rest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// 0: greedy (the first largest logit).
    pub temperature: f32,
    /// Keep the `top_k` largest logits (and any tied with the k-th); ≤ 0: off.
    pub top_k: i32,
    /// Keep the smallest most-likely set holding `top_p` of the probability; 1: off.
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one; 0: off.
    pub min_p: f32,
    /// The request's random stream.
    pub seed: u64,
    /// Which draw of the stream this is (tokens the request generated so far).
    pub step: u32,
}

impl Default for RowSampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            step: 0,
        }
    }
}

/// One row's chosen token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// `log softmax(logits / T)[token]` over the whole vocabulary (T = 1 when greedy): the
    /// log-prob the actor recomputes.
    pub log_prob: f32,
    /// Entropy of `softmax(logits / T)` over the whole vocabulary.
    pub entropy: f32,
    /// Tokens left after the filters (1 when greedy).
    pub kept: u32,
}

impl RowSampling {
    /// Whether the row takes its largest logit: a temperature that is not above 0 (NaN too).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// Whether this row can be drawn from vocabulary shards without their logits meeting:
    /// temperature and min-p need only the row's maximum, but top-k and top-p rank the whole
    /// vocabulary (`vocab` ids), so rows with either on are sampled from gathered logits.
    /// Greedy rows ignore both filters, as the whole-row kernel does.
    pub fn draws_from_shards(&self, vocab: usize) -> bool {
        let greedy = self.is_greedy();
        let top_k_on = self.top_k > 0 && (self.top_k as usize) < vocab;
        let top_p_on = self.top_p < 1.0;
        greedy || !(top_k_on || top_p_on)
    }
}

/// One tensor-parallel rank's part of sampling a row whose logits are split over the
/// vocabulary (`crate::sampling::sample_vocab_parallel`): its best candidate and its pieces of
/// the softmax's normaliser, all relative to the row's maximum over the whole vocabulary. The
/// ranks' parts combine into the [`SampledToken`] the whole row gives
/// (`crate::sampling::combine_shard_draws`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardDraw {
    /// The candidate's score: `s + g` (its scaled logit plus Gumbel noise) when sampling, its
    /// logit when greedy; `-inf` when the shard keeps no token.
    pub score: f32,
    /// The candidate's id in the whole vocabulary (`u32::MAX`: none).
    pub token: u32,
    /// `Σ exp(s)` and `Σ exp(s) · s` over the shard's ids, `s = (x − max) / T`.
    pub z: f32,
    pub zs: f32,
    /// Ids of the shard that passed the filters (0 when greedy).
    pub kept: u32,
    /// The candidate's `s`.
    pub s_token: f32,
    /// The shard's largest logit and its id (`u32::MAX`: none): the greedy token, and the
    /// token when no candidate passes the filters anywhere (as the whole-row kernel falls back
    /// to its largest logit).
    pub top: f32,
    pub top_token: u32,
}

impl ShardDraw {
    /// f32 words a row's draw takes on the device (the sampling kernel's layout: score, token
    /// bits, z, zs, kept bits, s_token, top, top_token bits).
    pub const WORDS: usize = 8;

    pub fn to_words(&self) -> [f32; Self::WORDS] {
        [
            self.score,
            f32::from_bits(self.token),
            self.z,
            self.zs,
            f32::from_bits(self.kept),
            self.s_token,
            self.top,
            f32::from_bits(self.top_token),
        ]
    }

    /// A draw from its words (`words.len() >= WORDS`).
    pub fn from_words(words: &[f32]) -> Self {
        Self {
            score: words[0],
            token: words[1].to_bits(),
            z: words[2],
            zs: words[3],
            kept: words[4].to_bits(),
            s_token: words[5],
            top: words[6],
            top_token: words[7].to_bits(),
        }
    }
}

/// A decode step's projections of one layer, as the decode-attention kernel reads them.
pub enum DecodeProjections<B: Backend> {
    /// `q` `[slots, heads · head_dim]`, `k`, `v` `[slots, kv_heads · head_dim]`, biases (if
    /// any) already added.
    Split {
        q: Tensor<B, 2>,
        k: Tensor<B, 2>,
        v: Tensor<B, 2>,
    },
    /// The fused q/k/v product `[slots, (heads + 2 · kv_heads) · head_dim]` (q, then k, then
    /// v) and its bias `[(heads + 2 · kv_heads) · head_dim]`, still to be added.
    Packed {
        qkv: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
    },
}

/// Where a prefill's keys and values go in a slot cache: target `i` copies the first `lens[i]`
/// positions of prompt `sources[i]` into slot `slots[i]` at positions `starts[i]..starts[i] +
/// lens[i]`: `(sources, slots, lens, starts)`.
pub type PrefixTargets<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a [usize]);

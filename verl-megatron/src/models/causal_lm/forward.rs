//! The training and log-prob passes: a pipeline stage's forward (padded or packed sequences,
//! sequence and context parallel), the decoder, and the output heads (LM, fused log-prob, value
//! and score).

use super::{CausalLm, DecoderLayer};

use burn::prelude::*;
use burn::tensor::{Int, TensorData};

use crate::layers::precision::{self};
use crate::layers::RopeTables;
use crate::models::attention::{attention_bias, positional_bias, AttentionMask, AttnCache};
use crate::models::kv_cache::{ChunkLayout, KvCache, SlotKvCache};
use crate::models::packing::PackedSequences;
use crate::parallel::{device_span, ContextSplit, ContextWindow, CpGroup, ParallelBackend, Region};

/// The attention mask's values at `positions` of each row, flattened `[batch · positions]`
/// (all ones without a mask): the tokens an MoE block sees, for its load-balancing loss.
fn attention_mask_local<B: Backend>(
    mask: &Option<Tensor<B, 2>>,
    positions: &[usize],
    batch: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    let n = batch * positions.len();
    match mask {
        None => Tensor::ones([n], device),
        Some(m) => m
            .clone()
            .select(1, crate::models::index_tensor(positions, device))
            .reshape([n]),
    }
}

/// What a fused head needs ([`CausalLm::forward_stage_with`]): the labels of the window's
/// positions `[batch, len]` and the sampling temperature the logits are divided by.
#[derive(Debug, Clone)]
pub struct FusedTargets<B: Backend> {
    pub labels: Tensor<B, 2, Int>,
    pub temperature: f64,
}

/// Which positions the output head computes.
pub(super) enum HeadWindow {
    All,
    /// `(start, len)`.
    Range(usize, usize),
    /// Any positions of a single row, in this order (a packed batch's outputs): `(positions,
    /// inverse, keep)` as [`PackedSequences::window_inverse`] gives them.
    Positions(Vec<usize>, Vec<usize>, Vec<f32>),
    /// A context-parallel rank's part of a window, gathered over the group after the head.
    Context(ContextWindow),
}

impl HeadWindow {
    /// The window's positions of `h` `[batch, seq, _]` (this cp rank's part of it).
    fn cut<B: ParallelBackend>(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            HeadWindow::All => h,
            HeadWindow::Range(start, len) => h.narrow(1, *start, *len),
            HeadWindow::Positions(p, inverse, keep) => {
                let [_, t, width] = h.dims();
                let device = h.device();
                let keep = Tensor::from_data(TensorData::new(keep.clone(), [t]), &device);
                let index = |i: &[usize]| crate::models::index_tensor(i, &device);
                B::gather_rows(h.reshape([t, width]), index(p), index(inverse), keep)
                    .unsqueeze_dim(0)
            }
            HeadWindow::Context(w) => {
                let local = crate::models::index_tensor(&w.local, &h.device());
                h.select(1, local)
            }
        }
    }

    /// Outputs of the positions [`Self::cut`] kept, whole: with cp each rank computed its own,
    /// gathered over the group (the gradient going back keeps each rank's part) and put in
    /// sequence order.
    fn gather<B: ParallelBackend>(&self, out: Tensor<B, 3>, cp: &CpGroup) -> Tensor<B, 3> {
        match self {
            HeadWindow::Context(w) => {
                let order = crate::models::index_tensor(&w.order, &out.device());
                cp.region(out, Region::GatherFrom(1)).select(1, order)
            }
            _ => out,
        }
    }
}

/// What enters a forward pass: token ids (the first pipeline stage) or the previous stage's
/// hidden states `[batch, seq, hidden]` (a sequence shard with sequence parallelism).
pub(super) enum StageInput<B: Backend> {
    Ids(Tensor<B, 2, Int>),
    Hidden(Tensor<B, 3>),
}

/// The logit given to padded vocabulary ids: exp() of it is 0 and, being finite, so is its
/// product with it (an entropy term), where −∞ would give NaN.
const PADDED_LOGIT: f32 = -1.0e30;

/// Token ids, the attention mask and position ids of a forward pass.
type ModelInputs<B> = (Tensor<B, 2, Int>, Option<Tensor<B, 2>>, Tensor<B, 2, Int>);

/// How [`CausalLm::decoder`] uses a cache.
pub(super) enum CacheMode<'a, B: Backend> {
    None,
    Grow(&'a mut KvCache<B>),
    Chunk {
        cache: &'a mut SlotKvCache<B>,
        chunks: &'a ChunkLayout,
    },
    Slots {
        cache: &'a mut SlotKvCache<B>,
        positions: &'a [usize],
        window: usize,
        on_device: Option<&'a Tensor<B, 1>>,
    },
}

impl<B: ParallelBackend> CausalLm<B> {
    /// The shape of the hidden states entering this stage for a micro-batch of `batch` rows of
    /// `seq` tokens (this rank's sequence shard with sequence parallelism).
    /// (A packed batch is one row of its tokens.)
    pub fn stage_input_shape(&self, batch: usize, seq: usize) -> [usize; 3] {
        let hidden = self.layers[0].input_layernorm.weight.dims()[0];
        let shards = self.sequence_shards();
        let padded = ContextSplit::padded_len(seq, self.cp.size(), shards);
        [batch, padded / self.cp.size() / shards, hidden]
    }

    /// One pipeline stage's forward: token ids on the first stage (`hidden` = `None`), the
    /// previous stage's hidden states elsewhere. Returns the hidden states for the next stage,
    /// or on the last stage (a whole model is one) the outputs of positions
    /// `start..start + len`. `input_ids` (for its shape), `attention_mask` and `position_ids`
    /// are the micro-batch's on every stage.
    pub fn forward_stage(
        &self,
        hidden: Option<Tensor<B, 3>>,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        start: usize,
        len: usize,
    ) -> Tensor<B, 3> {
        self.forward_stage_with(
            hidden,
            input_ids,
            attention_mask,
            position_ids,
            (start, len),
            None,
        )
    }

    /// Computes the output head fused with log-softmax and entropy, `chunk` tokens at a time
    /// ([`crate::models::fused_log_probs`]): passes that give their labels get `[batch, len, 2]`
    /// log-probs and entropies instead of logits. Only for an LM head without a logit soft-cap
    /// (Gemma 2's logits take the plain head).
    pub fn with_fused_log_probs(mut self, chunk: usize) -> Self {
        if self.score.is_none() && self.config.variants.final_logit_softcapping.is_none() {
            self.fused_head_chunk = Some(chunk.max(1));
        }
        self
    }

    /// [`Self::forward_stage`] with the window `(start, len)`; given `fused` targets and a
    /// fused head ([`Self::with_fused_log_probs`]), the last stage returns log-probs and
    /// entropies `[batch, len, 2]` instead of logits.
    pub fn forward_stage_with(
        &self,
        hidden: Option<Tensor<B, 3>>,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        (start, len): (usize, usize),
        fused: Option<FusedTargets<B>>,
    ) -> Tensor<B, 3> {
        let [b, t] = input_ids.dims();
        let device = input_ids.device();
        let positions = position_ids.unwrap_or_else(|| {
            Tensor::<B, 1, Int>::arange(0..t as i64, &device)
                .unsqueeze_dim::<2>(0)
                .repeat_dim(0, b)
        });
        let (input_ids, attention_mask, positions) =
            self.pad_for_sequence_parallel(input_ids, attention_mask, positions);
        let padded = input_ids.dims()[1];
        // With context parallelism this rank runs its own positions of the sequence; attention
        // reads the group's keys, gathered in `gathered_keys` order.
        let (input_ids, positions, mask, window) = if self.cp.is_parallel() {
            let split = self.cp.split(padded);
            let index = |p: Vec<usize>| crate::models::index_tensor::<B>(&p, &device);
            let (local, keys) = (split.local(), split.gathered_keys());
            let key_mask = attention_mask
                .clone()
                .map(|m| m.select(1, index(keys.clone())));
            let bias = positional_bias(b, &local, &keys, key_mask, &device);
            let ids = input_ids.select(1, index(local.clone()));
            let positions = positions.select(1, index(local.clone()));
            let window = HeadWindow::Context(split.window(start, len));
            if crate::models::sparse_moe::collecting_aux_losses() {
                let mask = attention_mask_local(&attention_mask, &local, b, &device);
                crate::models::sparse_moe::set_aux_token_mask(mask);
            }
            let mask = AttentionMask::from_bias(bias).at_positions(local, 1, keys);
            (ids, positions, mask, window)
        } else {
            if crate::models::sparse_moe::collecting_aux_losses() {
                let all: Vec<usize> = (0..padded).collect();
                let mask = attention_mask_local(&attention_mask, &all, b, &device);
                crate::models::sparse_moe::set_aux_token_mask(mask);
            }
            let mask = AttentionMask::causal(b, padded, attention_mask, &device);
            (input_ids, positions, mask, HeadWindow::Range(start, len))
        };
        self.run_stage(hidden, input_ids, positions, &mask, window, fused)
    }

    /// [`Self::forward_stage_with`] over a packed batch ([`crate::models::packing`]): `input_ids` and
    /// `position_ids` `[1, tokens]` are `packing`'s packed row (positions restarting at each
    /// sequence). The last stage returns the outputs at `packing.window`, `[rows, window_len,
    /// out]` as the padded pass returns them (`fused` labels are `[rows, window_len]`); the
    /// others, this stage's hidden states of the packed row.
    pub fn forward_packed_stage(
        &self,
        hidden: Option<Tensor<B, 3>>,
        packing: &PackedSequences,
        (input_ids, position_ids): (Tensor<B, 2, Int>, Tensor<B, 2, Int>),
        fused: Option<FusedTargets<B>>,
    ) -> Tensor<B, 3> {
        let device = input_ids.device();
        let tokens = packing.tokens();
        let padded = ContextSplit::padded_len(tokens, self.cp.size(), self.sequence_shards());
        // Positions past the packed tokens (so the row splits over sp and cp) are sequences of
        // their own, masked out of the MoE statistics.
        let pad = |x: Tensor<B, 2, Int>| match padded - tokens {
            0 => x,
            extra => Tensor::cat(vec![x, Tensor::zeros([1, extra], &device)], 1),
        };
        let (input_ids, positions) = (pad(input_ids), pad(position_ids));
        let real = || {
            let mut m = vec![1.0f32; tokens];
            m.resize(padded, 0.0);
            Tensor::<B, 2>::from_data(TensorData::new(m, [1, padded]), &device)
        };
        let fused = fused.map(|f| FusedTargets {
            labels: f.labels.reshape([1, packing.rows * packing.window_len]),
            temperature: f.temperature,
        });
        let (input_ids, positions, mask, window) = if self.cp.is_parallel() {
            let split = self.cp.split(padded);
            let (local, keys) = (split.local(), split.gathered_keys());
            let bias = crate::models::attention::packed_positional_bias(
                &local,
                &keys,
                &packing.segments(padded),
                &device,
            );
            if crate::models::sparse_moe::collecting_aux_losses() {
                let mask = attention_mask_local(&Some(real()), &local, 1, &device);
                crate::models::sparse_moe::set_aux_token_mask(mask);
            }
            let index = crate::models::index_tensor::<B>(&local, &device);
            (
                input_ids.select(1, index.clone()),
                positions.select(1, index),
                // Within a sequence, packed indices are as far apart as its positions.
                AttentionMask::from_bias(bias).at_positions(local, 1, keys),
                HeadWindow::Context(split.window_at(&packing.window)),
            )
        } else {
            if crate::models::sparse_moe::collecting_aux_losses() {
                crate::models::sparse_moe::set_aux_token_mask(real().reshape([padded]));
            }
            let mask = AttentionMask::packed(packing, padded, &device);
            let (inverse, keep) = packing.window_inverse(padded);
            let window = HeadWindow::Positions(packing.window.clone(), inverse, keep);
            (input_ids, positions, mask, window)
        };
        let out = self.run_stage(hidden, input_ids, positions, &mask, window, fused);
        if !self.stage.is_last() {
            return out;
        }
        let width = out.dims()[2];
        out.reshape([packing.rows, packing.window_len, width])
    }

    /// The decoder of this stage over its tokens (`input_ids` or `hidden`) at `positions`,
    /// and on the last stage the head's outputs at `window`.
    fn run_stage(
        &self,
        hidden: Option<Tensor<B, 3>>,
        input_ids: Tensor<B, 2, Int>,
        positions: Tensor<B, 2, Int>,
        mask: &AttentionMask<B>,
        window: HeadWindow,
        fused: Option<FusedTargets<B>>,
    ) -> Tensor<B, 3> {
        let rope = self.rope_tables(&positions);
        let input = match hidden {
            Some(h) => StageInput::Hidden(h),
            None => StageInput::Ids(input_ids),
        };
        let h = self.decoder(input, mask, &rope, CacheMode::None);
        if !self.stage.is_last() {
            return h;
        }
        match (fused, self.fused_head_chunk) {
            (Some(targets), Some(chunk)) => self.fused_head(h, window, targets, chunk),
            _ => self.head(h, window),
        }
    }

    /// Training and log-prob passes pack their sequences ([`Self::pack_sequences`]).
    pub fn with_packed_sequences(mut self, on: bool) -> Self {
        self.pack_sequences = on;
        self
    }

    /// This rank's rows of the output projection (the LM head, or the tied embedding).
    fn head_rows(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.embedding().weight.val(),
        }
    }

    /// The fused head on the window's hidden states: `[batch, len, 2]` log-probs of
    /// `targets.labels` and entropies, gathered over cp like logits are.
    fn fused_head(
        &self,
        h: Tensor<B, 3>,
        window: HeadWindow,
        targets: FusedTargets<B>,
        chunk: usize,
    ) -> Tensor<B, 3> {
        let h = window.cut(self.tp.enter(h));
        let labels = match &window {
            HeadWindow::Context(w) => targets
                .labels
                .select(1, crate::models::index_tensor(&w.offsets, &h.device())),
            _ => targets.labels,
        };
        let [b, n, hidden] = h.dims();
        let (vocab_start, real_rows, _) = self.tp.vocab_part(self.vocab_size);
        let spec = crate::models::fused_log_probs::FusedHead {
            vocab_start,
            real_rows,
            scale: 1.0 / targets.temperature,
            chunk,
            dtype: self.compute_dtype,
        };
        let out = self
            .tp
            .fused_head_log_probs(
                h.reshape([b * n, hidden]),
                self.head_rows(),
                labels.reshape([b * n]),
                spec,
            )
            .reshape([b, n, 2]);
        window.gather(out, &self.cp)
    }

    /// Logits `[batch, seq, vocab]` for `input_ids` `[batch, seq]` (with a score head:
    /// scores `[batch, seq, num_labels]`). `attention_mask` `[batch,
    /// seq]` (1 = token, 0 = padding) and `position_ids` default to all-ones and 0..seq.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        let t = input_ids.dims()[1];
        self.forward_window(input_ids, attention_mask, position_ids, 0, t)
    }

    /// The outputs (logits, or scores with a score head) of positions `start..start + len` only,
    /// `[batch, len, out]`: the response window of a training step, so the vocabulary projection
    /// runs on the response positions alone.
    pub fn forward_window(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        start: usize,
        len: usize,
    ) -> Tensor<B, 3> {
        self.forward_stage(None, input_ids, attention_mask, position_ids, start, len)
    }

    /// How many sequence-parallel shards each rank's tokens are cut into (1 without sequence
    /// parallelism).
    fn sequence_shards(&self) -> usize {
        if self.tp.sequence_parallel {
            self.tp.size
        } else {
            1
        }
    }

    /// With sequence parallelism the sequence must split evenly over the tp ranks, and with
    /// context parallelism into 2·cp chunks (each of which splits over tp): pads the batch on
    /// the right with masked tokens (which no real token attends to, being causal and masked)
    /// up to a multiple of that ([`ContextSplit::padded_len`]). Outputs are cut back to the
    /// asked positions.
    fn pad_for_sequence_parallel(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        positions: Tensor<B, 2, Int>,
    ) -> ModelInputs<B> {
        let [b, t] = input_ids.dims();
        let pad = ContextSplit::padded_len(t, self.cp.size(), self.sequence_shards()) - t;
        if pad == 0 {
            return (input_ids, attention_mask, positions);
        }
        let device = input_ids.device();
        let mask = attention_mask.unwrap_or_else(|| Tensor::ones([b, t], &device));
        (
            Tensor::cat(vec![input_ids, Tensor::zeros([b, pad], &device)], 1),
            Some(Tensor::cat(vec![mask, Tensor::zeros([b, pad], &device)], 1)),
            Tensor::cat(vec![positions, Tensor::zeros([b, pad], &device)], 1),
        )
    }

    /// As [`Self::forward`] for the new tokens `input_ids` `[batch, new]`, attending to the
    /// cached keys too, and extending `cache`. `attention_mask` covers every key, cached and new
    /// (`[batch, cached + new]`); `position_ids` are the new tokens' positions. A prefill is a
    /// call on an empty cache; a decode step is a call with one new token per row.
    pub fn forward_cached(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2>,
        position_ids: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        if cache.layers.len() != self.layers.len() {
            cache.layers = (0..self.layers.len()).map(|_| None).collect();
            cache.len = 0;
        }
        let [b, t] = input_ids.dims();
        let device = input_ids.device();
        let past = cache.len;
        let rope = self.rope_tables(&position_ids);
        let mask =
            AttentionMask::from_bias(attention_bias(b, t, past, Some(attention_mask), &device))
                .at_positions((past..past + t).collect(), 1, (0..past + t).collect());
        let h = self.decoder(
            StageInput::Ids(input_ids),
            &mask,
            &rope,
            CacheMode::Grow(cache),
        );
        cache.len += t;
        self.head(h, HeadWindow::All)
    }

    /// Embedding (first stage), this stage's decoder layers and the final norm (last stage):
    /// hidden states `[batch, seq, hidden]`.
    pub(super) fn decoder(
        &self,
        input: StageInput<B>,
        mask: &AttentionMask<B>,
        rope: &RopeTables<B>,
        mut mode: CacheMode<'_, B>,
    ) -> Tensor<B, 3> {
        assert!(
            !(self.tp.sequence_parallel || self.cp.is_parallel()) || matches!(mode, CacheMode::None),
            "sequence and context parallelism are for training passes; generation runs without them"
        );
        let _precision = precision::enter(self.compute_dtype);
        if matches!(mode, CacheMode::None) {
            if let Some(recompute) = self.recompute.filter(|_| super::recompute::recording()) {
                return self.decoder_recomputed(input, mask, rope, recompute);
            }
        }
        let mut h = match input {
            StageInput::Ids(ids) => self.embed(ids),
            StageInput::Hidden(h) => h,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let attn_cache = match &mut mode {
                CacheMode::None => AttnCache::None,
                CacheMode::Grow(c) => AttnCache::Grow(&mut c.layers[l]),
                CacheMode::Chunk { cache, chunks } => AttnCache::Chunk {
                    cache,
                    layer: l,
                    chunks,
                },
                CacheMode::Slots {
                    cache,
                    positions,
                    window,
                    on_device,
                } => AttnCache::Slots {
                    cache,
                    layer: l,
                    positions,
                    window: *window,
                    on_device: *on_device,
                },
            };
            h = layer.forward(h, mask, rope, attn_cache);
        }
        self.final_norm(h)
    }

    /// The rope tables of a forward at `positions` `[batch, seq]`.
    pub(super) fn rope_tables(&self, positions: &Tensor<B, 2, Int>) -> RopeTables<B> {
        self.rope.layer_tables(self.local_rope.as_ref(), positions)
    }

    /// The token embeddings of `ids`, times √hidden for Gemma (rounded to f32 first, as
    /// transformers' `embed_scale`).
    pub(super) fn embed(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.scale_embeddings(self.embedding().forward(ids))
    }

    /// Embeddings `h` as the first layer reads them (× √hidden for Gemma).
    pub(super) fn scale_embeddings(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        match self.config.architecture.is_gemma() {
            true => h * (self.config.hidden_size as f64).sqrt() as f32,
            false => h,
        }
    }

    /// The last stage's final norm (the identity elsewhere).
    pub(super) fn final_norm(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.norm {
            Some(norm) => norm.forward(h),
            None => h,
        }
    }

    /// The output projection of hidden states `[batch, seq, hidden]` (with sequence
    /// parallelism, this rank's sequence shard), restricted to `window` = `(start, len)`
    /// positions when given: the score head when present, else the LM head (or the tied
    /// embedding) on this rank's vocabulary shard.
    pub(super) fn head(&self, h: Tensor<B, 3>, window: HeadWindow) -> Tensor<B, 3> {
        let device = h.device();
        device_span::<B, _>(&device, "lm_head", || {
            window.gather(self.output_head(h, &window), &self.cp)
        })
    }

    fn output_head(&self, h: Tensor<B, 3>, window: &HeadWindow) -> Tensor<B, 3> {
        let _precision = precision::enter(self.compute_dtype);
        let cut = |h| window.cut(h);
        if let Some(score) = &self.score {
            // A replicated head reads whole sequences; each rank's gradient is then whole too,
            // so going back it is split, not summed.
            let h = if self.tp.sequence_parallel {
                self.tp.region(h, Region::GatherFrom(1))
            } else {
                h
            };
            return score.forward(cut(h));
        }
        let h = cut(self.tp.enter(h));
        let logits = match &self.lm_head {
            Some(head) => head.forward(h),
            None => {
                let [b, t, hidden] = h.dims();
                // A generation model's bf16 copy of the tied matrix, else the embedding.
                let w = match self.generation().and_then(|g| g.tied_head.clone()) {
                    Some(w) => w,
                    None => self.embedding().weight.val(),
                };
                let [vocab, _] = w.dims();
                precision::linear(h.reshape([b * t, hidden]), w).reshape([b, t, vocab])
            }
        };
        let logits = match self.config.variants.final_logit_softcapping {
            Some(cap) => (logits / cap).tanh() * cap,
            None => logits,
        };
        let (_, real, per) = self.tp.vocab_part(self.vocab_size);
        if real == per {
            return logits;
        }
        let [b, t, _] = logits.dims();
        let pad = Tensor::full([b, t, per - real], PADDED_LOGIT, &logits.device());
        match real {
            0 => pad,
            _ => Tensor::cat(vec![logits.narrow(2, 0, real), pad], 2),
        }
    }
}

impl<B: ParallelBackend> DecoderLayer<B> {
    /// The pre-norm layer: attention then the MLP, each added to the residual stream.
    pub(super) fn forward(
        &self,
        h: Tensor<B, 3>,
        mask: &AttentionMask<B>,
        rope: &RopeTables<B>,
        cache: AttnCache<'_, B>,
    ) -> Tensor<B, 3> {
        let device = h.device();
        let (cos, sin) = rope.for_layer(self.self_attn.scores.sliding_window.is_some());
        let attn = device_span::<B, _>(&device, "attention", || {
            self.self_attn.forward(
                self.input_layernorm.forward(h.clone()),
                mask,
                cos,
                sin,
                cache,
            )
        });
        // Gemma norms each sublayer's output before the residual add, and the MLP's input with
        // its own norm.
        let (attn, mlp_norm) = match &self.pre_feedforward_layernorm {
            Some(pre) => (self.post_attention_layernorm.forward(attn), pre),
            None => (attn, &self.post_attention_layernorm),
        };
        let h = h + attn;
        let ff = device_span::<B, _>(&device, "mlp", || {
            self.mlp.forward(mlp_norm.forward(h.clone()))
        });
        let ff = match &self.post_feedforward_layernorm {
            Some(post) => post.forward(ff),
            None => ff,
        };
        h + ff
    }
}

impl<B: Backend> CausalLm<B> {
    /// A sequence score read at each row's last token (`attention_mask` 1 = token; `None`: the
    /// last position), from per-token scores `[batch, seq, labels]` → `[batch, labels]`. This is
    /// where a reward model's score, and verl's outcome reward, live.
    pub fn last_token_scores(
        scores: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 2> {
        let [b, t, labels] = scores.dims();
        let last: Vec<i64> = match attention_mask {
            None => vec![t as i64 - 1; b],
            Some(mask) => {
                let m: Vec<f64> = mask.to_data().iter::<f64>().collect();
                (0..b)
                    .map(|i| (0..t).rev().find(|&j| m[i * t + j] > 0.5).unwrap_or(t - 1) as i64)
                    .collect()
            }
        };
        let idx =
            Tensor::<B, 3, Int>::from_data(TensorData::new(last, [b, 1, 1]), &scores.device())
                .repeat_dim(2, labels);
        scores.gather(1, idx).reshape([b, labels])
    }
}

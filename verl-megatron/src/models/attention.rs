//! Causal self-attention with grouped-query heads.

use std::cell::OnceCell;

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Int, TensorData};

use super::kv_cache::{keys_up_to, ChunkLayout, LayerKv, SlotKvCache};
use super::latent_attention::{identity_tables, LatentAttention};
use super::packing::PackedSequences;
use crate::layers::precision::{self, ComputeDtype};
use crate::layers::{ColumnParallelLinear, RmsNorm, RotaryEmbedding, RowParallelLinear};
use crate::ops::FusedOps;
use crate::parallel::{CpGroup, ParallelBackend, Region, TpGroup};

/// Where an attention call reads and writes cached keys and values.
pub enum AttnCache<'a, B: Backend> {
    /// No cache: keys are this call's tokens.
    None,
    /// Keys are the cached ones followed by this call's; the cache grows.
    Grow(&'a mut LayerKv<B>),
    /// A chunked prefill's continuation: each chunk's tokens written into its slot after the
    /// cached part; keys are the slots' first positions ([`ChunkLayout`]).
    Chunk {
        cache: &'a mut SlotKvCache<B>,
        layer: usize,
        chunks: &'a ChunkLayout,
    },
    /// One new token per slot, written at each slot's own position; keys are the slot's first
    /// `window` positions.
    Slots {
        cache: &'a mut SlotKvCache<B>,
        layer: usize,
        positions: &'a [usize],
        window: usize,
        /// The positions uploaded for the decode kernel ([`SlotKvCache::step_positions`]), when
        /// it applies.
        on_device: Option<&'a Tensor<B, 1>>,
    },
}

/// Which keys each query may attend to, in the two forms the attention paths read: the additive
/// bias `[batch, 1, queries, keys]` (0 allowed, −∞ not) of the decomposed path, and, for a pass
/// with no cache, the keys' mask `[batch, seq]` the fused kernel reads. The bias is built on
/// first use, so a pass that runs the fused kernel never builds it.
#[derive(Clone)]
pub struct AttentionMask<B: Backend> {
    bias: OnceCell<Tensor<B, 4>>,
    causal: Option<CausalKeys<B>>,
    /// A bias given as host values, uploaded on first use.
    host: Option<(Vec<f32>, [usize; 4], B::Device)>,
    /// A decode step's slots: slot `s` attends to its positions `0..=positions[s]` of the
    /// first `window`. The bias is built and uploaded only if some attention reads it (a step
    /// whose attention runs in the decode kernel never does).
    slots: Option<(Vec<usize>, usize, B::Device)>,
    /// A packed row's sequences ([`Self::packed`]).
    packed: Option<PackedRows<B>>,
    /// Where queries and keys sit, for a sliding window ([`Self::at_positions`]); causal,
    /// packed and decode-step masks derive theirs ([`Self::window_positions`]).
    positions: Option<MaskPositions>,
    /// The bias with a sliding window's cut, built on first use.
    windowed: OnceCell<(usize, Tensor<B, 4>)>,
}

/// The sequence positions of a mask's queries (`rows` × `queries`, `rows` 1 when every batch
/// row has the same) and keys, which decide what a sliding window cuts.
#[derive(Clone, Debug)]
struct MaskPositions {
    queries: Vec<usize>,
    rows: usize,
    keys: Vec<usize>,
}

/// A packed row's attention layout ([`super::packing::PackedSequences::attention_rows`]): each
/// sequence's tokens in a row of their own, `width` wide, for the attention product alone.
#[derive(Clone)]
struct PackedRows<B: Backend> {
    /// `[sequences · width]`: the packed position of each slot.
    rows_index: Tensor<B, 1, Int>,
    /// `[padded]`: the slot of each packed position.
    packed_index: Tensor<B, 1, Int>,
    /// `[padded]`: 1 for the packed tokens, 0 for the positions past them (in no slot).
    token_keep: Tensor<B, 1>,
    /// `[sequences · width]`: 1 for the slots holding a token, 0 past a sequence's end.
    slot_keep: Tensor<B, 1>,
    sequences: usize,
    width: usize,
    /// `[sequences, width]`, 1 = token.
    key_mask: Tensor<B, 2>,
}

/// A pass with no cache: causal over its own tokens, keys masked by `key_mask` (1 = token;
/// `None`: every key is a token).
#[derive(Clone)]
struct CausalKeys<B: Backend> {
    batch: usize,
    seq: usize,
    key_mask: Option<Tensor<B, 2>>,
    device: B::Device,
}

impl<B: Backend> AttentionMask<B> {
    /// A mask given as its additive bias (passes over a cache).
    pub fn from_bias(bias: Tensor<B, 4>) -> Self {
        Self {
            bias: OnceCell::from(bias),
            causal: None,
            host: None,
            slots: None,
            packed: None,
            positions: None,
            windowed: OnceCell::new(),
        }
    }

    /// This mask with its queries at sequence positions `queries` (`rows` × queries: one row
    /// for the whole batch, or one a batch row) and keys at `keys`, which a sliding window needs
    /// ([`Self::bias_within`]).
    pub fn at_positions(mut self, queries: Vec<usize>, rows: usize, keys: Vec<usize>) -> Self {
        assert!(
            rows > 0 && queries.len().is_multiple_of(rows),
            "{} query positions in {rows} rows",
            queries.len()
        );
        self.positions = Some(MaskPositions {
            queries,
            rows,
            keys,
        });
        self
    }

    /// A mask given as the additive bias's host values `shape` = `[batch, 1, queries, keys]`,
    /// uploaded only if some attention reads it.
    pub fn from_host_bias(values: Vec<f32>, shape: [usize; 4], device: &B::Device) -> Self {
        Self {
            bias: OnceCell::new(),
            causal: None,
            host: Some((values, shape, device.clone())),
            slots: None,
            packed: None,
            positions: None,
            windowed: OnceCell::new(),
        }
    }

    /// A decode step's mask: slot `s` attends to its positions `0..=positions[s]`, keys being
    /// the first `window` positions of each slot. Built only if some attention reads it.
    pub fn decode_step(positions: &[usize], window: usize, device: &B::Device) -> Self {
        assert!(
            positions.iter().all(|&p| p < window),
            "every position within the window {window}"
        );
        Self {
            bias: OnceCell::new(),
            causal: None,
            host: None,
            slots: Some((positions.to_vec(), window, device.clone())),
            packed: None,
            positions: None,
            windowed: OnceCell::new(),
        }
    }

    /// Causal attention over `seq` tokens per row with no cache; `key_mask` `[batch, seq]`
    /// (1 = token, 0 = padding) masks padded keys, and a padded query attends to itself so
    /// its softmax stays finite.
    pub fn causal(
        batch: usize,
        seq: usize,
        key_mask: Option<Tensor<B, 2>>,
        device: &B::Device,
    ) -> Self {
        Self {
            bias: OnceCell::new(),
            causal: Some(CausalKeys {
                batch,
                seq,
                key_mask,
                device: device.clone(),
            }),
            host: None,
            slots: None,
            packed: None,
            positions: None,
            windowed: OnceCell::new(),
        }
    }

    /// A packed row of `padded` positions holding `packing`'s sequences
    /// ([`super::packing`]): each token attends to the earlier tokens of its own sequence.
    /// Attention runs with each sequence in a row of its own (the bias, if read, is that
    /// layout's `[sequences, 1, width, width]`).
    pub fn packed(packing: &PackedSequences, padded: usize, device: &B::Device) -> Self {
        let (rows_index, packed_index, width) = packing.attention_rows(padded);
        let sequences = packing.lens.len();
        let slot_keep = Tensor::<B, 1>::from_data(
            TensorData::new(packing.attention_key_mask(width), [sequences * width]),
            device,
        );
        let mut tokens = vec![1.0f32; packing.tokens()];
        tokens.resize(packed_index.len(), 0.0);
        let token_keep = Tensor::from_data(TensorData::new(tokens, [packed_index.len()]), device);
        Self {
            bias: OnceCell::new(),
            causal: None,
            host: None,
            slots: None,
            packed: Some(PackedRows {
                rows_index: super::index_tensor(&rows_index, device),
                packed_index: super::index_tensor(&packed_index, device),
                token_keep,
                key_mask: slot_keep.clone().reshape([sequences, width]),
                slot_keep,
                sequences,
                width,
            }),
            positions: None,
            windowed: OnceCell::new(),
        }
    }

    /// The additive bias `[batch, 1, queries, keys]`.
    pub fn bias(&self) -> &Tensor<B, 4> {
        self.bias.get_or_init(|| {
            if let Some(p) = &self.packed {
                let device = p.key_mask.device();
                return attention_bias(p.sequences, p.width, 0, Some(p.key_mask.clone()), &device);
            }
            if let Some((values, shape, device)) = &self.host {
                return Tensor::from_data(TensorData::new(values.clone(), *shape), device);
            }
            if let Some((positions, window, device)) = &self.slots {
                let values = keys_up_to(positions.iter().copied(), *window);
                let shape = [positions.len(), 1, 1, *window];
                return Tensor::from_data(TensorData::new(values, shape), device);
            }
            let c = self
                .causal
                .as_ref()
                .expect("a mask is built from a bias or from its keys");
            attention_bias(c.batch, c.seq, 0, c.key_mask.clone(), &c.device)
        })
    }

    /// For a causal pass with no cache, the keys' mask (`Some(None)`: no padding).
    fn causal_keys(&self) -> Option<Option<Tensor<B, 2>>> {
        self.causal.as_ref().map(|c| c.key_mask.clone())
    }

    /// The last query position and the first key position: how far apart a query and a key
    /// can be. Derived for causal, packed and decode-step masks (no lists built).
    fn position_span(&self) -> Option<(usize, usize)> {
        if let Some(p) = &self.positions {
            return Some((*p.queries.iter().max()?, *p.keys.iter().min()?));
        }
        // Keys are positions 0.. in every derived case.
        let last = match (&self.causal, &self.packed, &self.slots) {
            (Some(c), _, _) => c.seq.checked_sub(1)?,
            (_, Some(p), _) => p.width.checked_sub(1)?,
            (_, _, Some((positions, _, _))) => *positions.iter().max()?,
            _ => panic!(
                "a mask read with a sliding window knows its positions (AttentionMask::at_positions)"
            ),
        };
        Some((last, 0))
    }

    /// The positions of the queries (`rows` × queries) and keys: given, or derived for causal
    /// passes and packed rows (each sequence in a row of its own from position 0) and decode
    /// steps (one query a slot, keys the window's positions).
    fn window_positions(&self) -> MaskPositions {
        if let Some(p) = &self.positions {
            return p.clone();
        }
        let all = |n: usize| (0..n).collect::<Vec<_>>();
        match (&self.causal, &self.packed, &self.slots) {
            (Some(c), _, _) => MaskPositions {
                queries: all(c.seq),
                rows: 1,
                keys: all(c.seq),
            },
            (_, Some(p), _) => MaskPositions {
                queries: all(p.width),
                rows: 1,
                keys: all(p.width),
            },
            (_, _, Some((positions, window, _))) => MaskPositions {
                queries: positions.clone(),
                rows: positions.len(),
                keys: all(*window),
            },
            _ => panic!(
                "a mask read with a sliding window knows its positions (AttentionMask::at_positions)"
            ),
        }
    }

    /// Whether a sliding window of `window` keys cuts any key this mask allows: some query sits
    /// `window` or more positions after some key.
    pub fn window_cuts(&self, window: usize) -> bool {
        self.position_span()
            .is_some_and(|(last, first)| last >= first + window)
    }

    /// The additive bias with a sliding window of `window` keys (`None`: [`Self::bias`]): a
    /// query at position q also loses the keys at positions k ≤ q − window.
    pub fn bias_within(&self, window: Option<usize>) -> Tensor<B, 4> {
        let Some(w) = window.filter(|&w| self.window_cuts(w)) else {
            return self.bias().clone();
        };
        let (built, bias) = self.windowed.get_or_init(|| {
            let bias = self.bias().clone();
            let [batch, _, t, keys] = bias.dims();
            let p = self.window_positions();
            let device = bias.device();
            let q = super::index_tensor::<B>(&p.queries, &device)
                .reshape([p.rows, 1, t, 1])
                .repeat_dim(3, keys);
            let k = super::index_tensor::<B>(&p.keys, &device)
                .reshape([1, 1, 1, keys])
                .repeat_dim(2, t)
                .repeat_dim(0, p.rows);
            let mut cut = q.sub(k).greater_equal_elem(w as i64);
            if p.rows != batch {
                cut = cut.repeat_dim(0, batch);
            }
            (w, bias.mask_fill(cut, f32::NEG_INFINITY))
        });
        assert_eq!(*built, w, "one sliding window a model");
        bias.clone()
    }
}

/// `[1, 1, t, past + t]`: 0 where new query i (absolute index past + i) may attend key j
/// (j ≤ past + i), −∞ elsewhere.
pub fn causal_bias<B: Backend>(t: usize, past: usize, device: &B::Device) -> Tensor<B, 4> {
    let keys = past + t;
    let allowed = keys_up_to(past..past + t, keys);
    Tensor::<B, 2>::from_data(TensorData::new(allowed, [t, keys]), device).reshape([1, 1, t, keys])
}

/// `[batch, 1, t, past + t]`: causal, no padded key (`attention_mask` covers every key, 1 =
/// token); a padded query attends to itself so its softmax stays finite.
pub fn attention_bias<B: Backend>(
    b: usize,
    t: usize,
    past: usize,
    attention_mask: Option<Tensor<B, 2>>,
    device: &B::Device,
) -> Tensor<B, 4> {
    let keys = past + t;
    let mut bias = causal_bias::<B>(t, past, device).repeat_dim(0, b);
    if let Some(mask) = attention_mask {
        let masked_keys = mask
            .reshape([b, 1, 1, keys])
            .lower_elem(0.5)
            .repeat_dim(2, t);
        bias = bias.mask_fill(masked_keys, f32::NEG_INFINITY);
        // A padded query row would be all −∞: let it attend to itself so softmax stays finite.
        let mut own: Vec<f32> = vec![0.0; t * keys];
        for i in 0..t {
            own[i * keys + past + i] = 1.0;
        }
        let diag = Tensor::<B, 2>::from_data(TensorData::new(own, [t, keys]), device)
            .reshape([1, 1, t, keys])
            .repeat_dim(0, b)
            .greater_elem(0.5);
        bias = bias.mask_fill(diag, 0.0);
    }
    bias
}

/// `[batch, 1, queries, keys]` for queries and keys given by their positions in the sequence
/// (a context-parallel rank's own tokens against the group's gathered keys): a query attends
/// to the keys at or before its position that are tokens (`key_mask` `[batch, keys]`, in the
/// keys' order, 1 = token), and always to its own position so its softmax stays finite.
pub fn positional_bias<B: Backend>(
    batch: usize,
    queries: &[usize],
    keys: &[usize],
    key_mask: Option<Tensor<B, 2>>,
    device: &B::Device,
) -> Tensor<B, 4> {
    sequence_bias(batch, (queries, keys), None, key_mask, device)
}

/// [`positional_bias`] over a packed row ([`super::packing`]): `segments[p]` is the sequence
/// of packed position `p`, and a query attends only to keys of its own sequence.
pub fn packed_positional_bias<B: Backend>(
    queries: &[usize],
    keys: &[usize],
    segments: &[usize],
    device: &B::Device,
) -> Tensor<B, 4> {
    sequence_bias(1, (queries, keys), Some(segments), None, device)
}

fn sequence_bias<B: Backend>(
    batch: usize,
    (queries, keys): (&[usize], &[usize]),
    segments: Option<&[usize]>,
    key_mask: Option<Tensor<B, 2>>,
    device: &B::Device,
) -> Tensor<B, 4> {
    let (t, k) = (queries.len(), keys.len());
    // Built on the device from the position lists (the grid is as large as the scores it
    // masks; a long sequence's never passes through host memory).
    let column = |p: &[usize]| {
        super::index_tensor::<B>(p, device)
            .reshape([t, 1])
            .repeat_dim(1, k)
    };
    let row = |p: &[usize]| {
        super::index_tensor::<B>(p, device)
            .reshape([1, k])
            .repeat_dim(0, t)
    };
    let (q, key) = (column(queries), row(keys));
    let expand = |m: Tensor<B, 2, Bool>| m.reshape([1, 1, t, k]).repeat_dim(0, batch);
    let own = key.clone().equal(q.clone());
    let mut earlier = key.lower_equal(q);
    if let Some(seg) = segments {
        let of = |p: &[usize]| p.iter().map(|&i| seg[i]).collect::<Vec<_>>();
        earlier = earlier.bool_and(column(&of(queries)).equal(row(&of(keys))));
    }
    let mut allowed = expand(earlier);
    if let Some(mask) = key_mask {
        let token = mask
            .reshape([batch, 1, 1, k])
            .greater_elem(0.5)
            .repeat_dim(2, t);
        allowed = allowed.bool_and(token);
    }
    allowed = allowed.bool_or(expand(own));
    Tensor::<B, 4>::zeros([batch, 1, t, k], device).mask_fill(allowed.bool_not(), f32::NEG_INFINITY)
}

/// How an attention layer turns q·k into probabilities beyond the causal softmax: its scale,
/// Gemma 2's soft-cap, and a sliding window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionScores {
    /// Scores are q·k times this (`head_dim^-1/2`; Gemma's `query_pre_attn_scalar^-1/2`).
    pub scale: f64,
    /// `cap · tanh(s / cap)` after scaling, before the mask (Gemma 2).
    pub softcap: Option<f64>,
    /// A query attends to itself and the `window - 1` keys before it (transformers'
    /// `0 <= q - k < window`).
    pub sliding_window: Option<usize>,
}

impl AttentionScores {
    /// Plain attention over heads of `head_dim`.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f64).sqrt(),
            softcap: None,
            sliding_window: None,
        }
    }

    /// Layer `layer` of `cfg` (its HF index).
    pub fn of(cfg: &crate::hf::HfModelConfig, layer: usize) -> Self {
        let v = &cfg.variants;
        Self {
            scale: match (&cfg.mla, v.query_pre_attn_scalar) {
                (Some(mla), _) => mla.softmax_scale,
                (None, Some(s)) => 1.0 / s.sqrt(),
                (None, None) => 1.0 / (cfg.head_dim as f64).sqrt(),
            },
            softcap: v.attn_logit_softcapping,
            sliding_window: v.sliding_window_of(layer),
        }
    }

    /// Whether the fused prefill and training kernel computes these scores (it knows the
    /// scale and windows, not soft-caps).
    fn fused_kernels_apply(&self) -> bool {
        self.softcap.is_none()
    }

    /// These scores as the fused kernel takes them for `mask`: the window only where it cuts a
    /// key.
    fn for_fused<B: Backend>(&self, mask: &AttentionMask<B>) -> crate::ops::FusedScores {
        crate::ops::FusedScores {
            scale: self.scale as f32,
            window: self.sliding_window.filter(|&w| mask.window_cuts(w)),
        }
    }

    /// These scores as the decode kernel takes them (heads of `head_dim`): it scales,
    /// soft-caps and windows them itself. The default scale keeps its √head_dim divisor, so
    /// plain models' steps are unchanged to the bit.
    fn for_decode(&self, head_dim: usize) -> crate::ops::DecodeScores {
        let plain = crate::ops::DecodeScores::plain(head_dim);
        crate::ops::DecodeScores {
            divisor: match self.scale == Self::plain(head_dim).scale {
                true => plain.divisor,
                false => (1.0 / self.scale) as f32,
            },
            softcap: self.softcap.map(|c| c as f32),
            window: self.sliding_window,
        }
    }
}

/// One attention block: q/k/v projections (column-parallel; or DeepSeek's latent projections,
/// [`LatentAttention`]), optional per-head q/k RMSNorm
/// (Qwen3), rotary embedding, causal softmax attention, output projection (row-parallel).
/// With tensor parallelism each rank holds `heads / tp` query heads and `kv_heads / tp` kv
/// heads (grouped-query groups stay whole on one rank).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// The grouped-query projections (`None` with latent attention).
    pub q_proj: Option<ColumnParallelLinear<B>>,
    pub k_proj: Option<ColumnParallelLinear<B>>,
    pub v_proj: Option<ColumnParallelLinear<B>>,
    /// DeepSeek's multi-head latent attention's projections, instead of q/k/v.
    pub latent: Option<LatentAttention<B>>,
    pub o_proj: RowParallelLinear<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    /// Heads on this tp rank.
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    #[module(skip)]
    pub scores: AttentionScores,
    #[module(skip)]
    pub tp: TpGroup,
    /// With context parallelism the queries are this rank's tokens and the keys and values
    /// the whole group's, all-gathered (their gradients reduce-scattered back).
    #[module(skip)]
    pub cp: CpGroup,
}

pub use crate::ops::DecodeProjections;

impl<B: ParallelBackend> Attention<B> {
    /// `x` `[batch, seq, hidden]`; `mask` says which keys each query attends to (causal and
    /// padding); cos/sin from [`RotaryEmbedding::tables`]. `cache` says which keys are attended
    /// to besides this call's ([`AttnCache`]).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        mask: &AttentionMask<B>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        cache: AttnCache<'_, B>,
    ) -> Tensor<B, 3> {
        // One entry into the tensor-parallel region for the three projections.
        // One cast of x for the three products.
        let x = precision::operand(self.tp.enter(x));
        let [b, t, _] = x.dims();
        let (hd, nh, nkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        if let Some(latent) = &self.latent {
            // Heads rotated and padded to head_dim by the projections: attention's own RoPE
            // step leaves them as they are, and the values' padding is cut after.
            let (q, k, v) = latent.project(x, nh, hd, cos, sin);
            let (ones, zeros) = identity_tables(b, t, hd, &q.device());
            let dv = latent.dims.v_head_dim;
            let out = self
                .attend(q, k, v, mask, &ones, &zeros, cache)
                .reshape([b, t, nh, hd])
                .narrow(3, 0, dv)
                .reshape([b, t, nh * dv]);
            return self.o_proj.forward(out);
        }
        let (Some(q_proj), Some(k_proj), Some(v_proj)) = (&self.q_proj, &self.k_proj, &self.v_proj)
        else {
            unreachable!("an attention block without latent projections has q, k and v")
        };
        // Projections as [batch, seq, heads, head_dim]; the per-head norms act on the last dim.
        let mut q = q_proj.forward(x.clone()).reshape([b, t, nh, hd]);
        let mut k = k_proj.forward(x.clone()).reshape([b, t, nkv, hd]);
        let v = v_proj.forward(x).reshape([b, t, nkv, hd]);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(q);
            k = kn.forward(k);
        }
        self.o_proj
            .forward(self.attend(q, k, v, mask, cos, sin, cache))
    }

    /// A decode step (one token per slot of a [`AttnCache::Slots`] cache) from the fused q/k/v
    /// product `qkv` `[slots, (heads + 2 · kv_heads) · head_dim]` whose `bias` is still to be
    /// added (layers without per-head norms): the attention output `[slots, heads · head_dim]`
    /// as the output projection reads it (bf16 with bf16 products), before that projection.
    /// One kernel on burn-cuda (bias, RoPE, cache write, attention, rounding); elsewhere the
    /// operands are split and take [`Self::forward`]'s path.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_packed(
        &self,
        qkv: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        mask: &AttentionMask<B>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        cache: AttnCache<'_, B>,
    ) -> Tensor<B, 2> {
        let [b, _] = qkv.dims();
        let (hd, nh, nkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let low = precision::current() == ComputeDtype::Bf16;
        let mut projections = DecodeProjections::Packed { qkv, bias };
        if let AttnCache::Slots {
            cache: slots,
            layer,
            window,
            on_device: Some(on_device),
            ..
        } = &cache
        {
            if cos.dims() == [b, 1, 1, hd] {
                match B::decode_attention(
                    projections,
                    &cos.clone().reshape([b, hd]),
                    &sin.clone().reshape([b, hd]),
                    on_device,
                    slots.layer(*layer),
                    *window,
                    self.scores.for_decode(hd),
                    (low, low),
                ) {
                    Ok(out) => return out,
                    Err(back) => projections = back,
                }
            }
        }
        let DecodeProjections::Packed { qkv, bias } = projections else {
            unreachable!("the packed operands come back as they went")
        };
        let qkv = match bias {
            Some(bias) => qkv + bias.unsqueeze_dim(0),
            None => qkv,
        };
        let q = qkv.clone().narrow(1, 0, nh * hd).reshape([b, 1, nh, hd]);
        let k = qkv
            .clone()
            .narrow(1, nh * hd, nkv * hd)
            .reshape([b, 1, nkv, hd]);
        let v = qkv
            .narrow(1, (nh + nkv) * hd, nkv * hd)
            .reshape([b, 1, nkv, hd]);
        let out = self.attend(q, k, v, mask, cos, sin, cache);
        precision::operand(out.reshape([b, nh * hd]))
    }

    /// Attention of the projections `q` `[batch, seq, heads, head_dim]`, `k`, `v` `[batch,
    /// seq, kv_heads, head_dim]` (before RoPE) through `cache`: `[batch, seq, heads ·
    /// head_dim]`, before the output projection.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        mask: &AttentionMask<B>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        cache: AttnCache<'_, B>,
    ) -> Tensor<B, 3> {
        let (q, k, v) = match self.decode_kernel(q, k, v, cos, sin, &cache) {
            Ok(out) => return out,
            Err(qkv) => qkv,
        };
        if let (AttnCache::None, Some(rows)) = (&cache, &mask.packed) {
            return self.attend_packed(q, k, v, rows, mask, (cos, sin));
        }
        let (q, k, v) = match self.rotate_or_fuse(q, k, v, mask, cos, sin, &cache) {
            Ok((out, rotated)) => {
                // A fresh prefill's keys and values (after RoPE) start the cache.
                if let (AttnCache::Grow(cache), Some((k, v))) = (cache, rotated) {
                    *cache = Some((k.swap_dims(1, 2), v.swap_dims(1, 2)));
                }
                return out;
            }
            Err(qkv) => qkv,
        };
        let (k, v) = self.keys_and_values(k, v, cache);
        let bias = mask.bias_within(self.scores.sliding_window);
        scored_attention(q, k, v, &bias, &self.scores)
    }

    /// A decode step over the slot cache: RoPE, the cache write and attention in one kernel
    /// (`[batch, 1, heads · head_dim]`), or the projections back where it does not apply.
    fn decode_kernel(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        cache: &AttnCache<'_, B>,
    ) -> Result<Tensor<B, 3>, Qkv<B>> {
        let [b, t, _, _] = q.dims();
        let (hd, nh, nkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let (mut q, mut k, mut v) = (q, k, v);
        if let AttnCache::Slots {
            cache: slots,
            layer,
            window,
            on_device: Some(on_device),
            ..
        } = cache
        {
            if t == 1 && cos.dims() == [b, 1, 1, hd] {
                let round = precision::current() == ComputeDtype::Bf16;
                match B::decode_attention(
                    DecodeProjections::Split {
                        q: q.reshape([b, nh * hd]),
                        k: k.reshape([b, nkv * hd]),
                        v: v.reshape([b, nkv * hd]),
                    },
                    &cos.clone().reshape([b, hd]),
                    &sin.clone().reshape([b, hd]),
                    on_device,
                    slots.layer(*layer),
                    *window,
                    self.scores.for_decode(hd),
                    (round, false),
                ) {
                    Ok(out) => return Ok(out.reshape([b, 1, nh * hd])),
                    Err(DecodeProjections::Split {
                        q: q2,
                        k: k2,
                        v: v2,
                    }) => {
                        q = q2.reshape([b, t, nh, hd]);
                        k = k2.reshape([b, t, nkv, hd]);
                        v = v2.reshape([b, t, nkv, hd]);
                    }
                    Err(DecodeProjections::Packed { .. }) => {
                        unreachable!("the split operands come back as they went")
                    }
                }
            }
        }
        Err((q, k, v))
    }

    /// RoPE on q and k, and with bf16 products the fused kernel where no cache is read (a
    /// training pass, or a prefill into an empty cache: the prompt's keys are all it attends
    /// to, so its memory stays linear in the prompt), which reads this layout directly
    /// (cos/sin seen as `[batch, seq, 1, head_dim]`): its output, with the rotated keys and
    /// values `[batch, seq, kv_heads, head_dim]` for a cache to start from; or q, k, v
    /// `[batch, heads, seq, head_dim]` rotated for the decomposed path.
    #[allow(clippy::too_many_arguments)]
    fn rotate_or_fuse(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        mask: &AttentionMask<B>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        cache: &AttnCache<'_, B>,
    ) -> Result<FusedOutput<B>, Qkv<B>> {
        let [b, t, _, _] = q.dims();
        let (hd, nh) = (self.head_dim, self.num_heads);
        let no_keys_cached = match cache {
            AttnCache::None => true,
            AttnCache::Grow(c) => c.is_none(),
            _ => false,
        };
        let fused_keys = match mask.causal_keys() {
            Some(keys)
                if no_keys_cached
                    && precision::current() == ComputeDtype::Bf16
                    && cos.dims() == [b, 1, t, hd]
                    && self.scores.fused_kernels_apply()
                    && B::fused_attention_applies(hd) =>
            {
                Some(keys)
            }
            _ => None,
        };
        Err(match fused_keys {
            Some(key_mask) => {
                let (cos, sin) = (
                    cos.clone().reshape([b, t, 1, hd]),
                    sin.clone().reshape([b, t, 1, hd]),
                );
                let q = RotaryEmbedding::apply(q, &cos, &sin);
                let k = RotaryEmbedding::apply(k, &cos, &sin);
                let kept = matches!(cache, AttnCache::Grow(_)).then(|| (k.clone(), v.clone()));
                match B::fused_attention(q, k, v, key_mask, self.scores.for_fused(mask)) {
                    Ok(out) => return Ok((out.reshape([b, t, nh * hd]), kept)),
                    Err((q, k, v)) => (q.swap_dims(1, 2), k.swap_dims(1, 2), v.swap_dims(1, 2)),
                }
            }
            None => {
                let q = RotaryEmbedding::apply(q.swap_dims(1, 2), cos, sin);
                let k = RotaryEmbedding::apply(k.swap_dims(1, 2), cos, sin);
                (q, k, v.swap_dims(1, 2))
            }
        })
    }

    /// Keys and values `[batch, kv_heads, keys, head_dim]` for the decomposed path: gathered
    /// over the context-parallel group, or extending (and written to) the cache.
    fn keys_and_values(
        &self,
        mut k: Tensor<B, 4>,
        mut v: Tensor<B, 4>,
        cache: AttnCache<'_, B>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        match cache {
            // One collective for keys and values together: ranks are threads of one process
            // on CPU, and burn's autodiff may order two independent backward steps differently
            // on each rank (node ids are process-wide), which would pair one rank's key
            // gradients with another's value gradients.
            AttnCache::None if self.cp.is_parallel() => {
                let kv = Tensor::cat(vec![k, v], 1);
                let kv = self.cp.region(kv, Region::GatherFromSequence(2));
                let heads = kv.dims()[1] / 2;
                k = kv.clone().narrow(1, 0, heads);
                v = kv.narrow(1, heads, heads);
            }
            AttnCache::None => {}
            // The new keys and values (after RoPE) extend the cached ones.
            AttnCache::Grow(cache) => {
                if let Some((ck, cv)) = cache.take() {
                    k = Tensor::cat(vec![ck, k], 2);
                    v = Tensor::cat(vec![cv, v], 2);
                }
                *cache = Some((k.clone(), v.clone()));
            }
            AttnCache::Slots {
                cache,
                layer,
                positions,
                window,
                ..
            } => (k, v) = cache.write_step(layer, k, v, positions, window),
            AttnCache::Chunk {
                cache,
                layer,
                chunks,
            } => (k, v) = cache.write_chunks(layer, chunks, k, v),
        }
        (k, v)
    }
}

/// Query, key and value projections handed back by a kernel that did not take them.
type Qkv<B> = (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>);

/// The fused kernel's output `[batch, seq, heads · head_dim]`, and with a cache to start, the
/// rotated keys and values `[batch, seq, kv_heads, head_dim]`.
type FusedOutput<B> = (Tensor<B, 3>, Option<(Tensor<B, 4>, Tensor<B, 4>)>);

impl<B: ParallelBackend> Attention<B> {
    /// Attention over a packed row (`q` `[1, tokens, heads, head_dim]`, `k`, `v` `[1, tokens,
    /// kv_heads, head_dim]`, before RoPE): each sequence's tokens are laid in a row of their
    /// own for the product (the fused kernel's layout on burn-cuda with bf16 products, else
    /// the decomposed path with `mask`'s bias), and the outputs packed back, `[1, tokens,
    /// heads · head_dim]`.
    fn attend_packed(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        rows: &PackedRows<B>,
        mask: &AttentionMask<B>,
        (cos, sin): (&Tensor<B, 4>, &Tensor<B, 4>),
    ) -> Tensor<B, 3> {
        let [_, t, _, _] = q.dims();
        let (hd, nh, nkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let (s, w) = (rows.sequences, rows.width);
        // RoPE on the packed tokens, each at its own position (cos/sin as [1, tokens, 1, hd]).
        let (cos, sin) = (
            cos.clone().reshape([1, t, 1, hd]),
            sin.clone().reshape([1, t, 1, hd]),
        );
        // Gathers both ways (`gather_rows`): a slot past a sequence's end gets no gradient
        // (its query's output is never read, its key is masked).
        let to_rows = |x: Tensor<B, 4>, heads: usize| {
            let x = x.reshape([t, heads * hd]);
            B::gather_rows(
                x,
                rows.rows_index.clone(),
                rows.packed_index.clone(),
                rows.token_keep.clone(),
            )
            .reshape([s, w, heads, hd])
        };
        let (q, k) = (
            to_rows(RotaryEmbedding::apply(q, &cos, &sin), nh),
            to_rows(RotaryEmbedding::apply(k, &cos, &sin), nkv),
        );
        let v = to_rows(v, nkv);
        let fused = precision::current() == ComputeDtype::Bf16
            && self.scores.fused_kernels_apply()
            && B::fused_attention_applies(hd);
        let out = match fused {
            true => B::fused_attention(
                q,
                k,
                v,
                Some(rows.key_mask.clone()),
                self.scores.for_fused(mask),
            )
            .map(|out| out.reshape([s, w, nh * hd])),
            false => Err((q, k, v)),
        };
        let out = out.unwrap_or_else(|(q, k, v)| {
            scored_attention(
                q.swap_dims(1, 2),
                k.swap_dims(1, 2),
                v.swap_dims(1, 2),
                &mask.bias_within(self.scores.sliding_window),
                &self.scores,
            )
        });
        B::gather_rows(
            out.reshape([s * w, nh * hd]),
            rows.packed_index.clone(),
            rows.rows_index.clone(),
            rows.slot_keep.clone(),
        )
        .reshape([1, t, nh * hd])
    }
}

/// Softmax attention of `q` `[batch, heads, seq, head_dim]` over `k`, `v`
/// `[batch, kv_heads, keys, head_dim]` with the additive `bias` `[batch, 1, seq, keys]`, products
/// in the current compute dtype: `[batch, seq, heads · head_dim]`. The path every backend runs,
/// and the reference for the fused kernel.
pub fn decomposed_attention<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    bias: &Tensor<B, 4>,
) -> Tensor<B, 3> {
    let hd = q.dims()[3];
    scored_attention(q, k, v, bias, &AttentionScores::plain(hd))
}

/// [`decomposed_attention`] with `scores`' scale and soft-cap (its window is in `bias`).
pub fn scored_attention<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    bias: &Tensor<B, 4>,
    scores: &AttentionScores,
) -> Tensor<B, 3> {
    let [b, nh, t, hd] = q.dims();
    let [_, nkv, keys, _] = k.dims();
    // Grouped-query attention: query heads g·rep .. (g+1)·rep share kv head g. Folding those
    // heads into the query rows lets them read the kv head directly, with no copies of it.
    let rep = nh / nkv;
    let q = q.reshape([b, nkv, rep * t, hd]);
    let bias = if rep == 1 {
        bias.clone()
    } else {
        bias.clone()
            .unsqueeze_dim::<5>(2)
            .repeat_dim(2, rep)
            .reshape([b, 1, rep * t, keys])
    };
    let products = precision::matmul(q, k.swap_dims(2, 3));
    // Heads of `hd` with the default scale divide by √hd as before; others multiply by their
    // scale, as transformers does.
    let mut logits = match scores.scale == AttentionScores::plain(hd).scale {
        true => products / (hd as f64).sqrt(),
        false => products * scores.scale,
    };
    if let Some(cap) = scores.softcap {
        logits = (logits / cap).tanh() * cap;
    }
    let probs = softmax(logits + bias, 3);
    precision::matmul(probs, v)
        .reshape([b, nh, t, hd])
        .swap_dims(1, 2)
        .reshape([b, t, nh * hd])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use verl_core::backend::CpuBackend as B;

    /// What transformers allows: key `k` for a query at `q` when `k <= q` and `q - k < window`.
    fn naive(queries: &[usize], keys: usize, window: usize) -> Vec<f32> {
        queries
            .iter()
            .flat_map(|&q| {
                (0..keys).map(move |k| match k <= q && q - k < window {
                    true => 0.0,
                    false => f32::NEG_INFINITY,
                })
            })
            .collect()
    }

    fn values(t: Tensor<B, 4>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x5749_4e44),
            cases: 64,
            ..ProptestConfig::default()
        })]

        #[test]
        fn a_decode_steps_window_keeps_the_last_keys_of_each_slot(
            positions in proptest::collection::vec(0usize..12, 1..5),
            window in 1usize..8,
        ) {
            let keys = positions.iter().max().unwrap() + 1;
            let mask = AttentionMask::<B>::decode_step(&positions, keys, &Default::default());
            prop_assert_eq!(values(mask.bias_within(Some(window))), naive(&positions, keys, window));
            // No window: every earlier key.
            prop_assert_eq!(values(mask.bias_within(None)), naive(&positions, keys, usize::MAX));
        }

        #[test]
        fn a_causal_passs_window_is_transformers_sliding_mask(
            batch in 1usize..3,
            seq in 1usize..10,
            window in 1usize..6,
        ) {
            let mask = AttentionMask::<B>::causal(batch, seq, None, &Default::default());
            let queries: Vec<usize> = (0..seq).collect();
            let one = naive(&queries, seq, window);
            let want: Vec<f32> = (0..batch).flat_map(|_| one.clone()).collect();
            prop_assert_eq!(values(mask.bias_within(Some(window))), want);
            prop_assert_eq!(mask.window_cuts(window), seq > window);
        }
    }

    #[test]
    fn a_window_wider_than_the_context_leaves_the_mask_as_it_is() {
        // Hand-checked: 3 tokens, window 3 (each query sees itself and 2 before): no cut.
        let mask = AttentionMask::<B>::causal(1, 3, None, &Default::default());
        assert!(!mask.window_cuts(3) && mask.window_cuts(2));
        let inf = f32::NEG_INFINITY;
        assert_eq!(
            values(mask.bias_within(Some(2))),
            vec![0.0, inf, inf, 0.0, 0.0, inf, inf, 0.0, 0.0]
        );
    }

    #[test]
    fn soft_capped_scores_stay_below_the_cap_and_scale_as_given() {
        // One query and two keys of head 2: q·k = 4 and 0 scaled by 1/2 → 2 and 0; capped at 1:
        // tanh(2) and 0, so the first key's weight is e^tanh 2 / (e^tanh 2 + 1).
        let d = Default::default();
        let q = Tensor::<B, 4>::from_floats([[[[2.0, 0.0]]]], &d);
        let k = Tensor::<B, 4>::from_floats([[[[2.0, 0.0], [0.0, 1.0]]]], &d);
        let v = Tensor::<B, 4>::from_floats([[[[1.0, 0.0], [0.0, 1.0]]]], &d);
        let bias = Tensor::<B, 4>::zeros([1, 1, 1, 2], &d);
        let scores = AttentionScores {
            scale: 0.5,
            softcap: Some(1.0),
            sliding_window: None,
        };
        let out: Vec<f32> = scored_attention(q, k, v, &bias, &scores)
            .into_data()
            .to_vec()
            .unwrap();
        let e = 2f32.tanh().exp();
        let p = e / (e + 1.0);
        assert!(
            (out[0] - p).abs() < 1e-6 && (out[1] - (1.0 - p)).abs() < 1e-6,
            "{out:?}"
        );
    }
}

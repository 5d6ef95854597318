//! The fused-operations seam: every hot path that a GPU backend runs as a kernel of its own goes
//! through [`FusedOps`], a trait over burn's `Backend` (as burn's `custom-cubecl-kernel`
//! example extends its backend). Its default methods are the plain chains of burn operations
//! ([`reference`]): what the CPU default runs, and what each kernel is checked against. The
//! CUDA backend overrides them with its kernels (`crate::cuda::ops`, feature `cuda`), each of
//! which falls back to the same chain where it does not apply (a dtype, a size, a switch).
//!
//! Models, layers, workers and the rollout call `B::rms_norm(..)`, `B::swiglu(..)`,
//! `B::decode_attention(..)`, `B::sample(..)`, `B::adamw_step(..)`: nothing above this module
//! knows which backend runs, and the kernels know no model or worker type (the values they
//! exchange are defined here: [`AdamWStep`], [`DecodeProjections`], [`RowSampling`],
//! [`SampledToken`]).
//!
//! Under autodiff, `Autodiff<B>` implements the trait once for every `B`: each differentiable
//! operation goes to `B`'s `*_tracked` hook, whose default is the reference chain on the
//! autodiff backend (burn differentiates it) and whose CUDA override records one node with a
//! backward kernel of its own. Inference-only operations (decode, sampling) and the optimizer's
//! run on plain backends and keep their defaults under autodiff.
//!
//! A few kernels replace work whose plain form belongs to the caller (attention with the
//! model's masks, the vocabulary-parallel statistics with their collectives, the slot cache's
//! writes, sampling on the host): those methods return `Err` with their inputs by default, and
//! the caller runs its own path.
//!
//! ```
//! use burn::prelude::*;
//! use verl_core::backend::CpuBackend;
//! use verl_megatron::ops::{reference, FusedOps};
//!
//! let device = Default::default();
//! let x = Tensor::<CpuBackend, 2>::from_floats([[3.0, 4.0]], &device);
//! let w = Tensor::<CpuBackend, 1>::ones([2], &device);
//! // x / sqrt(mean(x²)) = [3, 4] / sqrt(12.5)
//! let y = CpuBackend::rms_norm(x.clone(), w.clone(), 0.0);
//! let expected = reference::rms_norm(x, w, 0.0);
//! assert_eq!(y.into_data(), expected.into_data());
//! ```

mod adamw;
pub mod reference;
mod types;

pub use adamw::{AdamWHyper, AdamWStep};
pub use types::{DecodeProjections, PrefixTargets, RowSampling, SampledToken, ShardDraw};

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{FloatDType, Int};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;

/// How the fused attention kernel scores a pass: its scale and a sliding window (a query
/// attends to itself and the `window - 1` keys before it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedScores {
    pub scale: f32,
    pub window: Option<usize>,
}

impl FusedScores {
    /// Plain attention over heads of `head_dim`.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        }
    }
}

/// How a decode step turns q·k into attention weights: [`FusedOps::decode_attention`]'s
/// scale, soft-cap and sliding window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeScores {
    /// Scores are q·k divided by this: √head_dim, or the inverse of the model's own scale.
    pub divisor: f32,
    /// `cap · tanh(s / cap)` after scaling (Gemma 2).
    pub softcap: Option<f32>,
    /// A slot attends to its last `window` positions.
    pub window: Option<usize>,
}

impl DecodeScores {
    /// Plain attention over heads of `head_dim`.
    pub fn plain(head_dim: usize) -> Self {
        Self {
            divisor: (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }
}

/// A backend's fused operations; see the module documentation. Every method has a default (the
/// plain chain, or "not available" for the caller-side paths), so a backend implements only
/// what it has kernels for.
pub trait FusedOps: Backend {
    // ---- The training step's operations (differentiable under `Autodiff<Self>`). ----

    /// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) · weight`.
    fn rms_norm<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
    ) -> Tensor<Self, D> {
        reference::rms_norm(x, weight, eps)
    }

    /// The rotary tables `[batch, 1, seq, 2 · inv_freq.len()]` (cos, sin) of `positions`
    /// `[batch, seq]` for the inverse frequencies `inv_freq` (angles in f32, as HF computes
    /// them). By default computed on the host from the positions read back.
    fn rotary_tables(
        inv_freq: &[f64],
        positions: &Tensor<Self, 2, Int>,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        reference::rotary_tables(inv_freq, positions)
    }

    /// The "rotate half" rotation `x · cos + rotate_half(x) · sin`, the tables broadcast over
    /// `x` (constants: no gradient flows to them).
    fn rotary(x: Tensor<Self, 4>, cos: &Tensor<Self, 4>, sin: &Tensor<Self, 4>) -> Tensor<Self, 4> {
        reference::rotary(x, cos, sin)
    }

    /// `silu(gate) · up`.
    fn swiglu<const D: usize>(gate: Tensor<Self, D>, up: Tensor<Self, D>) -> Tensor<Self, D> {
        reference::swiglu(gate, up)
    }

    /// `y + b` on every row of `y` `[rows, cols]`.
    fn add_bias(y: Tensor<Self, 2>, b: Tensor<Self, 1>) -> Tensor<Self, 2> {
        reference::add_bias(y, b)
    }

    /// `a · b` as a bf16 product (batch dimensions equal): the operands come as f32 or bf16 and
    /// are read as bf16; the result may come as bf16 or f32 (callers cast), and under autodiff
    /// each operand's gradient comes in that operand's dtype.
    fn matmul_bf16<const D: usize>(a: Tensor<Self, D>, b: Tensor<Self, D>) -> Tensor<Self, D> {
        a.cast(FloatDType::BF16).matmul(b.cast(FloatDType::BF16))
    }

    /// `x · wᵀ` as a bf16 product of `x` `[rows, in]` and a weight in the HF layout
    /// `[out, in]`, as [`Self::matmul_bf16`] takes its operands. The weight is cast before it is
    /// transposed, so the cast reads it contiguously and the product gets a transposed view.
    fn linear_bf16(x: Tensor<Self, 2>, w: Tensor<Self, 2>) -> Tensor<Self, 2> {
        Self::matmul_bf16(x, w.cast(FloatDType::BF16).transpose())
    }

    /// Whether [`Self::fused_attention`] can take heads of `head_dim` (the caller then lays
    /// its inputs out for it).
    fn fused_attention_applies(head_dim: usize) -> bool {
        let _ = head_dim;
        false
    }

    /// Causal attention of `q` `[batch, seq, heads, head_dim]` over `k`, `v`
    /// `[batch, seq, kv_heads, head_dim]`, scores as `scores` says, padded keys masked by
    /// `key_mask` `[batch, seq]` (1 = token): `[batch, seq, heads, head_dim]`. Not available
    /// by default: the inputs come back for the model's decomposed attention.
    fn fused_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        key_mask: Option<Tensor<Self, 2>>,
        scores: FusedScores,
    ) -> Result<Tensor<Self, 4>, AttentionInputs<Self>> {
        let _ = (key_mask, scores);
        Err((q, k, v))
    }

    /// Whether [`Self::vocab_stats`] is available (the caller then prepares its labels).
    fn vocab_stats_applies() -> bool {
        false
    }

    /// Per-row `[m, s, p, w]` (`[rows, 4]`, f32) of a vocabulary shard's `logits`
    /// `[rows, vocab]` for `labels` `[rows]` (an index into the shard, negative outside it):
    /// the maximum, `Σ exp(x − m)`, the label's logit (0 outside), `Σ exp(x − m) · x`.
    /// Differentiable through `s`, `p` and `w`. Not available by default: the inputs come back
    /// for the model's chain with its collectives.
    fn vocab_stats(
        logits: Tensor<Self, 2>,
        labels: Tensor<Self, 1, Int>,
    ) -> Result<Tensor<Self, 2>, VocabInputs<Self>> {
        Err((logits, labels))
    }

    // ---- The rollout's decode step (plain backends). ----

    /// A decode step's residual sum `s = h + delta` (`h` without `delta`) and `rms_norm(s)`
    /// rounded to bf16 (the next products' operand): `(s, operand)`.
    fn add_rms_norm_bf16(
        h: Tensor<Self, 2>,
        delta: Option<Tensor<Self, 2>>,
        weight: Tensor<Self, 1>,
        eps: f64,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        reference::add_rms_norm_bf16(h, delta, weight, eps)
    }

    /// `silu(gate) · up` as bf16 from the fused gate/up product `gu` `[rows, 2 · inter]`.
    fn swiglu_packed_bf16(gu: Tensor<Self, 2>) -> Tensor<Self, 2> {
        reference::swiglu_packed_bf16(gu)
    }

    /// Whether [`Self::decode_attention`] takes `heads` query heads over `kv_heads` of size
    /// `head_dim` (the caller then keeps its projections packed).
    fn decode_attention_applies(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
        let _ = (heads, kv_heads, head_dim);
        false
    }

    /// One layer's decode step over a slot cache, its scores as `scores` says: rotates the new key (`cos`, `sin`
    /// `[slots, head_dim]`), writes it and the value into `cache` `[slots, kv_heads, capacity,
    /// head_dim]` at each slot's position (`positions`, from [`reference::step_positions`]) in
    /// place, and returns attention over positions `0..=position` `[slots, heads · head_dim]`
    /// (bf16 when `out_bf16`; operands rounded to bf16 when `round_bf16`); `keys` bounds every
    /// slot's position + 1 (a long context's keys may be split over several blocks). Not
    /// available by default: the projections come back for the cache's own path.
    #[allow(clippy::too_many_arguments)]
    fn decode_attention(
        projections: DecodeProjections<Self>,
        cos: &Tensor<Self, 2>,
        sin: &Tensor<Self, 2>,
        positions: &Tensor<Self, 1>,
        cache: (&Tensor<Self, 4>, &Tensor<Self, 4>),
        keys: usize,
        scores: DecodeScores,
        (round_bf16, out_bf16): (bool, bool),
    ) -> Result<Tensor<Self, 2>, DecodeProjections<Self>> {
        let _ = (
            cos, sin, positions, cache, keys, scores, round_bf16, out_bf16,
        );
        Err(projections)
    }

    /// Writes prefilled keys / values `[prompts, kv_heads, len, head_dim]` into a slot cache's
    /// layer in place (see [`PrefixTargets`]). Not available by default: the keys and values
    /// come back for the cache's scatter.
    #[allow(clippy::type_complexity)]
    fn write_prefix(
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        targets: PrefixTargets<'_>,
        cache: (&Tensor<Self, 4>, &Tensor<Self, 4>),
    ) -> Result<(), (Tensor<Self, 4>, Tensor<Self, 4>)> {
        let _ = (targets, cache);
        Err((k, v))
    }

    /// The next token of every row of `logits` `[rows, vocab]`, `rows[i]` for row `i`, drawn
    /// on the device. Not available by default: the logits come back for the host sampler.
    fn sample(
        logits: Tensor<Self, 2>,
        rows: &[RowSampling],
    ) -> Result<Vec<SampledToken>, Tensor<Self, 2>> {
        let _ = rows;
        Err(logits)
    }

    /// Whether [`Self::sample`] and [`Self::sample_shard`] draw on the device. Then a rollout
    /// whose tensor-parallel group has several ranks samples from the vocabulary shards (the
    /// same tokens) instead of gathering the logits for the host sampler.
    fn samples_on_device() -> bool {
        false
    }

    /// Each row's largest value among the first `valid` columns of `logits` `[rows, width]`
    /// (f32; `-inf` when `valid` is 0): a vocabulary shard's part of the row maximum.
    fn row_max(logits: Tensor<Self, 2>, valid: usize) -> Tensor<Self, 1> {
        reference::row_max(logits, valid)
    }

    /// Each row's [`ShardDraw`] over this rank's vocabulary shard `logits` `[rows, width]`
    /// (f32): its first `valid` columns are ids `vocab_start..vocab_start + valid` (the rest is
    /// padding), and `row_max` `[rows]` is each row's maximum over the whole vocabulary.
    /// Returns `[rows, ShardDraw::WORDS]` on the device. By default the shard is read back and
    /// drawn on the host ([`crate::sampling::reference_shard_draw`]).
    fn sample_shard(
        logits: Tensor<Self, 2>,
        row_max: Tensor<Self, 1>,
        rows: &[RowSampling],
        (vocab_start, valid): (usize, usize),
    ) -> Tensor<Self, 2> {
        reference::sample_shard(logits, row_max, rows, (vocab_start, valid))
    }

    // ---- The optimizer (plain backends). ----

    /// One AdamW update of a flat parameter with its flat gradient; `moments` is `None` before
    /// the first update: the new parameter, first and second moments.
    #[allow(clippy::type_complexity)]
    fn adamw_step(
        param: Tensor<Self, 1>,
        grad: Tensor<Self, 1>,
        moments: Option<(Tensor<Self, 1>, Tensor<Self, 1>)>,
        step: &AdamWStep,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>, Tensor<Self, 1>) {
        reference::adamw_step(param, grad, moments, step)
    }

    /// The sum of squares of each tensor, in f64, read to the host at once.
    fn sums_of_squares(tensors: Vec<Tensor<Self, 2>>) -> Vec<f64> {
        reference::sums_of_squares(tensors)
    }

    // ---- Hooks for `Autodiff<Self>`: the differentiable operations above under autodiff. ----

    /// [`Self::rms_norm`] under autodiff.
    fn rms_norm_tracked<C: CheckpointStrategy, const D: usize>(
        x: Tensor<Autodiff<Self, C>, D>,
        weight: Tensor<Autodiff<Self, C>, 1>,
        eps: f64,
    ) -> Tensor<Autodiff<Self, C>, D> {
        reference::rms_norm(x, weight, eps)
    }

    /// [`Self::rotary`] under autodiff.
    fn rotary_tracked<C: CheckpointStrategy>(
        x: Tensor<Autodiff<Self, C>, 4>,
        cos: &Tensor<Autodiff<Self, C>, 4>,
        sin: &Tensor<Autodiff<Self, C>, 4>,
    ) -> Tensor<Autodiff<Self, C>, 4> {
        reference::rotary(x, cos, sin)
    }

    /// [`Self::swiglu`] under autodiff.
    fn swiglu_tracked<C: CheckpointStrategy, const D: usize>(
        gate: Tensor<Autodiff<Self, C>, D>,
        up: Tensor<Autodiff<Self, C>, D>,
    ) -> Tensor<Autodiff<Self, C>, D> {
        reference::swiglu(gate, up)
    }

    /// [`Self::add_bias`] under autodiff.
    fn add_bias_tracked<C: CheckpointStrategy>(
        y: Tensor<Autodiff<Self, C>, 2>,
        b: Tensor<Autodiff<Self, C>, 1>,
    ) -> Tensor<Autodiff<Self, C>, 2> {
        reference::add_bias(y, b)
    }

    /// [`Self::matmul_bf16`] under autodiff.
    fn matmul_bf16_tracked<C: CheckpointStrategy, const D: usize>(
        a: Tensor<Autodiff<Self, C>, D>,
        b: Tensor<Autodiff<Self, C>, D>,
    ) -> Tensor<Autodiff<Self, C>, D> {
        a.cast(FloatDType::BF16).matmul(b.cast(FloatDType::BF16))
    }

    /// [`Self::linear_bf16`] under autodiff.
    fn linear_bf16_tracked<C: CheckpointStrategy>(
        x: Tensor<Autodiff<Self, C>, 2>,
        w: Tensor<Autodiff<Self, C>, 2>,
    ) -> Tensor<Autodiff<Self, C>, 2> {
        Self::matmul_bf16_tracked(x, w.cast(FloatDType::BF16).transpose())
    }

    /// [`Self::fused_attention`] under autodiff.
    #[allow(clippy::type_complexity)]
    fn fused_attention_tracked<C: CheckpointStrategy>(
        q: Tensor<Autodiff<Self, C>, 4>,
        k: Tensor<Autodiff<Self, C>, 4>,
        v: Tensor<Autodiff<Self, C>, 4>,
        key_mask: Option<Tensor<Autodiff<Self, C>, 2>>,
        scores: FusedScores,
    ) -> Result<Tensor<Autodiff<Self, C>, 4>, AttentionInputs<Autodiff<Self, C>>> {
        let _ = (key_mask, scores);
        Err((q, k, v))
    }

    /// [`Self::vocab_stats`] under autodiff.
    #[allow(clippy::type_complexity)]
    fn vocab_stats_tracked<C: CheckpointStrategy>(
        logits: Tensor<Autodiff<Self, C>, 2>,
        labels: Tensor<Autodiff<Self, C>, 1, Int>,
    ) -> Result<Tensor<Autodiff<Self, C>, 2>, VocabInputs<Autodiff<Self, C>>> {
        Err((logits, labels))
    }
}

/// Attention's inputs handed back: q, k, v.
pub type AttentionInputs<B> = (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>);

/// The vocabulary statistics' inputs handed back: logits and labels.
pub type VocabInputs<B> = (Tensor<B, 2>, Tensor<B, 1, Int>);

/// The CPU default: every operation is the plain chain.
impl FusedOps for burn::backend::Flex {}

/// Under autodiff the differentiable operations go to the inner backend's hooks; the rotary
/// tables are constants computed by the inner backend.
impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn rms_norm<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
    ) -> Tensor<Self, D> {
        B::rms_norm_tracked(x, weight, eps)
    }

    fn rotary_tables(
        inv_freq: &[f64],
        positions: &Tensor<Self, 2, Int>,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        let (cos, sin) = B::rotary_tables(inv_freq, &positions.clone().inner());
        (Tensor::from_inner(cos), Tensor::from_inner(sin))
    }

    fn rotary(x: Tensor<Self, 4>, cos: &Tensor<Self, 4>, sin: &Tensor<Self, 4>) -> Tensor<Self, 4> {
        B::rotary_tracked(x, cos, sin)
    }

    fn swiglu<const D: usize>(gate: Tensor<Self, D>, up: Tensor<Self, D>) -> Tensor<Self, D> {
        B::swiglu_tracked(gate, up)
    }

    fn add_bias(y: Tensor<Self, 2>, b: Tensor<Self, 1>) -> Tensor<Self, 2> {
        B::add_bias_tracked(y, b)
    }

    fn matmul_bf16<const D: usize>(a: Tensor<Self, D>, b: Tensor<Self, D>) -> Tensor<Self, D> {
        B::matmul_bf16_tracked(a, b)
    }

    fn linear_bf16(x: Tensor<Self, 2>, w: Tensor<Self, 2>) -> Tensor<Self, 2> {
        B::linear_bf16_tracked(x, w)
    }

    fn fused_attention_applies(head_dim: usize) -> bool {
        B::fused_attention_applies(head_dim)
    }

    fn fused_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        key_mask: Option<Tensor<Self, 2>>,
        scores: FusedScores,
    ) -> Result<Tensor<Self, 4>, AttentionInputs<Self>> {
        B::fused_attention_tracked(q, k, v, key_mask, scores)
    }

    fn vocab_stats_applies() -> bool {
        B::vocab_stats_applies()
    }

    fn vocab_stats(
        logits: Tensor<Self, 2>,
        labels: Tensor<Self, 1, Int>,
    ) -> Result<Tensor<Self, 2>, VocabInputs<Self>> {
        B::vocab_stats_tracked(logits, labels)
    }
}

/// Whether the fused attention kernel (CUDA builds) has a variant for heads of `head_dim`:
/// what its `fused_attention_applies` checks besides its switch, and what the trainer's config
/// check asks of a run that wants selective recompute (builds without CUDA too).
pub fn fused_attention_head_dim(head_dim: usize) -> bool {
    head_dim > 0 && head_dim <= 128 && head_dim.is_multiple_of(16)
}

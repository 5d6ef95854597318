//! burn-cuda's [`FusedOps`]: each operation runs our kernel where it applies (dtype, sizes, its
//! `VERL_*` switch) and the plain chain of [`reference`] where it does not. The kernels
//! themselves live in [`super::kernels`], one module per family.

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{FloatDType, Int};
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use verl_core::backend::CudaBackend;

use super::kernels::{
    adamw, attention, bias, decode_attention, gemm, norm, rope, sampling, sum_squares, swiglu,
    vocab,
};
use crate::ops::{
    reference, AdamWStep, AttentionInputs, DecodeProjections, DecodeScores, FusedOps, FusedScores,
    PrefixTargets, RowSampling, SampledToken, VocabInputs,
};

type Tracked<C> = Autodiff<CudaBackend, C>;

impl FusedOps for CudaBackend {
    fn rms_norm<const D: usize>(
        x: Tensor<Self, D>,
        weight: Tensor<Self, 1>,
        eps: f64,
    ) -> Tensor<Self, D> {
        norm::rms_norm(x, weight, eps).unwrap_or_else(|(x, w)| reference::rms_norm(x, w, eps))
    }

    fn rotary_tables(
        inv_freq: &[f64],
        positions: &Tensor<Self, 2, Int>,
    ) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        reference::rotary_tables_on_device(inv_freq, positions)
    }

    fn rotary(x: Tensor<Self, 4>, cos: &Tensor<Self, 4>, sin: &Tensor<Self, 4>) -> Tensor<Self, 4> {
        rope::rope(x, cos, sin).unwrap_or_else(|x| reference::rotary(x, cos, sin))
    }

    fn swiglu<const D: usize>(gate: Tensor<Self, D>, up: Tensor<Self, D>) -> Tensor<Self, D> {
        swiglu::swiglu(gate, up).unwrap_or_else(|(g, u)| reference::swiglu(g, u))
    }

    fn matmul_bf16<const D: usize>(a: Tensor<Self, D>, b: Tensor<Self, D>) -> Tensor<Self, D> {
        gemm::matmul(a, b)
            .unwrap_or_else(|(a, b)| a.cast(FloatDType::BF16).matmul(b.cast(FloatDType::BF16)))
    }

    fn linear_bf16(x: Tensor<Self, 2>, w: Tensor<Self, 2>) -> Tensor<Self, 2> {
        super::linear::linear(x, w)
            .unwrap_or_else(|(x, w)| Self::matmul_bf16(x, w.cast(FloatDType::BF16).transpose()))
    }

    fn fused_attention_applies(head_dim: usize) -> bool {
        attention::applies(head_dim)
    }

    fn fused_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        key_mask: Option<Tensor<Self, 2>>,
        scores: FusedScores,
    ) -> Result<Tensor<Self, 4>, AttentionInputs<Self>> {
        attention::attention(q, k, v, key_mask, scores)
    }

    fn vocab_stats_applies() -> bool {
        vocab::SWITCH.enabled()
    }

    fn vocab_stats(
        logits: Tensor<Self, 2>,
        labels: Tensor<Self, 1, Int>,
    ) -> Result<Tensor<Self, 2>, VocabInputs<Self>> {
        vocab::vocab_stats(logits, labels)
    }

    fn add_rms_norm_bf16(
        h: Tensor<Self, 2>,
        delta: Option<Tensor<Self, 2>>,
        weight: Tensor<Self, 1>,
        eps: f64,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        norm::add_rms_norm_bf16(h, delta, weight, eps)
            .unwrap_or_else(|(h, d, w)| reference::add_rms_norm_bf16(h, d, w, eps))
    }

    fn swiglu_packed_bf16(gu: Tensor<Self, 2>) -> Tensor<Self, 2> {
        swiglu::swiglu_packed_bf16(gu).unwrap_or_else(reference::swiglu_packed_bf16)
    }

    fn decode_attention_applies(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
        decode_attention::applies(heads, kv_heads, head_dim)
    }

    fn decode_attention(
        projections: DecodeProjections<Self>,
        cos: &Tensor<Self, 2>,
        sin: &Tensor<Self, 2>,
        positions: &Tensor<Self, 1>,
        cache: (&Tensor<Self, 4>, &Tensor<Self, 4>),
        keys: usize,
        scores: DecodeScores,
        rounding: (bool, bool),
    ) -> Result<Tensor<Self, 2>, DecodeProjections<Self>> {
        decode_attention::decode_attention(
            projections,
            cos,
            sin,
            positions,
            cache,
            keys,
            scores,
            rounding,
        )
    }

    fn write_prefix(
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        targets: PrefixTargets<'_>,
        cache: (&Tensor<Self, 4>, &Tensor<Self, 4>),
    ) -> Result<(), (Tensor<Self, 4>, Tensor<Self, 4>)> {
        decode_attention::write_prefix(k, v, targets, cache)
    }

    fn sample(
        logits: Tensor<Self, 2>,
        rows: &[RowSampling],
    ) -> Result<Vec<SampledToken>, Tensor<Self, 2>> {
        sampling::sample(logits, rows)
    }

    fn samples_on_device() -> bool {
        sampling::SWITCH.enabled() && sampling::SHARD_SWITCH.enabled()
    }

    fn row_max(logits: Tensor<Self, 2>, valid: usize) -> Tensor<Self, 1> {
        sampling::row_max(logits, valid)
    }

    fn sample_shard(
        logits: Tensor<Self, 2>,
        row_max: Tensor<Self, 1>,
        rows: &[RowSampling],
        shard: (usize, usize),
    ) -> Tensor<Self, 2> {
        sampling::sample_shard(logits, row_max, rows, shard)
    }

    fn adamw_step(
        param: Tensor<Self, 1>,
        grad: Tensor<Self, 1>,
        moments: Option<(Tensor<Self, 1>, Tensor<Self, 1>)>,
        step: &AdamWStep,
    ) -> (Tensor<Self, 1>, Tensor<Self, 1>, Tensor<Self, 1>) {
        adamw::step(param, grad, moments, step)
            .unwrap_or_else(|(p, g, m)| reference::adamw_step(p, g, m, step))
    }

    fn sums_of_squares(tensors: Vec<Tensor<Self, 2>>) -> Vec<f64> {
        match sum_squares::sums_of_squares(&tensors) {
            Some(values) => {
                crate::host_reads::note(1);
                values
            }
            None => reference::sums_of_squares(tensors),
        }
    }

    fn rms_norm_tracked<C: CheckpointStrategy, const D: usize>(
        x: Tensor<Tracked<C>, D>,
        weight: Tensor<Tracked<C>, 1>,
        eps: f64,
    ) -> Tensor<Tracked<C>, D> {
        norm::rms_norm_tracked(x, weight, eps)
            .unwrap_or_else(|(x, w)| reference::rms_norm(x, w, eps))
    }

    fn rotary_tracked<C: CheckpointStrategy>(
        x: Tensor<Tracked<C>, 4>,
        cos: &Tensor<Tracked<C>, 4>,
        sin: &Tensor<Tracked<C>, 4>,
    ) -> Tensor<Tracked<C>, 4> {
        rope::rope_tracked(x, cos, sin).unwrap_or_else(|x| reference::rotary(x, cos, sin))
    }

    fn swiglu_tracked<C: CheckpointStrategy, const D: usize>(
        gate: Tensor<Tracked<C>, D>,
        up: Tensor<Tracked<C>, D>,
    ) -> Tensor<Tracked<C>, D> {
        swiglu::swiglu_tracked(gate, up).unwrap_or_else(|(g, u)| reference::swiglu(g, u))
    }

    fn add_bias_tracked<C: CheckpointStrategy>(
        y: Tensor<Tracked<C>, 2>,
        b: Tensor<Tracked<C>, 1>,
    ) -> Tensor<Tracked<C>, 2> {
        bias::add_bias_tracked(y, b).unwrap_or_else(|(y, b)| reference::add_bias(y, b))
    }

    fn matmul_bf16_tracked<C: CheckpointStrategy, const D: usize>(
        a: Tensor<Tracked<C>, D>,
        b: Tensor<Tracked<C>, D>,
    ) -> Tensor<Tracked<C>, D> {
        gemm::matmul_tracked(a, b)
            .unwrap_or_else(|(a, b)| a.cast(FloatDType::BF16).matmul(b.cast(FloatDType::BF16)))
    }

    /// The weight goes to the product as a transposed view of itself, f32: the product's own
    /// operation casts it (through its stored order) and writes its gradient in f32.
    fn linear_bf16_tracked<C: CheckpointStrategy>(
        x: Tensor<Tracked<C>, 2>,
        w: Tensor<Tracked<C>, 2>,
    ) -> Tensor<Tracked<C>, 2> {
        super::linear::linear_tracked(x, w)
            .unwrap_or_else(|(x, w)| Self::matmul_bf16_tracked(x, w.transpose()))
    }

    fn fused_attention_tracked<C: CheckpointStrategy>(
        q: Tensor<Tracked<C>, 4>,
        k: Tensor<Tracked<C>, 4>,
        v: Tensor<Tracked<C>, 4>,
        key_mask: Option<Tensor<Tracked<C>, 2>>,
        scores: FusedScores,
    ) -> Result<Tensor<Tracked<C>, 4>, AttentionInputs<Tracked<C>>> {
        attention::attention_tracked(q, k, v, key_mask, scores)
    }

    fn vocab_stats_tracked<C: CheckpointStrategy>(
        logits: Tensor<Tracked<C>, 2>,
        labels: Tensor<Tracked<C>, 1, Int>,
    ) -> Result<Tensor<Tracked<C>, 2>, VocabInputs<Tracked<C>>> {
        vocab::vocab_stats_tracked(logits, labels)
    }
}

//! Log-probabilities and entropy from logits split over the vocabulary (one shard per tensor
//! parallel rank), never gathering the full vocabulary: each rank reduces its shard to a few
//! numbers per position and the group sums those (Megatron's vocab-parallel cross entropy,
//! here with autodiff doing the backward through the region operators).
//!
//! On burn-cuda a fused kernel (`cuda::kernels::vocab`) reduces each row of the shard to four
//! numbers in one pass, and its backward writes the logits' gradient in one pass; the chain of
//! burn operations below is the fallback and what every other backend runs.

use burn::prelude::*;
use burn::tensor::Int;
use verl_core::algorithms::logits::{entropy_from_logits, log_probs_from_logits};

use crate::parallel::{Collective, ParallelBackend, Region, TpGroup};

/// log softmax(logits)[label] per position `[batch, len]` and, when `with_entropy`, the
/// entropy of softmax(logits) `[batch, len]`, from this rank's logits `[batch, len, vocab / tp]`
/// covering ids `vocab_start..vocab_start + vocab / tp`. At tp = 1 these are
/// [`log_probs_from_logits`] and [`entropy_from_logits`].
pub fn vocab_parallel_log_probs<B: ParallelBackend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
    tp: &TpGroup,
    vocab_start: usize,
    with_entropy: bool,
) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
    let (logits, labels) = match fused_log_probs(logits, labels, tp, vocab_start, with_entropy) {
        Ok(out) => return out,
        Err(inputs) => inputs,
    };
    if !tp.is_parallel() {
        let entropy = with_entropy.then(|| entropy_from_logits(logits.clone()));
        return (log_probs_from_logits(logits, labels), entropy);
    }
    let [b, len, per] = logits.dims();
    // The global maximum is only a shift for stability: a constant to autodiff.
    let max = tp.collective(logits.clone().detach().max_dim(2), Collective::AllReduceMax);
    let z = logits - max;
    let exp = z.clone().exp();
    let sum_exp = tp.region(exp.clone().sum_dim(2), Region::ReduceFrom);
    let log_sum_exp = sum_exp.clone().log().reshape([b, len]);
    // The label's shifted logit lives on one rank; the others contribute 0.
    let (local, outside) = shard_labels(labels, vocab_start, per);
    let picked = z
        .clone()
        .gather(2, local.mask_fill(outside.clone(), 0).unsqueeze_dim(2))
        .reshape([b, len])
        .mask_fill(outside, 0.0);
    let label_logit = tp.region(picked, Region::ReduceFrom);
    let entropy = with_entropy.then(|| {
        // H = logsumexp(z) − Σ softmax(z)·z.
        let weighted = tp.region((exp * z).sum_dim(2), Region::ReduceFrom);
        log_sum_exp.clone() - (weighted / sum_exp).reshape([b, len])
    });
    (label_logit - log_sum_exp, entropy)
}

/// Labels as indices into this rank's shard of `per` ids from `vocab_start`, and which of them
/// lie outside it.
fn shard_labels<B: Backend>(
    labels: Tensor<B, 2, Int>,
    vocab_start: usize,
    per: usize,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Bool>) {
    let local = labels - vocab_start as i64;
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(per as i64));
    (local, outside)
}

/// The fused kernel's path: per-row statistics of this rank's shard (`[m, s, p, w]`, see
/// `cuda::kernels::vocab`), combined over the group on `[batch, len]` tensors. The inputs come
/// back where the kernel does not apply.
#[allow(clippy::type_complexity)]
fn fused_log_probs<B: ParallelBackend>(
    logits: Tensor<B, 3>,
    labels: Tensor<B, 2, Int>,
    tp: &TpGroup,
    vocab_start: usize,
    with_entropy: bool,
) -> Result<(Tensor<B, 2>, Option<Tensor<B, 2>>), (Tensor<B, 3>, Tensor<B, 2, Int>)> {
    if !B::vocab_stats_applies() {
        return Err((logits, labels));
    }
    let [b, len, per] = logits.dims();
    // Labels outside this shard become -1 (the kernel then reports a label logit of 0).
    let (local, outside) = shard_labels(labels.clone(), vocab_start, per);
    let local = local.mask_fill(outside, -1).reshape([b * len]);
    let stats = match B::vocab_stats(logits.reshape([b * len, per]), local) {
        Ok(stats) => stats,
        Err((logits, _)) => return Err((logits.reshape([b, len, per]), labels)),
    };
    let column = |i: usize| stats.clone().narrow(1, i, 1).reshape([b, len]);
    // The shard's maximum is a shift only: a constant to autodiff, as the kernel's backward
    // assumes.
    let shard_max = column(0).detach();
    let max = tp.collective(shard_max.clone(), Collective::AllReduceMax);
    let rescale = (shard_max - max.clone()).exp();
    let sum_exp = tp.region(column(1) * rescale.clone(), Region::ReduceFrom);
    let label_logit = tp.region(column(2), Region::ReduceFrom);
    let log_sum_exp = sum_exp.clone().log() + max;
    let entropy = with_entropy.then(|| {
        // H = logsumexp(x) − Σ softmax(x)·x.
        let weighted = tp.region(column(3) * rescale, Region::ReduceFrom);
        log_sum_exp.clone() - weighted / sum_exp
    });
    Ok((label_logit - log_sum_exp, entropy))
}

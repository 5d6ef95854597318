//! Log-probabilities and entropy from logits split over the vocabulary (one shard per tensor
//! parallel rank), never gathering the full vocabulary: each rank reduces its shard to a few
//! numbers per position and the group sums those (Megatron's vocab-parallel cross entropy,
//! here with autodiff doing the backward through the region operators).

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
    let local = labels - vocab_start as i64;
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(per as i64));
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

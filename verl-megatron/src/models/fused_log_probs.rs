//! The output projection fused with log-softmax and entropy, in token chunks, forward and
//! backward, never holding the `[tokens, vocabulary]` logits (verl's fused linear-for-ppo):
//! the forward keeps two numbers per token (the log-sum-exp and the entropy), the backward
//! recomputes each chunk's logits from the hidden states and the head.
//!
//! Vocabulary-parallel over tp as [`super::vocab_parallel`] is: each rank holds its rows of
//! the head, reduces its shard of each chunk to a few numbers per token and the group sums
//! those. The hidden states' gradient is this rank's partial sum (the caller's tensor-parallel
//! region reduces it); the head's gradient is this rank's rows, whole.
//!
//! The autodiff side is [`crate::parallel::ParallelBackend::fused_head_log_probs`]; this module
//! holds the arithmetic, on any plain backend.

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl_core::traits::{Communicator, CommunicatorExt, ReduceOp};

use crate::ops::FusedOps;

/// What the fused head computes: this rank's rows of the head start at vocabulary id
/// `vocab_start`, the first `real_rows` of them real (the rest padding), logits multiplied by
/// `scale` (1 / temperature), `chunk` tokens at a time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedHead {
    pub vocab_start: usize,
    pub real_rows: usize,
    pub scale: f64,
    pub chunk: usize,
    /// The products' dtype (bf16 casts the head once per pass, not per chunk).
    pub dtype: crate::layers::precision::ComputeDtype,
}

/// The logit a padded vocabulary row gets (see `causal_lm::PADDED_LOGIT`).
const PADDED: f32 = -1.0e30;

/// This chunk's scaled logits `[n, rows]` of this rank's shard, padding rows masked.
fn chunk_logits<B: FusedOps>(h: Tensor<B, 2>, w: &Tensor<B, 2>, spec: &FusedHead) -> Tensor<B, 2> {
    let [n, _] = h.dims();
    let rows = w.dims()[0];
    let z = crate::layers::precision::linear(h, w.clone()) * spec.scale;
    if spec.real_rows >= rows {
        return z;
    }
    let pad: Vec<bool> = (0..rows).map(|r| r >= spec.real_rows).collect();
    let pad = Tensor::<B, 1, Bool>::from_data(TensorData::new(pad, [rows]), &z.device())
        .reshape([1, rows])
        .repeat_dim(0, n);
    z.mask_fill(pad, PADDED)
}

/// Labels as indices into this rank's rows `[n, 1]` (0 where outside) and whether each is
/// outside them `[n, 1]`.
fn local_labels<B: FusedOps>(
    labels: Tensor<B, 1, Int>,
    spec: &FusedHead,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Bool>) {
    let n = labels.dims()[0];
    let local = labels.reshape([n, 1]) - spec.vocab_start as i64;
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(spec.real_rows as i64));
    (local.mask_fill(outside.clone(), 0), outside)
}

/// Log-probs of `labels` and entropies `[tokens, 2]`, and each token's log-sum-exp `[tokens]`
/// (for the backward), from hidden states `h` `[tokens, hidden]` and this rank's head rows `w`
/// `[rows, hidden]`, summed over `tp` (`None` at tp = 1).
pub fn fused_forward<B: FusedOps>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    spec: &FusedHead,
    tp: Option<&dyn Communicator<B>>,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let tp = tp.filter(|c| c.world_size() > 1);
    let reduce = |x: Tensor<B, 2>, op: crate::parallel::Collective| {
        let op = match op {
            crate::parallel::Collective::AllReduceMax => ReduceOp::Max,
            _ => ReduceOp::Sum,
        };
        tp.expect("reduce is only called with a group")
            .all_reduce_tensor(x, op)
            .unwrap_or_else(|e| panic!("fused log-prob: tp all-reduce failed: {e}"))
    };
    fused_forward_with(
        h,
        w,
        labels,
        spec,
        tp.map(|_| &reduce as &dyn Fn(_, _) -> _),
    )
}

/// [`fused_forward`] with the group's reduction given as a function (max or sum over tp).
#[allow(clippy::type_complexity)]
fn fused_forward_with<B: FusedOps>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    spec: &FusedHead,
    tp: Option<&dyn Fn(Tensor<B, 2>, crate::parallel::Collective) -> Tensor<B, 2>>,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let [tokens, _] = h.dims();
    let chunk = spec.chunk.max(1);
    let _precision = crate::layers::precision::enter(spec.dtype);
    // One cast of the head for every chunk's product.
    let w = crate::layers::precision::operand(w);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for start in (0..tokens).step_by(chunk) {
        let n = chunk.min(tokens - start);
        let z = chunk_logits(h.clone().narrow(0, start, n), &w, spec);
        let (local, outside) = local_labels(labels.clone().narrow(0, start, n), spec);
        // The backend's one-pass vocabulary kernel where it has one (burn-cuda): one read of
        // the chunk's logits instead of the chain below.
        let z = if B::vocab_stats_applies() {
            let kernel_labels = local.clone().mask_fill(outside.clone(), -1).reshape([n]);
            match B::vocab_stats(z, kernel_labels) {
                Ok(stats) => {
                    let (out, lse) = outputs_from_stats(stats, tp);
                    outs.push(out);
                    lses.push(lse.reshape([n]));
                    continue;
                }
                Err((z, _)) => z,
            }
        } else {
            z
        };
        let mut max = z.clone().max_dim(1);
        if let Some(reduce) = tp {
            max = reduce(max, crate::parallel::Collective::AllReduceMax);
        }
        let shifted = z - max.clone();
        let e = shifted.clone().exp();
        let picked = shifted.clone().gather(1, local).mask_fill(outside, 0.0);
        // Σ e, Σ e·(z − max), the label's shifted logit: summed over the shards at once.
        let mut sums = Tensor::cat(
            vec![e.clone().sum_dim(1), (e * shifted).sum_dim(1), picked],
            1,
        );
        if let Some(reduce) = tp {
            sums = reduce(sums, crate::parallel::Collective::AllReduceSum);
        }
        let s = sums.clone().narrow(1, 0, 1);
        let log_s = s.clone().log();
        let weighted = sums.clone().narrow(1, 1, 1) / s;
        let picked = sums.narrow(1, 2, 1);
        let log_prob = picked - log_s.clone();
        let entropy = log_s.clone() - weighted;
        outs.push(Tensor::cat(vec![log_prob, entropy], 1));
        lses.push((max + log_s).reshape([n]));
    }
    (Tensor::cat(outs, 0), Tensor::cat(lses, 0))
}

/// Log-probs and entropies `[n, 2]` and log-sum-exps `[n, 1]` from a shard's per-row
/// statistics `[m, s, p, w]` (`FusedOps::vocab_stats`: the shard's maximum, `Σ exp(x − m)`, the
/// label's logit or 0 outside the shard, `Σ exp(x − m) · x`), combined over `tp`: with `M` the
/// group's maximum and each shard's sums rescaled by `exp(m − M)`, `lse = M + log S`,
/// `log p = P − lse` and `H = lse − W / S`.
#[allow(clippy::type_complexity)]
fn outputs_from_stats<B: Backend>(
    stats: Tensor<B, 2>,
    tp: Option<&dyn Fn(Tensor<B, 2>, crate::parallel::Collective) -> Tensor<B, 2>>,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let column = |i: usize| stats.clone().narrow(1, i, 1);
    let shard_max = column(0);
    let max = match tp {
        Some(reduce) => reduce(shard_max.clone(), crate::parallel::Collective::AllReduceMax),
        None => shard_max.clone(),
    };
    let rescale = (shard_max - max.clone()).exp();
    let mut sums = Tensor::cat(
        vec![column(1) * rescale.clone(), column(3) * rescale, column(2)],
        1,
    );
    if let Some(reduce) = tp {
        sums = reduce(sums, crate::parallel::Collective::AllReduceSum);
    }
    let s = sums.clone().narrow(1, 0, 1);
    let lse = max + s.clone().log();
    let entropy = lse.clone() - sums.clone().narrow(1, 1, 1) / s;
    let log_prob = sums.narrow(1, 2, 1) - lse.clone();
    (Tensor::cat(vec![log_prob, entropy], 1), lse)
}

/// [`fused_forward`] on a backend whose collectives run on its base backend (`B::Base`): the
/// forward of the autodiff op, which the inner backend runs.
pub(crate) fn fused_forward_on<B: crate::parallel::ParallelBackend>(
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    spec: &FusedHead,
    tp: Option<&crate::parallel::CommHandle<B::Base>>,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let tp = match tp {
        Some(c) if c.0.world_size() > 1 => c,
        _ => return fused_forward(h, w, labels, spec, None),
    };
    // The group's sums go through the backend's collective (its base backend's tensors).
    let reduce = |x: Tensor<B, 2>, op: crate::parallel::Collective| B::collective(x, op, tp);
    fused_forward_with(h, w, labels, spec, Some(&reduce))
}

/// The gradients of `h` (this rank's partial sum) and `w` (its rows, whole) from the gradient
/// `grad` `[tokens, 2]` of [`fused_forward`]'s log-probs and entropies, recomputing each
/// chunk's logits; `lse` and `entropy` are the forward's.
pub fn fused_backward<B: FusedOps>(
    grad: Tensor<B, 2>,
    h: Tensor<B, 2>,
    w: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    lse: Tensor<B, 1>,
    entropy: Tensor<B, 1>,
    spec: &FusedHead,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let [tokens, _] = h.dims();
    let rows = w.dims()[0];
    let chunk = spec.chunk.max(1);
    let mut grad_w = Tensor::<B, 2>::zeros(w.dims(), &w.device());
    let _precision = crate::layers::precision::enter(spec.dtype);
    let w = crate::layers::precision::operand(w);
    let mut grad_h = Vec::new();
    for start in (0..tokens).step_by(chunk) {
        let n = chunk.min(tokens - start);
        let hc = h.clone().narrow(0, start, n);
        let z = chunk_logits(hc.clone(), &w, spec);
        let lse = lse.clone().narrow(0, start, n).reshape([n, 1]);
        let log_p = z - lse;
        let p = log_p.clone().exp();
        let g = grad.clone().narrow(0, start, n);
        let (g_lp, g_ent) = (g.clone().narrow(1, 0, 1), g.narrow(1, 1, 1));
        let (local, outside) = local_labels(labels.clone().narrow(0, start, n), spec);
        let inside = outside.bool_not().float();
        let one_hot = Tensor::<B, 2>::zeros([n, rows], &p.device()).scatter(
            1,
            local,
            inside,
            burn::tensor::IndexingUpdateOp::Add,
        );
        let h_tok = entropy.clone().narrow(0, start, n).reshape([n, 1]);
        // d log p_label / dz = 1[label] − p;  d H / dz = −p (log p + H).
        let dz = (one_hot - p.clone()) * g_lp - p * (log_p + h_tok) * g_ent;
        let dz = dz * spec.scale;
        grad_h.push(crate::layers::precision::matmul(dz.clone(), w.clone()));
        grad_w = grad_w + crate::layers::precision::matmul(dz.transpose(), hc);
    }
    (Tensor::cat(grad_h, 0), grad_w)
}

#[cfg(test)]
mod tests {
    use verl_core::algorithms::logits::{entropy_from_logits, log_probs_from_logits};
    use verl_core::backend::{CpuAutodiff, CpuBackend};

    use super::*;

    /// Values in [-1.5, 1.5) from a linear congruential sequence of `seed`.
    fn fixed<const D: usize>(
        shape: [usize; D],
        seed: u64,
        device: &burn::tensor::Device<CpuBackend>,
    ) -> Tensor<CpuBackend, D> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let values: Vec<f32> = (0..shape.iter().product::<usize>())
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 3.0 - 1.5
            })
            .collect();
        Tensor::from_data(TensorData::new(values, shape), device)
    }

    /// The statistics path (what a backend with a vocabulary kernel takes) against the chain
    /// the CPU runs: the kernel's `[m, s, p, w]` computed here with burn's operations from the
    /// same logits, combined by `outputs_from_stats`, give the chain's log-probs, entropies and
    /// log-sum-exps, with a padded row and the shard starting past id 0.
    #[test]
    fn statistics_give_the_chains_outputs() {
        let device = Default::default();
        let (tokens, hidden, rows) = (6, 4, 7);
        let h = fixed::<2>([tokens, hidden], 4, &device);
        let w = fixed::<2>([rows, hidden], 5, &device);
        // This shard holds ids 3..9, its last row padding. (A label outside the shard adds
        // its logit in another rank's sums, so at one rank every label is inside.)
        let labels = Tensor::<CpuBackend, 1, Int>::from_ints([3, 4, 8, 5, 7, 6], &device);
        let spec = FusedHead {
            vocab_start: 3,
            real_rows: rows - 1,
            scale: 1.3,
            chunk: tokens,
            dtype: Default::default(),
        };
        let (chain, chain_lse) = fused_forward(h.clone(), w.clone(), labels.clone(), &spec, None);
        let z = chunk_logits(h, &w, &spec);
        let (local, outside) = local_labels(labels, &spec);
        let m = z.clone().max_dim(1);
        let e = (z.clone() - m.clone()).exp();
        let p = z.clone().gather(1, local).mask_fill(outside, 0.0);
        let stats = Tensor::cat(vec![m, e.clone().sum_dim(1), p, (e * z).sum_dim(1)], 1);
        let (out, lse) = outputs_from_stats(stats, None);
        let flat = |t: Tensor<CpuBackend, 2>| t.into_data().to_vec::<f32>().unwrap();
        for (what, a, b) in [
            ("outputs", flat(out), flat(chain)),
            (
                "log-sum-exp",
                flat(lse),
                flat(chain_lse.reshape([tokens, 1])),
            ),
        ] {
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "{what}: {x} vs {y}"
                );
            }
        }
    }

    /// The chunked forward and the recomputing backward against autodiff through the full
    /// logits, at one rank, with padded rows and a temperature.
    #[test]
    fn the_fused_head_equals_the_plain_one_in_values_and_gradients() {
        let device = Default::default();
        let (tokens, hidden, rows, real) = (7, 5, 6, 5);
        // Fixed inputs: the process-wide random generator is shared with the tests running
        // beside this one, and a draw it once produced put the hidden gradient's f32 rounding
        // just past the bound.
        let h = fixed::<2>([tokens, hidden], 1, &device);
        let w = fixed::<2>([rows, hidden], 2, &device);
        let labels = Tensor::<CpuBackend, 1, Int>::from_ints([0, 4, 2, 3, 1, 4, 0], &device);
        let spec = FusedHead {
            vocab_start: 0,
            real_rows: real,
            scale: 1.0 / 0.7,
            chunk: 3,
            dtype: Default::default(),
        };
        let (out, lse) = fused_forward(h.clone(), w.clone(), labels.clone(), &spec, None);
        // What the backward reads: the forward's entropies.
        let entropy = out.clone().narrow(1, 1, 1).reshape([tokens]);
        // Plain: full logits of the real rows, through autodiff.
        let ha = Tensor::<CpuAutodiff, 2>::from_inner(h.clone()).require_grad();
        let wa = Tensor::<CpuAutodiff, 2>::from_inner(w.clone()).require_grad();
        let logits = ha.clone().matmul(wa.clone().narrow(0, 0, real).transpose()) * spec.scale;
        let logits = logits.reshape([1, tokens, real]);
        let lp = log_probs_from_logits(
            logits.clone(),
            Tensor::from_inner(labels.clone()).reshape([1, tokens]),
        );
        let ent = entropy_from_logits(logits);
        let close = |a: Vec<f32>, b: Vec<f32>, what: &str| {
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "{what}: {x} vs {y}"
                );
            }
        };
        let flat = |t: Tensor<CpuBackend, 2>| t.into_data().to_vec::<f32>().unwrap();
        close(
            flat(out.clone().narrow(1, 0, 1).reshape([1, tokens])),
            flat(lp.clone().inner()),
            "log-probs",
        );
        close(
            flat(out.narrow(1, 1, 1).reshape([1, tokens])),
            flat(ent.clone().inner()),
            "entropy",
        );
        // A loss weighting both outputs: gradients of h and of the head rows.
        let (a, b) = (0.3f32, -1.7f32);
        let weights = fixed::<2>([tokens, 2], 3, &device);
        let wa2 = weights.clone().narrow(1, 0, 1).reshape([1, tokens]) * a;
        let wb2 = weights.clone().narrow(1, 1, 1).reshape([1, tokens]) * b;
        let loss = (lp * Tensor::from_inner(wa2.clone())).sum()
            + (ent * Tensor::from_inner(wb2.clone())).sum();
        let grads = loss.backward();
        let grad = Tensor::cat(vec![wa2.reshape([tokens, 1]), wb2.reshape([tokens, 1])], 1);
        let (gh, gw) = fused_backward(grad, h, w, labels, lse, entropy, &spec);
        close(flat(gh), flat(ha.grad(&grads).unwrap()), "hidden gradient");
        let gw_plain = wa.grad(&grads).unwrap();
        close(
            flat(gw.clone().narrow(0, 0, real)),
            flat(gw_plain.narrow(0, 0, real)),
            "head gradient",
        );
        assert!(
            flat(gw.narrow(0, real, rows - real))
                .iter()
                .all(|g| *g == 0.0),
            "padding rows"
        );
    }
}

//! Qwen2-MoE's sparse mixture-of-experts block (the one piece of Qwen2-MoE the shared decoder
//! does not have).

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::{sigmoid, softmax};

use super::mlp::SwiGlu;
use crate::layers::ColumnParallelLinear;
use crate::parallel::{ParallelBackend, TpGroup};

/// Qwen2-MoE's block: a softmax router picks the top-k experts per token (weights renormalised
/// when `norm_topk_prob`), plus a shared expert scaled by a sigmoid gate.
#[derive(Module, Debug)]
pub struct SparseMoe<B: Backend> {
    /// Router `[experts, hidden]`, replicated on every rank.
    pub gate: ColumnParallelLinear<B>,
    pub experts: Vec<SwiGlu<B>>,
    pub shared_expert: SwiGlu<B>,
    /// `[1, hidden]`.
    pub shared_expert_gate: ColumnParallelLinear<B>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// Each expert's (and the shared expert's) intermediate features are split over the tp
    /// ranks; the router is replicated. The block enters the tensor-parallel region once and
    /// reduces once, after the weighted sum.
    #[module(skip)]
    pub tp: TpGroup,
}

impl<B: ParallelBackend> SparseMoe<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = self.tp.enter(x);
        let [b, t, h] = x.dims();
        let tokens = x.reshape([b * t, h]);
        let probs = softmax(self.gate.forward(tokens.clone()), 1);
        // Keep each token's k largest routing probabilities (ties are measure-zero for real
        // routers) and zero the rest.
        // (burn's autodiff has no top-k; a sort gives the k-th value, only compared with).
        let kth = probs
            .clone()
            .detach()
            .sort_descending(1)
            .narrow(1, self.top_k - 1, 1);
        let mut weights = probs.clone() * probs.greater_equal(kth).float();
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        // Every expert runs on every token here and is weighted by its (mostly zero) routing
        // weight: exact, but dense. Token dispatch belongs with expert parallelism.
        let mut out = self.shared_expert.forward_partial(tokens.clone())
            * sigmoid(self.shared_expert_gate.forward(tokens.clone()));
        for (e, expert) in self.experts.iter().enumerate() {
            out = out + expert.forward_partial(tokens.clone()) * weights.clone().narrow(1, e, 1);
        }
        self.tp.exit(out.reshape([b, t, h]))
    }
}

//! Qwen2-MoE's sparse mixture-of-experts block (the one piece of Qwen2-MoE the shared decoder
//! does not have), with token dispatch: each routed token goes only to its top-k experts, over
//! the expert-parallel group when the experts are distributed.
//!
//! # How tokens reach the experts
//!
//! The block works inside the tensor-parallel region, where every rank of a tp group holds the
//! same tokens. The tp group is cut into blocks of `etp` consecutive ranks (the expert-tensor
//! groups); each block routes its own share of the tokens, so every token is routed once per
//! block and each rank of the block computes its slice of each expert's features for the same
//! tokens. A rank sends each (token, chosen expert) pair to the ep rank holding that expert
//! (experts `ep_rank·E/ep ..` live on `ep_rank`), Megatron's capacity-free "dropless"
//! all-to-all: only routed tokens move, none is dropped. The expert outputs come back the same
//! way, weighted by the router and summed per token. The result is this rank's partial sum (the
//! other blocks' tokens are zero here, and within a block the expert slices are partial), which
//! the block's single tensor-parallel reduction completes, as the shared expert's is.
//!
//! With one rank everything above is local and the block computes each token's k experts
//! instead of all of them ([`SparseMoe::forward_dense`] keeps the every-expert form as the
//! reference).

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Int, TensorData};

use super::mlp::SwiGlu;
use crate::layers::ColumnParallelLinear;
use crate::parallel::{ParallelBackend, TpGroup};

/// Qwen2-MoE's block: a softmax router picks the top-k experts per token (weights renormalised
/// when `norm_topk_prob`), plus a shared expert scaled by a sigmoid gate.
#[derive(Module, Debug)]
pub struct SparseMoe<B: Backend> {
    /// Router `[experts, hidden]`, replicated on every rank.
    pub gate: ColumnParallelLinear<B>,
    /// This ep rank's routed experts: global ids `first_expert..first_expert + experts.len()`.
    pub experts: Vec<SwiGlu<B>>,
    pub shared_expert: SwiGlu<B>,
    /// `[1, hidden]`.
    pub shared_expert_gate: ColumnParallelLinear<B>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// Routed experts in the whole model.
    pub num_experts: usize,
    pub first_expert: usize,
    /// The shared expert's intermediate features are split over the tp ranks; the router is
    /// replicated. The block enters the tensor-parallel region once and reduces once, after
    /// the weighted sum.
    #[module(skip)]
    pub tp: TpGroup,
    /// Expert parallel group (experts distributed, tokens exchanged over it).
    #[module(skip)]
    pub ep: TpGroup,
    /// Expert tensor parallel group (each routed expert's features split over it).
    #[module(skip)]
    pub etp: TpGroup,
}

/// Where one block's routed (token, expert) pairs go and come back from, worked out on the
/// host from the router's choices.
struct Dispatch {
    /// Pair ids (`token · k + slot`) in send order: by expert, so by destination ep rank.
    send_order: Vec<usize>,
    /// Rows sent to each ep rank.
    send: Vec<usize>,
    /// Rows received from each ep rank.
    recv: Vec<usize>,
    /// Received rows grouped by local expert: the permutation and each expert's row count.
    by_expert: Vec<usize>,
    expert_rows: Vec<usize>,
}

fn index<B: Backend>(values: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let v: Vec<i64> = values.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(v, [values.len()]), device)
}

/// The inverse of a permutation.
fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

impl<B: ParallelBackend> SparseMoe<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = self.tp.enter(x);
        let [b, t, h] = x.dims();
        let tokens = x.reshape([b * t, h]);
        let probs = softmax(self.gate.forward(tokens.clone()), 1);
        let out = self.shared(tokens.clone()) + self.routed(tokens, probs);
        self.tp.exit(out.reshape([b, t, h]))
    }

    /// The shared expert scaled by its gate (partial over tp).
    fn shared(&self, tokens: Tensor<B, 2>) -> Tensor<B, 2> {
        self.shared_expert.forward_partial(tokens.clone())
            * sigmoid(self.shared_expert_gate.forward(tokens))
    }

    /// Every expert on every token, weighted by its (mostly zero) routing weight: the exact
    /// form token dispatch must reproduce, at tp = ep = 1 (every expert held here).
    pub fn forward_dense(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        assert!(
            self.experts.len() == self.num_experts,
            "the dense form needs every expert on this rank"
        );
        let x = self.tp.enter(x);
        let [b, t, h] = x.dims();
        let tokens = x.reshape([b * t, h]);
        let probs = softmax(self.gate.forward(tokens.clone()), 1);
        let kth = probs
            .clone()
            .detach()
            .sort_descending(1)
            .narrow(1, self.top_k - 1, 1);
        let mut weights = probs.clone() * probs.greater_equal(kth).float();
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        let mut out = self.shared(tokens.clone());
        for (e, expert) in self.experts.iter().enumerate() {
            out = out + expert.forward_partial(tokens.clone()) * weights.clone().narrow(1, e, 1);
        }
        self.tp.exit(out.reshape([b, t, h]))
    }

    /// This rank's share of the routed experts' output for `tokens` `[n, hidden]` under the
    /// router's `probs` `[n, experts]` (see the module docs).
    fn routed(&self, tokens: Tensor<B, 2>, probs: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, h] = tokens.dims();
        let device = tokens.device();
        let k = self.top_k;
        // This expert-tensor block's share of the tokens.
        let blocks = self.tp.size / self.etp.size;
        let block = self.tp.rank / self.etp.size;
        let per = n.div_ceil(blocks);
        let start = (block * per).min(n);
        let count = per.min(n - start);
        // A block with no tokens (fewer tokens than blocks) still takes part in the exchange;
        // its router joins the graph with weight 0, as an idle expert does below.
        let (experts, weights, unused_router) = if count == 0 {
            (Vec::new(), None, Some(probs.sum().reshape([1, 1]) * 0.0))
        } else {
            let mine = index::<B>(&(start..start + count).collect::<Vec<_>>(), &device);
            let (_, chosen) = probs
                .clone()
                .select(0, mine.clone())
                .detach()
                .sort_descending_with_indices(1);
            let chosen = chosen.narrow(1, 0, k);
            // The only host read of the block: which experts each token chose.
            let experts: Vec<usize> = chosen
                .clone()
                .into_data()
                .convert::<i64>()
                .iter::<i64>()
                .map(|e| e as usize)
                .collect();
            let mut weights = probs.select(0, mine).gather(1, chosen);
            if self.norm_topk_prob {
                weights = weights.clone() / weights.sum_dim(1);
            }
            (experts, Some(weights), None)
        };
        let plan = self.dispatch(&experts, &device);
        // Each pair's token, to its expert's rank.
        let send_tokens: Vec<usize> = plan.send_order.iter().map(|p| start + p / k).collect();
        let rows = tokens.clone().select(0, index::<B>(&send_tokens, &device));
        let received = self.ep.all_to_all_rows(rows, &plan.send, &plan.recv);
        let (computed, idle) = self.local_experts(received, &plan, h, &device);
        let back = self.ep.all_to_all_rows(computed, &plan.recv, &plan.send);
        let mut parts = vec![Tensor::<B, 2>::zeros([start, h], &device)];
        if let Some(weights) = weights {
            // Back in pair order (token, slot), weighted and summed over each token's experts.
            let pairs = back.select(0, index::<B>(&inverse(&plan.send_order), &device));
            let routed = (pairs.reshape([count, k, h]) * weights.unsqueeze_dim::<3>(2))
                .sum_dim(1)
                .reshape([count, h]);
            parts.push(routed);
        }
        parts.push(Tensor::zeros([n - start - count, h], &device));
        let out = Tensor::cat(parts, 0);
        match [idle, unused_router]
            .into_iter()
            .flatten()
            .reduce(|a, b| a + b)
        {
            Some(zero) => out + zero,
            None => out,
        }
    }

    /// Where this rank's (token, expert) pairs go, from each token's chosen `experts`
    /// (`count · k`, row-major); exchanges the per-expert counts over the ep group.
    fn dispatch(&self, experts: &[usize], device: &B::Device) -> Dispatch {
        let (ep, local) = (self.ep.size, self.experts.len());
        let mut send_order: Vec<usize> = (0..experts.len()).collect();
        send_order.sort_by_key(|&p| (experts[p], p));
        let mut per_expert = vec![0usize; self.num_experts];
        for &e in experts {
            per_expert[e] += 1;
        }
        let send: Vec<usize> = per_expert.chunks(local).map(|c| c.iter().sum()).collect();
        // Row j of `counts` goes to ep rank j: how many rows each of its experts gets from us.
        let got: Vec<usize> = if ep == 1 {
            per_expert.clone()
        } else {
            let counts: Vec<f32> = per_expert.iter().map(|&c| c as f32).collect();
            let counts = Tensor::<B, 2>::from_data(TensorData::new(counts, [ep, local]), device);
            self.ep
                .all_to_all_rows(counts, &vec![1; ep], &vec![1; ep])
                .into_data()
                .convert::<f32>()
                .iter::<f32>()
                .map(|c| c as usize)
                .collect()
        };
        // `got[src · local + e]`: rows of local expert e from ep rank src.
        let recv: Vec<usize> = got.chunks(local).map(|c| c.iter().sum()).collect();
        let mut offsets = vec![0usize; ep];
        for s in 1..ep {
            offsets[s] = offsets[s - 1] + recv[s - 1];
        }
        let mut by_expert = Vec::new();
        let mut expert_rows = Vec::with_capacity(local);
        for e in 0..local {
            let before = by_expert.len();
            for src in 0..ep {
                let skip: usize = got[src * local..src * local + e].iter().sum();
                let start = offsets[src] + skip;
                by_expert.extend(start..start + got[src * local + e]);
            }
            expert_rows.push(by_expert.len() - before);
        }
        Dispatch {
            send_order,
            send,
            recv,
            by_expert,
            expert_rows,
        }
    }

    /// The local experts on the rows they received (`[rows, hidden]`, grouped by source rank),
    /// partial over the expert-tensor group, in the received order; and, when some expert got
    /// no rows, a `[1, 1]` zero that depends on its parameters.
    fn local_experts(
        &self,
        received: Tensor<B, 2>,
        plan: &Dispatch,
        h: usize,
        device: &B::Device,
    ) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        let sorted = received.select(0, index::<B>(&plan.by_expert, device));
        let mut outputs = Vec::new();
        // An expert nobody routed to still joins the graph (with weight 0), so that every
        // parameter of a step has a gradient, as data-parallel reduction needs.
        let mut idle: Option<Tensor<B, 2>> = None;
        let mut offset = 0;
        for (expert, &rows) in self.experts.iter().zip(&plan.expert_rows) {
            if rows == 0 {
                let zero = expert.forward_partial(Tensor::<B, 2>::zeros([1, h], device)) * 0.0;
                idle = Some(match idle {
                    Some(z) => z + zero,
                    None => zero,
                });
                continue;
            }
            outputs.push(expert.forward_partial(sorted.clone().narrow(0, offset, rows)));
            offset += rows;
        }
        let computed = match outputs.is_empty() {
            true => Tensor::<B, 2>::zeros([0, h], device),
            false => Tensor::cat(outputs, 0),
        };
        let computed = computed.select(0, index::<B>(&inverse(&plan.by_expert), device));
        (computed, idle.map(|z| z.sum().reshape([1, 1])))
    }
}

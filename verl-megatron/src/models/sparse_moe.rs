//! The sparse mixture-of-experts block of Qwen2-MoE, Qwen3-MoE and Mixtral (the one piece of
//! them the shared decoder does not have), with token dispatch: each routed token goes only to its top-k experts, over
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

use std::any::Any;
use std::cell::RefCell;

use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{Int, TensorData};

use super::mlp::SwiGlu;
use crate::hf::MoeRouting;
use crate::layers::precision::ComputeDtype;
use crate::layers::ColumnParallelLinear;
use crate::parallel::{CpGroup, ParallelBackend, Region, TpGroup};

/// Qwen2-MoE's, Qwen3-MoE's and Mixtral's block: a softmax router picks the top-k experts per token
/// (weights renormalised when `norm_topk_prob`), plus, in Qwen2-MoE, a shared expert scaled by a
/// sigmoid gate.
#[derive(Module, Debug)]
pub struct SparseMoe<B: Backend> {
    /// Router `[experts, hidden]`, replicated on every rank.
    pub gate: ColumnParallelLinear<B>,
    /// This ep rank's routed experts: global ids `first_expert..first_expert + experts.len()`.
    pub experts: Vec<SwiGlu<B>>,
    /// Qwen2-MoE's shared expert (`None` in Qwen3-MoE, which has none).
    pub shared_expert: Option<SwiGlu<B>>,
    /// Its gate `[1, hidden]` (Qwen2-MoE's; DeepSeek's shared experts have none).
    pub shared_expert_gate: Option<ColumnParallelLinear<B>>,
    /// DeepSeek's `e_score_correction_bias` `[experts]`: added to the scores to choose experts,
    /// not to weigh them (no gradient reaches it).
    pub selection_bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub routing: MoeRouting,
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
    /// Context parallel group: the load-balancing loss counts the whole sequence's tokens.
    #[module(skip)]
    pub cp: CpGroup,
    /// Megatron's `moe_aux_loss_coeff`: the weight of the load-balancing loss (0: none).
    #[module(skip)]
    pub aux_loss_coeff: f64,
    /// This block's layer by Hugging Face index: its key in a replayed or recorded routing
    /// ([`super::router_replay`]).
    #[module(skip)]
    pub layer: usize,
}

thread_local! {
    /// While a training forward runs ([`collect_aux_losses`]): the tokens' mask and the
    /// load-balancing losses of the blocks it passed through (type-erased tensors).
    static AUX: RefCell<Option<AuxSink>> = const { RefCell::new(None) };
}

struct AuxSink {
    token_mask: Option<Box<dyn Any>>,
    losses: Vec<Box<dyn Any>>,
}

/// Runs `forward` collecting the load-balancing losses of the MoE blocks it runs through (each
/// already weighted by its `moe_aux_loss_coeff`), as Megatron's aux-loss scaler does: the
/// caller adds them to the micro-batch's loss (or, on a pipeline stage without a loss, to its
/// backward), so they reach the router on every stage.
pub fn collect_aux_losses<B: Backend, T>(forward: impl FnOnce() -> T) -> (T, Vec<Tensor<B, 1>>) {
    collect_aux_losses_masked(None, forward)
}

/// [`collect_aux_losses`] with the tokens' mask already known (a recomputed chunk of layers
/// runs again with the mask its first forward saw: [`aux_token_mask`]).
pub(crate) fn collect_aux_losses_masked<B: Backend, T>(
    token_mask: Option<Tensor<B, 1>>,
    forward: impl FnOnce() -> T,
) -> (T, Vec<Tensor<B, 1>>) {
    /// Puts the previous sink back however `forward` ends (a worker thread that survives a
    /// panic must not go on collecting into a sink nobody drains).
    struct Restore(Option<Option<AuxSink>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(previous) = self.0.take() {
                AUX.with(|a| *a.borrow_mut() = previous);
            }
        }
    }
    let mut restore = Restore(Some(AUX.with(|a| {
        a.borrow_mut().replace(AuxSink {
            token_mask: token_mask.map(|m| Box::new(m) as Box<dyn Any>),
            losses: Vec::new(),
        })
    })));
    let out = forward();
    let previous = restore.0.take().expect("restored once");
    let sink = AUX.with(|a| std::mem::replace(&mut *a.borrow_mut(), previous));
    let losses = sink
        .map(|s| s.losses)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|l| l.downcast::<Tensor<B, 1>>().ok().map(|t| *t))
        .collect();
    (out, losses)
}

/// Whether a forward is collecting load-balancing losses.
pub fn collecting_aux_losses() -> bool {
    AUX.with(|a| a.borrow().is_some())
}

/// The mask (`[tokens]`, 1 = a real token) of the tokens the MoE blocks of the running forward
/// see, in their order: padding is left out of the load-balancing loss, so that a layout's
/// own padding changes nothing.
pub fn set_aux_token_mask<B: Backend>(mask: Tensor<B, 1>) {
    AUX.with(|a| {
        if let Some(sink) = a.borrow_mut().as_mut() {
            sink.token_mask = Some(Box::new(mask));
        }
    });
}

pub(crate) fn aux_token_mask<B: Backend>() -> Option<Tensor<B, 1>> {
    AUX.with(|a| {
        a.borrow()
            .as_ref()
            .and_then(|s| s.token_mask.as_ref())
            .and_then(|m| m.downcast_ref::<Tensor<B, 1>>())
            .cloned()
    })
}

fn push_aux_loss<B: Backend>(loss: Tensor<B, 1>) {
    AUX.with(|a| {
        if let Some(sink) = a.borrow_mut().as_mut() {
            sink.losses.push(Box::new(loss));
        }
    });
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

/// Each row's `k` largest entries' columns `[rows, k]`, largest first, by k rounds of argmax
/// on the device (burn-cuda has no sort: its sort reads the tensor back to the host).
fn top_k_columns<B: Backend>(x: Tensor<B, 2>, k: usize) -> Tensor<B, 2, Int> {
    let e = x.dims()[1];
    let mut rest = x;
    let mut picks = Vec::with_capacity(k);
    for i in 0..k {
        let pick = rest.clone().argmax(1);
        if i + 1 < k {
            let taken = chosen_mask(pick.clone(), e).greater_elem(0.5);
            rest = rest.mask_fill(taken, f32::NEG_INFINITY);
        }
        picks.push(pick);
    }
    match picks.len() {
        1 => picks.remove(0),
        _ => Tensor::cat(picks, 1),
    }
}

/// `[rows, columns]`: 1 at each row's `chosen` columns `[rows, k]`, 0 elsewhere.
fn chosen_mask<B: Backend>(chosen: Tensor<B, 2, Int>, columns: usize) -> Tensor<B, 2> {
    let [n, k] = chosen.dims();
    let device = chosen.device();
    Tensor::<B, 2>::zeros([n, columns], &device).scatter(
        1,
        chosen,
        Tensor::ones([n, k], &device),
        burn::tensor::IndexingUpdateOp::Add,
    )
}

/// Each row's `k` largest columns `[rows, k]` of `scores` `[rows, experts]` among the
/// `topk_group` groups (of `n_group` consecutive experts) whose two largest scores sum
/// highest: DeepSeek-V3's group-limited routing.
pub fn group_limited_top_k<B: Backend>(
    scores: Tensor<B, 2>,
    n_group: usize,
    topk_group: usize,
    k: usize,
) -> Tensor<B, 2, Int> {
    let [n, e] = scores.dims();
    if n_group <= 1 || topk_group >= n_group {
        return top_k_columns(scores, k);
    }
    let per = e / n_group;
    let grouped = scores.clone().reshape([n * n_group, per]);
    let two_best = top_k_columns(grouped.clone(), 2);
    let group_scores = grouped.gather(1, two_best).sum_dim(1).reshape([n, n_group]);
    let groups = top_k_columns(group_scores, topk_group);
    let kept = chosen_mask(groups, n_group)
        .unsqueeze_dim::<3>(2)
        .repeat_dim(2, per)
        .reshape([n, e]);
    top_k_columns(scores.mask_fill(kept.lower_elem(0.5), f32::NEG_INFINITY), k)
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
        let probs = self.scores(tokens.clone());
        if self.aux_loss_coeff > 0.0 && collecting_aux_losses() {
            push_aux_loss(self.load_balancing_loss(probs.clone()));
        }
        let chosen = self.choose(probs.clone());
        let out = self.shared(tokens.clone()) + self.routed(tokens, probs, chosen);
        self.tp.exit(out.reshape([b, t, h]))
    }

    /// Each token's k experts `[n, k]` for the router's `probs` `[n, experts]`: its top-k, or,
    /// inside a replay scope holding this layer, the replayed ones (a row with a negative id
    /// keeps the router's); inside a recording scope, reported. The load-balancing loss keeps
    /// the router's own top-k, as Megatron's replay does.
    ///
    /// # Panics
    /// If a replayed routing does not hold `k` valid, distinct experts for each of the `n`
    /// tokens: the caller mapped another batch's choices onto this one.
    fn choose(&self, probs: Tensor<B, 2>) -> Tensor<B, 2, Int> {
        let [n, e] = probs.dims();
        let k = self.top_k;
        let device = probs.device();
        let own = || self.own_choice(probs.clone());
        let host = |t: Tensor<B, 2, Int>| -> Vec<i64> {
            t.into_data().convert::<i64>().iter::<i64>().collect()
        };
        let chosen = match super::router_replay::replayed(self.layer) {
            None => own(),
            Some(mut ids) => {
                assert_eq!(
                    ids.len(),
                    n * k,
                    "router replay: layer {} holds {} choices for {n} tokens of top-{k}",
                    self.layer,
                    ids.len()
                );
                // The router's own choices: the rows left to it take them, and the replayed
                // rows whose expert set differs from them are counted (the order within a row
                // does not matter).
                let routed = host(own());
                let (mut replayed, mut differing) = (0, 0);
                for (row, mine) in ids.chunks_mut(k).zip(routed.chunks(k)) {
                    if row.iter().any(|&x| x < 0) {
                        row.copy_from_slice(mine);
                    } else {
                        replayed += 1;
                        differing += usize::from(row.iter().any(|x| !mine.contains(x)));
                    }
                }
                super::router_replay::note_replayed(replayed, differing);
                for (t, row) in ids.chunks(k).enumerate() {
                    let valid = row.iter().all(|&x| (0..e as i64).contains(&x))
                        && (1..row.len()).all(|i| !row[..i].contains(&row[i]));
                    assert!(
                        valid,
                        "router replay: layer {} token {t} replays experts {row:?} of {e}",
                        self.layer
                    );
                }
                let ids: Vec<usize> = ids.into_iter().map(|x| x as usize).collect();
                super::index_tensor::<B>(&ids, &device).reshape([n, k])
            }
        };
        if super::router_replay::recording() {
            super::router_replay::record(self.layer, host(chosen.clone()));
        }
        chosen
    }

    /// Megatron's switch load-balancing loss of the router's `probs` `[tokens, experts]`:
    /// `coeff · E / (k · N²) · Σ_e (Σ_t p_te) · (tokens routed to e)`, over the real tokens
    /// (`N` of them) of the whole micro-batch: each tp rank sums its slice of the tokens (so the
    /// router's gradient, summed over tp, counts each once) and the sums are added over tp and
    /// cp (a reduction whose backward is the identity).
    fn load_balancing_loss(&self, probs: Tensor<B, 2>) -> Tensor<B, 1> {
        let [n, e] = probs.dims();
        let device = probs.device();
        let mask = aux_token_mask::<B>()
            .filter(|m| m.dims() == [n])
            .unwrap_or_else(|| Tensor::ones([n], &device));
        let per = n.div_ceil(self.tp.size);
        let start = (self.tp.rank * per).min(n);
        let count = per.min(n - start);
        let mut sums = Tensor::<B, 1>::zeros([2 * e + 1], &device);
        if count > 0 {
            let mine =
                super::index_tensor::<B>(&(start..start + count).collect::<Vec<_>>(), &device);
            let probs = probs.select(0, mine.clone());
            let mask = mask.select(0, mine).unsqueeze_dim::<2>(1);
            // Each token's k choices, as dispatch makes them.
            let chosen = self.own_choice(probs.clone());
            // Sigmoid scores enter the loss normalised per token, as Megatron's.
            let probs = match self.routing {
                MoeRouting::Softmax => probs,
                MoeRouting::SigmoidGroups { .. } => probs.clone() / probs.sum_dim(1),
            };
            let routed = chosen_mask(chosen, e) * mask.clone();
            let prob_sums = (probs * mask.clone()).sum_dim(0).reshape([e]);
            let counts = routed.sum_dim(0).reshape([e]);
            sums = Tensor::cat(vec![prob_sums, counts, mask.sum().reshape([1])], 0);
        }
        let sums = self.tp.region(sums, Region::ReduceFrom);
        let sums = self.cp.region(sums, Region::ReduceFrom);
        let prob_sums = sums.clone().narrow(0, 0, e);
        let counts = sums.clone().narrow(0, e, e).detach();
        let tokens = sums.narrow(0, 2 * e, 1).detach().clamp_min(1.0);
        let scale = self.aux_loss_coeff * e as f64 / self.top_k as f64;
        (prob_sums * counts).sum() * scale / tokens.powi_scalar(2)
    }

    /// The shared expert, scaled by its gate where it has one (partial over tp); zeros
    /// without one.
    fn shared(&self, tokens: Tensor<B, 2>) -> Tensor<B, 2> {
        match (&self.shared_expert, &self.shared_expert_gate) {
            (Some(expert), Some(gate)) => {
                expert.forward_partial(tokens.clone()) * sigmoid(gate.forward(tokens))
            }
            (Some(expert), None) => expert.forward_partial(tokens),
            _ => tokens.zeros_like(),
        }
    }

    /// The router's scores `[n, experts]` for `tokens` `[n, hidden]`: softmax, or DeepSeek's
    /// sigmoid, whose router product stays f32 under bf16 products (transformers keeps
    /// DeepSeek-V3's gate in f32 whatever the model's dtype).
    fn scores(&self, tokens: Tensor<B, 2>) -> Tensor<B, 2> {
        match self.routing {
            MoeRouting::Softmax => softmax(self.gate.forward(tokens), 1),
            MoeRouting::SigmoidGroups { .. } => {
                let _f32 = crate::layers::precision::enter(ComputeDtype::F32);
                sigmoid(self.gate.forward(tokens))
            }
        }
    }

    /// The router's own choice of each token's k experts `[n, k]` from its `scores`: their
    /// top-k, or DeepSeek's top-k of the scores plus the selection bias within the
    /// `topk_group` groups whose two best biased scores sum highest ([`group_limited_top_k`]).
    fn own_choice(&self, scores: Tensor<B, 2>) -> Tensor<B, 2, Int> {
        let scores = scores.detach();
        match self.routing {
            MoeRouting::Softmax => top_k_columns(scores, self.top_k),
            MoeRouting::SigmoidGroups {
                n_group,
                topk_group,
                ..
            } => {
                let biased = match &self.selection_bias {
                    Some(bias) => scores + bias.val().detach().unsqueeze_dim(0),
                    None => scores,
                };
                group_limited_top_k(biased, n_group, topk_group, self.top_k)
            }
        }
    }

    /// The chosen experts' weights from their scores `[n, k]` (or `[n, experts]` with the
    /// others 0): renormalised when `norm_topk_prob` (DeepSeek adds 10⁻²⁰ to the sum), then
    /// times DeepSeek's `routed_scaling_factor`.
    fn routing_weights(&self, chosen: Tensor<B, 2>) -> Tensor<B, 2> {
        match self.routing {
            MoeRouting::Softmax if self.norm_topk_prob => chosen.clone() / chosen.sum_dim(1),
            MoeRouting::Softmax => chosen,
            MoeRouting::SigmoidGroups {
                routed_scaling_factor,
                ..
            } => {
                let w = match self.norm_topk_prob {
                    true => chosen.clone() / (chosen.sum_dim(1) + 1e-20),
                    false => chosen,
                };
                w * routed_scaling_factor
            }
        }
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
        let probs = self.scores(tokens.clone());
        let chosen = self.choose(probs.clone());
        let weights = self.routing_weights(probs.clone() * chosen_mask(chosen, self.num_experts));
        let mut out = self.shared(tokens.clone());
        for (e, expert) in self.experts.iter().enumerate() {
            out = out + expert.forward_partial(tokens.clone()) * weights.clone().narrow(1, e, 1);
        }
        self.tp.exit(out.reshape([b, t, h]))
    }

    /// This rank's share of the routed experts' output for `tokens` `[n, hidden]` under the
    /// router's `probs` `[n, experts]`, each token going to its `chosen` experts `[n, k]` (see
    /// the module docs).
    fn routed(
        &self,
        tokens: Tensor<B, 2>,
        probs: Tensor<B, 2>,
        chosen: Tensor<B, 2, Int>,
    ) -> Tensor<B, 2> {
        let [n, h] = tokens.dims();
        let device = tokens.device();
        let k = self.top_k;
        // This expert-tensor block's share of the tokens.
        let blocks = self.tp.size / self.etp.size;
        let block = self.tp.rank / self.etp.size;
        // Balanced: a block is empty only when there are fewer tokens than blocks.
        let start = n * block / blocks;
        let count = n * (block + 1) / blocks - start;
        // A block with no tokens (fewer tokens than blocks) still takes part in the exchange;
        // its router joins the graph with weight 0, as an idle expert does below.
        let (experts, weights, unused_router) = if count == 0 {
            (Vec::new(), None, Some(probs.sum().reshape([1, 1]) * 0.0))
        } else {
            let mine =
                super::index_tensor::<B>(&(start..start + count).collect::<Vec<_>>(), &device);
            let chosen = chosen.select(0, mine.clone());
            // The only host read of the block: which experts each token chose.
            let experts: Vec<usize> = chosen
                .clone()
                .into_data()
                .convert::<i64>()
                .iter::<i64>()
                .map(|e| e as usize)
                .collect();
            let weights = self.routing_weights(probs.select(0, mine).gather(1, chosen));
            (experts, Some(weights), None)
        };
        let plan = self.dispatch(&experts, &device);
        // Each pair's token, to its expert's rank.
        let send_tokens: Vec<usize> = plan.send_order.iter().map(|p| start + p / k).collect();
        let rows = tokens
            .clone()
            .select(0, super::index_tensor::<B>(&send_tokens, &device));
        let received = self.ep.all_to_all_rows(rows, &plan.send, &plan.recv);
        let (computed, idle) = self.local_experts(received, &plan, h, &device);
        let back = self.ep.all_to_all_rows(computed, &plan.recv, &plan.send);
        // (burn-cuda cannot launch on empty tensors: only non-empty parts.)
        let mut parts = Vec::new();
        if start > 0 {
            parts.push(Tensor::<B, 2>::zeros([start, h], &device));
        }
        // With no tokens here `back` is empty, but it must stay on the loss's path: its
        // backward is the exchange the group's other ranks wait in.
        let mut unused_back = None;
        match weights {
            Some(weights) => {
                // Back in pair order (token, slot), weighted and summed over each token's
                // experts.
                let pairs = back.select(
                    0,
                    super::index_tensor::<B>(&inverse(&plan.send_order), &device),
                );
                let routed = (pairs.reshape([count, k, h]) * weights.unsqueeze_dim::<3>(2))
                    .sum_dim(1)
                    .reshape([count, h]);
                parts.push(routed);
            }
            None => unused_back = Some(back.sum().reshape([1, 1])),
        }
        if n > start + count {
            parts.push(Tensor::zeros([n - start - count, h], &device));
        }
        let out = match parts.len() {
            1 => parts.remove(0),
            _ => Tensor::cat(parts, 0),
        };
        match [idle, unused_router, unused_back]
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
        // Nothing received: every expert idle, nothing to send back.
        let sorted = (!plan.by_expert.is_empty()).then(|| {
            received
                .clone()
                .select(0, super::index_tensor::<B>(&plan.by_expert, device))
        });
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
            let rows_of = sorted
                .clone()
                .expect("rows were received")
                .narrow(0, offset, rows);
            outputs.push(expert.forward_partial(rows_of));
            offset += rows;
        }
        let computed = match outputs.len() {
            // `received` is empty then: sent back as it is.
            0 => received,
            1 => outputs.remove(0),
            _ => Tensor::cat(outputs, 0),
        };
        let computed = match plan.by_expert.is_empty() {
            true => computed,
            false => computed.select(
                0,
                super::index_tensor::<B>(&inverse(&plan.by_expert), device),
            ),
        };
        (computed, idle.map(|z| z.sum().reshape([1, 1])))
    }
}

/// A tiny Qwen2-MoE (hidden 8, 8-token vocabulary, every layer sparse with `experts` experts
/// of 4 features, `top_k` per token, a shared expert of 8) for the unit tests of the block and
/// of the layers around it.
#[cfg(test)]
pub(crate) fn tiny_config(experts: usize, top_k: usize, layers: usize) -> crate::hf::HfModelConfig {
    use crate::hf::{Architecture, HfModelConfig, MoeConfig, Qwen2Dims};
    let mut cfg = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 8,
        hidden_size: 8,
        intermediate_size: 8,
        num_hidden_layers: layers,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        max_position_embeddings: 16,
    });
    cfg.architecture = Architecture::Qwen2Moe;
    cfg.moe = Some(MoeConfig {
        num_experts: experts,
        num_experts_per_tok: top_k,
        moe_intermediate_size: 4,
        shared_expert_intermediate_size: 8,
        norm_topk_prob: false,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        routing: Default::default(),
    });
    cfg
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use proptest::prelude::*;
    use verl_core::backend::{CpuAutodiff, CpuBackend};

    use super::*;

    /// DeepSeek-V3's group-limited choice as a loop: the groups whose two best scores sum
    /// highest (`topk_group` of them), then the k best experts inside them.
    fn naive_group_limited(row: &[f32], groups: usize, topk_group: usize, k: usize) -> Vec<usize> {
        let per = row.len() / groups;
        let mut group_scores: Vec<(f32, usize)> = (0..groups)
            .map(|g| {
                let mut s: Vec<f32> = row[g * per..(g + 1) * per].to_vec();
                s.sort_by(|a, b| b.total_cmp(a));
                (s[0] + s[1], g)
            })
            .collect();
        group_scores.sort_by(|a, b| b.0.total_cmp(&a.0));
        let kept: Vec<usize> = group_scores[..topk_group].iter().map(|g| g.1).collect();
        let mut experts: Vec<(f32, usize)> = (0..row.len())
            .filter(|e| kept.contains(&(e / per)))
            .map(|e| (row[e], e))
            .collect();
        experts.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut chosen: Vec<usize> = experts[..k].iter().map(|e| e.1).collect();
        chosen.sort_unstable();
        chosen
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x4453_4b33),
            cases: 64,
            ..ProptestConfig::default()
        })]

        #[test]
        fn group_limited_routing_equals_the_loop(
            // Distinct scores: ties are the backends' own business.
            seed in 0u64..1_000_000,
            rows in 1usize..4,
            (groups, per) in (1usize..5, 2usize..5),
            topk_group in 1usize..5,
            k in 1usize..5,
        ) {
            let topk_group = topk_group.min(groups);
            let k = k.min(topk_group * per);
            let e = groups * per;
            let values: Vec<f32> = (0..rows * e)
                .map(|i| ((i as u64 * 2_654_435_761 + seed) % 1_000_003) as f32 / 1e6)
                .collect();
            let scores = Tensor::<CpuBackend, 2>::from_data(
                TensorData::new(values.clone(), [rows, e]),
                &Default::default(),
            );
            let got: Vec<i64> = group_limited_top_k(scores, groups, topk_group, k)
                .into_data()
                .convert::<i64>()
                .iter::<i64>()
                .collect();
            for (r, picks) in got.chunks(k).enumerate() {
                let mut picks: Vec<usize> = picks.iter().map(|&x| x as usize).collect();
                picks.sort_unstable();
                let want = naive_group_limited(&values[r * e..(r + 1) * e], groups, topk_group, k);
                prop_assert_eq!(picks, want);
            }
        }
    }

    #[test]
    fn deepseeks_router_stays_f32_under_bf16_products() {
        use crate::layers::precision::{self, ComputeDtype};
        let routed = |routing| {
            let mut cfg = tiny_config(4, 2, 1);
            if let Some(moe) = cfg.moe.as_mut() {
                moe.routing = routing;
            }
            let model = CausalLm::<CpuBackend>::init(&cfg, 0.3, 5, &Default::default());
            let Some(FeedForward::Moe(block)) = model.layers.into_iter().next().map(|l| l.mlp)
            else {
                panic!("an MoE layer")
            };
            let x = Tensor::<CpuBackend, 2>::random(
                [6, 8],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &Default::default(),
            );
            let f32: Vec<f32> = block.scores(x.clone()).into_data().to_vec().unwrap();
            let _bf16 = precision::enter(ComputeDtype::Bf16);
            let low: Vec<f32> = block.scores(x).into_data().to_vec().unwrap();
            (f32, low)
        };
        let deepseek = MoeRouting::SigmoidGroups {
            n_group: 2,
            topk_group: 1,
            routed_scaling_factor: 2.5,
        };
        let (a, b) = routed(deepseek);
        assert_eq!(a, b);
        // Qwen's router runs in the model's dtype (the control).
        let (a, b) = routed(MoeRouting::Softmax);
        assert_ne!(a, b);
    }

    #[test]
    fn group_limited_routing_skips_the_best_expert_of_a_weak_group() {
        // Hand-checked: groups {0, 1} (0.9 + 0.0) and {2, 3} (0.5 + 0.5); one group kept: the
        // second (1.0 > 0.9), so expert 0, the best alone, is not chosen.
        let scores =
            Tensor::<CpuBackend, 2>::from_floats([[0.9, 0.0, 0.5, 0.5]], &Default::default());
        let mut got: Vec<i64> = group_limited_top_k(scores, 2, 1, 2)
            .into_data()
            .convert::<i64>()
            .iter::<i64>()
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec![2, 3]);
    }
    use crate::models::feed_forward::FeedForward;
    use crate::models::CausalLm;

    fn block(experts: usize, top_k: usize, coeff: f64) -> SparseMoe<CpuAutodiff> {
        let cfg = tiny_config(experts, top_k, 1);
        let model = CausalLm::<CpuAutodiff>::init(&cfg, 0.3, 5, &Default::default())
            .with_moe_aux_loss(coeff);
        match model.layers.into_iter().next().map(|l| l.mlp) {
            Some(FeedForward::Moe(m)) => m,
            _ => unreachable!("a Qwen2-MoE layer"),
        }
    }

    /// A router that ignores its input (zero weights) gives every expert 1/E of each token;
    /// the top-k breaks the ties towards the first k experts (argmax's first maximum). By hand, with N tokens:
    /// Σ_t p = N/E per expert, the first k experts get N tokens each, so the loss is
    /// coeff · E/(k·N²) · k · (N/E) · N = coeff.
    #[test]
    fn a_uniform_router_costs_exactly_the_coefficient() {
        let mut m = block(4, 2, 0.3);
        let w = m.gate.weight.val();
        m.gate.weight = Param::from_tensor(w.zeros_like());
        let x = Tensor::<CpuAutodiff, 3>::ones([1, 5, 8], &Default::default());
        let (_, losses) = collect_aux_losses::<CpuAutodiff, _>(|| m.forward(x));
        assert_eq!(losses.len(), 1);
        let loss = losses[0].clone().into_scalar().elem::<f64>();
        assert!((loss - 0.3).abs() < 1e-6, "{loss}");
    }

    /// Padding tokens are left out: the loss over 3 real tokens and 2 padded ones is the loss
    /// of the 3 alone, and it reaches the router only (its gradient is non-zero).
    #[test]
    fn padding_is_left_out_and_the_loss_reaches_the_router() {
        let m = block(4, 2, 1.0);
        let device = Default::default();
        let x = Tensor::<CpuAutodiff, 3>::random(
            [1, 5, 8],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let (_, padded) = collect_aux_losses::<CpuAutodiff, _>(|| {
            set_aux_token_mask(Tensor::<CpuAutodiff, 1>::from_floats(
                [1.0, 1.0, 1.0, 0.0, 0.0],
                &device,
            ));
            m.forward(x.clone())
        });
        let (_, real) =
            collect_aux_losses::<CpuAutodiff, _>(|| m.forward(x.clone().narrow(1, 0, 3)));
        let (a, b) = (padded[0].clone(), real[0].clone());
        let (va, vb) = (
            a.clone().into_scalar().elem::<f64>(),
            b.into_scalar().elem::<f64>(),
        );
        assert!((va - vb).abs() < 1e-6 && va > 0.0, "{va} vs {vb}");
        let grads = a.backward();
        let router = m.gate.weight.grad(&grads).expect("the router's gradient");
        assert!(router.abs().sum().into_scalar().elem::<f64>() > 0.0);
    }

    fn random_tokens(shape: [usize; 3], seed: u64) -> Tensor<CpuAutodiff, 3> {
        let device = Default::default();
        <CpuAutodiff as Backend>::seed(&device, seed);
        Tensor::random(shape, burn::tensor::Distribution::Normal(0.0, 1.0), &device)
    }

    fn max_diff(a: Tensor<CpuAutodiff, 3>, b: Tensor<CpuAutodiff, 3>) -> f64 {
        (a - b).abs().max().into_scalar().elem::<f64>()
    }

    /// The replayed rows whose experts differ from the router's own are counted, as sets: a
    /// row replayed in another order agrees, a row left to the router is not counted.
    #[test]
    fn replays_count_the_tokens_their_router_would_route_elsewhere() {
        use crate::models::router_replay::{record_routing, replay_routing, take_disagreement};
        let m = block(4, 2, 0.0);
        let x = random_tokens([2, 5, 8], 11);
        let (_, mut routing) = record_routing(|| m.forward(x.clone()));
        let ids = routing.layers.get_mut(&0).expect("layer 0 recorded");
        // Token 0 to the two experts it did not choose, token 1 in swapped order, token 2 left
        // to the router.
        let others: Vec<i64> = (0..4).filter(|e| !ids[..2].contains(e)).collect();
        ids[..2].copy_from_slice(&others);
        ids.swap(2, 3);
        ids[4..6].copy_from_slice(&[-1, -1]);
        let _ = take_disagreement();
        replay_routing(std::sync::Arc::new(routing), || m.forward(x.clone()));
        assert_eq!(take_disagreement(), (9, 1));
        assert_eq!(take_disagreement(), (0, 0));
    }

    /// Replaying what a forward recorded gives that forward's output to the bit.
    #[test]
    fn replaying_recorded_choices_gives_the_same_output() {
        use crate::models::router_replay::{record_routing, replay_routing};
        let m = block(4, 2, 0.0);
        let x = random_tokens([2, 5, 8], 11);
        let (y, routing) = record_routing(|| m.forward(x.clone()));
        assert_eq!(routing.layers.len(), 1);
        assert_eq!(routing.layers[&0].len(), 2 * 5 * 2);
        let again = replay_routing(std::sync::Arc::new(routing), || m.forward(x.clone()));
        assert_eq!(y.into_data(), again.into_data());
    }

    /// A tie the router breaks one way, then the other after a 1e-5 nudge: without replay the
    /// token jumps to the other expert; with the first pass's choice replayed the output moves
    /// by the nudge alone. The router keeps its gradient under replay.
    #[test]
    fn replay_keeps_a_near_tie_on_its_recorded_expert() {
        use crate::models::router_replay::{record_routing, replay_routing};
        let mut m = block(4, 1, 0.0);
        let device = Default::default();
        // Experts 1 and 2 score alike on every token, experts 0 and 3 lower.
        let row = Tensor::<CpuAutodiff, 2>::random(
            [1, 8],
            burn::tensor::Distribution::Normal(0.0, 0.3),
            &device,
        );
        let low = row.clone() - 1.0;
        m.gate.weight = Param::from_tensor(Tensor::cat(
            vec![low.clone(), row.clone(), row.clone(), low],
            0,
        ));
        let x = Tensor::<CpuAutodiff, 3>::ones([1, 3, 8], &device);
        let (y, routing) = record_routing(|| m.forward(x.clone()));
        assert!(routing.layers[&0].iter().all(|&e| e == 1), "{routing:?}");
        // Expert 2 now scores 8e-5 above expert 1 on the all-ones tokens.
        let w = m.gate.weight.val();
        let nudge = Tensor::<CpuAutodiff, 2>::zeros([4, 8], &device)
            .slice_assign([2..3, 0..8], Tensor::ones([1, 8], &device) * 1e-5);
        m.gate.weight = Param::from_tensor((w + nudge).detach());
        let jumped = max_diff(m.forward(x.clone()), y.clone());
        let routing = std::sync::Arc::new(routing);
        let held = replay_routing(routing.clone(), || m.forward(x.clone()));
        let kept = max_diff(held.clone(), y);
        assert!(
            jumped > 1e-3,
            "the nudge flips the router's choice: {jumped}"
        );
        assert!(kept < 1e-4, "replay holds the expert: {kept}");
        let grads = held.sum().backward();
        let router = m.gate.weight.grad(&grads).expect("the router's gradient");
        assert!(router.abs().sum().into_scalar().elem::<f64>() > 0.0);
    }

    /// A replayed row with a negative id keeps the router's choice; the other rows take theirs.
    #[test]
    fn a_row_replayed_as_negative_keeps_the_routers_choice() {
        use crate::models::router_replay::{record_routing, replay_routing, Routing};
        let m = block(4, 2, 0.0);
        let x = random_tokens([1, 3, 8], 12);
        let (own, mine) = record_routing(|| m.forward(x.clone()));
        // Row 0 left to the router; rows 1 and 2 forced onto the two experts it did not pick.
        let mut forced = vec![-1, -1];
        for r in 1..3 {
            let picked = &mine.layers[&0][2 * r..2 * r + 2];
            forced.extend((0..4).filter(|e| !picked.contains(e)));
        }
        let routing = Routing {
            layers: [(0, forced)].into_iter().collect(),
        };
        let y = replay_routing(std::sync::Arc::new(routing), || m.forward(x.clone()));
        let row = |t: &Tensor<CpuAutodiff, 3>, i: usize| t.clone().narrow(1, i, 1);
        assert_eq!(row(&y, 0).into_data(), row(&own, 0).into_data());
        for r in 1..3 {
            assert!(max_diff(row(&y, r), row(&own, r)) > 1e-6, "row {r}");
        }
    }

    /// Token dispatch follows the replayed experts: the dispatched block equals the
    /// every-expert form under the same replay, and a row partly negative is the router's.
    #[test]
    fn dispatch_takes_the_replayed_experts() {
        use crate::models::router_replay::{record_routing, replay_routing, Routing};
        let m = block(4, 2, 0.0);
        let x = random_tokens([1, 3, 8], 13);
        let (own, mine) = record_routing(|| m.forward(x.clone()));
        let mut forced = vec![-1, 3];
        for r in 1..3 {
            let picked = &mine.layers[&0][2 * r..2 * r + 2];
            forced.extend((0..4).filter(|e| !picked.contains(e)));
        }
        let routing = std::sync::Arc::new(Routing {
            layers: [(0, forced)].into_iter().collect(),
        });
        let sparse = replay_routing(routing.clone(), || m.forward(x.clone()));
        let dense = replay_routing(routing, || m.forward_dense(x.clone()));
        assert!(max_diff(sparse.clone(), dense) < 1e-5);
        let row0 = |t: Tensor<CpuAutodiff, 3>| t.narrow(1, 0, 1).into_data();
        assert_eq!(row0(sparse), row0(own));
    }

    #[test]
    #[should_panic(expected = "token 1 replays experts [0, 4] of 4")]
    fn a_replayed_expert_out_of_range_is_refused() {
        use crate::models::router_replay::{replay_routing, Routing};
        let routing = Routing {
            layers: [(0, vec![0, 1, 0, 4])].into_iter().collect(),
        };
        let x = Tensor::<CpuAutodiff, 3>::ones([1, 2, 8], &Default::default());
        let m = block(4, 2, 0.0);
        let _ = replay_routing(std::sync::Arc::new(routing), || m.forward(x));
    }

    #[test]
    #[should_panic(expected = "token 0 replays experts [2, 2] of 4")]
    fn a_replayed_expert_chosen_twice_is_refused() {
        use crate::models::router_replay::{replay_routing, Routing};
        let routing = Routing {
            layers: [(0, vec![2, 2, 0, 1])].into_iter().collect(),
        };
        let x = Tensor::<CpuAutodiff, 3>::ones([1, 2, 8], &Default::default());
        let m = block(4, 2, 0.0);
        let _ = replay_routing(std::sync::Arc::new(routing), || m.forward(x));
    }

    /// Choices for another batch's tokens are refused, naming the layer.
    #[test]
    #[should_panic(expected = "router replay: layer 0 holds 2 choices for 3 tokens")]
    fn replayed_choices_of_the_wrong_length_are_refused() {
        use crate::models::router_replay::{replay_routing, Routing};
        let m = block(4, 1, 0.0);
        let routing = Routing {
            layers: [(0, vec![1, 2])].into_iter().collect(),
        };
        let x = Tensor::<CpuAutodiff, 3>::ones([1, 3, 8], &Default::default());
        let _ = replay_routing(std::sync::Arc::new(routing), || m.forward(x));
    }

    /// No coefficient, or no collecting forward (log-prob passes): no loss.
    #[test]
    fn only_training_forwards_with_a_coefficient_collect() {
        let x = Tensor::<CpuAutodiff, 3>::ones([1, 3, 8], &Default::default());
        let (_, none) =
            collect_aux_losses::<CpuAutodiff, _>(|| block(4, 2, 0.0).forward(x.clone()));
        assert!(none.is_empty());
        assert!(!collecting_aux_losses());
        let _ = block(4, 2, 1.0).forward(x);
    }
}

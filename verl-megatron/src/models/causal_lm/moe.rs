//! The mixture-of-experts switches of a [`CausalLm`]: the auxiliary loss, a frozen router, the
//! experts' parameter sets and groups.

use super::export::is_routed_expert;
use super::CausalLm;
use std::collections::HashSet;

use burn::module::{Module, ParamId};
use burn::prelude::*;

use crate::models::feed_forward::FeedForward;
use crate::parallel::TpGroup;

impl<B: Backend> CausalLm<B> {
    /// Adds Megatron's load-balancing loss to every MoE block's training forward, weighted by
    /// `coeff` (`moe_aux_loss_coeff`; 0 turns it off). See
    /// [`crate::models::sparse_moe::collect_aux_losses`].
    pub fn with_moe_aux_loss(mut self, coeff: f64) -> Self {
        if self.config.moe.is_none() {
            return self;
        }
        self.moe_aux_loss_coeff = coeff;
        for layer in &mut self.layers {
            if let FeedForward::Moe(m) = &mut layer.mlp {
                m.aux_loss_coeff = coeff;
            }
        }
        self
    }

    /// Freezes every MoE router and shared-expert gate (verl's `freeze_moe_router`, which
    /// freezes both): they get no gradient and keep their weights. The load-balancing loss,
    /// whose gradient only reaches the router, then moves nothing.
    pub fn freeze_moe_router(mut self) -> Self {
        for layer in &mut self.layers {
            if let FeedForward::Moe(m) = &mut layer.mlp {
                m.gate = m.gate.clone().no_grad();
                m.shared_expert_gate = m.shared_expert_gate.clone().map(|g| g.no_grad());
            }
        }
        self
    }

    /// The routed experts' parameters on this rank, and every other parameter.
    pub fn expert_param_sets(&self) -> (HashSet<ParamId>, HashSet<ParamId>) {
        let (mut experts, mut dense) = (HashSet::new(), HashSet::new());
        for (name, id, _) in self.named_param_ids() {
            match is_routed_expert(&name) {
                true => experts.insert(id),
                false => dense.insert(id),
            };
        }
        (experts, dense)
    }

    /// The expert parallel and expert tensor parallel groups of this stage's MoE layers
    /// (`None` without any).
    pub fn expert_groups(&self) -> Option<(&TpGroup, &TpGroup)> {
        self.layers.iter().find_map(|l| match &l.mlp {
            FeedForward::Moe(m) => Some((&m.ep, &m.etp)),
            FeedForward::Dense(_) => None,
        })
    }
}

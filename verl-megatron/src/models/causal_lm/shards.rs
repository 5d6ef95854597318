//! The parameters a rank holds, by Hugging Face name: their shapes and slices of the full
//! tensors (what a distributed checkpoint saves and loads), their ids and tensor-parallel sets.

use super::export::is_vocab_split;
use super::export::{is_routed_expert, tp_split_dim};
use super::CausalLm;
use std::collections::{HashMap, HashSet};

use burn::module::{Param, ParamId};
use burn::prelude::*;
use verl_core::NamedTensor;

use crate::error::MegatronError;
use crate::hf::hf_tensor_specs;
use crate::models::feed_forward::FeedForward;
use crate::models::generation_weights::FusedWeights;
use crate::models::mlp::SwiGlu;
use crate::parallel::TpGroup;

fn swiglu_param<'a, B: Backend>(m: &'a mut SwiGlu<B>, rest: &str) -> Option<ParamMut<'a, B>> {
    match rest {
        "gate_proj.weight" => Some(ParamMut::Matrix(&mut m.gate_proj.weight)),
        "up_proj.weight" => Some(ParamMut::Matrix(&mut m.up_proj.weight)),
        "down_proj.weight" => Some(ParamMut::Matrix(&mut m.down_proj.weight)),
        _ => None,
    }
}

/// A mutable reference to one parameter, found by its HF name.
pub(crate) enum ParamMut<'a, B: Backend> {
    Matrix(&'a mut Param<Tensor<B, 2>>),
    Vector(&'a mut Param<Tensor<B, 1>>),
}

impl<B: Backend> CausalLm<B> {
    /// The shape of this rank's shard of the weight called `name`, if the model has it.
    pub fn shard_shape(&mut self, name: &str) -> Option<Vec<usize>> {
        Some(match self.param_mut(name)? {
            ParamMut::Matrix(p) => p.val().dims().to_vec(),
            ParamMut::Vector(p) => p.val().dims().to_vec(),
        })
    }

    /// Replaces this rank's shard of one weight (named as in Hugging Face checkpoints, shaped
    /// as the shard), keeping its parameter id. The name must be one of this model's and the
    /// shape must match; otherwise the error names it.
    pub fn load_shard(&mut self, tensor: NamedTensor<B>) -> Result<(), MegatronError> {
        let name = tensor.name.clone();
        // Fused copies of the old values must not outlive them (`prepare_generation` rebuilds).
        self.generation = FusedWeights::default();
        let param = self
            .param_mut(&name)
            .ok_or_else(|| MegatronError::UnknownWeight { name: name.clone() })?;
        let shape_err = |expected: Vec<usize>| MegatronError::WeightShape {
            name: name.clone(),
            expected,
            found: tensor.shape.clone(),
        };
        match param {
            ParamMut::Matrix(p) => {
                let expected = p.val().dims().to_vec();
                if expected != tensor.shape {
                    return Err(shape_err(expected));
                }
                let mut t = tensor.to_tensor::<2>().map_err(|_| shape_err(expected))?;
                // A generation model's bf16 matrices stay bf16 (`with_generation_matrices`).
                if p.val().dtype() == burn::tensor::DType::BF16 {
                    t = t.cast(burn::tensor::FloatDType::BF16);
                }
                // On an autodiff backend the new value must stay a trained leaf.
                if p.val().is_require_grad() {
                    t = t.require_grad();
                }
                *p = Param::initialized(p.id, t);
            }
            ParamMut::Vector(p) => {
                let expected = p.val().dims().to_vec();
                if expected != tensor.shape {
                    return Err(shape_err(expected));
                }
                let mut t = tensor.to_tensor::<1>().map_err(|_| shape_err(expected))?;
                // On an autodiff backend the new value must stay a trained leaf.
                if p.val().is_require_grad() {
                    t = t.require_grad();
                }
                *p = Param::initialized(p.id, t);
            }
        }
        Ok(())
    }

    /// Where each tensor of [`Self::export_shards`] sits in its full tensor on this rank's
    /// tensor-parallel layout ([`tp_split_dim`]'s splits, which [`Self::from_source`] takes:
    /// q/k/v and gate/up rows, o_proj and down_proj columns, the vocabulary rows of the embedding
    /// and LM head, padded to a multiple of tp), the rest whole. A checkpoint records it so that it loads on another
    /// layout.
    pub fn shard_slices(
        &self,
    ) -> std::collections::BTreeMap<String, verl_core::weights::ShardSlice> {
        use verl_core::weights::ShardSlice;
        let full: HashMap<String, Vec<usize>> = hf_tensor_specs(&self.config)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        let split = |shape: &Vec<usize>, dim: usize, (start, len): (usize, usize)| ShardSlice {
            global_shape: shape.clone(),
            dim: Some(dim),
            start,
            len,
        };
        self.export_shards()
            .into_iter()
            .map(|t| {
                let shape = full
                    .get(&t.name)
                    .cloned()
                    .unwrap_or_else(|| t.shape.clone());
                let group = self.split_group(&t.name);
                let slice = match tp_split_dim(&t.name) {
                    _ if group.size == 1 => ShardSlice::whole(&shape),
                    Some(dim) if is_vocab_split(&t.name) => {
                        let (start, real, _) = self.tp.vocab_part(self.vocab_size);
                        split(&shape, dim, (start, real))
                    }
                    Some(dim) => split(&shape, dim, group.part(shape[dim])),
                    None => ShardSlice::whole(&shape),
                };
                (t.name, slice)
            })
            .collect()
    }

    /// Each of this rank's tensors with its slice of the full tensor and its shard shape
    /// (padding included): what loading a dist checkpoint saved on another layout assembles.
    pub fn shard_targets(&self) -> Vec<crate::checkpoint::ShardTarget> {
        let mut slices = self.shard_slices();
        self.export_shards()
            .into_iter()
            .filter_map(|t| {
                let slice = slices.remove(&t.name)?;
                Some(crate::checkpoint::ShardTarget {
                    name: t.name,
                    slice,
                    shape: t.shape,
                })
            })
            .collect()
    }

    /// Every parameter's Hugging Face name with its parameter id (what optimizer state is keyed
    /// by in burn) and whether it is a matrix (else a vector): how optimizer state is saved by
    /// name and restored onto a model whose ids differ.
    pub fn named_param_ids(&self) -> Vec<(String, burn::module::ParamId, bool)> {
        let names: Vec<String> = self.export_shards().into_iter().map(|t| t.name).collect();
        // `param_mut` needs `&mut`; a clone shares the tensors and keeps the ids.
        let mut model = self.clone();
        names
            .into_iter()
            .filter_map(|name| {
                let (id, matrix) = match model.param_mut(&name)? {
                    ParamMut::Matrix(p) => (p.id, true),
                    ParamMut::Vector(p) => (p.id, false),
                };
                Some((name, id, matrix))
            })
            .collect()
    }

    /// The parameters tensor parallelism shards, and the replicated ones whose gradient each
    /// rank gets only its part of, to be summed over the group: per-head q/k norms, MoE
    /// routers and latent attention's low-rank projections and norms (read inside the
    /// tensor-parallel region, each rank's heads using them), and with sequence parallelism the
    /// layer norms and row-parallel biases (applied to sequence shards).
    pub fn tp_param_sets(&self) -> (HashSet<ParamId>, HashSet<ParamId>) {
        let sp = self.tp.sequence_parallel;
        let (mut sharded, mut partial) = (HashSet::new(), HashSet::new());
        for (name, id, _) in self.named_param_ids() {
            let inside_region = [
                "q_norm.weight",
                "k_norm.weight",
                "mlp.gate.weight",
                "q_a_proj.weight",
                "q_a_layernorm.weight",
                "kv_a_proj_with_mqa.weight",
                "kv_a_layernorm.weight",
            ]
            .iter()
            .any(|s| name.ends_with(s))
                || name.ends_with("shared_expert_gate.weight");
            let on_sequence_shards = name.ends_with("layernorm.weight")
                || name == "model.norm.weight"
                || name.ends_with("o_proj.bias");
            if is_routed_expert(&name) {
                // Expert parallelism's business: see `expert_param_sets`.
                continue;
            }
            if tp_split_dim(&name).is_some() {
                sharded.insert(id);
            } else if inside_region || (sp && on_sequence_shards) {
                partial.insert(id);
            }
        }
        (sharded, partial)
    }

    /// The group that splits the weight called `name`: expert tensor parallel for a routed
    /// expert's, tensor parallel otherwise.
    pub fn split_group(&self, name: &str) -> &TpGroup {
        match self.expert_groups() {
            Some((_, etp)) if is_routed_expert(name) => etp,
            _ => &self.tp,
        }
    }

    pub(crate) fn param_mut(&mut self, name: &str) -> Option<ParamMut<'_, B>> {
        use ParamMut::{Matrix, Vector};
        match name {
            "model.embed_tokens.weight" => {
                return self.embed_tokens.as_mut().map(|e| Matrix(&mut e.weight))
            }
            "model.norm.weight" => return self.norm.as_mut().map(|n| Vector(&mut n.weight)),
            "lm_head.weight" => return self.lm_head.as_mut().map(|h| Matrix(&mut h.weight)),
            "score.weight" => return self.score.as_mut().map(|h| Matrix(&mut h.weight)),
            "score.bias" => {
                return self
                    .score
                    .as_mut()
                    .and_then(|h| h.bias.as_mut())
                    .map(Vector)
            }
            _ => {}
        }
        let rest = name.strip_prefix("model.layers.")?;
        let (index, rest) = rest.split_once('.')?;
        let index = index
            .parse::<usize>()
            .ok()?
            .checked_sub(self.stage.layers.start)?;
        let layer = self.layers.get_mut(index)?;
        if let Some(attn) = rest.strip_prefix("self_attn.") {
            let a = &mut layer.self_attn;
            let (module, kind) = attn.split_once('.')?;
            if let Some(l) = a.latent.as_mut() {
                let linear = match module {
                    "q_a_proj" => l.q_a_proj.as_mut(),
                    "q_b_proj" if l.q_a_proj.is_some() => Some(&mut l.q_b_proj),
                    "q_proj" if l.q_a_proj.is_none() => Some(&mut l.q_b_proj),
                    "kv_a_proj_with_mqa" => Some(&mut l.kv_a_proj_with_mqa),
                    "kv_b_proj" => Some(&mut l.kv_b_proj),
                    "q_a_layernorm" if kind == "weight" => {
                        return l.q_a_layernorm.as_mut().map(|n| Vector(&mut n.weight))
                    }
                    "kv_a_layernorm" if kind == "weight" => {
                        return Some(Vector(&mut l.kv_a_layernorm.weight))
                    }
                    _ => None,
                };
                if let Some(linear) = linear {
                    return match kind {
                        "weight" => Some(Matrix(&mut linear.weight)),
                        "bias" => linear.bias.as_mut().map(Vector),
                        _ => None,
                    };
                }
            }
            let (weight, bias) = match module {
                "q_proj" => grouped(a.q_proj.as_mut())?,
                "k_proj" => grouped(a.k_proj.as_mut())?,
                "v_proj" => grouped(a.v_proj.as_mut())?,
                "o_proj" => (&mut a.o_proj.weight, a.o_proj.bias.as_mut()),
                "q_norm" if kind == "weight" => {
                    return a.q_norm.as_mut().map(|n| Vector(&mut n.weight))
                }
                "k_norm" if kind == "weight" => {
                    return a.k_norm.as_mut().map(|n| Vector(&mut n.weight))
                }
                _ => return None,
            };
            return match kind {
                "weight" => Some(Matrix(weight)),
                "bias" => bias.map(Vector),
                _ => None,
            };
        }
        match rest {
            "input_layernorm.weight" => return Some(Vector(&mut layer.input_layernorm.weight)),
            "post_attention_layernorm.weight" => {
                return Some(Vector(&mut layer.post_attention_layernorm.weight))
            }
            "pre_feedforward_layernorm.weight" => {
                return layer
                    .pre_feedforward_layernorm
                    .as_mut()
                    .map(|n| Vector(&mut n.weight))
            }
            "post_feedforward_layernorm.weight" => {
                return layer
                    .post_feedforward_layernorm
                    .as_mut()
                    .map(|n| Vector(&mut n.weight))
            }
            _ => {}
        }
        let mlp = rest.strip_prefix("mlp.")?;
        match &mut layer.mlp {
            FeedForward::Dense(m) => swiglu_param(m, mlp),
            FeedForward::Moe(m) => {
                if mlp == "gate.weight" {
                    return Some(Matrix(&mut m.gate.weight));
                }
                if mlp == "gate.e_score_correction_bias" {
                    return m.selection_bias.as_mut().map(Vector);
                }
                if mlp == "shared_expert_gate.weight" {
                    return Some(Matrix(&mut m.shared_expert_gate.as_mut()?.weight));
                }
                if let Some(r) = mlp.strip_prefix("shared_expert.") {
                    return swiglu_param(m.shared_expert.as_mut()?, r);
                }
                let (e, r) = mlp.strip_prefix("experts.")?.split_once('.')?;
                let local = e.parse::<usize>().ok()?.checked_sub(m.first_expert)?;
                swiglu_param(m.experts.get_mut(local)?, r)
            }
        }
    }
}

/// A grouped-query projection's weight and bias, when the layer has it.
#[allow(clippy::type_complexity)]
fn grouped<B: Backend>(
    p: Option<&mut crate::layers::ColumnParallelLinear<B>>,
) -> Option<(&mut Param<Tensor<B, 2>>, Option<&mut Param<Tensor<B, 1>>>)> {
    p.map(|p| (&mut p.weight, p.bias.as_mut()))
}

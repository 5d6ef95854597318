//! Full weights out of a sharded model: per-tensor export in Hugging Face names, the buckets a
//! weight sync gathers together, the shards a rank holds, and loading a full tensor back.

use super::{CausalLm, DecoderLayer};
use std::collections::HashMap;

use burn::prelude::*;
use verl_core::NamedTensor;

use crate::error::MegatronError;
use crate::hf::{hf_tensor_specs, TensorSpec};
use crate::models::feed_forward::FeedForward;
use crate::models::mlp::SwiGlu;
use crate::parallel::{Collective, ParallelBackend, TpGroup};
use verl_core::traits::Communicator;

/// Weights a sync gathers and hands over together ([`CausalLm::weight_buckets`]).
#[derive(Debug, Clone, PartialEq)]
pub struct WeightBucket {
    /// The pipeline stage that holds them.
    pub owner: usize,
    /// Their full size in f32 bytes.
    pub bytes: usize,
    pub tensors: Vec<TensorSpec>,
}

/// Whether `name` is a matrix only ever used in products: a projection or the LM head.
pub(crate) fn is_product_matrix(name: &str) -> bool {
    name == "lm_head.weight" || name.ends_with("_proj.weight")
}

/// Whether `name` is one of a routed expert's weights (distributed by expert parallelism).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

/// Whether `name` is split over the vocabulary (and so padded with tp > 1).
pub(super) fn is_vocab_split(name: &str) -> bool {
    name == "model.embed_tokens.weight" || name == "lm_head.weight"
}

/// The dimension along which tensor parallelism splits the weight called `name` (HF naming),
/// or `None` for a replicated one.
pub fn tp_split_dim(name: &str) -> Option<usize> {
    let column = [
        "q_proj.weight",
        "q_proj.bias",
        "k_proj.weight",
        "k_proj.bias",
        "v_proj.weight",
        "v_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
        // Latent attention's per-head expansions (its low-rank projections are replicated).
        "q_b_proj.weight",
        "kv_b_proj.weight",
    ];
    if is_vocab_split(name) {
        return Some(0);
    }
    if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        return Some(1);
    }
    column.iter().any(|c| name.ends_with(c)).then_some(0)
}

impl<B: ParallelBackend> CausalLm<B> {
    /// Every weight under its Hugging Face name and full shape, one tensor at a time: what
    /// saving in HF format writes and what the rollout engine's `update_weights` consumes.
    /// With tp > 1 each shard is all-gathered from the group, so every tp rank must call this
    /// together.
    pub fn export_weights(&self) -> Vec<NamedTensor<B>> {
        let shards = self.export_shards();
        if self.distributed_experts().is_some() {
            // Every stage tensor in the HF table's order, so that the ep ranks broadcast each
            // routed expert from its owner together.
            let mut shards: HashMap<String, NamedTensor<B>> =
                shards.into_iter().map(|t| (t.name.clone(), t)).collect();
            return hf_tensor_specs(&self.config)
                .into_iter()
                .filter(|s| !s.optional && self.stage.owner_of(&s.name) == self.stage.stage)
                .map(|spec| {
                    let shard = shards.remove(&spec.name);
                    self.full_tensor(&spec, shard)
                        .expect("an expert-parallel group's ranks hold every expert between them")
                })
                .collect();
        }
        if !self.tp.is_parallel() && self.expert_groups().is_none_or(|(_, e)| !e.is_parallel()) {
            return shards;
        }
        shards.into_iter().map(|t| self.gather_shard(t)).collect()
    }

    /// The expert-parallel group, when the routed experts are spread over more than one rank.
    fn distributed_experts(&self) -> Option<&TpGroup> {
        self.expert_groups()
            .map(|(ep, _)| ep)
            .filter(|ep| ep.is_parallel())
    }

    /// The full tensor of `spec` from this rank's `shard` of it (gathered over its group), or,
    /// for a routed expert another ep rank holds, broadcast from that rank. Every rank of the
    /// tp (or expert tp) and ep groups calls this together for the same `spec`.
    fn full_tensor(
        &self,
        spec: &TensorSpec,
        shard: Option<NamedTensor<B>>,
    ) -> Result<NamedTensor<B>, MegatronError> {
        let ep = self
            .distributed_experts()
            .filter(|_| is_routed_expert(&spec.name));
        let Some(ep) = ep else {
            let shard = shard.ok_or_else(|| MegatronError::MissingWeight {
                name: spec.name.clone(),
            })?;
            return Ok(self.gather_shard(shard));
        };
        let n: usize = spec.shape.iter().product();
        let local = match shard {
            Some(t) => self.gather_shard(t).values,
            None => Tensor::zeros([n], &self.device()),
        };
        let expert: usize = spec
            .name
            .split(".mlp.experts.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|e| e.parse().ok())
            .ok_or_else(|| MegatronError::UnknownWeight {
                name: spec.name.clone(),
            })?;
        let per_rank = self
            .config
            .moe
            .as_ref()
            .map_or(1, |m| m.num_experts / ep.size);
        let comm = ep
            .comm::<B>()
            .expect("a parallel group has its communicator");
        let values = comm.broadcast(local, expert / per_rank.max(1))?;
        Ok(NamedTensor {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            values,
        })
    }

    /// The full tensor of this rank's shard `t`, all-gathered over the tensor-parallel group
    /// (every rank of it calls this together); a replicated tensor as it is.
    fn gather_shard(&self, t: NamedTensor<B>) -> NamedTensor<B> {
        let group = self.split_group(&t.name);
        let Some(dim) = tp_split_dim(&t.name).filter(|_| group.is_parallel()) else {
            return t;
        };
        let shard: Tensor<B, 2> = match t.shape.len() {
            2 => t.to_tensor::<2>().expect("rank checked"),
            _ => t.values.clone().unsqueeze_dim::<2>(1),
        };
        let mut full = group.collective(shard, Collective::AllGather(dim));
        if is_vocab_split(&t.name) {
            full = full.narrow(0, 0, self.vocab_size);
        }
        match t.shape.len() {
            2 => NamedTensor::new(t.name, full),
            _ => NamedTensor::new(t.name, full.flatten::<1>(0, 1)),
        }
    }

    /// The whole model's weights (HF table order, the optional ones left out) grouped into
    /// buckets of about `bucket_bytes` (f32) for a weight sync, each bucket's tensors held by
    /// one pipeline stage (its owner). The same on every rank.
    pub fn weight_buckets(&self, bucket_bytes: usize) -> Vec<WeightBucket> {
        let mut buckets: Vec<WeightBucket> = Vec::new();
        for spec in hf_tensor_specs(&self.config)
            .into_iter()
            .filter(|s| !s.optional)
        {
            let owner = self.stage.owner_of(&spec.name);
            let bytes = spec.shape.iter().product::<usize>() * 4;
            match buckets.last_mut() {
                Some(b) if b.owner == owner && b.bytes + bytes <= bucket_bytes => {
                    b.bytes += bytes;
                    b.tensors.push(spec);
                }
                _ => buckets.push(WeightBucket {
                    owner,
                    bytes,
                    tensors: vec![spec],
                }),
            }
        }
        buckets
    }

    /// One bucket's full tensors on every rank: its owner stage gathers each over its
    /// tensor-parallel group (taking its shards out of `shards`, this rank's
    /// [`Self::export_shards`] listed once per sync), then (with `pp`) sends the bucket to the
    /// other stages as one flat buffer. Every rank of the tp and pp groups calls this together.
    pub fn gather_bucket(
        &self,
        bucket: &WeightBucket,
        shards: &mut HashMap<String, NamedTensor<B>>,
        pp: Option<&dyn Communicator<B>>,
    ) -> Result<Vec<NamedTensor<B>>, MegatronError> {
        let me = pp.map_or(0, |p| p.rank());
        let mine = match bucket.owner == me {
            true => bucket
                .tensors
                .iter()
                .map(|s| self.full_tensor(s, shards.remove(&s.name)))
                .collect::<Result<Vec<_>, MegatronError>>()?,
            false => Vec::new(),
        };
        let pp = match pp {
            Some(p) if p.world_size() > 1 => p,
            _ => return Ok(mine),
        };
        let sizes: Vec<usize> = bucket
            .tensors
            .iter()
            .map(|s| s.shape.iter().product())
            .collect();
        let flat = match bucket.owner == me {
            true => Tensor::cat(mine.into_iter().map(|t| t.values).collect(), 0),
            false => Tensor::zeros([sizes.iter().sum::<usize>()], &self.device()),
        };
        let flat = pp.broadcast(flat, bucket.owner)?;
        let mut offset = 0;
        Ok(bucket
            .tensors
            .iter()
            .zip(sizes)
            .map(|(s, n)| {
                let values = flat.clone().narrow(0, offset, n);
                offset += n;
                NamedTensor {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    values,
                }
            })
            .collect())
    }

    /// Every weight of the whole model, full, on every rank of a pipeline-parallel model: each
    /// stage's tensors (gathered over tp, as [`Self::export_weights`]) broadcast from their
    /// stage over `pp`, one tensor at a time, in the HF table's order. Every rank of the tp and
    /// pp groups must call this together.
    pub fn export_all_stages(
        &self,
        pp: &dyn Communicator<B>,
    ) -> Result<Vec<NamedTensor<B>>, MegatronError> {
        if pp.world_size() == 1 {
            return Ok(self.export_weights());
        }
        let me = pp.rank();
        let mut mine: HashMap<String, NamedTensor<B>> = self
            .export_weights()
            .into_iter()
            .filter(|t| self.stage.owner_of(&t.name) == me)
            .map(|t| (t.name.clone(), t))
            .collect();
        let device = self.device();
        let mut out = Vec::new();
        // Optional tensors (a tied model's `lm_head.weight`) are not the model's own.
        for spec in hf_tensor_specs(&self.config)
            .into_iter()
            .filter(|s| !s.optional)
        {
            let owner = self.stage.owner_of(&spec.name);
            let n: usize = spec.shape.iter().product();
            let local = match mine.remove(&spec.name) {
                Some(t) if owner == me => t.values,
                _ => Tensor::zeros([n], &device),
            };
            let values = pp.broadcast(local, owner)?;
            out.push(NamedTensor {
                name: spec.name,
                shape: spec.shape,
                values,
            });
        }
        Ok(out)
    }

    /// Replaces one weight from its full tensor (named as in Hugging Face checkpoints), keeping
    /// its parameter id; this rank keeps its shard. A tensor already shaped as this rank's shard
    /// is taken as that shard. The name must be one of this model's and
    /// the shape must match; otherwise the error names it. This is how the rollout engine takes
    /// the actor's weights tensor by tensor.
    pub fn load_weight(&mut self, tensor: NamedTensor<B>) -> Result<(), MegatronError> {
        let split =
            tp_split_dim(&tensor.name).filter(|_| self.split_group(&tensor.name).is_parallel());
        // Already this rank's shard (a weight sync between equal tensor-parallel layouts).
        if split.is_some() && self.shard_shape(&tensor.name).as_ref() == Some(&tensor.shape) {
            return self.load_shard(tensor);
        }
        let Some(dim) = split else {
            return self.load_shard(tensor);
        };
        if is_vocab_split(&tensor.name) {
            let full = tensor
                .to_tensor::<2>()
                .map_err(|_| MegatronError::WeightShape {
                    name: tensor.name.clone(),
                    expected: vec![self.vocab_size, 0],
                    found: tensor.shape.clone(),
                })?;
            let [vocab, hidden] = full.dims();
            let (start, real, per) = self.tp.vocab_part(vocab);
            // No padding tensor when there is no padding: an empty tensor on burn-cuda is a
            // launch of zero blocks, which the driver refuses (CUDA_ERROR_INVALID_VALUE: the
            // first generation of a 7B pp=2 × tp=2 job, whose 152 064 rows split evenly).
            let device = full.device();
            let pad = || Tensor::<B, 2>::zeros([per - real, hidden], &device);
            let rows = match real {
                0 => pad(),
                _ if real == per => full.narrow(0, start, real),
                _ => Tensor::cat(vec![full.narrow(0, start, real), pad()], 0),
            };
            return self.load_shard(NamedTensor::new(tensor.name, rows));
        }
        let mut shape = tensor.shape.clone();
        let group = self.split_group(&tensor.name);
        if dim >= shape.len() || !shape[dim].is_multiple_of(group.size) {
            return Err(MegatronError::WeightShape {
                name: tensor.name.clone(),
                expected: vec![],
                found: shape,
            });
        }
        let (start, len) = group.part(shape[dim]);
        shape[dim] = len;
        let values = match tensor.shape.len() {
            2 => {
                let full = tensor.to_tensor::<2>().expect("rank checked");
                full.narrow(dim, start, len).flatten::<1>(0, 1)
            }
            _ => tensor.values.narrow(0, start, len),
        };
        self.load_shard(NamedTensor {
            name: tensor.name,
            shape,
            values,
        })
    }
}

impl<B: Backend> CausalLm<B> {
    /// This rank's shard of every weight under its Hugging Face name (the whole weights at
    /// tp = 1): what a sharded checkpoint stores per rank.
    pub fn export_shards(&self) -> Vec<NamedTensor<B>> {
        let mut out: Vec<NamedTensor<B>> = self
            .embed_tokens
            .iter()
            .map(|e| NamedTensor::new("model.embed_tokens.weight", e.weight.val()))
            .collect();
        for (l, layer) in self.stage.layers.clone().zip(&self.layers) {
            push_layer(&mut out, &format!("model.layers.{l}"), layer);
        }
        if let Some(norm) = &self.norm {
            out.push(NamedTensor::new("model.norm.weight", norm.weight.val()));
        }
        if let Some(head) = &self.lm_head {
            out.push(NamedTensor::new("lm_head.weight", head.weight.val()));
        }
        if let Some(score) = &self.score {
            out.push(NamedTensor::new("score.weight", score.weight.val()));
            if let Some(b) = &score.bias {
                out.push(NamedTensor::new("score.bias", b.val()));
            }
        }
        out
    }
}

/// Decoder layer `p`'s shards, in the order a sharded checkpoint stores them.
fn push_layer<B: Backend>(out: &mut Vec<NamedTensor<B>>, p: &str, layer: &DecoderLayer<B>) {
    out.push(NamedTensor::new(
        format!("{p}.input_layernorm.weight"),
        layer.input_layernorm.weight.val(),
    ));
    out.push(NamedTensor::new(
        format!("{p}.post_attention_layernorm.weight"),
        layer.post_attention_layernorm.weight.val(),
    ));
    for (name, norm) in [
        (
            "pre_feedforward_layernorm",
            &layer.pre_feedforward_layernorm,
        ),
        (
            "post_feedforward_layernorm",
            &layer.post_feedforward_layernorm,
        ),
    ] {
        if let Some(norm) = norm {
            out.push(NamedTensor::new(
                format!("{p}.{name}.weight"),
                norm.weight.val(),
            ));
        }
    }
    let a = &layer.self_attn;
    let latent = a.latent.as_ref().map(|l| {
        let q_b = match l.q_a_proj {
            Some(_) => "q_b_proj",
            None => "q_proj",
        };
        [
            ("q_a_proj", l.q_a_proj.as_ref()),
            (q_b, Some(&l.q_b_proj)),
            ("kv_a_proj_with_mqa", Some(&l.kv_a_proj_with_mqa)),
            ("kv_b_proj", Some(&l.kv_b_proj)),
        ]
    });
    let grouped = [
        ("q_proj", a.q_proj.as_ref()),
        ("k_proj", a.k_proj.as_ref()),
        ("v_proj", a.v_proj.as_ref()),
    ];
    for (name, proj) in latent.into_iter().flatten().chain(grouped) {
        if let Some(proj) = proj {
            push_linear(
                out,
                format!("{p}.self_attn.{name}"),
                proj.weight.val(),
                proj.bias.as_ref().map(|b| b.val()),
            );
        }
    }
    if let Some(l) = &a.latent {
        for (name, norm) in [
            ("q_a_layernorm", l.q_a_layernorm.as_ref()),
            ("kv_a_layernorm", Some(&l.kv_a_layernorm)),
        ] {
            if let Some(norm) = norm {
                out.push(NamedTensor::new(
                    format!("{p}.self_attn.{name}.weight"),
                    norm.weight.val(),
                ));
            }
        }
    }
    push_linear(
        out,
        format!("{p}.self_attn.o_proj"),
        a.o_proj.weight.val(),
        a.o_proj.bias.as_ref().map(|b| b.val()),
    );
    if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
        out.push(NamedTensor::new(
            format!("{p}.self_attn.q_norm.weight"),
            qn.weight.val(),
        ));
        out.push(NamedTensor::new(
            format!("{p}.self_attn.k_norm.weight"),
            kn.weight.val(),
        ));
    }
    match &layer.mlp {
        FeedForward::Dense(m) => push_swiglu(out, format!("{p}.mlp"), m),
        FeedForward::Moe(m) => {
            out.push(NamedTensor::new(
                format!("{p}.mlp.gate.weight"),
                m.gate.weight.val(),
            ));
            if let Some(bias) = &m.selection_bias {
                out.push(NamedTensor::new(
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    bias.val(),
                ));
            }
            for (e, expert) in m.experts.iter().enumerate() {
                let e = m.first_expert + e;
                push_swiglu(out, format!("{p}.mlp.experts.{e}"), expert);
            }
            if let Some(expert) = &m.shared_expert {
                push_swiglu(out, format!("{p}.mlp.shared_expert"), expert);
            }
            if let Some(gate) = &m.shared_expert_gate {
                out.push(NamedTensor::new(
                    format!("{p}.mlp.shared_expert_gate.weight"),
                    gate.weight.val(),
                ));
            }
        }
    }
}

/// A linear layer's bias (if any), then its weight.
fn push_linear<B: Backend>(
    out: &mut Vec<NamedTensor<B>>,
    name: String,
    w: Tensor<B, 2>,
    b: Option<Tensor<B, 1>>,
) {
    if let Some(b) = b {
        out.push(NamedTensor::new(format!("{name}.bias"), b));
    }
    out.push(NamedTensor::new(format!("{name}.weight"), w));
}

/// A SwiGLU MLP's gate, up and down weights.
fn push_swiglu<B: Backend>(out: &mut Vec<NamedTensor<B>>, p: String, m: &SwiGlu<B>) {
    for (name, proj) in [("gate_proj", &m.gate_proj), ("up_proj", &m.up_proj)] {
        out.push(NamedTensor::new(
            format!("{p}.{name}.weight"),
            proj.weight.val(),
        ));
    }
    out.push(NamedTensor::new(
        format!("{p}.down_proj.weight"),
        m.down_proj.weight.val(),
    ));
}

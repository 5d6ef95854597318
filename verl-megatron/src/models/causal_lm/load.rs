//! Building a [`CausalLm`] from a Hugging Face checkpoint, from named tensors, or from a random
//! init: every tensor by its HF name through a [`TensorSource`], sharded for this rank's layout.

use super::random_init::RandomInit;
use super::{CausalLm, DecoderLayer, PipelineStageLayout};
use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::Param;
use burn::prelude::*;
use verl_core::NamedTensor;

use crate::error::MegatronError;
use crate::hf::{hf_tensor_specs, HeadKind, HfCheckpoint, HfModelConfig, MoeRouting, TensorSpec};
use crate::layers::precision::ComputeDtype;
use crate::layers::{
    ColumnParallelLinear, RmsNorm, RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
};
use crate::models::attention::{Attention, AttentionScores};
use crate::models::feed_forward::FeedForward;
use crate::models::generation_weights::FusedWeights;
use crate::models::latent_attention::LatentAttention;
use crate::models::mlp::SwiGlu;
use crate::models::sparse_moe::SparseMoe;
use crate::parallel::{ModelGroups, ParallelBackend, TpGroup};

/// Where [`CausalLm::from_source`] takes each tensor from, by Hugging Face name.
pub trait TensorSource<B: Backend> {
    fn load<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, MegatronError>;

    /// `(start, len)` of dimension `dim` of the tensor: a tensor-parallel rank's shard. By
    /// default the whole tensor is loaded and narrowed.
    fn load_part<const D: usize>(
        &self,
        name: &str,
        dim: usize,
        (start, len): (usize, usize),
    ) -> Result<Tensor<B, D>, MegatronError> {
        Ok(self.load::<D>(name)?.narrow(dim, start, len))
    }
}

/// Tensors read from an HF checkpoint.
struct CheckpointSource<'a, B: Backend> {
    ckpt: &'a HfCheckpoint,
    device: &'a B::Device,
}

impl<B: ParallelBackend> TensorSource<B> for CheckpointSource<'_, B> {
    fn load<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, MegatronError> {
        self.ckpt.load::<B, D>(name, self.device)
    }

    /// Reads only the shard's bytes.
    fn load_part<const D: usize>(
        &self,
        name: &str,
        dim: usize,
        part: (usize, usize),
    ) -> Result<Tensor<B, D>, MegatronError> {
        self.ckpt
            .load_part::<B, D>(name, dim, Some(part), self.device)
    }
}

/// Tensors handed over by name, each taken (moved out) when loaded: full tensors, or this
/// rank's shards (told apart by their extent along the split dimension against the full
/// shape in `full`).
struct NamedSource<B: Backend> {
    tensors: RefCell<HashMap<String, NamedTensor<B>>>,
    full: HashMap<String, Vec<usize>>,
}

impl<B: Backend> TensorSource<B> for NamedSource<B> {
    fn load<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, MegatronError> {
        let t = self
            .tensors
            .borrow_mut()
            .remove(name)
            .ok_or_else(|| MegatronError::MissingWeight { name: name.into() })?;
        t.to_tensor::<D>().map_err(|_| MegatronError::WeightShape {
            name: name.into(),
            expected: vec![0; D],
            found: t.shape.clone(),
        })
    }

    fn load_part<const D: usize>(
        &self,
        name: &str,
        dim: usize,
        (start, len): (usize, usize),
    ) -> Result<Tensor<B, D>, MegatronError> {
        let t = self.load::<D>(name)?;
        let full_extent = self.full.get(name).and_then(|s| s.get(dim)).copied();
        Ok(match full_extent == Some(t.dims()[dim]) {
            true => t.narrow(dim, start, len),
            // Already this rank's shard: its real part (padding after it).
            false => t.narrow(dim, 0, len),
        })
    }
}

/// A value model over a causal LM's checkpoint: the backbone's tensors from the checkpoint, the
/// new head (`score.*`) drawn.
struct BackboneSource<'a, B: Backend> {
    ckpt: CheckpointSource<'a, B>,
    head: RandomInit<'a, B>,
}

impl<B: ParallelBackend> TensorSource<B> for BackboneSource<'_, B> {
    fn load<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, MegatronError> {
        match name.starts_with("score.") {
            true => self.head.load(name),
            false => self.ckpt.load(name),
        }
    }

    fn load_part<const D: usize>(
        &self,
        name: &str,
        dim: usize,
        part: (usize, usize),
    ) -> Result<Tensor<B, D>, MegatronError> {
        match name.starts_with("score.") {
            true => self.head.load_part(name, dim, part),
            false => self.ckpt.load_part(name, dim, part),
        }
    }
}

impl<B: ParallelBackend> CausalLm<B> {
    /// Loads the model from an open checkpoint (verified against `cfg` first), one tensor at a
    /// time.
    pub fn from_checkpoint(
        cfg: &HfModelConfig,
        ckpt: &HfCheckpoint,
        device: &B::Device,
    ) -> Result<Self, MegatronError> {
        Self::from_checkpoint_sharded(cfg, ckpt, device, &TpGroup::none())
    }

    /// This tensor-parallel rank's shard of the checkpoint's model: each tensor's shard is
    /// read alone from the mapped file (the full tensors are never materialised).
    pub fn from_checkpoint_sharded(
        cfg: &HfModelConfig,
        ckpt: &HfCheckpoint,
        device: &B::Device,
        tp: &TpGroup,
    ) -> Result<Self, MegatronError> {
        ckpt.verify(cfg)?;
        let whole = PipelineStageLayout::whole(cfg.num_hidden_layers);
        Self::from_source(cfg, &CheckpointSource { ckpt, device }, tp, &whole)
    }

    /// This tensor- and pipeline-parallel rank's part of the checkpoint's model.
    pub fn from_checkpoint_stage(
        cfg: &HfModelConfig,
        ckpt: &HfCheckpoint,
        device: &B::Device,
        groups: impl Into<ModelGroups>,
        stage: &PipelineStageLayout,
    ) -> Result<Self, MegatronError> {
        ckpt.verify(cfg)?;
        Self::from_source(cfg, &CheckpointSource { ckpt, device }, groups, stage)
    }

    /// A value model (one score per token, `…ForTokenClassification` with one label) on the
    /// backbone of the causal LM checkpoint `ckpt` whose config is `lm`: its layers, norms and
    /// embedding from the checkpoint, a new head drawn from N(0, `std`²) seeded by `seed`
    /// (the LM head is not read), as verl builds a PPO critic from an LM path. A checkpoint that
    /// already has a value head (`score.weight`, a critic saved earlier) loads whole.
    pub fn value_model_from_checkpoint_stage(
        lm: &HfModelConfig,
        ckpt: &HfCheckpoint,
        (std, seed): (f64, u64),
        device: &B::Device,
        groups: impl Into<ModelGroups>,
        stage: &PipelineStageLayout,
    ) -> Result<Self, MegatronError> {
        let mut value = lm.clone();
        value.head = HeadKind::TokenClassification { num_labels: 1 };
        value.tie_word_embeddings = false;
        if ckpt.contains("score.weight") {
            return Self::from_checkpoint_stage(&value, ckpt, device, groups, stage);
        }
        let mut causal = lm.clone();
        causal.head = HeadKind::CausalLm;
        ckpt.verify(&causal)?;
        let shapes = hf_tensor_specs(&value)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        let source = BackboneSource {
            ckpt: CheckpointSource { ckpt, device },
            head: RandomInit {
                shapes,
                std,
                seed,
                device,
                norm_weight: norm_start(lm),
            },
        };
        Self::from_source(&value, &source, groups, stage)
    }

    /// A freshly initialised model (training from scratch): weights drawn from
    /// N(0, `std`²) (HF's `initializer_range`, 0.02 by default), norms at 1, biases at 0, each
    /// tensor seeded by `seed` and its name so the result does not depend on load order.
    pub fn init(cfg: &HfModelConfig, std: f64, seed: u64, device: &B::Device) -> Self {
        Self::init_sharded(cfg, std, seed, device, &TpGroup::none())
            .expect("an unsharded model fits any configuration")
    }

    /// This tensor-parallel rank's shard of [`Self::init`]'s model: the same weights whatever
    /// the layout (each full tensor is drawn, then cut), so layouts can be compared exactly.
    pub fn init_sharded(
        cfg: &HfModelConfig,
        std: f64,
        seed: u64,
        device: &B::Device,
        tp: &TpGroup,
    ) -> Result<Self, MegatronError> {
        let whole = PipelineStageLayout::whole(cfg.num_hidden_layers);
        Self::init_stage(cfg, std, seed, device, tp, &whole)
    }

    /// This tensor- and pipeline-parallel rank's part of [`Self::init`]'s model.
    pub fn init_stage(
        cfg: &HfModelConfig,
        std: f64,
        seed: u64,
        device: &B::Device,
        groups: impl Into<ModelGroups>,
        stage: &PipelineStageLayout,
    ) -> Result<Self, MegatronError> {
        let shapes = hf_tensor_specs(cfg)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        Self::from_source(
            cfg,
            &RandomInit {
                shapes,
                std,
                seed,
                device,
                norm_weight: norm_start(cfg),
            },
            groups,
            stage,
        )
    }

    /// Builds the model from named full tensors (the rollout engine rebuilding its weights
    /// from a stream). Every tensor `cfg` implies must be present with its shape.
    pub fn from_named_tensors(
        cfg: &HfModelConfig,
        tensors: HashMap<String, NamedTensor<B>>,
    ) -> Result<Self, MegatronError> {
        let specs = hf_tensor_specs(cfg);
        let wanted: HashMap<&str, &TensorSpec> =
            specs.iter().map(|s| (s.name.as_str(), s)).collect();
        for t in tensors.values() {
            let spec = wanted
                .get(t.name.as_str())
                .ok_or_else(|| MegatronError::UnknownWeight {
                    name: t.name.clone(),
                })?;
            if spec.shape != t.shape {
                return Err(MegatronError::WeightShape {
                    name: t.name.clone(),
                    expected: spec.shape.clone(),
                    found: t.shape.clone(),
                });
            }
        }
        Self::from_named_shards(cfg, tensors, &TpGroup::none())
    }

    /// This tensor-parallel rank's whole model (every layer) from tensors by HF name, each
    /// either full or already this rank's shard: how a tensor-parallel rollout engine rebuilds
    /// its model from a weight stream.
    pub fn from_named_shards(
        cfg: &HfModelConfig,
        tensors: HashMap<String, NamedTensor<B>>,
        tp: &TpGroup,
    ) -> Result<Self, MegatronError> {
        let full = hf_tensor_specs(cfg)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        let whole = PipelineStageLayout::whole(cfg.num_hidden_layers);
        let source = NamedSource {
            tensors: RefCell::new(tensors),
            full,
        };
        Self::from_source(cfg, &source, tp, &whole)
    }

    /// Builds this tensor-parallel rank's model taking each tensor (or its shard), by HF name,
    /// from `source`. A layout the model cannot be split into is refused first
    /// ([`HfModelConfig::check_tensor_parallel`]).
    pub fn from_source<S: TensorSource<B>>(
        cfg: &HfModelConfig,
        source: &S,
        groups: impl Into<ModelGroups>,
        stage: &PipelineStageLayout,
    ) -> Result<Self, MegatronError> {
        let groups: ModelGroups = groups.into();
        let tp = &groups.tp;
        cfg.check_layout(tp.size, groups.ep.size, groups.expert_tp().size)?;
        if stage.layers.end > cfg.num_hidden_layers || stage.stage >= stage.stages {
            return Err(MegatronError::Setting {
                field: "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size".into(),
                message: format!(
                    "stage {} of {} cannot hold layers {:?} of a {}-layer model",
                    stage.stage, stage.stages, stage.layers, cfg.num_hidden_layers
                ),
            });
        }
        let loader = ShardLoader::new(cfg, source, &groups);
        let layers = stage
            .layers
            .clone()
            .map(|l| loader.decoder_layer(l))
            .collect::<Result<Vec<_>, _>>()?;
        let (lm_head, score) = match cfg.head {
            _ if !stage.is_last() => (None, None),
            HeadKind::CausalLm if cfg.tie_word_embeddings => (None, None),
            HeadKind::CausalLm => (
                Some(ColumnParallelLinear::new(
                    loader.vocab_rows("lm_head.weight")?,
                    None,
                )),
                None,
            ),
            HeadKind::TokenClassification { .. } => (None, Some(loader.replicated("score", true)?)),
            HeadKind::SequenceClassification { .. } => {
                (None, Some(loader.replicated("score", false)?))
            }
        };
        // The last stage computes tied logits with its own copy of the embedding (its gradient
        // is summed with the first stage's, as Megatron's embedding group does).
        let tied_head =
            stage.is_last() && cfg.head == HeadKind::CausalLm && cfg.tie_word_embeddings;
        Ok(Self {
            embed_tokens: if stage.is_first() || tied_head {
                Some(VocabParallelEmbedding::new(
                    loader.vocab_rows("model.embed_tokens.weight")?,
                    tp,
                ))
            } else {
                None
            },
            layers,
            norm: if stage.is_last() {
                Some(loader.norm("model.norm.weight")?)
            } else {
                None
            },
            lm_head,
            score,
            // Latent attention rotates only its heads' rope part.
            rope: RotaryEmbedding::new(
                cfg.mla
                    .as_ref()
                    .map_or(cfg.head_dim, |m| m.qk_rope_head_dim),
                cfg.rope_theta,
                cfg.rope_scaling,
            ),
            local_rope: cfg
                .variants
                .local_rope
                .map(|(theta, scaling)| RotaryEmbedding::new(cfg.head_dim, theta, scaling)),
            tp: tp.clone(),
            cp: groups.cp.clone(),
            vocab_size: cfg.vocab_size,
            stage: stage.clone(),
            tie_word_embeddings: cfg.head == HeadKind::CausalLm && cfg.tie_word_embeddings,
            compute_dtype: ComputeDtype::F32,
            moe_aux_loss_coeff: 0.0,
            fused_head_chunk: None,
            recompute: None,
            pack_sequences: false,
            config: cfg.clone(),
            generation: FusedWeights::default(),
        })
    }
}

/// What a fresh model's norm weights start at: 1, or 0 for Gemma's zero-centred norms (a scale
/// of 1 either way).
fn norm_start(cfg: &HfModelConfig) -> f32 {
    match cfg.architecture.is_gemma() {
        true => 0.0,
        false => 1.0,
    }
}

/// This rank's share of each layer, taken by HF name from a [`TensorSource`]: the shapes of
/// the full tensors say how each splits over its group.
struct ShardLoader<'a, B: Backend, S: TensorSource<B>> {
    cfg: &'a HfModelConfig,
    source: &'a S,
    groups: &'a ModelGroups,
    shapes: HashMap<String, Vec<usize>>,
    _backend: std::marker::PhantomData<B>,
}

impl<'a, B: ParallelBackend, S: TensorSource<B>> ShardLoader<'a, B, S> {
    fn new(cfg: &'a HfModelConfig, source: &'a S, groups: &'a ModelGroups) -> Self {
        let shapes = hf_tensor_specs(cfg)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        Self {
            cfg,
            source,
            groups,
            shapes,
            _backend: std::marker::PhantomData,
        }
    }

    /// This rank's part of dimension `dim` of `name`, split over `group`.
    fn part(
        &self,
        name: &str,
        dim: usize,
        group: &TpGroup,
    ) -> Result<(usize, usize), MegatronError> {
        Ok(group.part(self.shape(name)?[dim]))
    }

    fn shape(&self, name: &str) -> Result<&Vec<usize>, MegatronError> {
        self.shapes
            .get(name)
            .ok_or_else(|| MegatronError::UnknownWeight { name: name.into() })
    }

    /// `name`, whole, when `present`.
    fn optional(&self, name: String, present: bool) -> Result<Option<Tensor<B, 1>>, MegatronError> {
        present.then(|| self.source.load::<1>(&name)).transpose()
    }

    fn norm(&self, name: &str) -> Result<RmsNorm<B>, MegatronError> {
        let weight = self.source.load::<1>(name)?;
        Ok(match self.cfg.architecture.is_gemma() {
            true => RmsNorm::zero_centred(weight, self.cfg.rms_norm_eps),
            false => RmsNorm::new(weight, self.cfg.rms_norm_eps),
        })
    }

    /// Output rows (and bias) split over `group`: q/k/v, gate/up, the LM head.
    fn column(
        &self,
        p: &str,
        bias: bool,
        group: &TpGroup,
    ) -> Result<ColumnParallelLinear<B>, MegatronError> {
        let w = format!("{p}.weight");
        let rows = self.part(&w, 0, group)?;
        let bias = if bias {
            Some(self.source.load_part::<1>(&format!("{p}.bias"), 0, rows)?)
        } else {
            None
        };
        Ok(ColumnParallelLinear::new(
            self.source.load_part::<2>(&w, 0, rows)?,
            bias,
        ))
    }

    /// Input columns split over `group`, bias whole: o_proj, down_proj.
    fn row(
        &self,
        p: &str,
        bias: bool,
        group: &TpGroup,
    ) -> Result<RowParallelLinear<B>, MegatronError> {
        let w = format!("{p}.weight");
        let cols = self.part(&w, 1, group)?;
        Ok(RowParallelLinear::new(
            self.source.load_part::<2>(&w, 1, cols)?,
            self.optional(format!("{p}.bias"), bias)?,
            group,
        ))
    }

    /// Every rank holds all of it: routers, value and score heads.
    fn replicated(&self, p: &str, bias: bool) -> Result<ColumnParallelLinear<B>, MegatronError> {
        Ok(ColumnParallelLinear::new(
            self.source.load::<2>(&format!("{p}.weight"))?,
            self.optional(format!("{p}.bias"), bias)?,
        ))
    }

    /// A SwiGLU MLP with its features split over `group` (tp, or expert tp for experts).
    fn swiglu(&self, p: &str, group: &TpGroup) -> Result<SwiGlu<B>, MegatronError> {
        Ok(SwiGlu {
            gate_proj: self.column(&format!("{p}.gate_proj"), false, group)?,
            up_proj: self.column(&format!("{p}.up_proj"), false, group)?,
            down_proj: self.row(&format!("{p}.down_proj"), false, group)?,
            tp: group.clone(),
            activation: self.cfg.variants.activation,
        })
    }

    /// This rank's rows of a vocabulary-split weight, zero rows for the padding.
    fn vocab_rows(&self, name: &str) -> Result<Tensor<B, 2>, MegatronError> {
        let hidden = self.shape(name)?[1];
        let (start, real, per) = self.groups.tp.vocab_part(self.cfg.vocab_size);
        if real == per {
            return self.source.load_part::<2>(name, 0, (start, real));
        }
        let (rows, device) = if real > 0 {
            let rows = self.source.load_part::<2>(name, 0, (start, real))?;
            let device = rows.device();
            (Some(rows), device)
        } else {
            // All padding: one real row only tells the device.
            (None, self.source.load_part::<2>(name, 0, (0, 1))?.device())
        };
        let pad = Tensor::<B, 2>::zeros([per - real, hidden], &device);
        Ok(match rows {
            Some(rows) => Tensor::cat(vec![rows, pad], 0),
            None => pad,
        })
    }

    /// Decoder layer `l` (its HF index).
    fn decoder_layer(&self, l: usize) -> Result<DecoderLayer<B>, MegatronError> {
        let p = format!("model.layers.{l}");
        let gemma = self.cfg.architecture.is_gemma();
        let gemma_norm = |which: &str| {
            gemma
                .then(|| self.norm(&format!("{p}.{which}.weight")))
                .transpose()
        };
        Ok(DecoderLayer {
            input_layernorm: self.norm(&format!("{p}.input_layernorm.weight"))?,
            self_attn: self.attention(l, &format!("{p}.self_attn"))?,
            post_attention_layernorm: self.norm(&format!("{p}.post_attention_layernorm.weight"))?,
            pre_feedforward_layernorm: gemma_norm("pre_feedforward_layernorm")?,
            post_feedforward_layernorm: gemma_norm("post_feedforward_layernorm")?,
            mlp: self.feed_forward(l, &p)?,
        })
    }

    /// Layer `l`'s attention block at `a`, its heads split over tp.
    fn attention(&self, l: usize, a: &str) -> Result<Attention<B>, MegatronError> {
        let (cfg, tp) = (self.cfg, &self.groups.tp);
        let qk_norm = cfg.architecture.has_qk_norm();
        let head_norm = |which: &str| -> Result<Option<RmsNorm<B>>, MegatronError> {
            qk_norm
                .then(|| self.norm(&format!("{a}.{which}.weight")))
                .transpose()
        };
        let grouped = |p: &str| -> Result<Option<ColumnParallelLinear<B>>, MegatronError> {
            match cfg.mla {
                Some(_) => Ok(None),
                None => Some(self.column(&format!("{a}.{p}"), cfg.qkv_bias, tp)).transpose(),
            }
        };
        Ok(Attention {
            q_proj: grouped("q_proj")?,
            k_proj: grouped("k_proj")?,
            v_proj: grouped("v_proj")?,
            latent: self.latent_attention(a)?,
            o_proj: self.row(&format!("{a}.o_proj"), cfg.o_bias, tp)?,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            num_heads: cfg.num_attention_heads / tp.size,
            num_kv_heads: cfg.num_key_value_heads / tp.size,
            head_dim: cfg.head_dim,
            scores: AttentionScores::of(cfg, l),
            tp: tp.clone(),
            cp: self.groups.cp.clone(),
        })
    }

    /// DeepSeek's latent projections at `a`, `None` for other models. The low-rank projections
    /// are replicated over tp (each rank's heads read the whole code; their gradients are
    /// summed over the group, `CausalLm::tp_param_sets`), the per-head expansions split by heads.
    fn latent_attention(&self, a: &str) -> Result<Option<LatentAttention<B>>, MegatronError> {
        let Some(dims) = &self.cfg.mla else {
            return Ok(None);
        };
        let tp = &self.groups.tp;
        // transformers builds these two norms with its default ε, whatever rms_norm_eps says.
        let norm = |name: &str| -> Result<RmsNorm<B>, MegatronError> {
            Ok(RmsNorm::new(self.source.load::<1>(name)?, 1e-6))
        };
        let with_rank = dims.q_lora_rank.is_some();
        Ok(Some(LatentAttention {
            q_a_proj: with_rank
                .then(|| self.replicated(&format!("{a}.q_a_proj"), false))
                .transpose()?,
            q_a_layernorm: with_rank
                .then(|| norm(&format!("{a}.q_a_layernorm.weight")))
                .transpose()?,
            q_b_proj: match with_rank {
                true => self.column(&format!("{a}.q_b_proj"), false, tp)?,
                false => self.column(&format!("{a}.q_proj"), false, tp)?,
            },
            kv_a_proj_with_mqa: self.replicated(&format!("{a}.kv_a_proj_with_mqa"), false)?,
            kv_a_layernorm: norm(&format!("{a}.kv_a_layernorm.weight"))?,
            kv_b_proj: self.column(&format!("{a}.kv_b_proj"), false, tp)?,
            dims: dims.clone(),
        }))
    }

    /// Layer `l`'s feed-forward block at `p`: dense, or this ep rank's experts, each split
    /// over the expert tp group.
    fn feed_forward(&self, l: usize, p: &str) -> Result<FeedForward<B>, MegatronError> {
        let g = self.groups;
        let moe = match &self.cfg.moe {
            Some(moe) if moe.is_moe_layer(l) => moe,
            _ => return Ok(FeedForward::Dense(self.swiglu(&format!("{p}.mlp"), &g.tp)?)),
        };
        let local = moe.num_experts / g.ep.size;
        let first = g.ep.rank * local;
        let etp = g.expert_tp();
        // Qwen2-MoE's gated shared expert, DeepSeek's ungated one; Qwen3-MoE has none.
        let shared = moe.shared_expert_intermediate_size > 0;
        Ok(FeedForward::Moe(SparseMoe {
            gate: self.replicated(&format!("{p}.mlp.gate"), false)?,
            experts: (first..first + local)
                .map(|e| self.swiglu(&format!("{p}.mlp.experts.{e}"), etp))
                .collect::<Result<_, _>>()?,
            shared_expert: shared
                .then(|| self.swiglu(&format!("{p}.mlp.shared_expert"), &g.tp))
                .transpose()?,
            shared_expert_gate: moe
                .shared_expert_gated()
                .then(|| self.replicated(&format!("{p}.mlp.shared_expert_gate"), false))
                .transpose()?,
            selection_bias: (moe.routing != MoeRouting::Softmax)
                .then(|| {
                    self.source
                        .load::<1>(&format!("{p}.mlp.gate.e_score_correction_bias"))
                        // Kept as loaded: Megatron moves it by its own load-balancing rule
                        // (not built here), never by the optimizer.
                        .map(|b| Param::from_tensor(b).set_require_grad(false))
                })
                .transpose()?,
            routing: moe.routing,
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
            num_experts: moe.num_experts,
            first_expert: first,
            tp: g.tp.clone(),
            ep: g.ep.clone(),
            etp: etp.clone(),
            cp: g.cp.clone(),
            aux_loss_coeff: 0.0,
            layer: l,
        }))
    }
}

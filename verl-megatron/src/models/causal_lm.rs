//! The decoder-only causal language model and its loading from a Hugging Face checkpoint.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

use burn::module::{Module, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use verl_core::NamedTensor;

use super::attention::{
    attention_bias, causal_bias, decode_kernel_applies, positional_bias, Attention, AttentionMask,
    AttnCache,
};
use super::feed_forward::FeedForward;
use super::generation::{FusedWeights, GenerationWeights};
use super::kv_cache::{ChunkLayout, KvCache, SlotKvCache};
use super::mlp::SwiGlu;
use super::packing::PackedSequences;
use super::qwen2_moe::SparseMoe;
use crate::error::MegatronError;
use crate::hf::{hf_tensor_specs, Architecture, HeadKind, HfCheckpoint, HfModelConfig, TensorSpec};
use crate::layers::precision::{self, ComputeDtype};
use crate::layers::{
    ColumnParallelLinear, RmsNorm, RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
};
use crate::parallel::{
    device_span, Collective, ContextSplit, ContextWindow, CpGroup, ModelGroups, ParallelBackend,
    Region, TpGroup,
};
use verl_core::traits::Communicator;

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

impl<B: Backend> TensorSource<B> for CheckpointSource<'_, B> {
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

/// Random initialisation, seeded per tensor name; shapes from the architecture's tensor table.
struct RandomInit<'a, B: Backend> {
    shapes: HashMap<String, Vec<usize>>,
    std: f64,
    seed: u64,
    device: &'a B::Device,
}

impl<B: Backend> TensorSource<B> for RandomInit<'_, B> {
    fn load<const D: usize>(&self, name: &str) -> Result<Tensor<B, D>, MegatronError> {
        let shape = self
            .shapes
            .get(name)
            .ok_or_else(|| MegatronError::UnknownWeight { name: name.into() })?;
        let n: usize = shape.iter().product();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            // FNV-1a of the name, mixed with the seed: an order-independent stream per tensor.
            let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            });
            let mut rng = StdRng::seed_from_u64(h ^ self.seed);
            (0..n)
                .map(|_| {
                    // Box–Muller.
                    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                    let u2: f64 = rng.random();
                    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                    (z * self.std) as f32
                })
                .collect()
        };
        let mut dims = [0; D];
        dims.copy_from_slice(shape);
        Ok(Tensor::from_data(
            TensorData::new(values, dims),
            self.device,
        ))
    }
}

/// One pre-norm decoder layer.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: FeedForward<B>,
}

/// A decoder-only LM (Qwen2, Llama, Qwen3, Qwen2-MoE) on one tensor-parallel rank.
///
/// With tp > 1 the outputs of [`Self::forward`] and [`Self::forward_window`] are this rank's
/// vocabulary shard of the logits (`[batch, seq, vocab / tp]`, ids from
/// [`Self::vocab_start`]): feed them to the vocabulary-parallel log-prob and entropy of
/// [`crate::models::vocab_parallel`], which never gather the full vocabulary. Score heads are
/// replicated and their outputs whole.
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    /// On the first pipeline stage (and, with tied embeddings, a copy on the last one).
    pub embed_tokens: Option<VocabParallelEmbedding<B>>,
    /// This pipeline stage's decoder layers (HF layer `stage.layers.start + i`).
    pub layers: Vec<DecoderLayer<B>>,
    /// On the last pipeline stage.
    pub norm: Option<RmsNorm<B>>,
    /// `None` when the output projection is tied to the embedding (or a score head replaces it).
    pub lm_head: Option<ColumnParallelLinear<B>>,
    /// The value head (token classification) or reward score head (sequence classification),
    /// `[num_labels, hidden]`, replicated on every rank. Replaces the LM output when present.
    pub score: Option<ColumnParallelLinear<B>>,
    #[module(skip)]
    pub rope: RotaryEmbedding,
    #[module(skip)]
    pub tp: TpGroup,
    /// Context parallel: each sequence split over the group ([`crate::parallel::ContextSplit`]);
    /// training and log-prob passes only.
    #[module(skip)]
    pub cp: CpGroup,
    /// The real vocabulary size; with tp > 1 the vocabulary-split weights are padded to a
    /// multiple of tp and the padded ids' logits masked.
    pub vocab_size: usize,
    #[module(skip)]
    pub stage: PipelineStageLayout,
    /// The LM head is the word embedding (tied weights).
    pub tie_word_embeddings: bool,
    #[module(skip)]
    pub config: HfModelConfig,
    /// The dtype of the matrix products (parameters stay f32): see
    /// [`crate::layers::precision`].
    #[module(skip)]
    pub compute_dtype: ComputeDtype,
    /// Megatron's `moe_aux_loss_coeff` (every stage knows it, MoE layers or not).
    #[module(skip)]
    pub moe_aux_loss_coeff: f64,
    /// With an LM head: passes given their labels ([`FusedTargets`]) return log-probs and
    /// entropies computed by the fused, chunked head, this many tokens a chunk, never the
    /// logits ([`super::fused_log_probs`]).
    #[module(skip)]
    pub fused_head_chunk: Option<usize>,
    /// Training and log-prob passes pack each micro-batch's sequences into one row with no
    /// padding ([`super::packing`], verl's `use_remove_padding`).
    #[module(skip)]
    pub pack_sequences: bool,
    /// A generation-only model's fused weights ([`Self::with_generation_matrices`]); cleared by
    /// any weight load and rebuilt by [`Self::prepare_generation`].
    #[module(skip)]
    generation: FusedWeights,
}

/// Which part of the model a pipeline stage holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineStageLayout {
    pub stage: usize,
    pub stages: usize,
    /// The HF indices of the stage's decoder layers.
    pub layers: std::ops::Range<usize>,
    /// Every stage's layers, in stage order.
    pub split: Vec<std::ops::Range<usize>>,
}

impl PipelineStageLayout {
    /// The whole model on one stage.
    pub fn whole(num_layers: usize) -> Self {
        Self::of(0, std::iter::once(0..num_layers).collect())
    }

    /// Stage `stage` of the layer split `split` (see `parallel::pipeline::stage_layers`).
    pub fn of(stage: usize, split: Vec<std::ops::Range<usize>>) -> Self {
        Self {
            stage,
            stages: split.len(),
            layers: split.get(stage).cloned().unwrap_or(0..0),
            split,
        }
    }

    /// The stage holding the weight called `name` (HF naming): a layer's stage, the first for
    /// the embedding, the last for the final norm and the heads.
    pub fn owner_of(&self, name: &str) -> usize {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let layer: usize = rest
                .split('.')
                .next()
                .and_then(|i| i.parse().ok())
                .unwrap_or(0);
            return self
                .split
                .iter()
                .position(|r| r.contains(&layer))
                .unwrap_or(0);
        }
        if name == "model.embed_tokens.weight" {
            0
        } else {
            self.stages - 1
        }
    }

    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// The attention mask's values at `positions` of each row, flattened `[batch · positions]`
/// (all ones without a mask): the tokens an MoE block sees, for its load-balancing loss.
fn attention_mask_local<B: Backend>(
    mask: &Option<Tensor<B, 2>>,
    positions: &[usize],
    batch: usize,
    device: &B::Device,
) -> Tensor<B, 1> {
    let n = batch * positions.len();
    match mask {
        None => Tensor::ones([n], device),
        Some(m) => m
            .clone()
            .select(1, super::index_tensor(positions, device))
            .reshape([n]),
    }
}

/// What a fused head needs ([`CausalLm::forward_stage_with`]): the labels of the window's
/// positions `[batch, len]` and the sampling temperature the logits are divided by.
#[derive(Debug, Clone)]
pub struct FusedTargets<B: Backend> {
    pub labels: Tensor<B, 2, Int>,
    pub temperature: f64,
}

/// Which positions the output head computes.
enum HeadWindow {
    All,
    /// `(start, len)`.
    Range(usize, usize),
    /// Any positions of a single row, in this order (a packed batch's outputs): `(positions,
    /// inverse, keep)` as [`PackedSequences::window_inverse`] gives them.
    Positions(Vec<usize>, Vec<usize>, Vec<f32>),
    /// A context-parallel rank's part of a window, gathered over the group after the head.
    Context(ContextWindow),
}

impl HeadWindow {
    /// The window's positions of `h` `[batch, seq, _]` (this cp rank's part of it).
    fn cut<B: ParallelBackend>(&self, h: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            HeadWindow::All => h,
            HeadWindow::Range(start, len) => h.narrow(1, *start, *len),
            HeadWindow::Positions(p, inverse, keep) => {
                let [_, t, width] = h.dims();
                let device = h.device();
                let keep = Tensor::from_data(TensorData::new(keep.clone(), [t]), &device);
                let index = |i: &[usize]| super::index_tensor(i, &device);
                B::gather_rows(h.reshape([t, width]), index(p), index(inverse), keep)
                    .unsqueeze_dim(0)
            }
            HeadWindow::Context(w) => {
                let local = super::index_tensor(&w.local, &h.device());
                h.select(1, local)
            }
        }
    }

    /// Outputs of the positions [`Self::cut`] kept, whole: with cp each rank computed its own,
    /// gathered over the group (the gradient going back keeps each rank's part) and put in
    /// sequence order.
    fn gather<B: ParallelBackend>(&self, out: Tensor<B, 3>, cp: &CpGroup) -> Tensor<B, 3> {
        match self {
            HeadWindow::Context(w) => {
                let order = super::index_tensor(&w.order, &out.device());
                cp.region(out, Region::GatherFrom(1)).select(1, order)
            }
            _ => out,
        }
    }
}

/// What enters a forward pass: token ids (the first pipeline stage) or the previous stage's
/// hidden states `[batch, seq, hidden]` (a sequence shard with sequence parallelism).
enum StageInput<B: Backend> {
    Ids(Tensor<B, 2, Int>),
    Hidden(Tensor<B, 3>),
}

/// The logit given to padded vocabulary ids: exp() of it is 0 and, being finite, so is its
/// product with it (an entropy term), where −∞ would give NaN.
const PADDED_LOGIT: f32 = -1.0e30;

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

    /// Runs this model's matrix products in `dtype` (the weights stay f32): see
    /// [`crate::layers::precision`].
    pub fn with_compute_dtype(mut self, dtype: ComputeDtype) -> Self {
        self.compute_dtype = dtype;
        self
    }

    /// For a model that only generates (the rollout engine's copy): with bf16 products, keeps
    /// the linear layers' matrices (projections and LM head; not the embedding, norms, biases
    /// or router) in bf16, so a product reads its weight as it is instead of casting the f32
    /// matrix on every call: one launch and ~6 bytes of traffic per weight less per decode
    /// step. Weights loaded later keep that dtype ([`Self::load_shard`] casts them).
    ///
    /// It also stacks the matrices a decode step can multiply together (q/k/v, gate/up) for
    /// the fused decode step of [`crate::models::generation`].
    pub fn with_generation_matrices(mut self) -> Self {
        self.prepare_generation();
        self
    }

    /// [`Self::with_generation_matrices`] in place: after weights were loaded (which clears
    /// the fused weights, as their values changed), rebuilds what is missing. A model without
    /// bf16 products is left as it is.
    pub fn prepare_generation(&mut self) {
        if self.compute_dtype != ComputeDtype::Bf16 || self.generation().is_some() {
            return;
        }
        let names: Vec<String> = self
            .export_shards()
            .into_iter()
            .filter(|t| t.shape.len() == 2 && is_product_matrix(&t.name))
            .map(|t| t.name)
            .collect();
        for name in names {
            if let Some(ParamMut::Matrix(p)) = self.param_mut(&name) {
                let low = p.val().cast(burn::tensor::FloatDType::BF16);
                *p = Param::initialized(p.id, low);
            }
        }
        self.generation = FusedWeights::of(GenerationWeights::build(self));
    }

    /// The fused weights of a generation-only model, when built.
    pub fn generation(&self) -> Option<&GenerationWeights<B>> {
        self.generation.get::<B>()
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
        let (ep, etp) = (&groups.ep, groups.expert_tp());
        cfg.check_layout(tp.size, ep.size, etp.size)?;
        if stage.layers.end > cfg.num_hidden_layers || stage.stage >= stage.stages {
            return Err(MegatronError::Setting {
                field: "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size".into(),
                message: format!(
                    "stage {} of {} cannot hold layers {:?} of a {}-layer model",
                    stage.stage, stage.stages, stage.layers, cfg.num_hidden_layers
                ),
            });
        }
        let shapes: HashMap<String, Vec<usize>> = hf_tensor_specs(cfg)
            .into_iter()
            .map(|s| (s.name, s.shape))
            .collect();
        let w1 = |name: &str| source.load::<1>(name);
        // This rank's part of dimension `dim` of `name`, split over `group`.
        let part =
            |name: &str, dim: usize, group: &TpGroup| -> Result<(usize, usize), MegatronError> {
                let shape = shapes
                    .get(name)
                    .ok_or_else(|| MegatronError::UnknownWeight { name: name.into() })?;
                Ok(group.part(shape[dim]))
            };
        let opt1 = |name: String, present: bool| -> Result<Option<Tensor<B, 1>>, MegatronError> {
            if present {
                Ok(Some(w1(&name)?))
            } else {
                Ok(None)
            }
        };
        let norm = |name: &str| -> Result<RmsNorm<B>, MegatronError> {
            Ok(RmsNorm::new(w1(name)?, cfg.rms_norm_eps))
        };
        // Output rows (and bias) split over `group`: q/k/v, gate/up, the LM head.
        let column_of = |p: &str,
                         bias: bool,
                         group: &TpGroup|
         -> Result<ColumnParallelLinear<B>, MegatronError> {
            let w = format!("{p}.weight");
            let rows = part(&w, 0, group)?;
            let bias = if bias {
                Some(source.load_part::<1>(&format!("{p}.bias"), 0, rows)?)
            } else {
                None
            };
            Ok(ColumnParallelLinear::new(
                source.load_part::<2>(&w, 0, rows)?,
                bias,
            ))
        };
        // Input columns split over `group`, bias whole: o_proj, down_proj.
        let row_of =
            |p: &str, bias: bool, group: &TpGroup| -> Result<RowParallelLinear<B>, MegatronError> {
                let w = format!("{p}.weight");
                let cols = part(&w, 1, group)?;
                Ok(RowParallelLinear::new(
                    source.load_part::<2>(&w, 1, cols)?,
                    opt1(format!("{p}.bias"), bias)?,
                    group,
                ))
            };
        let column = |p: &str, bias: bool| column_of(p, bias, tp);
        let row = |p: &str, bias: bool| row_of(p, bias, tp);
        let replicated = |p: &str, bias: bool| -> Result<ColumnParallelLinear<B>, MegatronError> {
            Ok(ColumnParallelLinear::new(
                source.load::<2>(&format!("{p}.weight"))?,
                opt1(format!("{p}.bias"), bias)?,
            ))
        };
        // A SwiGLU MLP with its features split over `group` (tp, or expert tp for experts).
        let swiglu_of = |p: &str, group: &TpGroup| -> Result<SwiGlu<B>, MegatronError> {
            Ok(SwiGlu {
                gate_proj: column_of(&format!("{p}.gate_proj"), false, group)?,
                up_proj: column_of(&format!("{p}.up_proj"), false, group)?,
                down_proj: row_of(&format!("{p}.down_proj"), false, group)?,
                tp: group.clone(),
            })
        };
        let swiglu = |p: &str| swiglu_of(p, tp);
        // This rank's rows of a vocabulary-split weight, zero rows for the padding.
        let vocab_rows = |name: &str| -> Result<Tensor<B, 2>, MegatronError> {
            let hidden = shapes
                .get(name)
                .ok_or_else(|| MegatronError::UnknownWeight { name: name.into() })?[1];
            let (start, real, per) = tp.vocab_part(cfg.vocab_size);
            if real == per {
                return source.load_part::<2>(name, 0, (start, real));
            }
            let (rows, device) = if real > 0 {
                let rows = source.load_part::<2>(name, 0, (start, real))?;
                let device = rows.device();
                (Some(rows), device)
            } else {
                // All padding: one real row only tells the device.
                (None, source.load_part::<2>(name, 0, (0, 1))?.device())
            };
            let pad = Tensor::<B, 2>::zeros([per - real, hidden], &device);
            Ok(match rows {
                Some(rows) => Tensor::cat(vec![rows, pad], 0),
                None => pad,
            })
        };
        let mut layers = Vec::with_capacity(stage.layers.len());
        for l in stage.layers.clone() {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let qk_norm = cfg.architecture == Architecture::Qwen3;
            let self_attn = Attention {
                q_proj: column(&format!("{a}.q_proj"), cfg.qkv_bias)?,
                k_proj: column(&format!("{a}.k_proj"), cfg.qkv_bias)?,
                v_proj: column(&format!("{a}.v_proj"), cfg.qkv_bias)?,
                o_proj: row(&format!("{a}.o_proj"), cfg.o_bias)?,
                q_norm: if qk_norm {
                    Some(norm(&format!("{a}.q_norm.weight"))?)
                } else {
                    None
                },
                k_norm: if qk_norm {
                    Some(norm(&format!("{a}.k_norm.weight"))?)
                } else {
                    None
                },
                num_heads: cfg.num_attention_heads / tp.size,
                num_kv_heads: cfg.num_key_value_heads / tp.size,
                head_dim: cfg.head_dim,
                tp: tp.clone(),
                cp: groups.cp.clone(),
            };
            let mlp = match &cfg.moe {
                Some(moe) if moe.is_moe_layer(l) => {
                    // This ep rank's experts, each split over the expert tp group.
                    let local = moe.num_experts / ep.size;
                    let first = ep.rank * local;
                    FeedForward::Moe(SparseMoe {
                        gate: replicated(&format!("{p}.mlp.gate"), false)?,
                        experts: (first..first + local)
                            .map(|e| swiglu_of(&format!("{p}.mlp.experts.{e}"), etp))
                            .collect::<Result<_, _>>()?,
                        shared_expert: swiglu(&format!("{p}.mlp.shared_expert"))?,
                        shared_expert_gate: replicated(
                            &format!("{p}.mlp.shared_expert_gate"),
                            false,
                        )?,
                        top_k: moe.num_experts_per_tok,
                        norm_topk_prob: moe.norm_topk_prob,
                        num_experts: moe.num_experts,
                        first_expert: first,
                        tp: tp.clone(),
                        ep: ep.clone(),
                        etp: etp.clone(),
                        cp: groups.cp.clone(),
                        aux_loss_coeff: 0.0,
                    })
                }
                _ => FeedForward::Dense(swiglu(&format!("{p}.mlp"))?),
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"))?,
                self_attn,
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                mlp,
            });
        }
        let (lm_head, score) = match cfg.head {
            _ if !stage.is_last() => (None, None),
            HeadKind::CausalLm if cfg.tie_word_embeddings => (None, None),
            HeadKind::CausalLm => (
                Some(ColumnParallelLinear::new(
                    vocab_rows("lm_head.weight")?,
                    None,
                )),
                None,
            ),
            HeadKind::TokenClassification { .. } => (None, Some(replicated("score", true)?)),
            HeadKind::SequenceClassification { .. } => (None, Some(replicated("score", false)?)),
        };
        // The last stage computes tied logits with its own copy of the embedding (its gradient
        // is summed with the first stage's, as Megatron's embedding group does).
        let tied_head =
            stage.is_last() && cfg.head == HeadKind::CausalLm && cfg.tie_word_embeddings;
        Ok(Self {
            embed_tokens: if stage.is_first() || tied_head {
                Some(VocabParallelEmbedding::new(
                    vocab_rows("model.embed_tokens.weight")?,
                    tp,
                ))
            } else {
                None
            },
            layers,
            norm: if stage.is_last() {
                Some(norm("model.norm.weight")?)
            } else {
                None
            },
            lm_head,
            score,
            rope: RotaryEmbedding::new(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
            tp: tp.clone(),
            cp: groups.cp.clone(),
            vocab_size: cfg.vocab_size,
            stage: stage.clone(),
            tie_word_embeddings: cfg.head == HeadKind::CausalLm && cfg.tie_word_embeddings,
            compute_dtype: ComputeDtype::F32,
            moe_aux_loss_coeff: 0.0,
            fused_head_chunk: None,
            pack_sequences: false,
            config: cfg.clone(),
            generation: FusedWeights::default(),
        })
    }

    /// The first vocabulary id of this rank's shard of the logits.
    pub fn vocab_start(&self) -> usize {
        self.tp.vocab_part(self.vocab_size).0
    }

    fn embedding(&self) -> &VocabParallelEmbedding<B> {
        self.embed_tokens
            .as_ref()
            .expect("the embedding lives on the first pipeline stage")
    }

    fn device(&self) -> B::Device {
        self.devices()
            .into_iter()
            .next()
            .expect("a model has parameters")
    }

    /// With pipeline stages, the tied word embedding this stage holds (the first stage's input
    /// embedding or the last stage's output layer), whose gradient the two stages sum.
    pub fn pipeline_tied_embedding(&self) -> Option<ParamId> {
        let shared = self.stage.stages > 1 && self.tie_word_embeddings;
        self.embed_tokens
            .as_ref()
            .filter(|_| shared)
            .map(|e| e.weight.id)
    }

    /// The shape of the hidden states entering this stage for a micro-batch of `batch` rows of
    /// `seq` tokens (this rank's sequence shard with sequence parallelism).
    /// (A packed batch is one row of its tokens.)
    pub fn stage_input_shape(&self, batch: usize, seq: usize) -> [usize; 3] {
        let hidden = self.layers[0].input_layernorm.weight.dims()[0];
        let shards = self.sequence_shards();
        let padded = ContextSplit::padded_len(seq, self.cp.size(), shards);
        [batch, padded / self.cp.size() / shards, hidden]
    }

    /// One pipeline stage's forward: token ids on the first stage (`hidden` = `None`), the
    /// previous stage's hidden states elsewhere. Returns the hidden states for the next stage,
    /// or on the last stage (a whole model is one) the outputs of positions
    /// `start..start + len`. `input_ids` (for its shape), `attention_mask` and `position_ids`
    /// are the micro-batch's on every stage.
    pub fn forward_stage(
        &self,
        hidden: Option<Tensor<B, 3>>,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        start: usize,
        len: usize,
    ) -> Tensor<B, 3> {
        self.forward_stage_with(
            hidden,
            input_ids,
            attention_mask,
            position_ids,
            (start, len),
            None,
        )
    }

    /// Computes the output head fused with log-softmax and entropy, `chunk` tokens at a time
    /// ([`super::fused_log_probs`]): passes that give their labels get `[batch, len, 2]`
    /// log-probs and entropies instead of logits. Only for an LM head.
    pub fn with_fused_log_probs(mut self, chunk: usize) -> Self {
        if self.score.is_none() {
            self.fused_head_chunk = Some(chunk.max(1));
        }
        self
    }

    /// [`Self::forward_stage`] with the window `(start, len)`; given `fused` targets and a
    /// fused head ([`Self::with_fused_log_probs`]), the last stage returns log-probs and
    /// entropies `[batch, len, 2]` instead of logits.
    pub fn forward_stage_with(
        &self,
        hidden: Option<Tensor<B, 3>>,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        (start, len): (usize, usize),
        fused: Option<FusedTargets<B>>,
    ) -> Tensor<B, 3> {
        let [b, t] = input_ids.dims();
        let device = input_ids.device();
        let positions = position_ids.unwrap_or_else(|| {
            Tensor::<B, 1, Int>::arange(0..t as i64, &device)
                .unsqueeze_dim::<2>(0)
                .repeat_dim(0, b)
        });
        let (input_ids, attention_mask, positions) =
            self.pad_for_sequence_parallel(input_ids, attention_mask, positions);
        let padded = input_ids.dims()[1];
        // With context parallelism this rank runs its own positions of the sequence; attention
        // reads the group's keys, gathered in `gathered_keys` order.
        let (input_ids, positions, mask, window) = if self.cp.is_parallel() {
            let split = self.cp.split(padded);
            let index = |p: Vec<usize>| super::index_tensor::<B>(&p, &device);
            let (local, keys) = (split.local(), split.gathered_keys());
            let key_mask = attention_mask
                .clone()
                .map(|m| m.select(1, index(keys.clone())));
            let bias = positional_bias(b, &local, &keys, key_mask, &device);
            let ids = input_ids.select(1, index(local.clone()));
            let positions = positions.select(1, index(local.clone()));
            let window = HeadWindow::Context(split.window(start, len));
            if super::qwen2_moe::collecting_aux_losses() {
                let mask = attention_mask_local(&attention_mask, &local, b, &device);
                super::qwen2_moe::set_aux_token_mask(mask);
            }
            (ids, positions, AttentionMask::from_bias(bias), window)
        } else {
            if super::qwen2_moe::collecting_aux_losses() {
                let all: Vec<usize> = (0..padded).collect();
                let mask = attention_mask_local(&attention_mask, &all, b, &device);
                super::qwen2_moe::set_aux_token_mask(mask);
            }
            let mask = AttentionMask::causal(b, padded, attention_mask, &device);
            (input_ids, positions, mask, HeadWindow::Range(start, len))
        };
        self.run_stage(hidden, input_ids, positions, &mask, window, fused)
    }

    /// [`Self::forward_stage_with`] over a packed batch ([`super::packing`]): `input_ids` and
    /// `position_ids` `[1, tokens]` are `packing`'s packed row (positions restarting at each
    /// sequence). The last stage returns the outputs at `packing.window`, `[rows, window_len,
    /// out]` as the padded pass returns them (`fused` labels are `[rows, window_len]`); the
    /// others, this stage's hidden states of the packed row.
    pub fn forward_packed_stage(
        &self,
        hidden: Option<Tensor<B, 3>>,
        packing: &PackedSequences,
        (input_ids, position_ids): (Tensor<B, 2, Int>, Tensor<B, 2, Int>),
        fused: Option<FusedTargets<B>>,
    ) -> Tensor<B, 3> {
        let device = input_ids.device();
        let tokens = packing.tokens();
        let padded = ContextSplit::padded_len(tokens, self.cp.size(), self.sequence_shards());
        // Positions past the packed tokens (so the row splits over sp and cp) are sequences of
        // their own, masked out of the MoE statistics.
        let pad = |x: Tensor<B, 2, Int>| match padded - tokens {
            0 => x,
            extra => Tensor::cat(vec![x, Tensor::zeros([1, extra], &device)], 1),
        };
        let (input_ids, positions) = (pad(input_ids), pad(position_ids));
        let real = || {
            let mut m = vec![1.0f32; tokens];
            m.resize(padded, 0.0);
            Tensor::<B, 2>::from_data(TensorData::new(m, [1, padded]), &device)
        };
        let fused = fused.map(|f| FusedTargets {
            labels: f.labels.reshape([1, packing.rows * packing.window_len]),
            temperature: f.temperature,
        });
        let (input_ids, positions, mask, window) = if self.cp.is_parallel() {
            let split = self.cp.split(padded);
            let local = split.local();
            let bias = super::attention::packed_positional_bias(
                &local,
                &split.gathered_keys(),
                &packing.segments(padded),
                &device,
            );
            if super::qwen2_moe::collecting_aux_losses() {
                let mask = attention_mask_local(&Some(real()), &local, 1, &device);
                super::qwen2_moe::set_aux_token_mask(mask);
            }
            let index = super::index_tensor::<B>(&local, &device);
            (
                input_ids.select(1, index.clone()),
                positions.select(1, index),
                AttentionMask::from_bias(bias),
                HeadWindow::Context(split.window_at(&packing.window)),
            )
        } else {
            if super::qwen2_moe::collecting_aux_losses() {
                super::qwen2_moe::set_aux_token_mask(real().reshape([padded]));
            }
            let mask = AttentionMask::packed(packing, padded, &device);
            let (inverse, keep) = packing.window_inverse(padded);
            let window = HeadWindow::Positions(packing.window.clone(), inverse, keep);
            (input_ids, positions, mask, window)
        };
        let out = self.run_stage(hidden, input_ids, positions, &mask, window, fused);
        if !self.stage.is_last() {
            return out;
        }
        let width = out.dims()[2];
        out.reshape([packing.rows, packing.window_len, width])
    }

    /// The decoder of this stage over its tokens (`input_ids` or `hidden`) at `positions`,
    /// and on the last stage the head's outputs at `window`.
    fn run_stage(
        &self,
        hidden: Option<Tensor<B, 3>>,
        input_ids: Tensor<B, 2, Int>,
        positions: Tensor<B, 2, Int>,
        mask: &AttentionMask<B>,
        window: HeadWindow,
        fused: Option<FusedTargets<B>>,
    ) -> Tensor<B, 3> {
        let (cos, sin) = self.rope.tables(&positions);
        let input = match hidden {
            Some(h) => StageInput::Hidden(h),
            None => StageInput::Ids(input_ids),
        };
        let h = self.decoder(input, mask, &cos, &sin, CacheMode::None);
        if !self.stage.is_last() {
            return h;
        }
        match (fused, self.fused_head_chunk) {
            (Some(targets), Some(chunk)) => self.fused_head(h, window, targets, chunk),
            _ => self.head(h, window),
        }
    }

    /// Training and log-prob passes pack their sequences ([`Self::pack_sequences`]).
    pub fn with_packed_sequences(mut self, on: bool) -> Self {
        self.pack_sequences = on;
        self
    }

    /// This rank's rows of the output projection (the LM head, or the tied embedding).
    fn head_rows(&self) -> Tensor<B, 2> {
        match &self.lm_head {
            Some(head) => head.weight.val(),
            None => self.embedding().weight.val(),
        }
    }

    /// The fused head on the window's hidden states: `[batch, len, 2]` log-probs of
    /// `targets.labels` and entropies, gathered over cp like logits are.
    fn fused_head(
        &self,
        h: Tensor<B, 3>,
        window: HeadWindow,
        targets: FusedTargets<B>,
        chunk: usize,
    ) -> Tensor<B, 3> {
        let h = window.cut(self.tp.enter(h));
        let labels = match &window {
            HeadWindow::Context(w) => targets
                .labels
                .select(1, super::index_tensor(&w.offsets, &h.device())),
            _ => targets.labels,
        };
        let [b, n, hidden] = h.dims();
        let (vocab_start, real_rows, _) = self.tp.vocab_part(self.vocab_size);
        let spec = super::fused_log_probs::FusedHead {
            vocab_start,
            real_rows,
            scale: 1.0 / targets.temperature,
            chunk,
            dtype: self.compute_dtype,
        };
        let out = self
            .tp
            .fused_head_log_probs(
                h.reshape([b * n, hidden]),
                self.head_rows(),
                labels.reshape([b * n]),
                spec,
            )
            .reshape([b, n, 2]);
        window.gather(out, &self.cp)
    }

    /// Logits `[batch, seq, vocab]` for `input_ids` `[batch, seq]` (with a score head:
    /// scores `[batch, seq, num_labels]`). `attention_mask` `[batch,
    /// seq]` (1 = token, 0 = padding) and `position_ids` default to all-ones and 0..seq.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        let t = input_ids.dims()[1];
        self.forward_window(input_ids, attention_mask, position_ids, 0, t)
    }

    /// The outputs (logits, or scores with a score head) of positions `start..start + len` only,
    /// `[batch, len, out]`: the response window of a training step, so the vocabulary projection
    /// runs on the response positions alone.
    pub fn forward_window(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        position_ids: Option<Tensor<B, 2, Int>>,
        start: usize,
        len: usize,
    ) -> Tensor<B, 3> {
        self.forward_stage(None, input_ids, attention_mask, position_ids, start, len)
    }

    /// How many sequence-parallel shards each rank's tokens are cut into (1 without sequence
    /// parallelism).
    fn sequence_shards(&self) -> usize {
        if self.tp.sequence_parallel {
            self.tp.size
        } else {
            1
        }
    }

    /// With sequence parallelism the sequence must split evenly over the tp ranks, and with
    /// context parallelism into 2·cp chunks (each of which splits over tp): pads the batch on
    /// the right with masked tokens (which no real token attends to, being causal and masked)
    /// up to a multiple of that ([`ContextSplit::padded_len`]). Outputs are cut back to the
    /// asked positions.
    fn pad_for_sequence_parallel(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2>>,
        positions: Tensor<B, 2, Int>,
    ) -> ModelInputs<B> {
        let [b, t] = input_ids.dims();
        let pad = ContextSplit::padded_len(t, self.cp.size(), self.sequence_shards()) - t;
        if pad == 0 {
            return (input_ids, attention_mask, positions);
        }
        let device = input_ids.device();
        let mask = attention_mask.unwrap_or_else(|| Tensor::ones([b, t], &device));
        (
            Tensor::cat(vec![input_ids, Tensor::zeros([b, pad], &device)], 1),
            Some(Tensor::cat(vec![mask, Tensor::zeros([b, pad], &device)], 1)),
            Tensor::cat(vec![positions, Tensor::zeros([b, pad], &device)], 1),
        )
    }

    /// As [`Self::forward`] for the new tokens `input_ids` `[batch, new]`, attending to the
    /// cached keys too, and extending `cache`. `attention_mask` covers every key, cached and new
    /// (`[batch, cached + new]`); `position_ids` are the new tokens' positions. A prefill is a
    /// call on an empty cache; a decode step is a call with one new token per row.
    pub fn forward_cached(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2>,
        position_ids: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        if cache.layers.len() != self.layers.len() {
            cache.layers = (0..self.layers.len()).map(|_| None).collect();
            cache.len = 0;
        }
        let [b, t] = input_ids.dims();
        let device = input_ids.device();
        let past = cache.len;
        let (cos, sin) = self.rope.tables(&position_ids);
        let mask =
            AttentionMask::from_bias(attention_bias(b, t, past, Some(attention_mask), &device));
        let h = self.decoder(
            StageInput::Ids(input_ids),
            &mask,
            &cos,
            &sin,
            CacheMode::Grow(cache),
        );
        cache.len += t;
        self.head(h, HeadWindow::All)
    }

    /// Embedding (first stage), this stage's decoder layers and the final norm (last stage):
    /// hidden states `[batch, seq, hidden]`.
    fn decoder(
        &self,
        input: StageInput<B>,
        mask: &AttentionMask<B>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
        mut mode: CacheMode<'_, B>,
    ) -> Tensor<B, 3> {
        assert!(
            !(self.tp.sequence_parallel || self.cp.is_parallel()) || matches!(mode, CacheMode::None),
            "sequence and context parallelism are for training passes; generation runs without them"
        );
        let _precision = precision::enter(self.compute_dtype);
        let mut h = match input {
            StageInput::Ids(ids) => self.embedding().forward(ids),
            StageInput::Hidden(h) => h,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let attn_cache = match &mut mode {
                CacheMode::None => AttnCache::None,
                CacheMode::Grow(c) => AttnCache::Grow(&mut c.layers[l]),
                CacheMode::Chunk { cache, chunks } => AttnCache::Chunk {
                    cache,
                    layer: l,
                    chunks,
                },
                CacheMode::Slots {
                    cache,
                    positions,
                    window,
                    on_device,
                } => AttnCache::Slots {
                    cache,
                    layer: l,
                    positions,
                    window: *window,
                    on_device: *on_device,
                },
            };
            let device = h.device();
            let attn = device_span::<B, _>(&device, "attention", || {
                layer.self_attn.forward(
                    layer.input_layernorm.forward(h.clone()),
                    mask,
                    cos,
                    sin,
                    attn_cache,
                )
            });
            h = h + attn;
            let ff = device_span::<B, _>(&device, "mlp", || {
                layer
                    .mlp
                    .forward(layer.post_attention_layernorm.forward(h.clone()))
            });
            h = h + ff;
        }
        match &self.norm {
            Some(norm) => norm.forward(h),
            None => h,
        }
    }

    /// The output projection of hidden states `[batch, seq, hidden]` (with sequence
    /// parallelism, this rank's sequence shard), restricted to `window` = `(start, len)`
    /// positions when given: the score head when present, else the LM head (or the tied
    /// embedding) on this rank's vocabulary shard.
    fn head(&self, h: Tensor<B, 3>, window: HeadWindow) -> Tensor<B, 3> {
        let device = h.device();
        device_span::<B, _>(&device, "lm_head", || {
            window.gather(self.output_head(h, &window), &self.cp)
        })
    }

    fn output_head(&self, h: Tensor<B, 3>, window: &HeadWindow) -> Tensor<B, 3> {
        let _precision = precision::enter(self.compute_dtype);
        let cut = |h| window.cut(h);
        if let Some(score) = &self.score {
            // A replicated head reads whole sequences; each rank's gradient is then whole too,
            // so going back it is split, not summed.
            let h = if self.tp.sequence_parallel {
                self.tp.region(h, Region::GatherFrom(1))
            } else {
                h
            };
            return score.forward(cut(h));
        }
        let h = cut(self.tp.enter(h));
        let logits = match &self.lm_head {
            Some(head) => head.forward(h),
            None => {
                let [b, t, hidden] = h.dims();
                // A generation model's bf16 copy of the tied matrix, else the embedding.
                let w = match self.generation().and_then(|g| g.tied_head.clone()) {
                    Some(w) => w,
                    None => self.embedding().weight.val(),
                };
                let [vocab, _] = w.dims();
                precision::linear(h.reshape([b * t, hidden]), w).reshape([b, t, vocab])
            }
        };
        let (_, real, per) = self.tp.vocab_part(self.vocab_size);
        if real == per {
            return logits;
        }
        let [b, t, _] = logits.dims();
        let pad = Tensor::full([b, t, per - real], PADDED_LOGIT, &logits.device());
        match real {
            0 => pad,
            _ => Tensor::cat(vec![logits.narrow(2, 0, real), pad], 2),
        }
    }

    /// Prefills `prompts` into the given slots of `cache` (each from position 0) and returns the
    /// logits of each prompt's last token `[prompts, vocab]`. The prompts run as one
    /// right-padded batch: causal attention never lets a real token see the padding after it, so
    /// a prompt's result does not depend on its batch mates.
    pub fn prefill_slots(
        &self,
        prompts: &[Vec<u32>],
        slots: &[usize],
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        assert_eq!(prompts.len(), slots.len(), "one slot per prompt");
        let targets: Vec<(usize, usize)> = slots.iter().copied().enumerate().collect();
        self.prefill_shared(prompts, &targets, cache)
    }

    /// [`Self::prefill_slots`] where a prompt may fill several slots: each prompt runs once and
    /// its keys and values are written to every slot of `targets` = `(prompt, slot)` pairs (the
    /// `n` samples of one prompt sharing its prefill). Returns each prompt's last-token logits
    /// `[prompts, vocab]`.
    pub fn prefill_shared(
        &self,
        prompts: &[Vec<u32>],
        targets: &[(usize, usize)],
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        assert!(
            targets.iter().all(|&(p, _)| p < prompts.len()),
            "targets name prompts"
        );
        let device = self.device();
        let n = prompts.len();
        let t = prompts.iter().map(Vec::len).max().unwrap_or(0);
        assert!(t > 0 && t <= cache.capacity(), "prompt length 1..=capacity");
        let mut ids = vec![0i64; n * t];
        for (i, p) in prompts.iter().enumerate() {
            for (j, &tok) in p.iter().enumerate() {
                ids[i * t + j] = tok as i64;
            }
        }
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, t]), &device);
        let mut tmp = KvCache {
            layers: (0..self.layers.len()).map(|_| None).collect(),
            len: 0,
        };
        let positions = Tensor::<B, 1, Int>::arange(0..t as i64, &device)
            .unsqueeze_dim::<2>(0)
            .repeat_dim(0, n);
        let (cos, sin) = self.rope.tables(&positions);
        let mask = AttentionMask::from_bias(causal_bias::<B>(t, 0, &device).repeat_dim(0, n));
        let h = self.decoder(
            StageInput::Ids(ids),
            &mask,
            &cos,
            &sin,
            CacheMode::Grow(&mut tmp),
        );
        let sources: Vec<usize> = targets.iter().map(|&(p, _)| p).collect();
        let slots: Vec<usize> = targets.iter().map(|&(_, s)| s).collect();
        let lens: Vec<usize> = sources.iter().map(|&p| prompts[p].len()).collect();
        let starts = vec![0; slots.len()];
        for (l, kv) in tmp.layers.into_iter().enumerate() {
            let (k, v) = kv.expect("every layer cached its keys");
            cache.write_prefix(l, (&sources, &slots, &lens, &starts), k, v);
        }
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        self.last_token_logits(h, &lens)
    }

    /// The logits at each row's last token: `h` `[rows, t, hidden]` with `lens[i]` real tokens
    /// in row `i` (right padding after them); `[rows, vocab]`.
    fn last_token_logits(&self, h: Tensor<B, 3>, lens: &[usize]) -> Tensor<B, 2> {
        let [n, _, hidden] = h.dims();
        let last: Vec<i64> = lens.iter().map(|&l| l as i64 - 1).collect();
        let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(last, [n, 1, 1]), &h.device())
            .repeat_dim(2, hidden);
        let logits = self.head(h.gather(1, idx), HeadWindow::All);
        let vocab = logits.dims()[2];
        logits.reshape([n, vocab])
    }

    /// Continues prefills in chunks (chunked prefill): chunk `i` feeds `tokens` of slot `slot`
    /// from position `start` (the slot holds the prompt's first `start` tokens), writes their
    /// keys and values there and attends to the slot's positions up to each token. Returns
    /// each chunk's last-token logits `[chunks, vocab]`. The chunks run as one right-padded
    /// batch, as [`Self::prefill_slots`]'s prompts do.
    pub fn prefill_chunks(
        &self,
        chunks: &[(usize, usize, &[u32])],
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        let device = self.device();
        let n = chunks.len();
        let t = chunks.iter().map(|c| c.2.len()).max().unwrap_or(0);
        let layout = ChunkLayout {
            slots: chunks.iter().map(|c| c.0).collect(),
            starts: chunks.iter().map(|c| c.1).collect(),
            lens: chunks.iter().map(|c| c.2.len()).collect(),
        };
        let window = layout.window();
        assert!(
            t > 0 && layout.lens.iter().all(|&l| l > 0) && window <= cache.capacity(),
            "chunks of 1..=capacity tokens within the cache"
        );
        let mut ids = vec![0i64; n * t];
        let mut pos = vec![0i64; n * t];
        for (i, &(_, start, tokens)) in chunks.iter().enumerate() {
            for j in 0..t {
                ids[i * t + j] = tokens.get(j).map_or(0, |&x| x as i64);
                // Padding takes the last real position (its rotary angle is never used).
                pos[i * t + j] = (start + j.min(tokens.len() - 1)) as i64;
            }
        }
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [n, t]), &device);
        let positions = Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [n, t]), &device);
        let (cos, sin) = self.rope.tables(&positions);
        let mask = AttentionMask::from_host_bias(layout.bias(t), [n, 1, t, window], &device);
        let h = self.decoder(
            StageInput::Ids(ids),
            &mask,
            &cos,
            &sin,
            CacheMode::Chunk {
                cache,
                chunks: &layout,
            },
        );
        self.last_token_logits(h, &layout.lens)
    }

    /// One decode step for every slot of `cache`: slot `s` feeds `tokens[s]` at position
    /// `positions[s]` (its key and value are written there) and attends to its positions
    /// `0..=positions[s]`. Keys are read from the first `window` positions (`window` > every
    /// position). Returns next-token logits `[slots, vocab]`. Idle slots can pass any token at
    /// position 0; their output is meaningless and their slot is overwritten on reuse.
    pub fn decode_slots(
        &self,
        tokens: &[u32],
        positions: &[usize],
        window: usize,
        cache: &mut SlotKvCache<B>,
    ) -> Tensor<B, 2> {
        let s = cache.slots();
        assert!(
            tokens.len() == s && positions.len() == s,
            "one token per slot"
        );
        assert!(window <= cache.capacity(), "window within capacity");
        let device = self.device();
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(tokens.iter().map(|&t| t as i64).collect(), [s, 1]),
            &device,
        );
        let pos = Tensor::<B, 2, Int>::from_data(
            TensorData::new(positions.iter().map(|&p| p as i64).collect(), [s, 1]),
            &device,
        );
        let (cos, sin) = self.rope.tables(&pos);
        let mask = AttentionMask::decode_step(positions, window, &device);
        // Where the decode kernel applies, the positions go up once for every layer.
        let on_device = self.layers.first().and_then(|l| {
            let a = &l.self_attn;
            decode_kernel_applies::<B>(a.num_heads, a.num_kv_heads, a.head_dim)
                .then(|| SlotKvCache::<B>::step_positions(positions, &device))
        });
        let h = match self.generation() {
            Some(fused) => {
                let _precision = precision::enter(self.compute_dtype);
                let step = (positions, window, on_device.as_ref());
                self.decode_fused(fused, ids, &mask, &cos, &sin, cache, step)
            }
            None => {
                let mode = CacheMode::Slots {
                    cache,
                    positions,
                    window,
                    on_device: on_device.as_ref(),
                };
                self.decoder(StageInput::Ids(ids), &mask, &cos, &sin, mode)
            }
        };
        let logits = self.head(h, HeadWindow::All);
        let vocab = logits.dims()[2];
        logits.reshape([s, vocab])
    }
}

/// Token ids, the attention mask and position ids of a forward pass.
type ModelInputs<B> = (Tensor<B, 2, Int>, Option<Tensor<B, 2>>, Tensor<B, 2, Int>);

/// How [`CausalLm::decoder`] uses a cache.
enum CacheMode<'a, B: Backend> {
    None,
    Grow(&'a mut KvCache<B>),
    Chunk {
        cache: &'a mut SlotKvCache<B>,
        chunks: &'a ChunkLayout,
    },
    Slots {
        cache: &'a mut SlotKvCache<B>,
        positions: &'a [usize],
        window: usize,
        on_device: Option<&'a Tensor<B, 1>>,
    },
}

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
fn is_product_matrix(name: &str) -> bool {
    name == "lm_head.weight" || name.ends_with("_proj.weight")
}

/// Whether `name` is one of a routed expert's weights (distributed by expert parallelism).
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

/// Whether `name` is split over the vocabulary (and so padded with tp > 1).
fn is_vocab_split(name: &str) -> bool {
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
            let pad = Tensor::<B, 2>::zeros([per - real, hidden], &full.device());
            let rows = match real {
                0 => pad,
                _ => Tensor::cat(vec![full.narrow(0, start, real), pad], 0),
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
        let lin = |out: &mut Vec<NamedTensor<B>>,
                   name: String,
                   w: Tensor<B, 2>,
                   b: Option<Tensor<B, 1>>| {
            if let Some(b) = b {
                out.push(NamedTensor::new(format!("{name}.bias"), b));
            }
            out.push(NamedTensor::new(format!("{name}.weight"), w));
        };
        let swiglu = |out: &mut Vec<NamedTensor<B>>, p: String, m: &SwiGlu<B>| {
            out.push(NamedTensor::new(
                format!("{p}.gate_proj.weight"),
                m.gate_proj.weight.val(),
            ));
            out.push(NamedTensor::new(
                format!("{p}.up_proj.weight"),
                m.up_proj.weight.val(),
            ));
            out.push(NamedTensor::new(
                format!("{p}.down_proj.weight"),
                m.down_proj.weight.val(),
            ));
        };
        for (l, layer) in self.stage.layers.clone().zip(&self.layers) {
            let p = format!("model.layers.{l}");
            out.push(NamedTensor::new(
                format!("{p}.input_layernorm.weight"),
                layer.input_layernorm.weight.val(),
            ));
            out.push(NamedTensor::new(
                format!("{p}.post_attention_layernorm.weight"),
                layer.post_attention_layernorm.weight.val(),
            ));
            let a = &layer.self_attn;
            for (name, proj) in [
                ("q_proj", &a.q_proj),
                ("k_proj", &a.k_proj),
                ("v_proj", &a.v_proj),
            ] {
                lin(
                    &mut out,
                    format!("{p}.self_attn.{name}"),
                    proj.weight.val(),
                    proj.bias.as_ref().map(|b| b.val()),
                );
            }
            lin(
                &mut out,
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
                FeedForward::Dense(m) => swiglu(&mut out, format!("{p}.mlp"), m),
                FeedForward::Moe(m) => {
                    out.push(NamedTensor::new(
                        format!("{p}.mlp.gate.weight"),
                        m.gate.weight.val(),
                    ));
                    for (e, expert) in m.experts.iter().enumerate() {
                        let e = m.first_expert + e;
                        swiglu(&mut out, format!("{p}.mlp.experts.{e}"), expert);
                    }
                    swiglu(&mut out, format!("{p}.mlp.shared_expert"), &m.shared_expert);
                    out.push(NamedTensor::new(
                        format!("{p}.mlp.shared_expert_gate.weight"),
                        m.shared_expert_gate.weight.val(),
                    ));
                }
            }
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

    /// A sequence score read at each row's last token (`attention_mask` 1 = token; `None`: the
    /// last position), from per-token scores `[batch, seq, labels]` → `[batch, labels]`. This is
    /// where a reward model's score, and verl's outcome reward, live.
    pub fn last_token_scores(
        scores: Tensor<B, 3>,
        attention_mask: Option<Tensor<B, 2>>,
    ) -> Tensor<B, 2> {
        let [b, t, labels] = scores.dims();
        let last: Vec<i64> = match attention_mask {
            None => vec![t as i64 - 1; b],
            Some(mask) => {
                let m: Vec<f64> = mask.to_data().iter::<f64>().collect();
                (0..b)
                    .map(|i| (0..t).rev().find(|&j| m[i * t + j] > 0.5).unwrap_or(t - 1) as i64)
                    .collect()
            }
        };
        let idx =
            Tensor::<B, 3, Int>::from_data(TensorData::new(last, [b, 1, 1]), &scores.device())
                .repeat_dim(2, labels);
        scores.gather(1, idx).reshape([b, labels])
    }
}

fn swiglu_param<'a, B: Backend>(m: &'a mut SwiGlu<B>, rest: &str) -> Option<ParamMut<'a, B>> {
    match rest {
        "gate_proj.weight" => Some(ParamMut::Matrix(&mut m.gate_proj.weight)),
        "up_proj.weight" => Some(ParamMut::Matrix(&mut m.up_proj.weight)),
        "down_proj.weight" => Some(ParamMut::Matrix(&mut m.down_proj.weight)),
        _ => None,
    }
}

/// A mutable reference to one parameter, found by its HF name.
enum ParamMut<'a, B: Backend> {
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
    /// rank gets only its part of, to be summed over the group: per-head q/k norms and MoE
    /// routers (read inside the tensor-parallel region), and with sequence parallelism the
    /// layer norms and row-parallel biases (applied to sequence shards).
    pub fn tp_param_sets(&self) -> (HashSet<ParamId>, HashSet<ParamId>) {
        let sp = self.tp.sequence_parallel;
        let (mut sharded, mut partial) = (HashSet::new(), HashSet::new());
        for (name, id, _) in self.named_param_ids() {
            let inside_region = ["q_norm.weight", "k_norm.weight", "mlp.gate.weight"]
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

    /// Adds Megatron's load-balancing loss to every MoE block's training forward, weighted by
    /// `coeff` (`moe_aux_loss_coeff`; 0 turns it off). See
    /// [`super::qwen2_moe::collect_aux_losses`].
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
                m.shared_expert_gate = m.shared_expert_gate.clone().no_grad();
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

    fn param_mut(&mut self, name: &str) -> Option<ParamMut<'_, B>> {
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
            let (weight, bias) = match module {
                "q_proj" => (&mut a.q_proj.weight, a.q_proj.bias.as_mut()),
                "k_proj" => (&mut a.k_proj.weight, a.k_proj.bias.as_mut()),
                "v_proj" => (&mut a.v_proj.weight, a.v_proj.bias.as_mut()),
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
            _ => {}
        }
        let mlp = rest.strip_prefix("mlp.")?;
        match &mut layer.mlp {
            FeedForward::Dense(m) => swiglu_param(m, mlp),
            FeedForward::Moe(m) => {
                if mlp == "gate.weight" {
                    return Some(Matrix(&mut m.gate.weight));
                }
                if mlp == "shared_expert_gate.weight" {
                    return Some(Matrix(&mut m.shared_expert_gate.weight));
                }
                if let Some(r) = mlp.strip_prefix("shared_expert.") {
                    return swiglu_param(&mut m.shared_expert, r);
                }
                let (e, r) = mlp.strip_prefix("experts.")?.split_once('.')?;
                let local = e.parse::<usize>().ok()?.checked_sub(m.first_expert)?;
                swiglu_param(m.experts.get_mut(local)?, r)
            }
        }
    }
}

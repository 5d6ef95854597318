//! The decoder-only causal language model, split by concern: the model and its pipeline stage
//! here; loading from a Hugging Face checkpoint, named tensors or a random init ([`load`]); the
//! training and log-prob passes ([`forward`]); the rollout's prefill and decode steps over KV
//! caches ([`decode`]); full-weight export and bucketed weight sync ([`export`]); the sharded
//! parameters a distributed checkpoint saves and loads ([`shards`]); and the mixture-of-experts
//! switches ([`moe`]). The generation model's fused weights are
//! [`crate::models::generation`]'s.

mod decode;
mod export;
mod forward;
mod load;
mod moe;
mod random_init;
mod recompute;
mod shards;

pub(crate) use export::is_product_matrix;
pub use export::{is_routed_expert, tp_split_dim, WeightBucket};
pub use forward::FusedTargets;
pub use load::TensorSource;
pub use recompute::{
    chunk_replays, record_recompute, Recompute, RecomputeMethod, RecomputeTape, TapeGradients,
};
pub(crate) use shards::ParamMut;

use burn::module::{Module, ParamId};
use burn::prelude::*;

use crate::hf::HfModelConfig;
use crate::layers::precision::ComputeDtype;
use crate::layers::{ColumnParallelLinear, RmsNorm, RotaryEmbedding, VocabParallelEmbedding};
use crate::models::attention::Attention;
use crate::models::feed_forward::FeedForward;
use crate::models::generation_weights::{FusedWeights, GenerationWeights};
use crate::parallel::{CpGroup, ParallelBackend, TpGroup};

/// One pre-norm decoder layer. Llama's `post_attention_layernorm` is the MLP's input norm;
/// Gemma's norms the attention output before the residual add, and its
/// `pre_feedforward_layernorm` and `post_feedforward_layernorm` surround the MLP.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub pre_feedforward_layernorm: Option<RmsNorm<B>>,
    pub post_feedforward_layernorm: Option<RmsNorm<B>>,
    pub mlp: FeedForward<B>,
}

/// A decoder-only LM (Qwen2, Llama, Qwen3, Mistral, Qwen2-MoE, Qwen3-MoE, Mixtral) on one tensor-parallel rank.
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
    /// The sliding layers' own rope (Gemma 3's local layers), if any.
    #[module(skip)]
    pub local_rope: Option<RotaryEmbedding>,
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
    /// logits ([`crate::models::fused_log_probs`]).
    #[module(skip)]
    pub fused_head_chunk: Option<usize>,
    /// Training and log-prob passes pack each micro-batch's sequences into one row with no
    /// padding ([`crate::models::packing`], verl's `use_remove_padding`).
    #[module(skip)]
    pub pack_sequences: bool,
    /// Megatron's full activation recompute ([`Recompute`]): training forwards keep only the
    /// inputs of the recomputed layer chunks and run them again in the backward pass.
    #[module(skip)]
    pub recompute: Option<Recompute>,
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

impl<B: ParallelBackend> CausalLm<B> {
    /// Runs this model's matrix products in `dtype` (the weights stay f32): see
    /// [`crate::layers::precision`].
    pub fn with_compute_dtype(mut self, dtype: ComputeDtype) -> Self {
        self.compute_dtype = dtype;
        self
    }

    /// The fused weights of a generation-only model, when built.
    pub fn generation(&self) -> Option<&GenerationWeights<B>> {
        self.generation.get::<B>()
    }

    /// Replaces the generation-only model's fused weights ([`crate::models::generation`]
    /// builds them).
    pub(crate) fn set_generation(&mut self, weights: FusedWeights) {
        self.generation = weights;
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
}

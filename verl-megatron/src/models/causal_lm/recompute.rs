//! Activation recompute, as Megatron's `recompute_granularity: full` does it: a training
//! forward keeps only the input of each recomputed chunk of decoder layers, nothing computed
//! inside it; the backward pass runs each chunk's forward again from its input and
//! back-propagates through it before moving to the chunk below. A stage's activation memory
//! then grows with its number of chunks instead of with everything its layers compute, for one
//! more forward of the recomputed layers (about a third more arithmetic).
//!
//! Megatron's two methods ([`RecomputeMethod`]): `uniform` cuts the stage's layers into chunks
//! of `recompute_num_layers`; `block` recomputes the stage's first `recompute_num_layers` layers
//! one by one and keeps the activations of the others.
//!
//! Why the backward is staged by hand rather than being one custom autodiff step: burn 0.21's
//! autodiff holds a graph's lock through the whole of its backward and ends every backward by
//! locking every graph of the process, so no backward can run inside another one's step. The
//! forward therefore cuts the graph at the chunk boundaries instead: the chunks (and the first
//! stage's embedding, which is cheap to redo) run untracked, the layers above the last chunk
//! start from a new leaf, and [`RecomputeTape::backward`] walks the chunks top-down, one
//! `backward()` each, seeding each chunk with the gradient of the one above. Every chunk's
//! forward runs the tensor-parallel collectives of its layers, so peer ranks meet there before
//! anyone enters the chunk's backward (the ordering `PipelineStage::before_backward` explains).

use std::any::Any;
use std::cell::RefCell;
use std::ops::Range;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::prelude::*;
use burn::tensor::Int;

use super::forward::StageInput;
use super::CausalLm;
use crate::error::MegatronError;
use crate::layers::{precision, RopeTables};
use crate::models::attention::{AttentionMask, AttnCache};
use crate::models::sparse_moe::{aux_token_mask, collect_aux_losses_masked, collecting_aux_losses};
use crate::parallel::{device_span, with_fresh_leaves, ParallelAutodiffBackend, ParallelBackend};

/// How Megatron picks the layers it recomputes (`recompute_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// The stage's layers in chunks of `recompute_num_layers`, every chunk recomputed.
    Uniform,
    /// The stage's first `recompute_num_layers` layers, each recomputed on its own; the
    /// others keep their activations.
    Block,
}

/// Full activation recompute: Megatron's `recompute_granularity: full` with its
/// `recompute_method` and `recompute_num_layers`.
///
/// ```
/// use verl_megatron::models::{Recompute, RecomputeMethod};
/// let uniform = Recompute { method: RecomputeMethod::Uniform, num_layers: 2 };
/// assert_eq!(uniform.chunks(5), vec![0..2, 2..4, 4..5]);
/// let block = Recompute { method: RecomputeMethod::Block, num_layers: 2 };
/// assert_eq!(block.chunks(5), vec![0..1, 1..2]); // layers 2..5 keep their activations
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recompute {
    pub method: RecomputeMethod,
    pub num_layers: usize,
}

impl Recompute {
    /// The recomputed chunks of a stage of `layers` decoder layers, bottom-up, as ranges of the
    /// stage's layer indices. They always start at layer 0 and are contiguous; the layers above
    /// the last chunk keep their activations.
    pub fn chunks(&self, layers: usize) -> Vec<Range<usize>> {
        let n = self.num_layers.max(1);
        match self.method {
            RecomputeMethod::Uniform => (0..layers)
                .step_by(n)
                .map(|start| start..(start + n).min(layers))
                .collect(),
            RecomputeMethod::Block => (0..n.min(layers)).map(|l| l..l + 1).collect(),
        }
    }
}

impl<B: Backend> CausalLm<B> {
    /// Recomputes activations in training passes as `recompute` says (`None`: keeps them all).
    /// Gradients and updates are those of the model that keeps them.
    pub fn with_recompute(mut self, recompute: Option<Recompute>) -> Self {
        self.recompute = recompute;
        self
    }
}

thread_local! {
    /// While a training forward records ([`record_recompute`]): the tape its decoder left, type-erased.
    static TAPE: RefCell<Option<Option<Box<dyn Any>>>> = const { RefCell::new(None) };
}

/// Whether a training forward is recording a tape on this thread.
pub(super) fn recording() -> bool {
    TAPE.with(|t| t.borrow().is_some())
}

/// Runs `forward`, a training forward whose backward goes through
/// [`RecomputeTape::backward`], and returns what its decoder left to recompute: `None` when
/// the model recomputes nothing (no [`Recompute`] set). Forwards outside `record_recompute`
/// (log-prob passes, which have no backward) never recompute.
///
/// ```
/// use burn::optim::GradientsParams;
/// use burn::prelude::*;
/// use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
/// use verl_megatron::models::causal_lm::record_recompute;
/// use verl_megatron::models::{CausalLm, Recompute, RecomputeMethod};
/// type B = verl_core::backend::CpuAutodiff;
///
/// let dims = Qwen2Dims { vocab_size: 16, hidden_size: 8, intermediate_size: 16,
///     num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1,
///     max_position_embeddings: 8 };
/// let device = Default::default();
/// let model = CausalLm::<B>::init(&HfModelConfig::qwen2(dims), 0.2, 0, &device)
///     .with_recompute(Some(Recompute { method: RecomputeMethod::Uniform, num_layers: 1 }));
/// let ids = Tensor::<B, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
/// let (logits, tape) = record_recompute::<B, _>(|| model.forward(ids, None, None));
/// let grads = logits.powi_scalar(2).mean().reshape([1]).backward();
/// // The two layers run again here, one at a time.
/// let (grads, _) = tape.unwrap().backward(&model, grads, 0.0).unwrap();
/// let norm = model.layers[0].input_layernorm.weight.id;
/// assert!(grads.get::<verl_core::backend::CpuBackend, 1>(norm).is_some());
/// ```
pub fn record_recompute<B: Backend, T>(
    forward: impl FnOnce() -> T,
) -> (T, Option<RecomputeTape<B>>) {
    /// Puts the previous recording state back however `forward` ends (a worker thread that
    /// survives a panic must not go on recording).
    struct Restore(Option<Option<Box<dyn Any>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            TAPE.with(|t| *t.borrow_mut() = previous);
        }
    }
    let restore = Restore(TAPE.with(|t| t.borrow_mut().replace(None)));
    let out = forward();
    let tape = TAPE.with(|t| t.borrow_mut().take()).flatten();
    drop(restore);
    let tape = tape
        .and_then(|t| t.downcast::<RecomputeTape<B>>().ok())
        .map(|t| *t);
    (out, tape)
}

/// How many recomputed chunks have run again in this process: what shows that recompute ran
/// (its results equal the kept run's by design).
pub fn chunk_replays() -> u64 {
    REPLAYS.load(std::sync::atomic::Ordering::Relaxed)
}

static REPLAYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What a recomputing forward keeps of one micro-batch: each chunk's input and what its layers
/// read besides it, to run the chunks again in the backward pass.
pub struct RecomputeTape<B: Backend> {
    mask: AttentionMask<B>,
    rope: RopeTables<B>,
    /// The first stage's token ids: its embedding runs again too.
    embedding_ids: Option<Tensor<B, 2, Int>>,
    /// Each chunk's layers and input hidden states (untracked), bottom-up.
    chunks: Vec<(Range<usize>, Tensor<B, 3>)>,
    /// The leaf the kept layers (or the final norm and head) start from: the last chunk's
    /// output.
    top: Tensor<B, 3>,
    /// Whether the forward collected MoE load-balancing losses (then the chunks' are
    /// recomputed into the backward), and the tokens' mask they were computed with.
    collecting: bool,
    aux_mask: Option<Tensor<B, 1>>,
    /// The MoE routing the forward replayed, replayed again when the chunks run anew (else a
    /// re-run chunk could route its tokens elsewhere than the loss did).
    replay: Option<std::sync::Arc<crate::models::router_replay::Routing>>,
}

impl<B: ParallelBackend> CausalLm<B> {
    /// The decoder of a recording training forward ([`record_recompute`]): the embedding and the
    /// recomputed chunks run untracked, each chunk's input kept; the layers above them and the
    /// final norm run as usual from a new leaf. Same values as the plain decoder.
    pub(super) fn decoder_recomputed(
        &self,
        input: StageInput<B>,
        mask: &AttentionMask<B>,
        rope: &RopeTables<B>,
        recompute: Recompute,
    ) -> Tensor<B, 3> {
        let (mut h, embedding_ids) = match input {
            StageInput::Ids(ids) => (
                self.scale_embeddings(self.embedding().clone().no_grad().forward(ids.clone())),
                Some(ids),
            ),
            // The previous stage's activation: its gradient comes out of the tape's backward.
            StageInput::Hidden(h) => (h.set_require_grad(false), None),
        };
        let ranges = recompute.chunks(self.layers.len());
        let kept_from = ranges.last().map_or(0, |r| r.end);
        let mut chunks = Vec::with_capacity(ranges.len());
        for range in ranges {
            chunks.push((range.clone(), h.clone()));
            for layer in &self.layers[range] {
                h = layer
                    .clone()
                    .no_grad()
                    .forward(h, mask, rope, AttnCache::None);
            }
        }
        let top = h.require_grad();
        let mut h = top.clone();
        for layer in &self.layers[kept_from..] {
            h = layer.forward(h, mask, rope, AttnCache::None);
        }
        let collecting = collecting_aux_losses();
        let tape = RecomputeTape {
            mask: mask.clone(),
            rope: rope.clone(),
            embedding_ids,
            chunks,
            top,
            collecting,
            aux_mask: collecting.then(aux_token_mask::<B>).flatten(),
            replay: crate::models::router_replay::current_replay(),
        };
        TAPE.with(|t| {
            if let Some(slot) = t.borrow_mut().as_mut() {
                assert!(
                    slot.is_none(),
                    "one recomputing decoder per recorded forward: a second tape would drop \
                     the first one's gradients"
                );
                *slot = Some(Box::new(tape));
            }
        });
        self.final_norm(h)
    }
}

impl<B: ParallelBackend> RecomputeTape<B> {
    /// `layers` over `h`, with what the forward's layers read besides their input.
    fn run(&self, layers: &[super::DecoderLayer<B>], mut h: Tensor<B, 3>) -> Tensor<B, 3> {
        for layer in layers {
            h = layer.forward(h, &self.mask, &self.rope, AttnCache::None);
        }
        h
    }
}

/// What a tape's backward gives: the parameters' gradients, and the stage input's gradient on
/// a stage after the first.
pub type TapeGradients<B> = (
    GradientsParams,
    Option<Tensor<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend, 3>>,
);

impl<B: ParallelAutodiffBackend> RecomputeTape<B> {
    /// The rest of a micro-batch's backward once `grads`, the backward of its loss (or of the
    /// next stage's gradient), has run through the layers above the chunks: each chunk is run
    /// again and back-propagated, top-down, then the embedding. `model` is the model the forward
    /// ran with; `aux_scale` weighs the chunks' MoE load-balancing losses as the forward's were.
    /// Returns the parameters' gradients and, on a stage after the first, its input's.
    pub fn backward(
        self,
        model: &CausalLm<B>,
        grads: B::Gradients,
        aux_scale: f64,
    ) -> Result<TapeGradients<B>, MegatronError> {
        let lost = |what| MegatronError::RecomputeLostGradient { what };
        let mut acc = GradientsAccumulator::<CausalLm<B>>::new();
        let mut g = self
            .top
            .grad(&grads)
            .ok_or_else(|| lost("the recomputed layers' output"))?;
        acc.accumulate(model, GradientsParams::from_grads(grads, model));
        let _precision = precision::enter(model.compute_dtype);
        let device = model.device();
        for (range, x) in self.chunks.iter().rev() {
            // The chunk's layers as new leaves: its graph is its own, its gradients by id.
            let fresh = with_fresh_leaves(model.layers[range.clone()].to_vec());
            let x = x.clone().require_grad();
            let (y, aux) = device_span::<B, _>(&device, "recompute", || {
                let run = || {
                    if self.collecting {
                        collect_aux_losses_masked(self.aux_mask.clone(), || {
                            self.run(&fresh, x.clone())
                        })
                    } else {
                        (self.run(&fresh, x.clone()), Vec::new())
                    }
                };
                match &self.replay {
                    Some(routing) => {
                        crate::models::router_replay::replay_routing(routing.clone(), run)
                    }
                    None => run(),
                }
            });
            REPLAYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // A chunk's activations are all held now: the backward's peak.
            crate::parallel::sample_memory::<B>(&device);
            let mut seed = (y * Tensor::from_inner(g)).sum();
            for a in aux {
                seed = seed + a.sum() * aux_scale;
            }
            let chunk_grads = seed.backward();
            g = x
                .grad(&chunk_grads)
                .ok_or_else(|| lost("a recomputed chunk's input"))?;
            acc.accumulate(model, GradientsParams::from_grads(chunk_grads, &fresh));
        }
        match self.embedding_ids {
            Some(ids) => {
                let fresh = with_fresh_leaves(model.embedding().clone());
                let h = model.scale_embeddings(fresh.forward(ids));
                let grads = (h * Tensor::from_inner(g)).sum().backward();
                acc.accumulate(model, GradientsParams::from_grads(grads, &fresh));
                Ok((acc.grads(), None))
            }
            None => Ok((acc.grads(), Some(g))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Chunks start at layer 0, follow one another, hold at most `num_layers` layers each;
        /// uniform covers every layer, block exactly the first `num_layers` one by one.
        #[test]
        fn chunks_tile_the_bottom_of_the_stage(layers in 1usize..40, n in 1usize..12, block: bool) {
            let method = if block { RecomputeMethod::Block } else { RecomputeMethod::Uniform };
            let chunks = Recompute { method, num_layers: n }.chunks(layers);
            let mut next = 0;
            for c in &chunks {
                prop_assert_eq!(c.start, next);
                prop_assert!(!c.is_empty() && c.len() <= n);
                next = c.end;
            }
            match method {
                RecomputeMethod::Uniform => {
                    prop_assert_eq!(next, layers);
                    prop_assert_eq!(chunks.len(), layers.div_ceil(n));
                }
                RecomputeMethod::Block => {
                    prop_assert_eq!(next, n.min(layers));
                    prop_assert!(chunks.iter().all(|c| c.len() == 1));
                }
            }
        }
    }

    /// Outside [`record_recompute`] nothing is recorded, and a model without a setting leaves
    /// no tape even inside it.
    #[test]
    fn only_recording_forwards_of_recomputing_models_leave_a_tape() {
        use crate::hf::{HfModelConfig, Qwen2Dims};
        type B = verl_core::backend::CpuAutodiff;
        let dims = Qwen2Dims {
            vocab_size: 16,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 3,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            max_position_embeddings: 8,
        };
        let device = Default::default();
        let plain = CausalLm::<B>::init(&HfModelConfig::qwen2(dims), 0.2, 0, &device);
        let ids = Tensor::<B, 2, Int>::from_ints([[1, 2, 3]], &device);
        let (_, tape) = record_recompute::<B, _>(|| plain.forward(ids.clone(), None, None));
        assert!(tape.is_none());
        let model = plain.clone().with_recompute(Some(Recompute {
            method: RecomputeMethod::Uniform,
            num_layers: 2,
        }));
        assert!(!recording());
        let kept = model.forward(ids.clone(), None, None);
        let (out, tape) = record_recompute::<B, _>(|| model.forward(ids.clone(), None, None));
        let tape = tape.expect("a tape");
        // Two chunks (layers 0..2 and 2..3), each keeping only its input; the same logits.
        assert_eq!(tape.chunks.len(), 2);
        assert_eq!(tape.chunks[1].0, 2..3);
        assert!(tape.embedding_ids.is_some());
        out.into_data()
            .assert_approx_eq::<f32>(&kept.into_data(), burn::tensor::Tolerance::absolute(0.0));
    }

    /// A forward under a replayed MoE routing, recomputed in a backward that runs outside the
    /// replay scope, routes the re-run layers as the forward did: the router's gradient equals
    /// the one of the forward that kept its activations.
    #[test]
    fn recompute_replays_the_forwards_routing() {
        use crate::models::feed_forward::FeedForward;
        use crate::models::router_replay::{record_routing, replay_routing, Routing};
        use burn::optim::GradientsParams;
        type B = verl_core::backend::CpuAutodiff;
        let cfg = crate::models::sparse_moe::tiny_config(4, 2, 2);
        let device = Default::default();
        let plain = CausalLm::<B>::init(&cfg, 0.3, 3, &device);
        let ids = Tensor::<B, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
        // Every token of every layer forced onto the two experts its router did not pick.
        let (_, own) = record_routing(|| plain.forward(ids.clone(), None, None));
        let forced = Routing {
            layers: own
                .layers
                .iter()
                .map(|(&l, picks)| {
                    let others = picks
                        .chunks(2)
                        .flat_map(|p| (0..4).filter(|e| !p.contains(e)).collect::<Vec<i64>>())
                        .collect();
                    (l, others)
                })
                .collect(),
        };
        let forced = std::sync::Arc::new(forced);
        let router = |m: &CausalLm<B>| match &m.layers[0].mlp {
            FeedForward::Moe(b) => b.gate.weight.id,
            _ => unreachable!("a Qwen2-MoE layer"),
        };
        let kept = replay_routing(forced.clone(), || plain.forward(ids.clone(), None, None));
        let kept = GradientsParams::from_grads(kept.sum().backward(), &plain);
        let model = plain.clone().with_recompute(Some(Recompute {
            method: RecomputeMethod::Uniform,
            num_layers: 1,
        }));
        let (out, tape) = replay_routing(forced, || {
            record_recompute::<B, _>(|| model.forward(ids.clone(), None, None))
        });
        let (grads, _) = tape
            .expect("a tape")
            .backward(&model, out.sum().backward(), 0.0)
            .expect("the recomputed backward");
        let a = kept
            .get::<verl_core::backend::CpuBackend, 2>(router(&plain))
            .expect("kept");
        let b = grads
            .get::<verl_core::backend::CpuBackend, 2>(router(&model))
            .expect("recomputed");
        a.into_data()
            .assert_approx_eq::<f32>(&b.into_data(), burn::tensor::Tolerance::absolute(1e-6));
    }
}

//! The optimizer of the actor and critic: AdamW (decoupled weight decay, as Megatron's), global
//! gradient-norm clipping, and Megatron's learning-rate schedule (linear warm-up, then constant,
//! linear or cosine decay to `min_lr`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use serde_json::{json, Value};
use verl_core::config::OptimConfig;
use verl_core::traits::{Communicator, ReduceOp};
use verl_core::NamedTensor;

use super::adamw::{AdamW, AdamWHyper, Moments};
use crate::error::MegatronError;
use crate::ops::FusedOps;

/// The learning rate at each optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_init: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub style: DecayStyle,
}

/// How the learning rate falls after warm-up (the config's `optim.lr_decay_style`).
pub use verl_core::config::LrDecayStyle as DecayStyle;

impl LrSchedule {
    /// From `*.optim`; `total_steps` is the run's optimizer-step count (for the warm-up ratio and
    /// the decay length when `lr_decay_steps` is unset).
    pub fn from_config(cfg: &OptimConfig, total_steps: u64) -> Result<Self, MegatronError> {
        let style = cfg.lr_decay_style;
        let warmup_steps = match cfg.lr_warmup_steps {
            Some(s) if s >= 0 => s as u64,
            _ => (cfg.lr_warmup_steps_ratio * total_steps as f64) as u64,
        };
        Ok(Self {
            max_lr: cfg.lr,
            min_lr: cfg.min_lr,
            warmup_init: cfg.lr_warmup_init,
            warmup_steps,
            decay_steps: cfg.lr_decay_steps.unwrap_or(total_steps).max(1),
            style,
        })
    }

    /// The learning rate of optimizer step `step` (0-based).
    ///
    /// ```
    /// use verl_megatron::workers::optim::{DecayStyle, LrSchedule};
    /// let s = LrSchedule { max_lr: 1.0, min_lr: 0.0, warmup_init: 0.0, warmup_steps: 2,
    ///                      decay_steps: 10, style: DecayStyle::Cosine };
    /// assert_eq!(s.lr(0), 0.0);
    /// assert_eq!(s.lr(1), 0.5);
    /// assert_eq!(s.lr(2), 1.0);
    /// assert!((s.lr(6) - 0.5).abs() < 1e-12); // halfway through the cosine
    /// assert_eq!(s.lr(10), 0.0);
    /// ```
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            let f = step as f64 / self.warmup_steps as f64;
            return self.warmup_init + (self.max_lr - self.warmup_init) * f;
        }
        if self.style == DecayStyle::Constant || step >= self.decay_steps {
            return match self.style {
                DecayStyle::Constant => self.max_lr,
                _ => self.min_lr,
            };
        }
        let span = (self.decay_steps - self.warmup_steps).max(1) as f64;
        let f = (step - self.warmup_steps) as f64 / span;
        let coeff = match self.style {
            DecayStyle::Linear => 1.0 - f,
            _ => 0.5 * (1.0 + (std::f64::consts::PI * f).cos()),
        };
        self.min_lr + (self.max_lr - self.min_lr) * coeff
    }
}

/// Sums the squares of every parameter's gradient, those of `sharded` parameters apart.
///
/// Each gradient's sum of squares stays on its device until [`Self::totals`] reads them all in
/// one transfer: one host synchronisation per step instead of one per parameter.
struct SquaredNorm<'a, I: Backend> {
    grads: &'a GradientsParams,
    sharded: Option<&'a HashSet<ParamId>>,
    /// Routed experts' parameters, counted apart (they are summed over other groups).
    experts: Option<&'a HashSet<ParamId>>,
    /// A parameter another stage counts (the last stage's copy of a tied embedding).
    exclude: Option<ParamId>,
    /// The gradients themselves (as matrices) with their kinds, summed by the backend's
    /// [`FusedOps::sums_of_squares`] when the totals are read (a few launches on burn-cuda).
    deferred: Vec<(Tensor<I, 2>, NormPart)>,
}

/// Which total a gradient's squares go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormPart {
    Replicated,
    /// A tensor-parallel shard.
    Sharded,
    /// A routed expert (or its expert-tensor shard).
    Expert,
}

/// The sums of squares of a stage's gradients by kind.
#[derive(Debug, Clone, Copy, Default)]
struct NormTotals {
    replicated: f64,
    sharded: f64,
    experts: f64,
}

impl<'a, I: FusedOps> SquaredNorm<'a, I> {
    fn new(
        grads: &'a GradientsParams,
        sharded: Option<&'a HashSet<ParamId>>,
        experts: Option<&'a HashSet<ParamId>>,
        exclude: Option<ParamId>,
    ) -> Self {
        Self {
            grads,
            sharded,
            experts,
            exclude,
            deferred: Vec::new(),
        }
    }

    /// The sums of squares of the replicated, the sharded and the experts' gradients, added in
    /// the model's order in f64.
    fn totals(self) -> NormTotals {
        let (grads, parts): (Vec<_>, Vec<_>) = self.deferred.into_iter().unzip();
        split_totals(I::sums_of_squares(grads), parts)
    }
}

/// The sums of squares by kind, added in order.
fn split_totals(values: Vec<f64>, parts: Vec<NormPart>) -> NormTotals {
    let mut t = NormTotals::default();
    for (v, part) in values.into_iter().zip(parts) {
        match part {
            NormPart::Replicated => t.replicated += v,
            NormPart::Sharded => t.sharded += v,
            NormPart::Expert => t.experts += v,
        }
    }
    t
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.exclude == Some(param.id) {
            return;
        }
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let sharded = if self.experts.is_some_and(|s| s.contains(&param.id)) {
                NormPart::Expert
            } else if self.sharded.is_some_and(|s| s.contains(&param.id)) {
                NormPart::Sharded
            } else {
                NormPart::Replicated
            };
            let dims = g.dims();
            // A matrix as it is (its primitive carries its shape and pitch); anything else as
            // rows of its last dimension.
            let matrix = if D == 2 {
                Tensor::<B::InnerBackend, 2>::from_primitive(g.into_primitive())
            } else {
                let cols = dims[D - 1];
                g.reshape([dims.iter().product::<usize>() / cols.max(1), cols])
            };
            self.deferred.push((matrix, sharded));
        }
    }
}

/// Multiplies every parameter's gradient by a factor.
struct ScaleGrads<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ScaleGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, g * self.factor);
        }
    }
}

/// Takes every parameter's gradient (of `only` when given) out of `grads`, flattened, in the
/// model's parameter order.
struct TakeGrads<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    only: Option<&'a HashSet<ParamId>>,
    /// Each gradient flattened, on its device.
    taken: Vec<(ParamId, Tensor<I, 1>)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.only.is_some_and(|o| !o.contains(&param.id)) {
            return;
        }
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let n = g.shape().num_elements();
            self.taken.push((param.id, g.reshape([n])));
        }
    }
}

/// Puts reduced gradients back, shaped as their parameters.
struct PutGrads<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    reduced: HashMap<ParamId, Tensor<I, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutGrads<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(v) = self.reduced.remove(&param.id) {
            let dims = param.val().dims();
            self.grads.register(param.id, v.reshape(dims));
        }
    }
}

/// Sums `grads` (those of `only` when given) over `comm`, in buckets of about `bucket_elems`
/// elements (as Megatron's DDP does, so each collective is large and there are few of them).
/// Every rank must hold gradients for the same parameters. The buckets are built and split on
/// the gradients' device (a GPU's gradients never pass through host memory).
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    comm: &dyn Communicator<B::InnerBackend>,
    bucket_elems: usize,
    only: Option<&HashSet<ParamId>>,
) -> Result<(), MegatronError> {
    let mut take = TakeGrads::<B::InnerBackend> {
        grads,
        only,
        taken: Vec::new(),
    };
    model.visit(&mut take);
    let mut taken = take.taken.into_iter().peekable();
    let mut reduced = HashMap::new();
    while taken.peek().is_some() {
        // One bucket: consecutive gradients up to the size (at least one).
        let mut bucket: Vec<(ParamId, Tensor<B::InnerBackend, 1>)> = Vec::new();
        let mut elems = 0;
        while let Some((_, next)) = taken.peek() {
            let n = next.dims()[0];
            if !bucket.is_empty() && elems + n > bucket_elems {
                break;
            }
            elems += n;
            bucket.push(taken.next().expect("peeked"));
        }
        let lens: Vec<(ParamId, usize)> = bucket.iter().map(|(id, t)| (*id, t.dims()[0])).collect();
        let flat = Tensor::cat(bucket.into_iter().map(|(_, t)| t).collect(), 0);
        let sum = comm.all_reduce(flat, ReduceOp::Sum)?;
        let mut offset = 0;
        for (id, n) in lens {
            reduced.insert(id, sum.clone().narrow(0, offset, n));
            offset += n;
        }
    }
    let mut put = PutGrads::<B::InnerBackend> { grads, reduced };
    model.visit(&mut put);
    Ok(())
}

/// The global L2 norm of all gradients of `model`.
pub fn grad_norm<B: AutodiffBackend<InnerBackend: FusedOps>, M: AutodiffModule<B>>(
    model: &M,
    grads: &GradientsParams,
) -> f64 {
    let mut v = SquaredNorm::<B::InnerBackend>::new(grads, None, None, None);
    model.visit(&mut v);
    v.totals().replicated.sqrt()
}

/// The global L2 norm of a model-parallel model's gradients: tensor-parallel shards' squares
/// summed over the tp group and replicated parameters counted once, then the pipeline stages'
/// sums added over the pp group (a tied embedding counted on the first stage only), as Megatron
/// counts each parameter once. The same on every rank of the model-parallel group.
pub fn model_parallel_grad_norm<
    B: AutodiffBackend<InnerBackend: FusedOps>,
    M: AutodiffModule<B>,
>(
    model: &M,
    grads: &GradientsParams,
    tp: Option<&TensorParallelGrads<B::InnerBackend>>,
    pp: Option<&PipelineParallelGrads<B::InnerBackend>>,
    experts: Option<&ExpertParallelGrads<B::InnerBackend>>,
) -> Result<f64, MegatronError> {
    let exclude = pp.and_then(|p| (p.comm.rank() != 0).then_some(p.tied_embedding).flatten());
    let mut v = SquaredNorm::<B::InnerBackend>::new(
        grads,
        tp.map(|t| &t.sharded),
        experts.map(|e| &e.experts),
        exclude,
    );
    model.visit(&mut v);
    let totals = v.totals();
    let (total, sharded_total) = (totals.replicated, totals.sharded);
    // On the model's device: a communicator may only reach its own GPU's memory.
    let device = model.devices().into_iter().next().unwrap_or_default();
    let sum = |comm: &GroupHandle<B::InnerBackend>, x: f64| -> Result<f64, MegatronError> {
        let t = Tensor::<B::InnerBackend, 1>::from_floats([x as f32], &device);
        crate::host_reads::note(1);
        Ok(comm
            .all_reduce(t, ReduceOp::Sum)?
            .into_scalar()
            .elem::<f64>())
    };
    let mut stage = total;
    stage += match tp {
        Some(tp) => sum(&tp.comm, sharded_total)?,
        None => sharded_total,
    };
    // Each expert shard lives once in an expert-tensor × expert-parallel group.
    if let Some(e) = experts {
        let mut x = totals.experts;
        for comm in [&e.etp, &e.ep].into_iter().flatten() {
            x = sum(comm, x)?;
        }
        stage += x;
    }
    let total = match pp {
        Some(pp) => sum(&pp.comm, stage)?,
        None => stage,
    };
    Ok(total.sqrt())
}

/// Sums the tied embedding's gradient between the first and the last pipeline stage (both hold
/// the weight: the input embedding and the output layer).
fn sum_tied_embedding<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    pp: &PipelineParallelGrads<B::InnerBackend>,
) -> Result<(), MegatronError> {
    let (rank, stages) = (pp.comm.rank(), pp.comm.world_size());
    let Some(id) = pp.tied_embedding else {
        return Ok(());
    };
    if stages < 2 || (rank != 0 && rank + 1 != stages) {
        return Ok(());
    }
    let Some(g) = grads.remove::<B::InnerBackend, 2>(id) else {
        return Ok(());
    };
    let dims = g.dims();
    let n = dims[0] * dims[1];
    let peer = if rank == 0 { stages - 1 } else { 0 };
    let mine = g.clone().reshape([n]);
    // First sends then receives, last the reverse: a pairing blocking transports accept.
    let theirs = if rank == 0 {
        pp.comm.send(mine, peer)?;
        pp.comm.recv(peer, n, &g.device())?
    } else {
        let t = pp.comm.recv(peer, n, &g.device())?;
        pp.comm.send(mine, peer)?;
        t
    };
    // The same order of addition on both stages, so both apply the same update.
    let total = if rank == 0 {
        g + theirs.reshape(dims)
    } else {
        theirs.reshape(dims) + g
    };
    grads.register(id, total);
    Ok(())
}

/// Scales gradients so their global norm is at most `max_norm` (Megatron's `clip_grad`);
/// returns the norm before clipping. A non-finite norm is returned as is and the caller skips
/// the step.
pub fn clip_grad_norm<B: AutodiffBackend<InnerBackend: FusedOps>, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    let norm = grad_norm(model, grads);
    scale_to_norm(model, grads, norm, max_norm);
    norm
}

/// Scales gradients whose global norm is `norm` to at most `max_norm`.
fn scale_to_norm<B: AutodiffBackend<InnerBackend: FusedOps>, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    norm: f64,
    max_norm: f64,
) {
    let factor = clip_factor(norm, max_norm);
    if factor != 1.0 {
        model.visit(&mut ScaleGrads { grads, factor });
    }
}

/// The factor that brings gradients of global norm `norm` to at most `max_norm` (1 when they
/// are within it, when clipping is off, or when the norm is not finite).
pub fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if norm.is_finite() && max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

/// `params` cut into runs of consecutive entries of at most `bucket_elems` elements in all
/// (a larger parameter alone in its run); empty for no parameters.
fn param_buckets(params: &[(ParamId, usize)], bucket_elems: usize) -> Vec<&[(ParamId, usize)]> {
    let mut buckets = Vec::new();
    let (mut start, mut elems) = (0, 0);
    for (i, &(_, n)) in params.iter().enumerate() {
        if i > start && elems + n > bucket_elems {
            buckets.push(&params[start..i]);
            (start, elems) = (i, 0);
        }
        elems += n;
    }
    if start < params.len() {
        buckets.push(&params[start..]);
    }
    buckets
}

/// Every parameter's id and element count, in the model's order.
struct ParamSizes(Vec<(ParamId, usize)>);

impl<B: AutodiffBackend> ModuleVisitor<B> for ParamSizes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // A frozen parameter (a frozen MoE router) never changes: nobody owns its update.
        if param.val().is_require_grad() {
            self.0.push((param.id, param.val().shape().num_elements()));
        }
    }
}

/// Drops the gradients of parameters another rank updates.
struct KeepGrads<'a> {
    grads: &'a mut GradientsParams,
    keep: &'a HashSet<ParamId>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for KeepGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !self.keep.contains(&param.id) {
            self.grads.remove::<B::InnerBackend, D>(param.id);
        }
    }
}

/// The values of the given parameters, flattened, in the model's order.
struct ReadParams<'a, I: Backend> {
    ids: &'a HashSet<ParamId>,
    values: Vec<Tensor<I, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ReadParams<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.ids.contains(&param.id) {
            // Flattened on the parameter's device, in f32 so that one buffer holds them all.
            let v = param.val().inner();
            let n = v.shape().num_elements();
            self.values
                .push(v.reshape([n]).cast(burn::tensor::FloatDType::F32));
        }
    }
}

/// Replaces parameters by the values other ranks broadcast (still trained leaves), on the
/// parameters' device and in each parameter's own precision.
struct WriteParams<I: Backend> {
    values: HashMap<ParamId, Tensor<I, 1>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for WriteParams<B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(v) = self.values.remove(&param.id) else {
            return param;
        };
        let (id, old, mapper) = param.consume();
        let inner = v.reshape(old.dims()).cast(old.dtype());
        // Trainable as it was (a frozen parameter stays frozen).
        let value = Tensor::from_inner(inner).set_require_grad(old.is_require_grad());
        Param::from_mapped_value(id, value, mapper)
    }
}

/// Megatron's distributed optimizer over the data-parallel group: every parameter has one
/// owning dp rank (balanced by element count), only the owner keeps AdamW moments for it and
/// updates it, and the owners broadcast the updated values. Optimizer memory per rank is about
/// 1/dp of the whole; the update is the single-rank one.
struct DistributedOptimizer {
    /// Owner rank of every parameter, in the model's order, with its size.
    owners: Vec<(ParamId, usize, usize)>,
}

impl DistributedOptimizer {
    /// Balanced, deterministic ownership (the same on every rank): each parameter, in order,
    /// goes to the least-loaded rank so far.
    fn assign(sizes: Vec<(ParamId, usize)>, ranks: usize) -> Self {
        let mut load = vec![0usize; ranks];
        let owners = sizes
            .into_iter()
            .map(|(id, n)| {
                let r = (0..ranks).min_by_key(|&r| (load[r], r)).unwrap_or(0);
                load[r] += n;
                (id, n, r)
            })
            .collect();
        Self { owners }
    }

    fn owned_by(&self, rank: usize) -> HashSet<ParamId> {
        self.owners
            .iter()
            .filter(|(_, _, r)| *r == rank)
            .map(|(id, _, _)| *id)
            .collect()
    }
}

/// A pipeline stage's group, for the optimizer: the gradient norm adds up over it, and the tied
/// embedding (held by the first and the last stage) gets the sum of both stages' gradients.
pub struct PipelineParallelGrads<I: Backend> {
    pub comm: GroupHandle<I>,
    pub tied_embedding: Option<ParamId>,
}

/// How a tensor-parallel model holds its parameters, for the optimizer: which are shards
/// (their squares are summed over the group in the gradient norm) and which are replicated
/// but get only this rank's part of their gradient (layer norms under sequence parallelism,
/// per-head norms, routers), to be summed over the group before the step.
pub struct TensorParallelGrads<I: Backend> {
    pub comm: GroupHandle<I>,
    pub sharded: HashSet<ParamId>,
    pub partial: HashSet<ParamId>,
}

/// How a mixture-of-experts model holds its routed experts, for the optimizer: their
/// gradients are summed over the expert data-parallel group (the ranks holding the same expert
/// shard) instead of the data-parallel one, their squares over the expert tensor and expert
/// parallel groups in the gradient norm, and the distributed optimizer leaves them to their
/// rank (the dp ranks hold different experts).
pub struct ExpertParallelGrads<I: Backend> {
    pub experts: HashSet<ParamId>,
    /// Every other parameter.
    pub dense: HashSet<ParamId>,
    /// Expert tensor parallel group (`None` for one rank).
    pub etp: Option<GroupHandle<I>>,
    /// Expert parallel group (`None` for one rank).
    pub ep: Option<GroupHandle<I>>,
    /// Expert data parallel group; `None`: the data-parallel group, which it equals when the
    /// experts are not distributed (ep = 1, etp = tp).
    pub expert_dp: Option<GroupHandle<I>>,
    /// Whether the experts are distributed (ep > 1 or etp ≠ tp): then `expert_dp` must be set
    /// whenever there is data parallelism.
    pub distributed: bool,
}

/// AdamW with clipping and the schedule, stepping one model.
pub struct ModelOptimizer<B: AutodiffBackend, M: AutodiffModule<B>> {
    adamw: AdamW<B::InnerBackend>,
    model: std::marker::PhantomData<fn(M)>,
    pub schedule: LrSchedule,
    pub clip_grad: f64,
    /// Optimizer steps taken.
    pub step: u64,
    /// The data-parallel group gradients are summed over before each step, and the bucket
    /// size in elements.
    data_parallel: Option<(GroupHandle<B::InnerBackend>, usize)>,
    tensor_parallel: Option<TensorParallelGrads<B::InnerBackend>>,
    pipeline_parallel: Option<PipelineParallelGrads<B::InnerBackend>>,
    expert_parallel: Option<ExpertParallelGrads<B::InnerBackend>>,
    /// `use_distributed_optimizer`: set once the parameters are known (first step).
    distributed: Option<Option<DistributedOptimizer>>,
}

/// A rank's shared handle on a process group.
pub type GroupHandle<B> = Arc<dyn Communicator<B>>;

/// Megatron's default gradient-reduction bucket: 40 M elements.
pub const DEFAULT_GRAD_BUCKET_ELEMS: usize = 40_000_000;

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    pub grad_norm: f64,
    pub lr: f64,
    /// False when the gradient norm was not finite and the step was skipped.
    pub applied: bool,
}

impl<B: AutodiffBackend<InnerBackend: FusedOps>, M: AutodiffModule<B>> ModelOptimizer<B, M> {
    pub fn new(cfg: &OptimConfig, total_steps: u64) -> Result<Self, MegatronError> {
        if cfg.optimizer != "adam" && cfg.optimizer != "adamw" {
            return Err(MegatronError::Setting {
                field: "optim.optimizer".into(),
                message: format!("`{}` is not supported; use adam (AdamW)", cfg.optimizer),
            });
        }
        let adamw = AdamW::new(AdamWHyper {
            beta_1: cfg.betas[0] as f32,
            beta_2: cfg.betas[1] as f32,
            epsilon: cfg.eps as f32,
            weight_decay: cfg.weight_decay as f32,
        });
        Ok(Self {
            adamw,
            model: std::marker::PhantomData,
            schedule: LrSchedule::from_config(cfg, total_steps)?,
            clip_grad: cfg.clip_grad,
            step: 0,
            data_parallel: None,
            tensor_parallel: None,
            pipeline_parallel: None,
            expert_parallel: None,
            distributed: None,
        })
    }

    /// Sums gradients over `comm` (the data-parallel group) before every step; with the loss
    /// normalised by the global batch, each rank then applies the single-rank update.
    pub fn with_data_parallel(
        mut self,
        comm: Arc<dyn Communicator<B::InnerBackend>>,
        bucket_elems: usize,
    ) -> Self {
        self.data_parallel = Some((comm, bucket_elems.max(1)));
        self
    }

    /// Shards the AdamW state over the data-parallel group (Megatron's
    /// `use_distributed_optimizer`): see [`Self::step`]. Without a data-parallel group of more
    /// than one rank this changes nothing.
    pub fn with_distributed_optimizer(mut self, enabled: bool) -> Self {
        self.distributed = enabled.then_some(None);
        self
    }

    /// Whether burn-cuda parameters are updated by the fused AdamW kernel (the default) or by
    /// burn's chain of tensor operations (to compare the two).
    pub fn with_fused_adamw(mut self, fused: bool) -> Self {
        self.adamw.set_fused(fused);
        self
    }

    /// The AdamW state, to move it to host memory and back.
    pub fn adamw_mut(&mut self) -> &mut AdamW<B::InnerBackend> {
        &mut self.adamw
    }

    /// Whether this rank keeps only its share of the optimizer state.
    pub fn is_distributed(&self) -> bool {
        self.distributed.is_some()
            && self
                .data_parallel
                .as_ref()
                .is_some_and(|(c, _)| c.world_size() > 1)
    }

    /// Over how many data-parallel ranks the AdamW state is spread (1 unless distributed).
    pub fn sharded_over(&self) -> usize {
        match &self.data_parallel {
            Some((dp, _)) if self.is_distributed() => dp.world_size(),
            _ => 1,
        }
    }

    /// With the distributed optimizer: keeps only this rank's gradients for the update.
    fn keep_owned_grads(&mut self, model: &M, grads: &mut GradientsParams) {
        let Some((dp, _)) = &self.data_parallel else {
            return;
        };
        if dp.world_size() == 1 {
            return;
        }
        let Some(dist) = self.distributed.as_mut() else {
            return;
        };
        let experts = self.expert_parallel.as_ref().map(|e| &e.experts);
        let dist = dist.get_or_insert_with(|| {
            let mut sizes = ParamSizes(Vec::new());
            model.visit(&mut sizes);
            let dense = sizes
                .0
                .into_iter()
                .filter(|(id, _)| !experts.is_some_and(|e| e.contains(id)))
                .collect();
            DistributedOptimizer::assign(dense, dp.world_size())
        });
        let mut keep = dist.owned_by(dp.rank());
        keep.extend(experts.into_iter().flatten().copied());
        model.visit(&mut KeepGrads { grads, keep: &keep });
        // Moments of parameters another rank owns (a checkpoint saved on another layout loads
        // them all) are never read again.
        self.adamw.retain_moments(|id| keep.contains(id));
    }

    /// With the distributed optimizer: each owner broadcasts its updated parameters in
    /// buckets of about the gradient bucket's size (a flat f32 buffer built and split on the
    /// parameters' device), and every rank writes each bucket it receives into its model at
    /// once, so the parameters it replaces are freed bucket by bucket. One flat buffer per owner
    /// was 9.4 GB on a 7B tp=2 × dp=2 rank, beside the model it replaces: the step-2 update ran
    /// out of memory.
    fn gather_updated(&self, model: M) -> (M, Result<(), MegatronError>) {
        let (Some((dp, bucket_elems)), Some(Some(dist))) = (&self.data_parallel, &self.distributed)
        else {
            return (model, Ok(()));
        };
        let me = dp.rank();
        let device = model.devices().into_iter().next().unwrap_or_default();
        let mut model = model;
        for owner in 0..dp.world_size() {
            let owned: Vec<(ParamId, usize)> = dist
                .owners
                .iter()
                .filter(|(_, _, r)| *r == owner)
                .map(|(id, n, _)| (*id, *n))
                .collect();
            // Every rank cuts the same buckets (the owner table is the same everywhere), so
            // the broadcasts pair up.
            for bucket in param_buckets(&owned, *bucket_elems) {
                let len: usize = bucket.iter().map(|(_, n)| n).sum();
                let t = if owner == me {
                    let ids: HashSet<ParamId> = bucket.iter().map(|(id, _)| *id).collect();
                    let mut read = ReadParams::<B::InnerBackend> {
                        ids: &ids,
                        values: Vec::new(),
                    };
                    model.visit(&mut read);
                    Tensor::cat(read.values, 0)
                } else {
                    Tensor::<B::InnerBackend, 1>::zeros([len], (&device, burn::tensor::DType::F32))
                };
                let got = match dp.broadcast(t, owner) {
                    Ok(t) => t,
                    Err(e) => return (model, Err(e.into())),
                };
                if owner == me {
                    continue;
                }
                let mut values = HashMap::new();
                let mut offset = 0;
                for &(id, n) in bucket {
                    values.insert(id, got.clone().narrow(0, offset, n));
                    offset += n;
                }
                model = model.map(&mut WriteParams::<B::InnerBackend> { values });
            }
        }
        (model, Ok(()))
    }

    /// Steps a mixture-of-experts model: see [`ExpertParallelGrads`].
    pub fn with_expert_parallel(mut self, experts: ExpertParallelGrads<B::InnerBackend>) -> Self {
        self.expert_parallel = (!experts.experts.is_empty()).then_some(experts);
        self
    }

    /// Sets the expert data-parallel group (see [`ExpertParallelGrads::expert_dp`]).
    pub fn with_expert_data_parallel(mut self, comm: GroupHandle<B::InnerBackend>) -> Self {
        if let Some(e) = self.expert_parallel.as_mut() {
            e.expert_dp = Some(comm);
        }
        self
    }

    /// Steps a tensor-parallel model: see [`TensorParallelGrads`].
    pub fn with_tensor_parallel(mut self, tp: TensorParallelGrads<B::InnerBackend>) -> Self {
        self.tensor_parallel = (tp.comm.world_size() > 1).then_some(tp);
        self
    }

    /// Completes the gradients (tensor-parallel partial sums, then the data-parallel sum) and
    /// returns their global norm.
    fn reduce_grads(&self, model: &M, grads: &mut GradientsParams) -> Result<f64, MegatronError> {
        let bucket = self
            .data_parallel
            .as_ref()
            .map_or(DEFAULT_GRAD_BUCKET_ELEMS, |(_, b)| *b);
        if let Some(tp) = &self.tensor_parallel {
            all_reduce_grads(model, grads, tp.comm.as_ref(), bucket, Some(&tp.partial))?;
        }
        if let Some(pp) = &self.pipeline_parallel {
            sum_tied_embedding::<B>(grads, pp)?;
        }
        let experts = self.expert_parallel.as_ref();
        if let Some((comm, bucket)) = &self.data_parallel {
            if comm.world_size() > 1 {
                all_reduce_grads(
                    model,
                    grads,
                    comm.as_ref(),
                    *bucket,
                    experts.map(|e| &e.dense),
                )?;
            }
        }
        if let Some(e) = experts {
            let dp = self.data_parallel.as_ref().map(|(c, _)| c);
            let group = match (&e.expert_dp, dp) {
                (Some(edp), _) => Some(edp),
                (None, Some(dp)) if dp.world_size() > 1 && e.distributed => {
                    return Err(MegatronError::Setting {
                        field: "expert_model_parallel_size".into(),
                        message: "the routed experts are distributed over ranks, so their \
                                  gradients need the expert data-parallel group \
                                  (with_expert_data_parallel)"
                            .into(),
                    })
                }
                (None, dp) => dp,
            };
            if let Some(group) = group.filter(|g| g.world_size() > 1) {
                let bucket = self
                    .data_parallel
                    .as_ref()
                    .map_or(DEFAULT_GRAD_BUCKET_ELEMS, |(_, b)| *b);
                all_reduce_grads(model, grads, group.as_ref(), bucket, Some(&e.experts))?;
            }
        }
        model_parallel_grad_norm(
            model,
            grads,
            self.tensor_parallel.as_ref(),
            self.pipeline_parallel.as_ref(),
            experts,
        )
    }

    /// Steps one pipeline stage: see [`PipelineParallelGrads`].
    pub fn with_pipeline_parallel(mut self, pp: PipelineParallelGrads<B::InnerBackend>) -> Self {
        self.pipeline_parallel = (pp.comm.world_size() > 1).then_some(pp);
        self
    }

    /// Sums `grads` over the tensor- and data-parallel groups (if any), clips them, then
    /// applies them at the scheduled learning rate. The model always comes back, also when the
    /// step fails (a communication error), so the caller keeps its state.
    pub fn step(
        &mut self,
        model: M,
        mut grads: GradientsParams,
    ) -> (M, Result<StepReport, MegatronError>) {
        let norm = match self.reduce_grads(&model, &mut grads) {
            Ok(norm) => norm,
            Err(e) => return (model, Err(e)),
        };
        let lr = self.schedule.lr(self.step);
        // Clipping is folded into the update (one pass over the gradients, not two).
        let grad_scale = clip_factor(norm, self.clip_grad);
        if norm.is_finite() {
            self.keep_owned_grads(&model, &mut grads);
        }
        if !norm.is_finite() {
            let report = StepReport {
                grad_norm: norm,
                lr,
                applied: false,
            };
            return (model, Ok(report));
        }
        let model = self.adamw.step(lr, grad_scale, model, grads);
        self.step += 1;
        let (model, gathered) = self.gather_updated(model);
        if let Err(e) = gathered {
            return (model, Err(e));
        }
        let report = StepReport {
            grad_norm: norm,
            lr,
            applied: true,
        };
        (model, Ok(report))
    }
}

/// A parameter as optimizer state is saved: its name, id in the live model, and whether it is a
/// matrix (else a vector). See [`crate::models::CausalLm::named_param_ids`].
pub type NamedParam = (String, ParamId, bool);

impl<B: AutodiffBackend<InnerBackend: FusedOps>, M: AutodiffModule<B>> ModelOptimizer<B, M> {
    /// The AdamW moments by parameter name (`{name}.exp_avg`, `{name}.exp_avg_sq`, as torch
    /// names them) and the counters (optimizer step, each moment's update count) as JSON.
    /// Parameters not yet stepped have no moments.
    pub fn state(&self, params: &[NamedParam]) -> (Vec<NamedTensor<B::InnerBackend>>, Value) {
        let moments: HashMap<&ParamId, &Moments<B::InnerBackend>> = self.adamw.moments().collect();
        let mut tensors = Vec::new();
        let mut times = serde_json::Map::new();
        for (name, id, _) in params {
            let Some(m) = moments.get(id) else {
                continue;
            };
            let named = |suffix: &str, values: &Tensor<B::InnerBackend, 1>| NamedTensor {
                name: format!("{name}.{suffix}"),
                shape: m.shape.clone(),
                values: values.clone(),
            };
            times.insert(name.clone(), json!(m.time));
            tensors.push(named("exp_avg", &m.exp_avg));
            tensors.push(named("exp_avg_sq", &m.exp_avg_sq));
        }
        // How many data-parallel ranks the moments are spread over (a distributed optimizer
        // saves each rank's own): a load on another count merges them from every rank.
        let sharded_over = self.sharded_over();
        (
            tensors,
            json!({ "step": self.step, "moment_updates": times, "sharded_over": sharded_over }),
        )
    }

    /// Restores what [`Self::state`] saved onto a model whose parameters are `params` (ids may
    /// differ from the saving run's; names and shapes must match).
    pub fn load_state(
        &mut self,
        params: &[NamedParam],
        tensors: Vec<NamedTensor<B::InnerBackend>>,
        extra: &Value,
    ) -> Result<(), MegatronError> {
        let bad = |message: String| MegatronError::Checkpoint { message };
        let step = extra
            .get("step")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("optimizer state has no `step`".into()))?;
        let times = extra
            .get("moment_updates")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("optimizer state has no `moment_updates`".into()))?;
        let mut by_name: HashMap<String, NamedTensor<B::InnerBackend>> =
            tensors.into_iter().map(|t| (t.name.clone(), t)).collect();
        let mut moments = HashMap::new();
        for (name, id, matrix) in params {
            let Some(time) = times.get(name).and_then(Value::as_u64) else {
                continue;
            };
            let mut take = |suffix: &str| {
                let key = format!("{name}.{suffix}");
                let t = by_name
                    .remove(&key)
                    .ok_or_else(|| bad(format!("optimizer state lacks `{key}`")))?;
                let rank = if *matrix { 2 } else { 1 };
                if t.shape.len() != rank || t.values.dims()[0] != t.shape.iter().product::<usize>()
                {
                    return Err(bad(format!(
                        "optimizer state `{}` has shape {:?}, which does not fit the model",
                        t.name, t.shape
                    )));
                }
                Ok(t)
            };
            let (m1, m2) = (take("exp_avg")?, take("exp_avg_sq")?);
            let state = Moments {
                time: time as usize,
                shape: m1.shape,
                exp_avg: m1.values,
                exp_avg_sq: m2.values,
            };
            moments.insert(*id, state);
        }
        if let Some(name) = times
            .keys()
            .find(|n| !params.iter().any(|(p, _, _)| p == *n))
        {
            return Err(bad(format!(
                "optimizer state has moments for `{name}`, which this model does not have"
            )));
        }
        self.adamw.set_moments(moments);
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(sizes: &[usize]) -> Vec<(ParamId, usize)> {
        sizes.iter().map(|&n| (ParamId::new(), n)).collect()
    }

    /// A non-finite gradient norm skips the step, for the actor's optimizer and the critic's
    /// alike (both are this one; each counts `applied == false` as `*/skipped_steps`): the
    /// weights stay as they were, no AdamW state is made, and the schedule does not advance.
    #[test]
    fn a_non_finite_gradient_skips_the_step_and_changes_nothing() {
        use burn::nn::{Linear, LinearConfig};
        type A = verl_core::backend::CpuAutodiff;
        let device = Default::default();
        let layer: Linear<A> = LinearConfig::new(3, 2).init(&device);
        let before = layer.weight.val().into_data();
        let x = Tensor::<A, 2>::ones([2, 3], &device);
        let loss = layer.forward(x).sum() * f32::NAN;
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        let mut optim =
            ModelOptimizer::<A, Linear<A>>::new(&OptimConfig::default(), 10).expect("adam");
        let (layer, report) = optim.step(layer, grads);
        let report = report.expect("no communication to fail");
        assert!(!report.applied);
        assert!(!report.grad_norm.is_finite());
        assert_eq!(layer.weight.val().into_data(), before);
        assert_eq!(optim.adamw_mut().moments().count(), 0);
        assert_eq!(optim.step, 0);
    }

    /// By hand: 40-element buckets over 10, 25, 30, 50, 5, 5.
    #[test]
    fn buckets_by_hand() {
        let p = ids(&[10, 25, 30, 50, 5, 5]);
        let sizes: Vec<Vec<usize>> = param_buckets(&p, 40)
            .iter()
            .map(|b| b.iter().map(|(_, n)| *n).collect())
            .collect();
        assert_eq!(sizes, vec![vec![10, 25], vec![30], vec![50], vec![5, 5]]);
        assert!(param_buckets(&[], 40).is_empty());
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// The buckets are the parameters in order, none over the size unless a lone
        /// parameter is, and none could take the next bucket's first parameter.
        #[test]
        fn buckets_cover_in_order_within_the_size(
            sizes in proptest::collection::vec(1usize..100, 0..40),
            bucket in 1usize..200,
        ) {
            let p = ids(&sizes);
            let buckets = param_buckets(&p, bucket);
            let flat: Vec<ParamId> = buckets.iter().flat_map(|b| b.iter().map(|(id, _)| *id)).collect();
            prop_assert_eq!(flat, p.iter().map(|(id, _)| *id).collect::<Vec<_>>());
            for (i, b) in buckets.iter().enumerate() {
                let total: usize = b.iter().map(|(_, n)| n).sum();
                prop_assert!(!b.is_empty());
                prop_assert!(total <= bucket || b.len() == 1);
                if let Some(next) = buckets.get(i + 1) {
                    prop_assert!(total + next[0].1 > bucket);
                }
            }
        }
    }
}

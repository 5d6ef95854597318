//! The tensor-parallel region operators: collectives in the forward pass whose backward pass is
//! the conjugate collective, as Megatron's `mappings` define them.
//!
//! | region                      | forward            | backward           |
//! |-----------------------------|--------------------|--------------------|
//! | [`Region::CopyTo`]          | identity           | all-reduce         |
//! | [`Region::ReduceFrom`]      | all-reduce         | identity           |
//! | [`Region::ScatterTo`]       | keep own chunk     | all-gather         |
//! | [`Region::GatherFrom`]      | all-gather         | keep own chunk     |
//! | [`Region::GatherFromSequence`] | all-gather      | reduce-scatter     |
//! | [`Region::ReduceScatterToSequence`] | reduce-scatter | all-gather     |
//!
//! burn's autodiff has no hook for user collectives, so [`ParallelBackend`] is implemented
//! once for each plain backend (forward only) and once for `Autodiff<B>`, where the region is a
//! custom autodiff operation whose backward step runs the conjugate collective on the gradient.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{unary, Backward, Ops, OpsKind};
use verl_core::memory::MemoryUsage;

use crate::ops::FusedOps;
use verl_core::traits::{Communicator, ReduceOp};

/// A collective on one tensor, seen from one rank of the group. Chunks along a dimension are
/// equal (tensor-parallel shards always are).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    Identity,
    /// Element-wise sum over the group.
    AllReduceSum,
    /// Element-wise maximum over the group (no gradient: used on detached values).
    AllReduceMax,
    /// This rank's chunk of the dimension.
    Split(usize),
    /// The ranks' tensors concatenated along the dimension.
    AllGather(usize),
    /// The group sum, split along the dimension; this rank keeps its chunk.
    ReduceScatter(usize),
}

/// A tensor-parallel region boundary: a forward collective and its conjugate for the gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    /// Entering a tensor-parallel region from a replicated tensor.
    CopyTo,
    /// Leaving it: the ranks' partial sums are added.
    ReduceFrom,
    /// A replicated tensor split along the dimension.
    ScatterTo(usize),
    /// A split tensor gathered for a replicated consumer.
    GatherFrom(usize),
    /// Sequence parallel: sequence shards gathered for a tensor-parallel consumer (whose
    /// gradients are partial, so they are reduce-scattered back).
    GatherFromSequence(usize),
    /// Sequence parallel: partial sums reduced and split along the sequence.
    ReduceScatterToSequence(usize),
}

impl Region {
    /// The collective this region runs in the forward pass.
    pub fn forward(self) -> Collective {
        match self {
            Region::CopyTo => Collective::Identity,
            Region::ReduceFrom => Collective::AllReduceSum,
            Region::ScatterTo(d) => Collective::Split(d),
            Region::GatherFrom(d) | Region::GatherFromSequence(d) => Collective::AllGather(d),
            Region::ReduceScatterToSequence(d) => Collective::ReduceScatter(d),
        }
    }

    /// The region whose forward collective is this one's backward.
    pub fn adjoint(self) -> Region {
        match self {
            Region::CopyTo => Region::ReduceFrom,
            Region::ReduceFrom => Region::CopyTo,
            Region::ScatterTo(d) => Region::GatherFrom(d),
            Region::GatherFrom(d) => Region::ScatterTo(d),
            Region::GatherFromSequence(d) => Region::ReduceScatterToSequence(d),
            Region::ReduceScatterToSequence(d) => Region::GatherFromSequence(d),
        }
    }
}

/// A shared communicator handle that autodiff state can hold (it must be `Debug`).
pub struct CommHandle<B: Backend>(pub Arc<dyn Communicator<B>>);

impl<B: Backend> Clone for CommHandle<B> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B: Backend> fmt::Debug for CommHandle<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CommHandle(rank {} of {})",
            self.0.rank(),
            self.0.world_size()
        )
    }
}

/// A backend on which tensor-parallel regions can run. Collectives run on [`Self::Base`]'s
/// tensors: the backend itself for plain backends, the inner backend under autodiff.
pub trait ParallelBackend: FusedOps {
    type Base: Backend;

    /// The collective on `x`'s values, as a constant for autodiff.
    fn collective<const D: usize>(
        x: Tensor<Self, D>,
        op: Collective,
        comm: &CommHandle<Self::Base>,
    ) -> Tensor<Self, D>;

    /// The region's forward collective, with the conjugate one in the backward pass.
    fn region<const D: usize>(
        x: Tensor<Self, D>,
        region: Region,
        comm: &CommHandle<Self::Base>,
    ) -> Tensor<Self, D>;

    /// Expert-parallel token exchange: `x`'s rows, in blocks of `send[j]` rows for rank `j`,
    /// go to their ranks; this rank gets `recv[i]` rows from each rank `i`, in rank order. The
    /// gradient goes back the same way with the counts swapped.
    fn all_to_all_rows(
        x: Tensor<Self, 2>,
        send: &[usize],
        recv: &[usize],
        comm: &CommHandle<Self::Base>,
    ) -> Tensor<Self, 2>;

    /// The output head fused with log-softmax and entropy (`crate::models::fused_log_probs`):
    /// `[tokens, 2]` log-probs of `labels` and entropies from hidden states `h` and this rank's
    /// head rows `w`, over the tp group `tp` (`None` at tp = 1). Under autodiff its backward
    /// recomputes each chunk's logits instead of keeping them.
    fn fused_head_log_probs(
        h: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        labels: Tensor<Self, 1, burn::tensor::Int>,
        spec: crate::models::fused_log_probs::FusedHead,
        tp: Option<&CommHandle<Self::Base>>,
    ) -> Tensor<Self, 2>;

    /// `x`'s rows picked by `index` (`x.select(0, index)`), whose gradient is gathered back
    /// rather than scattered: row `i` of `x` gets the output gradient's row `inverse[i]` times
    /// `keep[i]`. Exact when each row of `x` is picked at `inverse[i]` (or, `keep` 0, nowhere)
    /// and any other pick of it has a zero gradient: the layouts of a packed batch
    /// ([`crate::models::packing`]). burn-cuda's scatter (`select_assign`) runs one thread per
    /// column, serially over the rows, which made a packed update slower than a padded one.
    fn gather_rows(
        x: Tensor<Self, 2>,
        index: Tensor<Self, 1, burn::tensor::Int>,
        inverse: Tensor<Self, 1, burn::tensor::Int>,
        keep: Tensor<Self, 1>,
    ) -> Tensor<Self, 2>;

    /// The device's memory in use and reserved, as far as the backend can tell: burn-cuda's
    /// pool for this thread's stream; on the CPU backend, host memory counted by
    /// `verl_core::memory::CountingAllocator` (`None` when the program did not install it).
    fn memory_usage(device: &Self::Device) -> Option<MemoryUsage>;

    /// Hands the memory the backend keeps cached but no tensor uses back to the device
    /// (burn-cuda's free pool pages), as verl empties torch's cache between phases: a phase's
    /// activations come in sizes the next phase's never reuse, and a pool that only grows ends
    /// a 7B job out of memory. Nothing on the CPU backend.
    fn release_cached_memory(_device: &Self::Device) {}

    /// A flat tensor of `data` (stored as its own dtype) on `device`: how checkpoints reach the
    /// device, burn's `from_data` by default. The seam for a faster upload on a backend whose
    /// `from_data` copies slowly (burn-cuda's: docs/PERFORMANCE.md, 7B loading).
    fn upload_flat(data: burn::tensor::TensorData, device: &Self::Device) -> Tensor<Self, 1> {
        let dtype = data.dtype;
        Tensor::from_data(data, (device, dtype))
    }

    /// `elements` values of `dtype` whose bytes are `runs`, one after another, as a flat
    /// tensor on `device`, where the backend can take them without a host buffer in between
    /// (a checkpoint shard straight from its mapped file); `None`: gather them and use
    /// [`Self::upload_flat`] (the default).
    fn upload_runs(
        _runs: &[&[u8]],
        _elements: usize,
        _dtype: burn::tensor::DType,
        _device: &Self::Device,
    ) -> Option<Tensor<Self, 1>> {
        None
    }
}

/// Records the device's usage into the peak of the phase open on this thread (if one is; see
/// `verl_core::memory`). Called where usage is highest: after a forward pass, around the
/// optimizer step, after a reload or a generation.
///
/// With `RUST_LOG=verl_megatron::memory=debug`, each sample is also a debug event naming the
/// line of code it was taken at (through the callers marked `#[track_caller]`): where a
/// training step's memory goes, phase by phase.
#[track_caller]
pub fn sample_memory<B: ParallelBackend>(device: &B::Device) {
    let traced = tracing::enabled!(target: "verl_megatron::memory", tracing::Level::DEBUG);
    let measured = verl_core::memory::phase_open();
    if !(measured || traced) {
        return;
    }
    let Some(usage) = B::memory_usage(device) else {
        return;
    };
    if measured {
        verl_core::memory::record(usage);
    }
    if traced {
        let at = std::panic::Location::caller();
        let gib = verl_core::memory::gib;
        tracing::debug!(
            target: "verl_megatron::memory",
            at = %format_args!("{}:{}", at.file(), at.line()),
            allocated_gib = gib(usage.allocated),
            reserved_gib = gib(usage.reserved),
            device_used_gib = gib(usage.device_used),
        );
    }
}

/// `verl_core::profiling::device_span`, and while a profiler's memory timeline listens, a
/// sample of the device's usage after the work, for the profiler only (the phase peaks the
/// metrics report keep their own sample points, profiled or not).
pub fn device_span<B: ParallelBackend, T>(
    device: &B::Device,
    name: &'static str,
    work: impl FnOnce() -> T,
) -> T {
    let out = verl_core::profiling::device_span::<B, T>(device, name, work);
    if verl_core::memory::listening() {
        if let Some(usage) = B::memory_usage(device) {
            verl_core::memory::notify(usage);
        }
    }
    out
}

/// [`device_span`] over work that consumes `model` (the optimizer step): the device is looked
/// up only while a profiler needs it.
pub fn module_device_span<B: ParallelBackend, M: burn::module::Module<B>, T>(
    model: M,
    name: &'static str,
    work: impl FnOnce(M) -> T,
) -> T {
    if !verl_core::profiling::active() {
        return work(model);
    }
    match model.devices().into_iter().next() {
        Some(device) => device_span::<B, T>(&device, name, || work(model)),
        None => work(model),
    }
}

/// An autodiff backend whose inner backend runs tensor-parallel regions too: what the actor and
/// critic train on.
pub trait ParallelAutodiffBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend: ParallelBackend> + ParallelBackend
{
}

impl<B> ParallelAutodiffBackend for B where
    B: burn::tensor::backend::AutodiffBackend<InnerBackend: ParallelBackend> + ParallelBackend
{
}

/// Runs `op` on a plain backend. A failed collective means a peer rank died: there is nothing
/// a forward pass can do but stop this rank too, naming the cause.
pub fn run_collective<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    op: Collective,
    comm: &dyn Communicator<B>,
) -> Tensor<B, D> {
    let (n, rank) = (comm.world_size(), comm.rank());
    if n == 1 {
        return x;
    }
    let fail = |e| -> ! { panic!("tensor-parallel collective {op:?} failed on rank {rank}: {e}") };
    let dims = x.dims();
    match op {
        Collective::Identity => x,
        Collective::AllReduceSum | Collective::AllReduceMax => {
            let reduce = if op == Collective::AllReduceSum {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            comm.all_reduce(x.flatten(0, D - 1), reduce)
                .unwrap_or_else(|e| fail(e))
                .reshape(dims)
        }
        Collective::Split(d) => {
            assert!(
                dims[d].is_multiple_of(n),
                "split of dim {d} of {dims:?} over {n} ranks must divide"
            );
            let per = dims[d] / n;
            x.narrow(d, rank * per, per)
        }
        // Gathered and scattered along `d` in place: `[outer, (ranks,) inner]` with `outer`
        // the dimensions before `d` (no copy to move `d` first).
        Collective::AllGather(d) => {
            let outer = dims[..d].iter().product();
            let mut full = dims;
            full[d] *= n;
            comm.all_gather_interleaved(x.flatten(0, D - 1), outer)
                .unwrap_or_else(|e| fail(e))
                .reshape(full)
        }
        Collective::ReduceScatter(d) => {
            assert!(
                dims[d].is_multiple_of(n),
                "reduce-scatter of dim {d} of {dims:?} over {n} ranks must divide"
            );
            let outer = dims[..d].iter().product();
            let mut part = dims;
            part[d] /= n;
            comm.reduce_scatter_interleaved(x.flatten(0, D - 1), ReduceOp::Sum, outer)
                .unwrap_or_else(|e| fail(e))
                .reshape(part)
        }
    }
}

/// [`ParallelBackend::all_to_all_rows`] on a plain backend.
pub fn run_all_to_all_rows<B: Backend>(
    x: Tensor<B, 2>,
    send: &[usize],
    recv: &[usize],
    comm: &dyn Communicator<B>,
) -> Tensor<B, 2> {
    if comm.world_size() == 1 {
        return x;
    }
    let [_, h] = x.dims();
    let device = x.device();
    let mut chunks = Vec::with_capacity(send.len());
    let mut offset = 0;
    for &n in send {
        // burn cannot narrow to zero rows, and burn-cuda launches nothing on an empty tensor:
        // an empty block is an empty allocation.
        chunks.push(match n {
            0 => Tensor::empty([0], &device),
            _ => x.clone().narrow(0, offset, n).reshape([n * h]),
        });
        offset += n;
    }
    let lens: Vec<usize> = recv.iter().map(|n| n * h).collect();
    let got = comm.all_to_all(chunks, &lens).unwrap_or_else(|e| {
        panic!(
            "expert-parallel all-to-all failed on rank {}: {e}",
            comm.rank()
        )
    });
    let rows: usize = recv.iter().sum();
    let mut got: Vec<_> = got.into_iter().filter(|t| t.dims()[0] > 0).collect();
    match got.len() {
        0 => Tensor::empty([0, h], &device),
        1 => got.remove(0).reshape([rows, h]),
        _ => Tensor::cat(got, 0).reshape([rows, h]),
    }
}

/// [`ParallelBackend::release_cached_memory`] on the device `model` lives on.
pub fn release_module_memory<B: ParallelBackend, M: burn::module::Module<B>>(model: &M) {
    if let Some(device) = model.devices().first() {
        B::release_cached_memory(device);
    }
}

/// [`sample_memory`] on the device of `model`'s parameters (looked up only when a phase is
/// being measured).
#[track_caller]
pub fn sample_module_memory<B: ParallelBackend, M: burn::module::Module<B>>(model: &M) {
    if verl_core::memory::phase_open()
        || tracing::enabled!(target: "verl_megatron::memory", tracing::Level::DEBUG)
    {
        if let Some(device) = model.devices().first() {
            sample_memory::<B>(device);
        }
    }
}

/// `ParallelBackend` for a plain backend `$ty` whose memory usage `$memory` reports: the
/// collectives through its communicators (the CPU default here, burn-cuda in `crate::cuda`).
#[doc(hidden)]
#[macro_export]
macro_rules! plain_parallel_backend {
    ($ty:ty, $memory:expr $(, release: $release:expr)? $(, upload: $upload:expr, $runs:expr)?) => {
        impl $crate::parallel::ParallelBackend for $ty {
            type Base = $ty;

            fn memory_usage(device: &Self::Device) -> Option<verl_core::memory::MemoryUsage> {
                $memory(device)
            }

            $(
                fn release_cached_memory(device: &Self::Device) {
                    $release(device)
                }

            )?
            $(
                fn upload_flat(
                    data: burn::tensor::TensorData,
                    device: &Self::Device,
                ) -> burn::tensor::Tensor<Self, 1> {
                    $upload(data, device)
                }

                fn upload_runs(
                    runs: &[&[u8]],
                    elements: usize,
                    dtype: burn::tensor::DType,
                    device: &Self::Device,
                ) -> Option<burn::tensor::Tensor<Self, 1>> {
                    $runs(runs, elements, dtype, device)
                }

            )?

            fn collective<const D: usize>(
                x: burn::tensor::Tensor<Self, D>,
                op: $crate::parallel::Collective,
                comm: &$crate::parallel::CommHandle<Self>,
            ) -> burn::tensor::Tensor<Self, D> {
                $crate::parallel::run_collective(x, op, comm.0.as_ref())
            }

            fn region<const D: usize>(
                x: burn::tensor::Tensor<Self, D>,
                region: $crate::parallel::Region,
                comm: &$crate::parallel::CommHandle<Self>,
            ) -> burn::tensor::Tensor<Self, D> {
                $crate::parallel::run_collective(x, region.forward(), comm.0.as_ref())
            }

            fn all_to_all_rows(
                x: burn::tensor::Tensor<Self, 2>,
                send: &[usize],
                recv: &[usize],
                comm: &$crate::parallel::CommHandle<Self>,
            ) -> burn::tensor::Tensor<Self, 2> {
                $crate::parallel::run_all_to_all_rows(x, send, recv, comm.0.as_ref())
            }

            fn gather_rows(
                x: burn::tensor::Tensor<Self, 2>,
                index: burn::tensor::Tensor<Self, 1, burn::tensor::Int>,
                _inverse: burn::tensor::Tensor<Self, 1, burn::tensor::Int>,
                _keep: burn::tensor::Tensor<Self, 1>,
            ) -> burn::tensor::Tensor<Self, 2> {
                x.select(0, index)
            }

            fn fused_head_log_probs(
                h: burn::tensor::Tensor<Self, 2>,
                w: burn::tensor::Tensor<Self, 2>,
                labels: burn::tensor::Tensor<Self, 1, burn::tensor::Int>,
                spec: $crate::models::fused_log_probs::FusedHead,
                tp: Option<&$crate::parallel::CommHandle<Self>>,
            ) -> burn::tensor::Tensor<Self, 2> {
                $crate::models::fused_log_probs::fused_forward(
                    h,
                    w,
                    labels,
                    &spec,
                    tp.map(|c| c.0.as_ref()),
                )
                .0
            }
        }
    };
}

crate::plain_parallel_backend!(burn::backend::Flex, |_: &_| verl_core::memory::host_usage());

/// The backward step of a region: the adjoint region on the gradient.
#[derive(Debug)]
struct RegionBackward<const D: usize>;

impl<B: ParallelBackend, const D: usize> Backward<B, 1> for RegionBackward<D> {
    type State = (Region, CommHandle<B::Base>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (region, comm) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(grad));
            B::region(grad, region.adjoint(), &comm)
                .into_primitive()
                .tensor()
        });
    }
}

/// The backward step of an all-to-all: the reverse exchange of the gradient's rows.
#[derive(Debug)]
struct AllToAllBackward;

impl<B: ParallelBackend> Backward<B, 1> for AllToAllBackward {
    type State = (Vec<usize>, Vec<usize>, CommHandle<B::Base>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (send, recv, comm) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad));
            B::all_to_all_rows(grad, &recv, &send, &comm)
                .into_primitive()
                .tensor()
        });
    }
}

/// The backward step of [`ParallelBackend::gather_rows`]: the gradient's rows gathered back.
#[derive(Debug)]
struct GatherRowsBackward;

impl<B: ParallelBackend> Backward<B, 1> for GatherRowsBackward {
    type State = (Tensor<B, 1, burn::tensor::Int>, Tensor<B, 1>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (inverse, keep) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad));
            (grad.select(0, inverse) * keep.unsqueeze_dim(1))
                .into_primitive()
                .tensor()
        });
    }
}

/// The backward step of the fused head: both inputs' gradients from recomputed logits.
#[derive(Debug)]
struct FusedHeadBackward;

/// What the fused head's backward keeps: hidden states, head rows, labels, and each token's
/// log-sum-exp and entropy (no logits).
type FusedHeadState<B> = (
    Tensor<B, 2>,
    Tensor<B, 2>,
    Tensor<B, 1, burn::tensor::Int>,
    Tensor<B, 1>,
    Tensor<B, 1>,
    crate::models::fused_log_probs::FusedHead,
);

impl<B: ParallelBackend> Backward<B, 2> for FusedHeadBackward {
    type State = FusedHeadState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad =
            Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grads.consume::<B>(&ops.node)));
        let (h, w, labels, lse, entropy, spec) = ops.state;
        let (grad_h, grad_w) =
            crate::models::fused_log_probs::fused_backward(grad, h, w, labels, lse, entropy, &spec);
        let [parent_h, parent_w] = ops.parents;
        if let Some(node) = parent_h {
            grads.register::<B>(node.id, grad_h.into_primitive().tensor());
        }
        if let Some(node) = parent_w {
            grads.register::<B>(node.id, grad_w.into_primitive().tensor());
        }
    }
}

impl<B: ParallelBackend, C: CheckpointStrategy> ParallelBackend for Autodiff<B, C> {
    type Base = B::Base;

    fn fused_head_log_probs(
        h: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        labels: Tensor<Self, 1, burn::tensor::Int>,
        spec: crate::models::fused_log_probs::FusedHead,
        tp: Option<&CommHandle<Self::Base>>,
    ) -> Tensor<Self, 2> {
        let h = h.into_primitive().tensor();
        let w = w.into_primitive().tensor();
        let h_inner = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(h.primitive.clone()));
        let w_inner = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(w.primitive.clone()));
        let labels = labels.inner();
        // The forward on the inner backend (its collectives included), keeping the
        // log-sum-exp and entropy the backward needs.
        let (out, lse) = crate::models::fused_log_probs::fused_forward_on::<B>(
            h_inner.clone(),
            w_inner.clone(),
            labels.clone(),
            &spec,
            tp,
        );
        let entropy = out.clone().narrow(1, 1, 1).reshape([out.dims()[0]]);
        let prep = <FusedHeadBackward as Backward<B, 2>>::prepare::<C>(
            FusedHeadBackward,
            [h.node.clone(), w.node.clone()],
        );
        let out = out.into_primitive().tensor();
        let out = match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                prep.finish((h_inner, w_inner, labels, lse, entropy, spec), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn all_to_all_rows(
        x: Tensor<Self, 2>,
        send: &[usize],
        recv: &[usize],
        comm: &CommHandle<Self::Base>,
    ) -> Tensor<Self, 2> {
        let tracked = x.into_primitive().tensor();
        let inner = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(tracked.primitive));
        let out = B::all_to_all_rows(inner, send, recv, comm)
            .into_primitive()
            .tensor();
        let prep = <AllToAllBackward as Backward<B, 1>>::prepare::<C>(
            AllToAllBackward,
            [tracked.node.clone()],
        );
        let out = match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                prep.finish((send.to_vec(), recv.to_vec(), comm.clone()), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn gather_rows(
        x: Tensor<Self, 2>,
        index: Tensor<Self, 1, burn::tensor::Int>,
        inverse: Tensor<Self, 1, burn::tensor::Int>,
        keep: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        let tracked = x.into_primitive().tensor();
        let inner = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(tracked.primitive));
        let out = inner.select(0, index.inner()).into_primitive().tensor();
        let prep = <GatherRowsBackward as Backward<B, 1>>::prepare::<C>(
            GatherRowsBackward,
            [tracked.node.clone()],
        );
        let out = match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((inverse.inner(), keep.inner()), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn memory_usage(device: &Self::Device) -> Option<MemoryUsage> {
        B::memory_usage(device)
    }

    fn release_cached_memory(device: &Self::Device) {
        B::release_cached_memory(device)
    }

    fn upload_flat(data: burn::tensor::TensorData, device: &Self::Device) -> Tensor<Self, 1> {
        Tensor::from_inner(B::upload_flat(data, device))
    }

    fn upload_runs(
        runs: &[&[u8]],
        elements: usize,
        dtype: burn::tensor::DType,
        device: &Self::Device,
    ) -> Option<Tensor<Self, 1>> {
        B::upload_runs(runs, elements, dtype, device).map(Tensor::from_inner)
    }

    fn collective<const D: usize>(
        x: Tensor<Self, D>,
        op: Collective,
        comm: &CommHandle<Self::Base>,
    ) -> Tensor<Self, D> {
        Tensor::from_inner(B::collective(x.inner(), op, comm))
    }

    fn region<const D: usize>(
        x: Tensor<Self, D>,
        region: Region,
        comm: &CommHandle<Self::Base>,
    ) -> Tensor<Self, D> {
        let tracked = x.into_primitive().tensor();
        let inner = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(tracked.primitive));
        let out = B::region(inner, region, comm).into_primitive().tensor();
        let prep = <RegionBackward<D> as Backward<B, 1>>::prepare::<C>(
            RegionBackward::<D>,
            [tracked.node.clone()],
        );
        let out = match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((region, comm.clone()), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

/// A rank's tensor-parallel group as the layers hold it: rank, size, whether sequence
/// parallelism is on, and the communicator (type-erased so that a model and its inference copy
/// on the inner backend share one group).
#[derive(Clone)]
pub struct TpGroup {
    pub rank: usize,
    pub size: usize,
    /// Activations outside attention and MLP are split along the sequence.
    pub sequence_parallel: bool,
    comm: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TpGroup(rank {} of {}{})",
            self.rank,
            self.size,
            if self.sequence_parallel { ", sp" } else { "" }
        )
    }
}

impl Default for TpGroup {
    fn default() -> Self {
        Self::none()
    }
}

impl TpGroup {
    /// No tensor parallelism: every region is the identity.
    pub fn none() -> Self {
        Self {
            rank: 0,
            size: 1,
            sequence_parallel: false,
            comm: None,
        }
    }

    /// The group of `comm`, whose backend is the collectives' base backend of the models that
    /// will use it (the CPU backend for `Autodiff<CpuBackend>` and `CpuBackend` alike).
    pub fn new<B: Backend>(comm: Arc<dyn Communicator<B>>, sequence_parallel: bool) -> Self {
        let (rank, size) = (comm.rank(), comm.world_size());
        Self {
            rank,
            size,
            sequence_parallel: sequence_parallel && size > 1,
            comm: Some(Arc::new(CommHandle(comm))),
        }
    }

    /// Whether there is more than one rank.
    pub fn is_parallel(&self) -> bool {
        self.size > 1
    }

    /// The communicator, for the backend it was made for (`None` at tp = 1 or for another
    /// backend).
    pub fn comm<B: Backend>(&self) -> Option<Arc<dyn Communicator<B>>> {
        self.comm
            .as_ref()
            .and_then(|c| c.downcast_ref::<CommHandle<B>>())
            .map(|h| h.0.clone())
    }

    fn handle<B: Backend>(&self) -> &CommHandle<B> {
        self.comm
            .as_ref()
            .and_then(|c| c.downcast_ref::<CommHandle<B>>())
            .unwrap_or_else(|| {
                panic!(
                    "tensor-parallel group of size {} has no communicator for backend {}",
                    self.size,
                    std::any::type_name::<B>()
                )
            })
    }

    /// `region` on `x` (the identity when tp = 1).
    pub fn region<B: ParallelBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        region: Region,
    ) -> Tensor<B, D> {
        if self.size == 1 {
            return x;
        }
        B::region(x, region, self.handle::<B::Base>())
    }

    /// `op` on `x`'s values with no gradient (the identity when tp = 1).
    pub fn collective<B: ParallelBackend, const D: usize>(
        &self,
        x: Tensor<B, D>,
        op: Collective,
    ) -> Tensor<B, D> {
        if self.size == 1 {
            return x;
        }
        B::collective(x, op, self.handle::<B::Base>())
    }

    /// [`ParallelBackend::fused_head_log_probs`] over this group.
    pub fn fused_head_log_probs<B: ParallelBackend>(
        &self,
        h: Tensor<B, 2>,
        w: Tensor<B, 2>,
        labels: Tensor<B, 1, burn::tensor::Int>,
        spec: crate::models::fused_log_probs::FusedHead,
    ) -> Tensor<B, 2> {
        let comm = (self.size > 1).then(|| self.handle::<B::Base>());
        B::fused_head_log_probs(h, w, labels, spec, comm)
    }

    /// [`ParallelBackend::all_to_all_rows`] over this group (the identity for one rank).
    pub fn all_to_all_rows<B: ParallelBackend>(
        &self,
        x: Tensor<B, 2>,
        send: &[usize],
        recv: &[usize],
    ) -> Tensor<B, 2> {
        if self.size == 1 {
            return x;
        }
        B::all_to_all_rows(x, send, recv, self.handle::<B::Base>())
    }

    /// Into the tensor-parallel region from the residual stream (`[batch, seq, hidden]`): a
    /// copy, or with sequence parallelism an all-gather of the sequence shards.
    pub fn enter<B: ParallelBackend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.sequence_parallel {
            self.region(x, Region::GatherFromSequence(1))
        } else {
            self.region(x, Region::CopyTo)
        }
    }

    /// Out of the region into the residual stream: the partial sums reduced (and with sequence
    /// parallelism split along the sequence).
    pub fn exit<B: ParallelBackend, const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.sequence_parallel {
            self.region(x, Region::ReduceScatterToSequence(1))
        } else {
            self.region(x, Region::ReduceFrom)
        }
    }

    /// This rank's rows of a vocabulary of `vocab` ids padded to a multiple of the group size:
    /// `(start, real, per_rank)`, the rank holding ids `start..start + per_rank` of which the
    /// first `real` exist (the rest is padding).
    pub fn vocab_part(&self, vocab: usize) -> (usize, usize, usize) {
        let per = vocab.div_ceil(self.size);
        let start = per * self.rank;
        (start, vocab.saturating_sub(start).min(per), per)
    }

    /// This rank's part `[start, start + len)` of a dimension of `full` elements.
    pub fn part(&self, full: usize) -> (usize, usize) {
        let per = full / self.size;
        (per * self.rank, per)
    }
}

//! Collective communication between the ranks of one process group, over burn tensors.
//!
//! Parallel layers and optimizers are written once against [`Communicator`]; an in-process
//! implementation (threads on CPU) proves every layout in CI, and an NCCL one runs on GPUs
//! with the same calls. Every rank of the group must make the same collective calls in the
//! same order (as with NCCL); point-to-point `send` / `recv` pair up by (source, destination)
//! in order.
//!
//! The object-safe core works on flat `Tensor<B, 1>`s; [`CommunicatorExt`] adds the shaped
//! forms (all-gather and reduce-scatter along a dimension) on top.

use burn::prelude::*;

use crate::error::CommError;

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the group size.
    Avg,
    Max,
}

/// The chunk each rank gets from a reduce-scatter of `len` elements over `world` ranks, or the
/// error every implementation gives when the length does not divide.
///
/// ```
/// use verl_core::traits::reduce_scatter_chunk;
/// assert_eq!(reduce_scatter_chunk(12, 4).unwrap(), 3);
/// assert!(reduce_scatter_chunk(10, 4).unwrap_err().to_string().contains("must divide"));
/// ```
pub fn reduce_scatter_chunk(len: usize, world: usize) -> Result<usize, CommError> {
    if !len.is_multiple_of(world) {
        return Err(CommError::Shape(format!(
            "reduce-scatter of {len} elements over {world} ranks: the length must divide"
        )));
    }
    Ok(len / world)
}

/// The environment variable that bounds how long a rank waits for its peers in a collective.
pub const COMM_TIMEOUT_ENV: &str = "VERL_COMM_TIMEOUT_S";

/// How long a rank waits for its peers before reporting them gone: `VERL_COMM_TIMEOUT_S`
/// seconds (a whole number ≥ 1), 600 when unset. A value that is not such a number is an
/// error naming the variable, never a silent default.
///
/// ```
/// use verl_core::traits::comm_timeout_from;
/// assert_eq!(comm_timeout_from(None).unwrap().as_secs(), 600);
/// assert_eq!(comm_timeout_from(Some("30")).unwrap().as_secs(), 30);
/// for bad in ["0", "abc", "-5"] {
///     assert!(comm_timeout_from(Some(bad)).unwrap_err().to_string().contains("VERL_COMM_TIMEOUT_S"));
/// }
/// ```
pub fn comm_timeout_from(value: Option<&str>) -> Result<std::time::Duration, CommError> {
    let Some(text) = value else {
        return Ok(std::time::Duration::from_secs(600));
    };
    match text.trim().parse::<u64>() {
        Ok(s) if s >= 1 => Ok(std::time::Duration::from_secs(s)),
        _ => Err(CommError::Setting(format!(
            "{COMM_TIMEOUT_ENV}={text:?}: must be a whole number of seconds ≥ 1 (the default is 600)"
        ))),
    }
}

/// [`comm_timeout_from`] of the process environment.
pub fn comm_timeout() -> Result<std::time::Duration, CommError> {
    let value = std::env::var(COMM_TIMEOUT_ENV).ok();
    comm_timeout_from(value.as_deref())
}

/// One rank's handle on a process group.
pub trait Communicator<B: Backend>: Send + Sync {
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Every rank gets the element-wise reduction of all ranks' `tensor`s.
    fn all_reduce(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError>;

    /// Every rank gets every rank's `tensor`, in rank order; all ranks' lengths are equal.
    fn all_gather(&self, tensor: Tensor<B, 1>) -> Result<Vec<Tensor<B, 1>>, CommError>;

    /// The reduction of all ranks' `tensor`s, split in `world_size` equal chunks; this rank
    /// gets chunk `rank`. The length must divide evenly.
    fn reduce_scatter(&self, tensor: Tensor<B, 1>, op: ReduceOp)
        -> Result<Tensor<B, 1>, CommError>;

    /// Every rank gets `root`'s `tensor` (the others' inputs only give the shape).
    fn broadcast(&self, tensor: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError>;

    /// The all-gather along a middle dimension: each rank's `tensor` is `[outer, inner]`
    /// (flat), and every rank gets `[outer, world, inner]` (flat), rank `r`'s part at `r` of
    /// the middle. Sequence parallelism gathers `[batch, seq, hidden]` so, with `outer` the
    /// batch. `outer` must divide the length. The default gathers, then interleaves with a
    /// copy; a communicator that can write the layout directly overrides it.
    fn all_gather_interleaved(
        &self,
        tensor: Tensor<B, 1>,
        outer: usize,
    ) -> Result<Tensor<B, 1>, CommError> {
        let inner = interleaved_inner(tensor.dims()[0], outer, 1)?;
        let parts = self.all_gather(tensor)?;
        Ok(interleave(parts, outer, inner))
    }

    /// The reduce-scatter along a middle dimension: each rank's `tensor` is
    /// `[outer, world, inner]` (flat), and this rank gets `[outer, inner]` (flat), the
    /// reduction of part `rank` of the middle. `outer · world` must divide the length. The
    /// default moves the middle dimension first with a copy.
    fn reduce_scatter_interleaved(
        &self,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
        outer: usize,
    ) -> Result<Tensor<B, 1>, CommError> {
        let world = self.world_size();
        let inner = interleaved_inner(tensor.dims()[0], outer, world)?;
        self.reduce_scatter(middle_first(tensor, outer, world, inner), op)
    }

    /// Sends `tensor` to rank `dst`; pairs with `dst`'s `recv(self.rank())`.
    fn send(&self, tensor: Tensor<B, 1>, dst: usize) -> Result<(), CommError>;

    /// Receives the next tensor rank `src` sent to this rank: `len` elements (the receiver
    /// knows the size, as NCCL needs), placed on `device`.
    fn recv(&self, src: usize, len: usize, device: &B::Device) -> Result<Tensor<B, 1>, CommError>;

    /// `chunks[j]` goes to rank `j`; this rank gets what every rank addressed to it, in rank
    /// order, rank `i`'s chunk having `recv_lens[i]` elements (expert-parallel token exchange:
    /// exchange the counts first, then the tokens).
    fn all_to_all(
        &self,
        chunks: Vec<Tensor<B, 1>>,
        recv_lens: &[usize],
    ) -> Result<Vec<Tensor<B, 1>>, CommError>;

    /// Returns once every rank of the group has called it.
    fn barrier(&self) -> Result<(), CommError>;

    /// This rank failed (`reason` says where): every peer waiting in, or later entering, a
    /// collective of this group gets [`CommError::Aborted`] with `reason` at once, instead of
    /// waiting out the timeout. The default does nothing (a communicator whose ranks are
    /// processes is aborted by the driver ending them).
    fn abort(&self, reason: &str) {
        let _ = reason;
    }
}

/// `inner` of a flat `[outer, world, inner]` tensor of `len` elements, or the error naming why
/// the length does not split so.
pub fn interleaved_inner(len: usize, outer: usize, world: usize) -> Result<usize, CommError> {
    if outer == 0 || world == 0 || !len.is_multiple_of(outer * world) {
        return Err(CommError::Shape(format!(
            "{len} elements do not split as [outer {outer}, ranks {world}, inner]"
        )));
    }
    Ok(len / (outer * world))
}

/// The ranks' `[outer, inner]` parts laid out as `[outer, world, inner]`, flat: the default
/// of [`Communicator::all_gather_interleaved`], one copy.
pub fn interleave<B: Backend>(
    parts: Vec<Tensor<B, 1>>,
    outer: usize,
    inner: usize,
) -> Tensor<B, 1> {
    if outer == 1 {
        return Tensor::cat(parts, 0);
    }
    let world = parts.len();
    let parts = parts
        .into_iter()
        .map(|p| p.reshape([outer, 1, inner]))
        .collect();
    Tensor::cat(parts, 1).reshape([outer * world * inner])
}

/// A flat `[outer, world, inner]` tensor as `[world, outer, inner]`, flat (a copy unless
/// `outer` is 1): the layout whose equal chunks are the parts.
pub fn middle_first<B: Backend>(
    tensor: Tensor<B, 1>,
    outer: usize,
    world: usize,
    inner: usize,
) -> Tensor<B, 1> {
    if outer == 1 {
        return tensor;
    }
    tensor
        .reshape([outer, world, inner])
        .swap_dims(0, 1)
        .reshape([outer * world * inner])
}

/// Shaped collectives on top of the flat core, for any communicator.
pub trait CommunicatorExt<B: Backend>: Communicator<B> {
    /// [`Communicator::all_reduce`] of a tensor of any rank.
    fn all_reduce_tensor<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError> {
        let shape = tensor.shape();
        Ok(self
            .all_reduce(tensor.flatten(0, D - 1), op)?
            .reshape(shape))
    }

    /// The ranks' tensors concatenated along `dim`, in rank order.
    fn all_gather_dim<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        dim: usize,
    ) -> Result<Tensor<B, D>, CommError> {
        let shapes = self.all_gather_shapes(&tensor.dims(), &tensor.device())?;
        let parts = self.all_gather(tensor.flatten(0, D - 1))?;
        let parts = parts
            .into_iter()
            .zip(shapes)
            .map(|(p, s)| p.reshape(s))
            .collect();
        Ok(Tensor::cat(parts, dim))
    }

    /// The reduction of the ranks' tensors, split along `dim` in `world_size` equal parts;
    /// this rank gets part `rank`.
    fn reduce_scatter_dim<const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, CommError> {
        let n = self.world_size();
        let dims = tensor.dims();
        if !dims[dim].is_multiple_of(n) {
            return Err(CommError::Shape(format!(
                "reduce-scatter along dim {dim} of {dims:?} over {n} ranks: the size must divide"
            )));
        }
        // `[outer, ranks, inner]` with `outer` the dimensions before `dim`.
        let outer = dims[..dim].iter().product();
        let mut part_dims = dims;
        part_dims[dim] /= n;
        let part = self.reduce_scatter_interleaved(tensor.flatten(0, D - 1), op, outer)?;
        Ok(part.reshape(part_dims))
    }

    /// Every rank's `dims` (to gather tensors whose sizes differ between ranks, pad to the
    /// largest first), exchanged through a small tensor on `device`.
    fn all_gather_shapes<const D: usize>(
        &self,
        dims: &[usize; D],
        device: &B::Device,
    ) -> Result<Vec<[usize; D]>, CommError> {
        let local: Vec<f32> = dims.iter().map(|&d| d as f32).collect();
        let all = self.all_gather(Tensor::<B, 1>::from_floats(local.as_slice(), device))?;
        Ok(all
            .into_iter()
            .map(|t| {
                let v: Vec<f32> = t.into_data().convert::<f32>().to_vec().unwrap_or_default();
                std::array::from_fn(|i| v.get(i).copied().unwrap_or(0.0) as usize)
            })
            .collect())
    }
}

impl<B: Backend, C: Communicator<B> + ?Sized> CommunicatorExt<B> for C {}

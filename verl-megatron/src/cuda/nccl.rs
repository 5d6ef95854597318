//! [`NcclCommunicator`]: the [`Communicator`] trait over NCCL, on burn-cuda device buffers with
//! no host copies.
//!
//! One communicator per rank and process group. Ranks may be threads of one process (one GPU
//! each: [`NcclId::new`] once, shared with the members) or processes on one or more nodes
//! ([`NcclIdExchange::from_env`]: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, with each
//! group's id handed out over TCP by the job's rank 0).
//!
//! Within one node, all-reduce, all-gather, reduce-scatter and broadcast of f32 and bf16
//! tensors run as one kernel on burn's stream over peer-mapped staging buffers
//! ([`super::peer::PeerBuffers`], `kernels::collectives`): ordered with burn's work on the
//! device, no host wait. The group maps its buffers on its first such call, and all members
//! grow them together when a larger message comes (up to `VERL_PEER_BUFFER_MAX_MB`; one host
//! wait and an exchange, once per growth). Everything else
//! (send / receive, all-to-all, other dtypes, messages larger than a staging half, groups
//! across nodes, and every call when
//! `VERL_DEVICE_COLLECTIVES=decomposed`) follows [`super::buffer`]'s protocol: the buffers are
//! resolved, burn's stream is waited for, the collective runs on the communicator's own stream,
//! and that stream is waited for before the result goes back to burn (one host round trip,
//! counted in [`crate::host_reads`]). [`Communicator::barrier`] always blocks the host.
//!
//! libnccl is loaded at run time by cudarc, which looks for `libnccl.so` (not NCCL's soname
//! `libnccl.so.2`): on machines with only the latter, put a `libnccl.so` link to it on
//! `LD_LIBRARY_PATH` (README: "GPUs"). NVLink multicast must stay off (`NCCL_NVLS_ENABLE=0`);
//! [`NcclCommunicator::new`] sets it unless the environment already does.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use burn::backend::cuda::CudaDevice;
use burn::prelude::*;
use burn::tensor::DType;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};
use verl_core::backend::CudaBackend;
use verl_core::error::CommError;
use verl_core::traits::{
    interleave, interleaved_inner, middle_first, reduce_scatter_chunk, Communicator, ReduceOp,
};

use super::buffer::DeviceBuffer;
use super::kernels::collectives::{self, Collective};
use super::peer::PeerBuffers;
use std::collections::BTreeMap;

use verl_core::topology::{GroupKind, Topology};

use crate::parallel::{ProcessGroups, Rendezvous};

fn err(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Backend(format!("NCCL {what}: {e:?}"))
}

/// The 128-byte id every member of an NCCL group starts from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x?}..)", &self.0[..8])
    }
}

impl NcclId {
    /// A fresh id (one member creates it; the others receive it).
    pub fn new() -> Result<Self, CommError> {
        require_libnccl()?;
        let id = nccl::get_uniqueid().map_err(|e| err("get unique id", e))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

fn require_libnccl() -> Result<(), CommError> {
    // SAFETY: only tries to load the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CommError::Backend(
            "libnccl.so could not be loaded: install NCCL, or put a `libnccl.so` link to \
             libnccl.so.2 in a directory on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Hands NCCL ids from the members that create them to the others, across processes: the
/// job's [`Rendezvous`] (rank 0 serves on `MASTER_ADDR:MASTER_PORT`).
pub struct NcclIdExchange {
    pub rendezvous: Rendezvous,
}

impl NcclIdExchange {
    /// From the launcher's environment (torchrun's or Slurm's): see [`Rendezvous::from_env`].
    pub fn from_env() -> Result<Self, CommError> {
        Ok(Self {
            rendezvous: Rendezvous::from_env()?,
        })
    }

    /// The id of group `key` (e.g. `tp3`): the member that calls with `create` makes it and
    /// publishes it; the others wait for it.
    pub fn id(&self, key: &str, create: bool) -> Result<NcclId, CommError> {
        if create {
            let id = NcclId::new()?;
            self.rendezvous.publish(key, &id.0)?;
            return Ok(id);
        }
        let bytes = self.rendezvous.get(key)?;
        let id: [u8; 128] = bytes.try_into().map_err(|b: Vec<u8>| {
            CommError::Backend(format!(
                "the NCCL id of `{key}` has {} bytes, not 128",
                b.len()
            ))
        })?;
        Ok(NcclId(id))
    }
}

struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time, which the
// mutex around it ensures.
unsafe impl Send for RawComm {}

/// Whether a group's staging buffers are mapped: tried on the first call that could use them.
enum PeerState {
    NotTried,
    Mapped(PeerBuffers),
    Unavailable,
}

/// One rank's NCCL communicator for one process group, on one GPU.
pub struct NcclCommunicator {
    rank: usize,
    world: usize,
    device: CudaDevice,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: Mutex<RawComm>,
    peer: Mutex<PeerState>,
    /// Whether this communicator may use the device kernels (the process switch at creation;
    /// [`NcclCommunicator::set_device_collectives`] changes it for this group only).
    device_collectives: std::sync::atomic::AtomicBool,
}

/// `name` in MiB from the environment as bytes, `default` MiB when unset or not a number.
fn env_mib(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(default)
        << 20
}

/// Bytes of one staging half when a group maps its peer buffers: `VERL_PEER_BUFFER_MB` MiB, 64
/// by default (two halves per group that uses them).
fn staging_half_bytes() -> usize {
    env_mib("VERL_PEER_BUFFER_MB", 64)
}

/// The most bytes a staging half grows to for a larger message: `VERL_PEER_BUFFER_MAX_MB` MiB,
/// 256 by default. Messages above it go to NCCL.
fn staging_half_max_bytes() -> usize {
    env_mib("VERL_PEER_BUFFER_MAX_MB", 256).max(staging_half_bytes())
}

/// The half size to grow to for a message of `message` bytes from halves of `now` bytes:
/// at least double, so that messages of slowly rising sizes (dynamic batches) grow the buffers
/// a few times only; `None` past `max`.
fn grown_half_bytes(now: usize, message: usize, max: usize) -> Option<usize> {
    (message <= max).then(|| message.max(2 * now).min(max))
}

fn nccl_dtype(dtype: DType) -> Result<sys::ncclDataType_t, CommError> {
    use sys::ncclDataType_t::*;
    Ok(match dtype {
        DType::F32 | DType::Flex32 => ncclFloat32,
        DType::BF16 => ncclBfloat16,
        DType::F16 => ncclFloat16,
        DType::F64 => ncclFloat64,
        DType::I32 => ncclInt32,
        DType::I64 => ncclInt64,
        other => {
            return Err(CommError::Backend(format!(
                "NCCL has no collective for {other:?} tensors"
            )))
        }
    })
}

fn kernel_op(op: ReduceOp) -> u32 {
    match op {
        ReduceOp::Sum => collectives::OP_SUM,
        ReduceOp::Avg => collectives::OP_AVG,
        ReduceOp::Max => collectives::OP_MAX,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// What the collectives of this process's [`NcclCommunicator`]s have moved so far (all-reduce,
/// all-gather, reduce-scatter and broadcast): read it before and after a step, as
/// [`crate::host_reads`], to see how many collectives a step runs and how many bytes they carry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CollectiveTraffic {
    /// Collectives called.
    pub calls: usize,
    /// Of those, the ones that ran as the device kernels (the rest: NCCL behind a host wait).
    pub on_device: usize,
    /// Bytes of their messages (NCCL's convention: the all-gather's output, the others' input).
    pub bytes: usize,
}

static TRAFFIC: [std::sync::atomic::AtomicUsize; 3] =
    [const { std::sync::atomic::AtomicUsize::new(0) }; 3];

/// The collectives recorded so far in this process.
pub fn collective_traffic() -> CollectiveTraffic {
    let read = |i: usize| TRAFFIC[i].load(std::sync::atomic::Ordering::Relaxed);
    CollectiveTraffic {
        calls: read(0),
        on_device: read(1),
        bytes: read(2),
    }
}

fn note_traffic(on_device: bool, bytes: usize) {
    use std::sync::atomic::Ordering::Relaxed;
    TRAFFIC[0].fetch_add(1, Relaxed);
    TRAFFIC[1].fetch_add(on_device as usize, Relaxed);
    TRAFFIC[2].fetch_add(bytes, Relaxed);
}

/// Whether the device collectives hand their launches over with cubecl's syncing flush
/// (`VERL_COLLECTIVE_FLUSH=sync`) instead of [`super::issue_queued`].
fn flush_syncs() -> bool {
    static SYNC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("VERL_COLLECTIVE_FLUSH").is_ok_and(|v| v == "sync"))
}

impl NcclCommunicator {
    /// Joins group `id` as `rank` of `world` on `device`; blocks until every member has joined.
    pub fn new(
        id: &NcclId,
        rank: usize,
        world: usize,
        device: CudaDevice,
    ) -> Result<Self, CommError> {
        if rank >= world {
            return Err(CommError::BadRank { rank, world });
        }
        require_libnccl()?;
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // NVLink multicast can take a shared host's GPUs out of service; never use it.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        // The device's primary context, the one burn-cuda uses: its pointers are valid here.
        let ctx = CudaContext::new(device.index).map_err(|e| err("context", e))?;
        let stream = ctx.new_stream().map_err(|e| err("stream", e))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success; the id is a valid unique id.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), world as i32, id.raw(), rank as i32)
                .map_err(|e| err("init", e))?;
            comm.assume_init()
        };
        Ok(Self {
            rank,
            world,
            device,
            ctx,
            stream,
            comm: Mutex::new(RawComm(comm)),
            peer: Mutex::new(PeerState::NotTried),
            device_collectives: collectives::SWITCH.enabled().into(),
        })
    }

    /// Turns the device kernels on or off for this group (benchmarks compare them with NCCL
    /// behind a host wait). Every member must switch at the same point of its call sequence.
    pub fn set_device_collectives(&self, on: bool) {
        self.device_collectives
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// `collective` of `tensor` as the device kernel, when it applies; the tensor back
    /// otherwise. The answer depends only on what every member shares (the switch, the group,
    /// the dtype and the length), so all members take the same path.
    fn on_device(
        &self,
        collective: Collective,
        tensor: Tensor<CudaBackend, 1>,
    ) -> Result<Result<Tensor<CudaBackend, 1>, Tensor<CudaBackend, 1>>, CommError> {
        let dtype = tensor.dtype();
        let n = tensor.dims()[0];
        let message = match collective {
            Collective::AllGather { .. } => n * self.world,
            _ => n,
        } * dtype.size();
        let result = self.try_on_device(collective, tensor, n, dtype);
        if let Ok(ran) = &result {
            note_traffic(ran.is_ok(), message);
        }
        result
    }

    fn try_on_device(
        &self,
        collective: Collective,
        tensor: Tensor<CudaBackend, 1>,
        n: usize,
        dtype: DType,
    ) -> Result<Result<Tensor<CudaBackend, 1>, Tensor<CudaBackend, 1>>, CommError> {
        if !self
            .device_collectives
            .load(std::sync::atomic::Ordering::Relaxed)
            || !collectives::takes(dtype)
            || n == 0
            || n > u32::MAX as usize / self.world
        {
            return Ok(Err(tensor));
        }
        let mut state = self.peer.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*state, PeerState::NotTried) {
            let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
            DeviceBuffer::sync_burn(&self.device).map_err(CommError::Backend)?;
            crate::host_reads::note(1);
            let opened = PeerBuffers::open(
                comm.0,
                &self.stream,
                &self.ctx,
                (self.rank, self.world),
                staging_half_bytes(),
            )?;
            *state = opened.map_or(PeerState::Unavailable, PeerState::Mapped);
        }
        let PeerState::Mapped(buffers) = &mut *state else {
            return Ok(Err(tensor));
        };
        if n > buffers.capacity(dtype.size()) {
            // Every member sees the same length, so all grow here together, or all hand the
            // message to NCCL (past the largest half: one host wait is small beside it).
            let Some(half) = grown_half_bytes(
                buffers.half_bytes(),
                n * dtype.size(),
                staging_half_max_bytes(),
            ) else {
                return Ok(Err(tensor));
            };
            let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
            let old_half = buffers.half_bytes();
            // Nothing may read the old buffers when they go: this rank's work first, then
            // every member's (the exchange is a barrier).
            DeviceBuffer::sync_burn(&self.device).map_err(CommError::Backend)?;
            crate::host_reads::note(1);
            PeerBuffers::quiesce(comm.0, &self.stream, &self.ctx, self.world)?;
            *state = PeerState::NotTried;
            let open = |bytes| {
                PeerBuffers::open(
                    comm.0,
                    &self.stream,
                    &self.ctx,
                    (self.rank, self.world),
                    bytes,
                )
            };
            // A member that cannot allocate the larger halves keeps the group on the old size.
            let grown = match open(half)? {
                Some(grown) => Some(grown),
                None => open(old_half)?,
            };
            tracing::debug!(
                rank = self.rank,
                from_mib = old_half >> 20,
                to_mib = grown.as_ref().map(|b| b.half_bytes() >> 20),
                "staging halves grown for a larger message"
            );
            *state = grown.map_or(PeerState::Unavailable, PeerState::Mapped);
            drop(comm);
            let PeerState::Mapped(grown) = &mut *state else {
                return Ok(Err(tensor));
            };
            if n > grown.capacity(dtype.size()) {
                return Ok(Err(tensor));
            }
        }
        let PeerState::Mapped(buffers) = &mut *state else {
            return Ok(Err(tensor));
        };
        let input = burn_cubecl::kernel::into_contiguous(tensor.into_primitive().tensor());
        let output = collectives::output_for(collective, &input, n, self.world);
        collectives::launch(collective, &input, &output, n, &buffers.next_call());
        // The kernels wait on the device for the peers' kernels: hand them to the GPU now, so
        // that no peer waits on a launch still queued on this host. `VERL_COLLECTIVE_FLUSH=
        // sync` flushes as before, syncing to the previous flush (to compare).
        if flush_syncs() {
            input.client.flush().map_err(|e| err("flush", e))?;
        } else {
            super::issue_queued(&input.device);
        }
        Ok(Ok(Tensor::from_primitive(
            burn::tensor::TensorPrimitive::Float(output),
        )))
    }

    /// The GPU this rank's buffers live on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    fn raw_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// Runs the NCCL call(s) `f` on the raw communicator after burn's work is done, then waits
    /// for them; a failure is reported as `what`'s.
    fn run<T>(
        &self,
        what: &str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<T, nccl::NcclError>,
    ) -> Result<(), CommError> {
        DeviceBuffer::sync_burn(&self.device).map_err(CommError::Backend)?;
        crate::host_reads::note(1);
        let comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        self.ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        f(comm.0, self.raw_stream()).map_err(|e| err(what, e))?;
        self.stream.synchronize().map_err(|e| err(what, e))
    }

    /// `rank` as NCCL's peer index, refused when it is not in the group.
    fn peer(&self, rank: usize) -> Result<i32, CommError> {
        if rank < self.world {
            Ok(rank as i32)
        } else {
            Err(CommError::BadRank {
                rank,
                world: self.world,
            })
        }
    }

    /// The tensor's buffer on this rank's GPU. A tensor made on another GPU is copied over
    /// through the host (burn-cuda's own device-to-device copy brings its own NCCL into play);
    /// callers keep collective inputs on the rank's GPU, so this is only a safety net.
    fn buffer(&self, t: Tensor<CudaBackend, 1>) -> Result<DeviceBuffer, CommError> {
        let t = if t.device() == self.device {
            t
        } else {
            tracing::warn!(from = ?t.device(), to = ?self.device, "collective input on another GPU");
            Tensor::from_data(t.into_data(), &self.device)
        };
        DeviceBuffer::of(t).map_err(CommError::Backend)
    }

    fn empty(&self, len: usize, dtype: DType) -> Result<DeviceBuffer, CommError> {
        DeviceBuffer::empty(len, dtype, &self.device).map_err(CommError::Backend)
    }

    fn nccl_all_reduce(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        let send = self.buffer(tensor)?;
        let recv = self.empty(send.len(), send.dtype())?;
        let dtype = nccl_dtype(send.dtype())?;
        // SAFETY: `send` and `recv` are live device buffers of `send.len()` elements of `dtype` on
        // this communicator's GPU, held until `run` has waited for the stream; `comm` and `stream`
        // are this communicator's own.
        self.run("all-reduce", |comm, stream| unsafe {
            nccl::all_reduce(
                ptr(&send),
                mut_ptr(&recv),
                send.len(),
                dtype,
                nccl_op(op),
                comm,
                stream,
            )
        })?;
        Ok(recv.into_tensor())
    }

    fn nccl_all_gather(
        &self,
        tensor: Tensor<CudaBackend, 1>,
    ) -> Result<Vec<Tensor<CudaBackend, 1>>, CommError> {
        let send = self.buffer(tensor)?;
        let n = send.len();
        let recv = self.empty(n * self.world, send.dtype())?;
        let dtype = nccl_dtype(send.dtype())?;
        // SAFETY: `send` holds `n` elements and `recv` `n · world` of `dtype`, both live on this
        // communicator's GPU until `run` has waited for the stream.
        self.run("all-gather", |comm, stream| unsafe {
            nccl::all_gather(ptr(&send), mut_ptr(&recv), n, dtype, comm, stream)
        })?;
        let all = recv.into_tensor();
        Ok((0..self.world)
            .map(|r| all.clone().narrow(0, r * n, n))
            .collect())
    }

    fn nccl_reduce_scatter(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        let send = self.buffer(tensor)?;
        let part = reduce_scatter_chunk(send.len(), self.world)?;
        let recv = self.empty(part, send.dtype())?;
        let dtype = nccl_dtype(send.dtype())?;
        // SAFETY: `send` holds `part · world` elements and `recv` `part` of `dtype` (the chunk
        // checked above), both live on this communicator's GPU until `run` has waited.
        self.run("reduce-scatter", |comm, stream| unsafe {
            nccl::reduce_scatter(
                ptr(&send),
                mut_ptr(&recv),
                part,
                dtype,
                nccl_op(op),
                comm,
                stream,
            )
        })?;
        Ok(recv.into_tensor())
    }

    fn nccl_broadcast(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        root: usize,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        let root_peer = self.peer(root)?;
        let send = self.buffer(tensor)?;
        let recv = self.empty(send.len(), send.dtype())?;
        let dtype = nccl_dtype(send.dtype())?;
        // SAFETY: `send` and `recv` hold `send.len()` elements of `dtype` on this communicator's
        // GPU until `run` has waited; `root_peer` is a rank of the group (checked by `peer`).
        self.run("broadcast", |comm, stream| unsafe {
            nccl::broadcast(
                ptr(&send),
                mut_ptr(&recv),
                send.len(),
                dtype,
                root_peer,
                comm,
                stream,
            )
        })?;
        Ok(recv.into_tensor())
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // A collective handed over by `issue_queued` may still wait in cubecl's queue: drain
        // burn's stream first, so the staging buffers (freed with this communicator) outlive
        // every kernel that reads them.
        if matches!(
            *self.peer.get_mut().unwrap_or_else(|p| p.into_inner()),
            PeerState::Mapped(_)
        ) {
            let _ = DeviceBuffer::sync_burn(&self.device);
        }
        let comm = self.comm.get_mut().unwrap_or_else(|p| p.into_inner());
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is not used after this.
        unsafe {
            let _ = nccl::comm_destroy(comm.0);
        }
    }
}

fn ptr(b: &DeviceBuffer) -> *const c_void {
    b.ptr() as *const c_void
}

fn mut_ptr(b: &DeviceBuffer) -> *mut c_void {
    b.ptr() as *mut c_void
}

impl Communicator<CudaBackend> for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        if self.world == 1 {
            return Ok(tensor);
        }
        match self.on_device(Collective::AllReduce(kernel_op(op)), tensor)? {
            Ok(out) => Ok(out),
            Err(tensor) => self.nccl_all_reduce(tensor, op),
        }
    }

    fn all_gather(
        &self,
        tensor: Tensor<CudaBackend, 1>,
    ) -> Result<Vec<Tensor<CudaBackend, 1>>, CommError> {
        if self.world == 1 {
            return Ok(vec![tensor]);
        }
        let n = tensor.dims()[0];
        match self.on_device(Collective::AllGather { outer: 1 }, tensor)? {
            Ok(all) => Ok((0..self.world)
                .map(|r| all.clone().narrow(0, r * n, n))
                .collect()),
            Err(tensor) => self.nccl_all_gather(tensor),
        }
    }

    fn reduce_scatter(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        reduce_scatter_chunk(tensor.dims()[0], self.world)?;
        if self.world == 1 {
            return Ok(tensor);
        }
        let collective = Collective::ReduceScatter {
            op: kernel_op(op),
            outer: 1,
        };
        match self.on_device(collective, tensor)? {
            Ok(out) => Ok(out),
            Err(tensor) => self.nccl_reduce_scatter(tensor, op),
        }
    }

    /// The device kernel writes the interleaved layout itself (no copy after the gather).
    fn all_gather_interleaved(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        outer: usize,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        let inner = interleaved_inner(tensor.dims()[0], outer, 1)?;
        if self.world == 1 {
            return Ok(tensor);
        }
        match u32::try_from(outer) {
            Ok(outer) => match self.on_device(Collective::AllGather { outer }, tensor)? {
                Ok(all) => Ok(all),
                Err(tensor) => Ok(interleave(
                    self.nccl_all_gather(tensor)?,
                    outer as usize,
                    inner,
                )),
            },
            Err(_) => Ok(interleave(self.all_gather(tensor)?, outer, inner)),
        }
    }

    /// The device kernel reads the rank's place of the middle in place (no copy before).
    fn reduce_scatter_interleaved(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        op: ReduceOp,
        outer: usize,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        let inner = interleaved_inner(tensor.dims()[0], outer, self.world)?;
        if self.world == 1 {
            return Ok(tensor);
        }
        let fallback =
            |tensor| self.nccl_reduce_scatter(middle_first(tensor, outer, self.world, inner), op);
        match u32::try_from(outer) {
            Ok(outer_u32) => {
                let collective = Collective::ReduceScatter {
                    op: kernel_op(op),
                    outer: outer_u32,
                };
                match self.on_device(collective, tensor)? {
                    Ok(out) => Ok(out),
                    Err(tensor) => fallback(tensor),
                }
            }
            Err(_) => fallback(tensor),
        }
    }

    fn broadcast(
        &self,
        tensor: Tensor<CudaBackend, 1>,
        root: usize,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        self.peer(root)?;
        if self.world == 1 {
            return Ok(tensor);
        }
        match self.on_device(Collective::Broadcast { root: root as u32 }, tensor)? {
            Ok(out) => Ok(out),
            Err(tensor) => self.nccl_broadcast(tensor, root),
        }
    }

    /// Returns once `dst` has received (NCCL's send completes with its matching receive).
    fn send(&self, tensor: Tensor<CudaBackend, 1>, dst: usize) -> Result<(), CommError> {
        let dst_peer = self.peer(dst)?;
        let send = self.buffer(tensor)?;
        let dtype = nccl_dtype(send.dtype())?;
        // SAFETY: `send` holds `send.len()` elements of `dtype` until `run` has waited (NCCL's
        // send completes with its receive); `dst_peer` is a rank of the group.
        self.run("send", |comm, stream| unsafe {
            nccl::send(ptr(&send), send.len(), dtype, dst_peer, comm, stream)
        })
    }

    fn recv(
        &self,
        src: usize,
        len: usize,
        device: &CudaDevice,
    ) -> Result<Tensor<CudaBackend, 1>, CommError> {
        let src_peer = self.peer(src)?;
        if device != &self.device {
            return Err(CommError::Backend(format!(
                "recv onto {device:?}, but this communicator's GPU is {:?}",
                self.device
            )));
        }
        let recv = self.empty(len, DType::F32)?;
        let dtype = nccl_dtype(DType::F32)?;
        // SAFETY: `recv` holds `len` f32 elements on this communicator's GPU (checked above) until
        // `run` has waited; `src_peer` is a rank of the group.
        self.run("recv", |comm, stream| unsafe {
            nccl::recv(mut_ptr(&recv), len, dtype, src_peer, comm, stream)
        })?;
        Ok(recv.into_tensor())
    }

    fn all_to_all(
        &self,
        chunks: Vec<Tensor<CudaBackend, 1>>,
        recv_lens: &[usize],
    ) -> Result<Vec<Tensor<CudaBackend, 1>>, CommError> {
        if chunks.len() != self.world || recv_lens.len() != self.world {
            return Err(CommError::Shape(format!(
                "all-to-all over {} ranks needs one chunk and one receive length per rank \
                 (got {} and {})",
                self.world,
                chunks.len(),
                recv_lens.len()
            )));
        }
        let sends = chunks
            .into_iter()
            .map(|c| self.buffer(c))
            .collect::<Result<Vec<_>, _>>()?;
        let dtype = sends.first().map_or(DType::F32, |b| b.dtype());
        let recvs = recv_lens
            .iter()
            .map(|&n| self.empty(n, dtype))
            .collect::<Result<Vec<_>, _>>()?;
        let nd = nccl_dtype(dtype)?;
        // SAFETY: every send and receive buffer holds the elements it is given of `nd`, and all
        // stay alive until `run` has waited for the stream (`sends` is dropped after it); the
        // group calls bracket the pairs so NCCL schedules them together.
        self.run("all-to-all", |comm, stream| unsafe {
            nccl::group_start()?;
            for (peer, (s, r)) in sends.iter().zip(&recvs).enumerate() {
                if !s.is_empty() {
                    nccl::send(ptr(s), s.len(), nd, peer as i32, comm, stream)?;
                }
                if !r.is_empty() {
                    nccl::recv(mut_ptr(r), r.len(), nd, peer as i32, comm, stream)?;
                }
            }
            nccl::group_end()
        })?;
        drop(sends);
        Ok(recvs.into_iter().map(DeviceBuffer::into_tensor).collect())
    }

    /// Blocks the host until every member has reached it (NCCL, waited for).
    fn barrier(&self) -> Result<(), CommError> {
        let one = Tensor::<CudaBackend, 1>::ones([1], &self.device);
        self.nccl_all_reduce(one, ReduceOp::Sum).map(|_| ())
    }
}

impl ProcessGroups<CudaBackend> {
    /// This rank's groups of `topo` as NCCL communicators on `device`, when the ranks are
    /// processes with one GPU each: every group's id is made by its first member and handed to
    /// the others through `rendezvous`, under names that start with `prefix`. Every rank of the
    /// job calls it with the same `topo` and `prefix` (NCCL's initialisation is collective).
    pub fn nccl(
        topo: &Topology,
        rank: usize,
        rendezvous: Rendezvous,
        device: burn::backend::cuda::CudaDevice,
        prefix: &str,
    ) -> Result<Self, CommError> {
        let exchange = NcclIdExchange { rendezvous };
        let world = topo.world_size();
        let join = |key: String, position: usize, size: usize| {
            let id = exchange.id(&key, position == 0)?;
            NcclCommunicator::new(&id, position, size, device.clone())
        };
        let world_comm = join(format!("{prefix}.world"), rank, world)?;
        let mut groups: BTreeMap<GroupKind, Arc<dyn Communicator<_>>> = BTreeMap::new();
        for kind in GroupKind::ALL {
            let (index, position, size) = crate::parallel::membership(topo, kind, rank)?;
            let comm = join(format!("{prefix}.{kind:?}{index}"), position, size)?;
            groups.insert(kind, Arc::new(comm));
        }
        Ok(ProcessGroups::from_parts(Arc::new(world_comm), groups))
    }
}

#[cfg(test)]
mod tests {
    use super::grown_half_bytes;

    #[test]
    fn staging_grows_at_least_twofold_up_to_the_cap() {
        const MIB: usize = 1 << 20;
        // A 100 MB message from 64 MiB halves: 128 MiB (twice), not just the message.
        assert_eq!(
            grown_half_bytes(64 * MIB, 100_000_000, 256 * MIB),
            Some(128 * MIB)
        );
        // A message past twice the halves: the message itself.
        assert_eq!(
            grown_half_bytes(64 * MIB, 200 * MIB, 256 * MIB),
            Some(200 * MIB)
        );
        // Doubling stops at the cap; a message over the cap goes to NCCL.
        assert_eq!(
            grown_half_bytes(200 * MIB, 210 * MIB, 256 * MIB),
            Some(256 * MIB)
        );
        assert_eq!(grown_half_bytes(64 * MIB, 257 * MIB, 256 * MIB), None);
    }
}

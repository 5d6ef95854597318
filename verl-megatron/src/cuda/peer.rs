//! Staging buffers every rank of a group on one node can read: each rank allocates one buffer
//! (a flag array and two staging halves) with `cuMemAlloc`, and the ranks map each other's
//! through CUDA IPC (rank processes) or peer access (rank threads of one process). The
//! collective kernels (`kernels::collectives`) run over them on burn's stream.
//!
//! Setting the mapping up is collective: the members swap a 128-byte record each (IPC handle,
//! process, GPU, address, node) over the group's NCCL communicator, open the others', and swap
//! whether that worked; if any member failed (another node, no peer access), every member
//! drops the mapping and the group stays on NCCL.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use verl_core::error::CommError;

use super::kernels::collectives::{PeerCall, FLAG_BYTES, MAX_RANKS};

fn err(what: &str, e: impl std::fmt::Debug) -> CommError {
    CommError::Backend(format!("peer buffers: {what}: {e:?}"))
}

/// This member's staging allocation of `bytes` (zeroed: the flags start below every epoch) and
/// its record for the exchange: IPC handle, process nonce, GPU, address, node, size.
fn allocate(ctx: &Arc<CudaContext>, bytes: usize) -> Result<(u64, [u8; RECORD]), CommError> {
    // SAFETY: a fresh allocation of `bytes`, zeroed before use.
    let own = unsafe { result::malloc_sync(bytes).map_err(|e| err("alloc", e))? };
    let filled = (|| {
        // SAFETY: `own` holds `bytes` bytes; `handle` is written on success.
        let handle = unsafe {
            result::memset_d8_sync(own, 0, bytes).map_err(|e| err("zero", e))?;
            let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
            sys::cuIpcGetMemHandle(handle.as_mut_ptr(), own)
                .result()
                .map_err(|e| err("IPC handle", e))?;
            handle.assume_init()
        };
        let mut record = [0u8; RECORD];
        let raw: [u8; 64] = handle.reserved.map(|c| c as u8);
        record[..64].copy_from_slice(&raw);
        for (at, v) in [
            (64, process_nonce()),
            (72, ctx.ordinal() as u64),
            (80, own),
            (88, node_id()),
            (96, bytes as u64),
        ] {
            record[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        Ok(record)
    })();
    match filled {
        Ok(record) => Ok((own, record)),
        Err(e) => {
            free(own);
            Err(e)
        }
    }
}

/// Frees a staging allocation (0: none).
fn free(own: u64) {
    if own != 0 {
        // SAFETY: `own` came from `malloc_sync` and nothing uses it any more.
        unsafe {
            let _ = result::free_sync(own);
        }
    }
}

/// A number that tells this process from every other on the node (a process id can repeat
/// across containers that share a kernel): the process id and start time, hashed with a
/// random key.
fn process_nonce() -> u64 {
    use std::hash::BuildHasher;
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        std::process::id().hash(&mut h);
        std::time::SystemTime::now().hash(&mut h);
        h.finish()
    })
}

/// One member's record in the set-up exchange.
const RECORD: usize = 128;

/// The flag array comes first, padded so the halves start 256-byte aligned.
const FLAG_REGION: usize = FLAG_BYTES.next_multiple_of(256);

/// The staging buffers of one group, mapped on this rank.
pub struct PeerBuffers {
    rank: usize,
    ctx: Arc<CudaContext>,
    /// This rank's own allocation.
    own: u64,
    /// Every rank's allocation base as mapped here (own included), by rank.
    bases: Vec<u64>,
    /// The bases opened through IPC (closed on drop).
    opened: Vec<u64>,
    /// Bytes of one staging half.
    half_bytes: usize,
    /// Calls made so far (the kernel's epoch is the next one).
    calls: u32,
    timeout_ns: u64,
}

// SAFETY: the addresses are plain numbers; the memory they name is only touched by kernels and
// by this struct's drop, with the context bound.
unsafe impl Send for PeerBuffers {}

/// A number naming this machine's boot, so ranks on other nodes are told apart.
fn node_id() -> u64 {
    let mut h = DefaultHasher::new();
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .hash(&mut h);
    std::env::var("HOSTNAME").unwrap_or_default().hash(&mut h);
    h.finish()
}

/// Swaps one `RECORD`-byte record with every member of `comm` (NCCL all-gather on `stream`,
/// waited for): a set-up step, so the host wait does not matter.
fn exchange(
    comm: nccl_sys::ncclComm_t,
    stream: &Arc<CudaStream>,
    world: usize,
    mine: &[u8; RECORD],
) -> Result<Vec<[u8; RECORD]>, CommError> {
    let raw_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
    // SAFETY: both buffers are allocated here with the sizes the calls use, the copies and the
    // all-gather complete before the buffers are freed (synchronous copies, stream waited for).
    unsafe {
        let send = result::malloc_sync(RECORD).map_err(|e| err("alloc", e))?;
        let recv = result::malloc_sync(RECORD * world).map_err(|e| err("alloc", e))?;
        let out = (|| {
            result::memcpy_htod_sync(send, &mine[..]).map_err(|e| err("copy", e))?;
            nccl::all_gather(
                send as *const _,
                recv as *mut _,
                RECORD,
                nccl_sys::ncclDataType_t::ncclUint8,
                comm,
                raw_stream,
            )
            .map_err(|e| err("all-gather", e))?;
            stream.synchronize().map_err(|e| err("all-gather", e))?;
            let mut all = vec![0u8; RECORD * world];
            result::memcpy_dtoh_sync(&mut all[..], recv).map_err(|e| err("copy", e))?;
            Ok(all
                .chunks(RECORD)
                .map(|c| c.try_into().expect("RECORD-byte chunks"))
                .collect())
        })();
        let _ = result::free_sync(send);
        let _ = result::free_sync(recv);
        out
    }
}

fn word(record: &[u8; RECORD], at: usize) -> u64 {
    u64::from_le_bytes(record[at..at + 8].try_into().expect("8 bytes"))
}

impl PeerBuffers {
    /// Maps staging halves of `half_bytes` each among the `world` members of `comm` (this one
    /// is `rank`, on `ctx`'s GPU). Collective: every member calls it at the same point.
    /// `Ok(None)`: some member cannot map the others (another node, no peer access); the group
    /// stays on NCCL.
    pub fn open(
        comm: nccl_sys::ncclComm_t,
        stream: &Arc<CudaStream>,
        ctx: &Arc<CudaContext>,
        (rank, world): (usize, usize),
        half_bytes: usize,
    ) -> Result<Option<Self>, CommError> {
        if world > MAX_RANKS {
            return Ok(None);
        }
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        let half_bytes = half_bytes.next_multiple_of(256);
        let bytes = FLAG_REGION + 2 * half_bytes;
        // A member whose allocation fails still takes part in both exchanges (with an empty
        // record), so that no other member waits for it forever; the verdict then keeps the
        // whole group on NCCL.
        let (own, record) = match allocate(ctx, bytes) {
            Ok(mine) => mine,
            Err(e) => {
                tracing::info!(rank, error = %e, "collectives stay on NCCL");
                (0, [0u8; RECORD])
            }
        };
        let records = match exchange(comm, stream, world, &record) {
            Ok(records) => records,
            Err(e) => {
                free(own);
                return Err(e);
            }
        };
        let mut buffers = Self {
            rank,
            ctx: ctx.clone(),
            own,
            bases: vec![0; world],
            opened: Vec::new(),
            half_bytes,
            calls: 0,
            timeout_ns: timeout_ns(),
        };
        let mapped = if own == 0 {
            Err(err("alloc", "this member has no staging buffer"))
        } else {
            buffers.map_peers(&records, bytes)
        };
        // Opening a peer's context may have left it current; the exchange runs on this GPU.
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        let mut verdict = [0u8; RECORD];
        verdict[0] = mapped.is_ok() as u8;
        let verdicts = exchange(comm, stream, world, &verdict)?;
        if let Err(e) = &mapped {
            tracing::info!(rank, error = %e, "collectives stay on NCCL");
        }
        if verdicts.iter().all(|v| v[0] == 1) {
            Ok(Some(buffers))
        } else {
            // Dropping `buffers` closes what it opened and frees `own`.
            Ok(None)
        }
    }

    /// Maps every other member's allocation from its record.
    fn map_peers(&mut self, records: &[[u8; RECORD]], bytes: usize) -> Result<(), CommError> {
        let me = &records[self.rank];
        for (r, theirs) in records.iter().enumerate() {
            if word(theirs, 88) != word(me, 88) {
                return Err(err("map", format!("rank {r} is on another node")));
            }
            if word(theirs, 96) != bytes as u64 {
                return Err(err(
                    "map",
                    format!("rank {r} staged {} bytes", word(theirs, 96)),
                ));
            }
            if r == self.rank {
                self.bases[r] = self.own;
            } else if word(theirs, 64) == word(me, 64) {
                // A thread of this process (same nonce): its address is valid here once peer
                // access is on.
                let peer =
                    CudaContext::new(word(theirs, 72) as usize).map_err(|e| err("peer", e))?;
                self.ctx.bind_to_thread().map_err(|e| err("bind", e))?;
                // SAFETY: both are primary contexts of live devices; enabling twice is harmless.
                let status = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
                if status != sys::CUresult::CUDA_SUCCESS
                    && status != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    return Err(err("peer access", status));
                }
                self.bases[r] = word(theirs, 80);
            } else {
                let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
                for (d, s) in handle.reserved.iter_mut().zip(&theirs[..64]) {
                    *d = *s as std::ffi::c_char;
                }
                let mut base = 0;
                // SAFETY: the handle came from the peer's cuIpcGetMemHandle; `base` is written on
                // success and closed on drop.
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut base,
                        handle,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                    .result()
                    .map_err(|e| err("IPC open", e))?;
                }
                self.opened.push(base);
                self.bases[r] = base;
            }
        }
        Ok(())
    }

    /// Elements of `bytes_per` bytes one staging half holds.
    pub fn capacity(&self, bytes_per: usize) -> usize {
        self.half_bytes / bytes_per
    }

    /// Bytes of one staging half.
    pub fn half_bytes(&self) -> usize {
        self.half_bytes
    }

    /// Returns once every member of `comm` has called it (an exchange of empty records): with
    /// each member's device work waited for before, no kernel reads any member's buffers any
    /// more, and they may be dropped. Collective.
    pub fn quiesce(
        comm: nccl_sys::ncclComm_t,
        stream: &Arc<CudaStream>,
        ctx: &Arc<CudaContext>,
        world: usize,
    ) -> Result<(), CommError> {
        ctx.bind_to_thread().map_err(|e| err("bind", e))?;
        exchange(comm, stream, world, &[0u8; RECORD]).map(|_| ())
    }

    /// The next call's view: its epoch and the staging half it uses on every rank.
    pub fn next_call(&mut self) -> PeerCall {
        self.calls = self.calls.wrapping_add(1).max(1);
        let half = (self.calls % 2) as u64 * self.half_bytes as u64;
        PeerCall {
            data: self
                .bases
                .iter()
                .map(|b| b + FLAG_REGION as u64 + half)
                .collect(),
            flags: self.bases.clone(),
            rank: self.rank as u32,
            epoch: self.calls,
            timeout_ns: self.timeout_ns,
        }
    }
}

/// How long a rank's kernel waits at a barrier for a peer before it gives up (and the process
/// fails instead of hanging): `VERL_COLLECTIVE_TIMEOUT_S`, 600 s by default (a peer may be
/// saving a checkpoint).
fn timeout_ns() -> u64 {
    let s = std::env::var("VERL_COLLECTIVE_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(600);
    s.saturating_mul(1_000_000_000)
}

impl Drop for PeerBuffers {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the kernels that used the mappings are waited for first; the addresses were
        // opened / allocated by this struct and are not used after this.
        unsafe {
            let _ = result::ctx::synchronize();
            for base in &self.opened {
                let _ = sys::cuIpcCloseMemHandle(*base);
            }
        }
        free(self.own);
    }
}

//! Host bytes to the device through pinned staging and a copy kernel on burn's stream: how a
//! checkpoint's tensors reach the GPU.
//!
//! burn-cuda's `from_data` goes through cubecl's `create`, which copies every tensor's bytes
//! once more into fresh pageable memory and then copies from there (15 GB of a 7B checkpoint
//! in ~25 s, docs/PERFORMANCE.md). Here each device has a few chunks of pinned host memory
//! mapped into the device's address space. A tensor's bytes are copied into a free chunk by
//! host threads, and a kernel on burn's stream ([`kernels::host_copy`]) reads them over the
//! bus into the tensor; a second kernel then stores a ticket into a mapped flag, which the
//! host polls before it fills that chunk again. The host never waits for burn's stream, only
//! for a chunk to come free, so filling one chunk overlaps the device reading another.
//!
//! `VERL_PINNED_UPLOAD=decomposed` (or [`SWITCH`]) keeps burn's `from_data`, which is also
//! what small tensors and a failed staging allocation use.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use burn::backend::cuda::CudaDevice;
use burn::prelude::*;
use burn::tensor::{DType, TensorData, TensorPrimitive};
use cudarc::driver::{result, sys, CudaContext};
use verl_core::backend::CudaBackend;

use super::kernels::host_copy::{launch_copy, launch_flag};
use super::kernels::{CudaPrimitive, KernelSwitch};
use crate::hf::byte_runs::ByteRuns;

/// Whether uploads go through the staging chunks: on unless `VERL_PINNED_UPLOAD=decomposed`.
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_PINNED_UPLOAD");

/// Tensors of fewer bytes take burn's `from_data`: their copy cost is the call, not the bytes.
pub const MIN_BYTES: usize = 1 << 20;
/// Bytes of one staging chunk.
const CHUNK_BYTES: usize = 64 << 20;
/// Staging chunks per device: the host fills one while the device reads the others.
const CHUNKS: usize = 4;
/// How long the host waits for a chunk to come free before it calls the device stuck.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(300);

/// One device's staging: `CHUNKS` chunks of pinned, mapped host memory and their flags.
struct Staging {
    /// The device's primary context, held: pinned memory lives only while its context does,
    /// and a context nothing else holds yet (the first tensor of a process) would go with it.
    _ctx: Arc<CudaContext>,
    /// Host address of the chunks (also their device address: unified addressing).
    base: u64,
    /// Host address of `CHUNKS` flag words (the device stores tickets there).
    flags: u64,
    /// The ticket each chunk's last copy will store (0: never used).
    pending: [u64; CHUNKS],
    /// Tickets handed out so far.
    issued: u64,
    /// The chunk to fill next.
    next: usize,
}

/// A pinned, device-mapped host allocation of `bytes` (unified addressing: the host address
/// is the device's), or why not.
fn map_pinned(bytes: usize) -> Result<u64, String> {
    let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
    // SAFETY: a fresh pinned allocation; its mapped address is asked of the driver, and it is
    // freed again on every failure after it.
    unsafe {
        let host = result::malloc_host(bytes, flags)
            .map_err(|e| format!("pinned allocation of {bytes} bytes: {e:?}"))?;
        let mut mapped: sys::CUdeviceptr = 0;
        let got = sys::cuMemHostGetDevicePointer_v2(&mut mapped, host, 0).result();
        match got {
            Ok(()) if mapped == host as u64 => Ok(mapped),
            // Only without unified addressing do the two differ, and every 64-bit Linux CUDA
            // platform has it: one address serves both sides.
            Ok(()) => {
                let _ = result::free_host(host);
                Err("the device maps pinned memory at another address".into())
            }
            Err(e) => {
                let _ = result::free_host(host);
                Err(format!("mapped address: {e:?}"))
            }
        }
    }
}

impl Staging {
    /// Allocates the chunks and flags for `device`, or says why not.
    fn new(device: &CudaDevice) -> Result<Self, String> {
        let ctx = CudaContext::new(device.index).map_err(|e| format!("context: {e:?}"))?;
        ctx.bind_to_thread()
            .map_err(|e| format!("context: {e:?}"))?;
        let base = map_pinned(CHUNKS * CHUNK_BYTES)?;
        let flags = match map_pinned(CHUNKS * 8) {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: `base` came from `malloc_host` and nothing uses it yet.
                let _ = unsafe { result::free_host(base as *mut std::ffi::c_void) };
                return Err(e);
            }
        };
        // SAFETY: `flags` holds CHUNKS words; nothing reads them yet.
        unsafe { std::ptr::write_bytes(flags as *mut u64, 0, CHUNKS) };
        Ok(Self {
            _ctx: ctx,
            base,
            flags,
            pending: [0; CHUNKS],
            issued: 0,
            next: 0,
        })
    }

    /// Waits until chunk `k`'s last copy has read its bytes.
    fn wait_free(&self, k: usize) -> Result<(), String> {
        let want = self.pending[k];
        let flag = (self.flags + 8 * k as u64) as *const u64;
        let started = Instant::now();
        let mut spins = 0u32;
        // SAFETY: `flag` is a word of the pinned flag array, stored to by the device.
        while unsafe { std::ptr::read_volatile(flag) } < want {
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
                if started.elapsed() > CHUNK_TIMEOUT {
                    return Err(format!(
                        "a staging chunk's copy did not finish in {}s (the device is stuck or \
                         failed); `VERL_PINNED_UPLOAD=decomposed` uploads through burn instead",
                        CHUNK_TIMEOUT.as_secs()
                    ));
                }
            }
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        Ok(())
    }

    /// Queues the copy of `runs`, one after another, into `dst` (from its first byte), chunk
    /// by chunk. Returns the seconds spent waiting for chunks, filling them, and queueing the
    /// kernels.
    fn upload(&mut self, runs: &ByteRuns<'_>, dst: &CudaPrimitive) -> Result<[f64; 3], String> {
        let mut spent = [0.0; 3];
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        for (i, from) in (0..runs.total()).step_by(CHUNK_BYTES).enumerate() {
            let len = CHUNK_BYTES.min(runs.total() - from);
            let k = self.next;
            self.next = (k + 1) % CHUNKS;
            let t = Instant::now();
            self.wait_free(k)?;
            spent[0] += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let at = self.base + (k * CHUNK_BYTES) as u64;
            // SAFETY: chunk `k` is CHUNK_BYTES ≥ len of pinned host memory that only this
            // (locked) staging writes, and its last copy has read it (waited for above).
            let chunk = unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) };
            runs.copy_range_parallel(from, chunk, threads);
            spent[1] += t.elapsed().as_secs_f64();
            let t = Instant::now();
            self.issued += 1;
            self.pending[k] = self.issued;
            launch_copy(dst, at, (i * CHUNK_BYTES) as u64, len as u64);
            launch_flag(dst, self.flags + 8 * k as u64, self.issued);
            // The kernels must reach the device before the host may wait for their flag.
            dst.client
                .flush()
                .map_err(|e| format!("flushing burn's queue: {e:?}"))?;
            spent[2] += t.elapsed().as_secs_f64();
        }
        Ok(spent)
    }
}

/// Each device's staging, made on first use; `None` after a failed allocation (said once).
fn staging(device: &CudaDevice) -> Option<Arc<Mutex<Staging>>> {
    type Table = Mutex<HashMap<usize, Option<Arc<Mutex<Staging>>>>>;
    static TABLE: OnceLock<Table> = OnceLock::new();
    let mut table = TABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    table
        .entry(device.index)
        .or_insert_with(|| match Staging::new(device) {
            Ok(s) => Some(Arc::new(Mutex::new(s))),
            Err(why) => {
                tracing::warn!(
                    "pinned upload staging on GPU {}: {why}; uploads go through burn's from_data",
                    device.index
                );
                None
            }
        })
        .clone()
}

/// `data` as a flat tensor on `device` through the staging chunks, or `None` where burn's
/// `from_data` is the way: the switch off, a small tensor, or no staging.
///
/// # Panics
/// If a chunk never comes free (the device stuck or failed): the tensor would be incomplete.
pub fn upload(data: &TensorData, device: &CudaDevice) -> Option<Tensor<CudaBackend, 1>> {
    upload_runs(&[data.as_bytes()], data.num_elements(), data.dtype, device)
}

/// `elements` values of `dtype` whose bytes are `runs`, one after another (a checkpoint
/// tensor's shard straight from the mapped file: no host buffer in between), as a flat tensor
/// on `device`; `None` as for [`upload`].
///
/// # Panics
/// As [`upload`]; and if the runs do not hold `elements` values of `dtype`.
pub fn upload_runs(
    runs: &[&[u8]],
    elements: usize,
    dtype: DType,
    device: &CudaDevice,
) -> Option<Tensor<CudaBackend, 1>> {
    let runs = ByteRuns::new(runs);
    assert_eq!(
        runs.total(),
        elements * dtype.size(),
        "upload: the runs do not hold {elements} values of {dtype:?}"
    );
    if !SWITCH.enabled() || runs.total() < MIN_BYTES {
        return None;
    }
    // The tensor first: it makes burn's context on the device before the staging needs it.
    let started = Instant::now();
    let out: CudaPrimitive = Tensor::<CudaBackend, 1>::empty([elements], (device, dtype))
        .into_primitive()
        .tensor();
    let allocated = started.elapsed().as_secs_f64();
    let staging = staging(device)?;
    let mut staging = staging
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    match staging.upload(&runs, &out) {
        Ok([wait, fill, queue]) => tracing::debug!(
            target: "verl_megatron::upload",
            bytes = runs.total(),
            allocate_s = allocated,
            wait_s = wait,
            fill_s = fill,
            queue_s = queue,
            "staged upload"
        ),
        Err(why) => panic!(
            "uploading {} bytes to GPU {}: {why}",
            runs.total(),
            device.index
        ),
    }
    Some(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

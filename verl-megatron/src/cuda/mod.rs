//! burn-cuda specifics (feature `cuda`): the backend's fused operations ([`ops`], over the
//! kernels of [`kernels`]) and its tensor-parallel regions, the GPUs of a node, raw access to
//! burn-cuda buffers for libraries that take device pointers, the NCCL communicator, and a
//! cuBLASLt matrix product.
//!
//! The ranks of one process each drive their own GPU ([`rank_device`]); everything here loads
//! the CUDA driver and libraries at run time, so the `cuda` feature builds without CUDA.

// The fused operations hand their inputs back in `Err` when a kernel does not apply, so the
// caller runs the plain path on them (boxing them would allocate on every product), and the
// autodiff variants spell out `Autodiff<CudaBackend, C>` in those results.
#![allow(clippy::result_large_err, clippy::type_complexity)]

pub mod buffer;
pub mod cublaslt;
pub mod kernels;
pub mod linear;
pub mod nccl;
pub mod ops;
pub mod peer;
pub mod upload;

pub use buffer::DeviceBuffer;
pub use cublaslt::CublasLt;
pub use nccl::{NcclCommunicator, NcclId, NcclIdExchange};

use burn::backend::cuda::CudaDevice;

/// The CUDA devices visible to this process (0 when the driver is missing).
pub fn device_count() -> usize {
    cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// The GPU a local rank drives: rank `r` of a node uses device `r` modulo the devices visible,
/// so a layout with more ranks than GPUs still runs (ranks then share devices).
pub fn rank_device(local_rank: usize) -> CudaDevice {
    // A failure on burn's device thread must reach the rank's report, not vanish into a log.
    crate::device_faults::install_panic_hook();
    CudaDevice::new(local_rank % device_count().max(1))
}

/// Hands the launches this host has queued for `device` to cubecl's device thread now, which
/// issues them to the GPU, without waiting for anything.
///
/// cubecl passes tasks to its device thread in batches of 32. A kernel that waits on the device
/// for another rank's kernel must not sit in a partial batch. `ComputeClient::flush` would hand
/// the batch over too, but it also syncs the fence its previous flush recorded (cubecl's drop
/// queue). The host then waits for the GPU to reach the previous flush. One flush per
/// collective kept the host at most one collective ahead of the GPU, so host and GPU took
/// turns instead of overlapping (a rollout tp = 4 decode step spent 14 of its 15 ms
/// "enqueueing").
pub fn issue_queued(device: &CudaDevice) {
    use cubecl::device::Device;
    type Server = <cubecl::cuda::CudaRuntime as cubecl::Runtime>::Server;
    cubecl::device_handle::DeviceHandle::<Server>::new(device.to_id()).flush_queue();
}

/// Bytes of burn-cuda's memory pool in use and reserved on `device` for the calling thread's
/// stream (burn 0.21 has no peak counter: callers sample this where usage is highest).
pub fn memory_usage(device: &CudaDevice) -> Option<(u64, u64)> {
    use cubecl::Runtime;
    let usage = cubecl::cuda::CudaRuntime::client(device)
        .memory_usage()
        .ok()?;
    Some((usage.bytes_in_use, usage.bytes_reserved))
}

/// Free and total bytes of `device` as the driver counts them (every process and pool).
pub fn device_memory(device: &CudaDevice) -> Option<(u64, u64)> {
    let ctx = cudarc::driver::CudaContext::new(device.index).ok()?;
    ctx.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some((free as u64, total as u64))
}

// Tensor-parallel regions on burn-cuda: the collectives through its communicators (NCCL between
// rank processes), memory from its pool.
crate::plain_parallel_backend!(
    verl_core::backend::CudaBackend,
    |device| {
        memory_usage(device).map(|(allocated, reserved)| {
            let (free, total) = device_memory(device).unwrap_or((0, 0));
            verl_core::memory::MemoryUsage {
                allocated,
                reserved,
                device_used: total - free,
                device_total: total,
            }
        })
    },
    release: release_cached_memory,
    upload: upload_flat, upload::upload_runs
);

/// A checkpoint tensor's bytes on the device: through pinned staging ([`upload`]) where it
/// applies, burn's `from_data` otherwise.
fn upload_flat(
    data: burn::tensor::TensorData,
    device: &CudaDevice,
) -> burn::tensor::Tensor<verl_core::backend::CudaBackend, 1> {
    match upload::upload(&data, device) {
        Some(t) => t,
        None => {
            let dtype = data.dtype;
            burn::tensor::Tensor::from_data(data, (device, dtype))
        }
    }
}

/// Frees the pool pages of `device` (this thread's stream) that hold no tensor.
fn release_cached_memory(device: &CudaDevice) {
    use cubecl::Runtime;
    cubecl::cuda::CudaRuntime::client(device).memory_cleanup();
}

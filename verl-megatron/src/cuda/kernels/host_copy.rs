//! Copies out of pinned, device-mapped host memory into burn-cuda buffers as kernels on burn's
//! stream (`host_copy.cu`), and a flag the host polls to know a copy's reads are done. The
//! staging memory and its reuse are [`crate::cuda::upload`]'s; this module only launches.

use super::source::CudaSource;
use super::CudaPrimitive;

const SOURCE: &str = include_str!("host_copy.cu");
/// Threads per block (`THREADS` in the source).
const THREADS: u32 = 256;
/// Blocks per copy: enough 16-byte loads in flight to fill the bus (a read of mapped host
/// memory takes microseconds to return), few enough to stay resident at once.
const BLOCKS: u32 = 264;

/// Queues a copy of `bytes` bytes from the mapped host address `src` to byte `dst_offset` of
/// `dst`. `src` and `dst_offset` must be 16-byte aligned, `dst` must hold the bytes, and the
/// host memory must stay untouched until the copy ran ([`launch_flag`] tells the host).
pub fn launch_copy(dst: &CudaPrimitive, src: u64, dst_offset: u64, bytes: u64) {
    debug_assert!(
        src.is_multiple_of(16) && dst_offset.is_multiple_of(16),
        "host copy: 16-byte vector loads need aligned ends"
    );
    let vectors = bytes.div_ceil(16);
    let blocks = (vectors.div_ceil(THREADS as u64)).clamp(1, BLOCKS as u64) as u32;
    source("verl_host_copy").launch(
        &dst.client,
        (blocks, 1, 1),
        &[dst],
        vec![src, dst_offset, bytes],
    );
}

/// Queues the store of `ticket` into the mapped host word at `flag`, after everything queued
/// before it on `on`'s stream. `on` is only the launch's handle to that stream.
pub fn launch_flag(on: &CudaPrimitive, flag: u64, ticket: u64) {
    source("verl_host_flag").launch(&on.client, (1, 1, 1), &[on], vec![flag, ticket]);
}

fn source(entry: &'static str) -> CudaSource {
    CudaSource::plain(entry, SOURCE, THREADS)
}

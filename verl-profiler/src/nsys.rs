//! The "nsys" tool: while an [`NsysCapture`] is open, the role's spans on the rank are mirrored
//! as NVTX ranges ([`crate::nvtx`]) and the CUDA profiler API's capture range is open
//! (`cuProfilerStart` / `cuProfilerStop` through cudarc), so that
//! `nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat ...` records exactly
//! the profiled steps (or, with `discrete`, each profiled worker method).
//!
//! The heavy operations get ranges of their own (attention and MLP per layer, the output head,
//! backward, the optimizer step, prefill and decode steps), without the device waits of the
//! torch tool's device spans: Nsight times the device itself.
//!
//! The capture range is per process: captures of several roles on one rank (actor, reference
//! and critic colocated) share it, opened by the first and closed by the last. Without CUDA
//! (the CPU build, or no driver) the range cannot open; that is said once, as a warning, and
//! the NVTX ranges still flow.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::capture::{mirror_to_nvtx, NvtxMirror};

/// Captures open in this process (the range is open while there is one).
static OPEN: Mutex<usize> = Mutex::new(0);
static WARNED: AtomicBool = AtomicBool::new(false);

/// An open nsys capture of one role on one rank.
#[derive(Debug)]
pub struct NsysCapture {
    _mirror: NvtxMirror,
    /// Heavy operations (attention, MLP, backward, ...) get ranges of their own.
    _named: verl_core::profiling::SwitchGuard,
}

impl NsysCapture {
    pub fn begin(role: &str, rank: usize) -> Self {
        let mirror = mirror_to_nvtx(role, rank);
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        if *open == 0 {
            if let Err(why) = range(true) {
                warn_once(&why);
            }
        }
        *open += 1;
        Self {
            _mirror: mirror,
            _named: verl_core::profiling::name_heavy_ops(),
        }
    }
}

impl Drop for NsysCapture {
    fn drop(&mut self) {
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        *open = open.saturating_sub(1);
        if *open == 0 {
            if let Err(why) = range(false) {
                warn_once(&why);
            }
        }
    }
}

fn warn_once(why: &str) {
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "profiler tool nsys: {why}; NVTX ranges are still emitted, but nsys's \
             --capture-range=cudaProfilerApi will not see the profiled steps"
        );
    }
}

/// Opens (`start`) or closes the CUDA profiler's capture range on this rank's GPU: the
/// primary context of device `LOCAL_RANK` modulo the devices visible, which is the rank's GPU
/// when ranks run as processes (how verl-rs runs on GPUs). The range is process-wide, so for
/// ranks run as threads any GPU's context opens it for all.
#[cfg(feature = "cuda")]
fn range(start: bool) -> Result<(), String> {
    use cudarc::driver::CudaContext;
    let devices = CudaContext::device_count().map_err(|e| format!("no CUDA driver ({e})"))?;
    if devices <= 0 {
        return Err("no CUDA device is visible".into());
    }
    let local_rank: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let ctx = CudaContext::new(local_rank % devices as usize)
        .map_err(|e| format!("the GPU's context could not be opened ({e})"))?;
    ctx.bind_to_thread()
        .map_err(|e| format!("the GPU's context could not be bound ({e})"))?;
    let done = if start {
        cudarc::driver::profiler_start()
    } else {
        cudarc::driver::profiler_stop()
    };
    done.map_err(|e| {
        format!(
            "cuProfiler{} failed ({e})",
            if start { "Start" } else { "Stop" }
        )
    })
}

#[cfg(not(feature = "cuda"))]
fn range(_start: bool) -> Result<(), String> {
    Err("this build has no CUDA (build with `--features cuda`)".into())
}

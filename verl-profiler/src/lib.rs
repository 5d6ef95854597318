//! verl-profiler: verl's profiler (the `global_profiler` block and each role's `profiler`
//! block: tool, steps, ranks, discrete) on verl-rs's workers.
//!
//! - [`CapturePlan`], [`covers_rank`]: which steps make a capture (one per listed step, or one
//!   per run of consecutive steps with `profile_continuous_steps`) and which ranks are profiled.
//! - [`TraceLayer`], [`Capture`]: a `tracing` layer that collects the closed spans of one role on
//!   one rank while a capture is open (a span's `role` / `rank` fields tag it and everything
//!   under it).
//! - [`RoleProfiler`]: a worker's profiler — verl's `start_profile` / `stop_profile` around a
//!   step, `annotate` around a worker method (a capture per call in `discrete` mode).
//! - [`ChromeTrace`]: gzipped Chrome trace-event files, written and read back (ours or
//!   torch's), summed by span name for `verl profile summarize`.
//!
//! - [`MemoryCapture`], [`MemoryTimeline`]: the "torch_memory" tool's device-memory timeline
//!   (JSON and PNG).
//! - [`NsysCapture`], [`nvtx`]: the "nsys" tool's NVTX ranges (the injection protocol
//!   Nsight Systems speaks; no libnvToolsExt needed) and CUDA profiler capture range.
//!
//! The "torch" tool records host spans (`contents: [cpu]`), device spans (`cuda`: the heavy
//! operations timed between waits for the device) and memory samples (`memory`).

mod capture;
mod memory;
mod nsys;
pub mod nvtx;
mod role;
mod schedule;
mod spans;
mod trace;

pub use capture::{mirror_to_nvtx, Capture, Contents, NvtxMirror, TraceLayer, DEVICE_TRACK};
pub use memory::{MemoryCapture, MemorySample, MemoryTimeline, PhaseMemory};
pub use nsys::NsysCapture;
pub use role::RoleProfiler;
pub use schedule::{covers_rank, CapturePlan};
pub use trace::{ChromeTrace, SpanTotal, TraceEvent};

use std::path::PathBuf;

/// What can go wrong writing or reading a capture.
#[derive(Debug, thiserror::Error)]
pub enum ProfilerError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path} is not a trace-event file: {message}")]
    Trace { path: PathBuf, message: String },
}

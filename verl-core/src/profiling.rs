//! Switches a profiler flips while it captures, read by the code it measures (the switches live
//! here so that models and workers need not depend on the profiler). They are process-wide:
//! while one role on one rank is captured, every role and in-process rank of the process runs
//! its heavy operations the same way (with device waits, for device spans), only the captured
//! ones are recorded.
//!
//! - Device spans: while [`time_device`]'s guards live, the heavy operations of a step
//!   (attention, MLP, the output head, backward, the optimizer step, collectives, decode steps)
//!   run between two waits for the device, under a span marked `device = true`, so the span's
//!   length is the device's time for that work (the method cubecl's own profiling uses on
//!   CUDA). The waits cost overlap between host and device; outside a capture nothing waits.
//!
//! - Named heavy operations: while [`name_heavy_ops`]'s guards live (and device spans are
//!   off), the same operations run under plain spans with no waits, so a tool that times the
//!   device itself (Nsight Systems, through NVTX ranges) sees them named.
//!
//! ```
//! use verl_core::profiling;
//! assert!(!profiling::device_spans_on());
//! let guard = profiling::time_device();
//! assert!(profiling::device_spans_on());
//! drop(guard);
//! assert!(!profiling::device_spans_on());
//! ```

pub use crate::switch::{Switch, SwitchGuard};

static DEVICE_SPANS: Switch = Switch::new();
static NAMED: Switch = Switch::new();

/// Whether device spans are being recorded anywhere in the process.
pub fn device_spans_on() -> bool {
    DEVICE_SPANS.is_on()
}

/// Turns device spans on until the guard drops.
pub fn time_device() -> SwitchGuard {
    DEVICE_SPANS.hold()
}

/// Whether any profiler switch is on (device spans, named operations, a memory listener):
/// where even looking up a device costs, callers check this first.
pub fn active() -> bool {
    device_spans_on() || NAMED.is_on() || crate::memory::listening()
}

/// Names the heavy operations with spans (no waits) until the guard drops.
pub fn name_heavy_ops() -> SwitchGuard {
    NAMED.hold()
}

/// Runs `work`, the heavy operation `name`, as a device span while device spans are on: the
/// device is drained before and after, inside a span marked `device = true`, so the span lasts
/// as long as the device took. While heavy operations are only named, a plain span without
/// waits. Otherwise it just runs `work`.
///
/// ```
/// use verl_core::backend::CpuBackend;
/// use burn::tensor::Tensor;
/// let device = Default::default();
/// let x = Tensor::<CpuBackend, 1>::ones([4], &device);
/// let y = verl_core::profiling::device_span::<CpuBackend, _>(&device, "double", || x * 2.0);
/// assert_eq!(y.into_data().to_vec::<f32>().unwrap(), vec![2.0; 4]);
/// ```
pub fn device_span<B: burn::tensor::backend::Backend, T>(
    device: &B::Device,
    name: &'static str,
    work: impl FnOnce() -> T,
) -> T {
    if !device_spans_on() {
        if !NAMED.is_on() {
            return work();
        }
        let _span = tracing::info_span!("op", otel.name = name).entered();
        return work();
    }
    // A failed wait shows up again in the work itself; the span is only a measurement.
    let _ = B::sync(device);
    let _span = tracing::info_span!("device", otel.name = name, device = true).entered();
    let out = work();
    let _ = B::sync(device);
    out
}

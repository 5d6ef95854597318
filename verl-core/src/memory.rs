//! Memory accounting: a device's memory in use and reserved, and the peak of a phase.
//!
//! burn 0.21 has no peak counter (torch's `max_memory_allocated`), so a role samples its
//! device's usage where usage is highest (after a reload, after each micro-batch's forward
//! pass, before and after the optimizer step, after generation) and [`PhasePeak`] keeps the
//! highest sample of the phase on the rank's own thread.
//!
//! On the CPU backend the device is host memory: [`CountingAllocator`], installed by the
//! program as its global allocator (the `verl` binary does), counts the bytes the process has
//! allocated; the reserved figure is the process's resident set.
//!
//! ```
//! use verl_core::memory::{MemoryUsage, PhasePeak};
//! let phase = PhasePeak::start();
//! verl_core::memory::record(MemoryUsage { allocated: 3 << 30, reserved: 4 << 30, device_used: 0, device_total: 0 });
//! verl_core::memory::record(MemoryUsage { allocated: 1 << 30, reserved: 4 << 30, device_used: 0, device_total: 0 });
//! assert_eq!(phase.finish().unwrap().allocated, 3 << 30);
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Bytes of a device's memory: in use by tensors, and held by the allocator (in use plus
/// cached free pages; what the device has given away).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    pub allocated: u64,
    pub reserved: u64,
    /// Bytes of the whole device in use by every process and allocator (a GPU's total less its
    /// free memory), where the backend can tell; 0 where it cannot. Beside `reserved` it shows
    /// memory that this pool does not see (other pools, the driver, other processes).
    pub device_used: u64,
    /// Bytes of the whole device (a GPU's total memory) where the backend can tell; 0 where it
    /// cannot (the CPU backend).
    pub device_total: u64,
}

impl MemoryUsage {
    /// The larger of each figure.
    pub fn max(self, other: Self) -> Self {
        Self {
            allocated: self.allocated.max(other.allocated),
            reserved: self.reserved.max(other.reserved),
            device_used: self.device_used.max(other.device_used),
            device_total: self.device_total.max(other.device_total),
        }
    }
}

/// Gibibytes, as verl's `perf/max_memory_*_gb` metrics count them.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

thread_local! {
    /// Whether a phase is open on this thread, and the highest usage sampled in it so far.
    static PEAK: Cell<(bool, Option<MemoryUsage>)> = const { Cell::new((false, None)) };
}

/// Records a sample of the device's usage into the current phase's peak (if a phase is open
/// on this thread) and hands it to the sample listener while one listens (a profiler's memory
/// timeline).
pub fn record(usage: MemoryUsage) {
    PEAK.with(|p| {
        if let (true, peak) = p.get() {
            p.set((true, Some(peak.map_or(usage, |q| q.max(usage)))));
        }
    });
    notify(usage);
}

/// Whether samples are wanted on this thread: a phase is being measured, or a listener
/// listens (sampling costs nothing otherwise).
pub fn phase_open() -> bool {
    LISTENING.is_on() || PEAK.with(|p| p.get().0)
}

/// Hands a sample to the listener only (not to the phase's peak): the extra samples a profiler
/// takes, which must not change the peaks the metrics report.
pub fn notify(usage: MemoryUsage) {
    if LISTENING.is_on() {
        if let Some(listener) = LISTENER.get() {
            listener(usage);
        }
    }
}

/// Whether a listener listens (a profiler's memory timeline or memory track is open).
pub fn listening() -> bool {
    LISTENING.is_on()
}

/// Where every sample goes while [`listen`]'s guards are alive (set once per process; the
/// profiler's memory timeline sets it).
static LISTENER: std::sync::OnceLock<fn(MemoryUsage)> = std::sync::OnceLock::new();
static LISTENING: crate::switch::Switch = crate::switch::Switch::new();

/// Sets the process's sample listener; `false` when another was set before (the first
/// stays).
pub fn set_listener(listener: fn(MemoryUsage)) -> bool {
    LISTENER.set(listener).is_ok() || LISTENER.get() == Some(&listener)
}

/// Samples flow to the listener until the guard drops (guards count: the last one stops the
/// flow).
pub fn listen() -> crate::switch::SwitchGuard {
    LISTENING.hold()
}

/// A phase whose peak memory is being measured on this thread (phases do not nest: starting
/// one restarts the count, as torch's `reset_peak_memory_stats`).
#[derive(Debug)]
pub struct PhasePeak(());

impl PhasePeak {
    pub fn start() -> Self {
        PEAK.with(|p| p.set((true, None)));
        Self(())
    }

    /// The highest usage recorded since [`Self::start`]; `None` when nothing was (a backend
    /// without memory figures).
    pub fn finish(self) -> Option<MemoryUsage> {
        PEAK.with(|p| p.replace((false, None))).1
    }
}

/// A global allocator that counts live bytes (on top of the system allocator); install it
/// with `#[global_allocator] static A: CountingAllocator = CountingAllocator;` to give the CPU
/// backend a memory figure.
pub struct CountingAllocator;

static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
static PEAK_BYTES: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn grew(by: u64) {
    let now = LIVE_BYTES.fetch_add(by, Ordering::Relaxed) + by;
    PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
}

impl CountingAllocator {
    /// Restarts the high-water mark at the bytes live now (every thread's), and returns them.
    pub fn reset_peak() -> u64 {
        let now = LIVE_BYTES.load(Ordering::Relaxed);
        PEAK_BYTES.store(now, Ordering::Relaxed);
        now
    }

    /// The most bytes live at once since [`Self::reset_peak`] (0 when not installed).
    pub fn peak() -> u64 {
        PEAK_BYTES.load(Ordering::Relaxed)
    }
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract (a valid, non-zero-size layout) is passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
            INSTALLED.store(true, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`: the caller's layout is passed on unchanged.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size() as u64);
            INSTALLED.store(true, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` through this allocator with `layout` (every
        // allocation above forwards to it).
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size() as u64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout` (as in `dealloc`) and the caller
        // guarantees `new_size` is valid for that layout's alignment.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            grew(new_size as u64);
            LIVE_BYTES.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        }
        p
    }
}

/// The process's resident set in bytes (Linux; `None` elsewhere).
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Host memory as the CPU backend's device memory: bytes live through [`CountingAllocator`]
/// and the resident set. `None` when the program did not install the allocator.
pub fn host_usage() -> Option<MemoryUsage> {
    if !INSTALLED.load(Ordering::Relaxed) {
        return None;
    }
    let allocated = LIVE_BYTES.load(Ordering::Relaxed);
    Some(MemoryUsage {
        allocated,
        reserved: resident_bytes().unwrap_or(allocated).max(allocated),
        device_used: 0,
        device_total: 0,
    })
}

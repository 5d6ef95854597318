//! Process-wide on/off switches held by guards: the profiler's switches
//! ([`crate::profiling`]) and the memory listener's ([`crate::memory`]).

use std::sync::atomic::{AtomicU64, Ordering};

/// A process-wide switch that is on while any of its guards lives (guards count, so nested
/// and overlapping captures each hold it).
#[derive(Debug)]
pub struct Switch(AtomicU64);

impl Switch {
    pub const fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    pub fn is_on(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }

    /// Turns the switch on until the guard drops.
    pub fn hold(&'static self) -> SwitchGuard {
        self.0.fetch_add(1, Ordering::AcqRel);
        SwitchGuard(self)
    }
}

impl Default for Switch {
    fn default() -> Self {
        Self::new()
    }
}

/// See [`Switch::hold`].
#[derive(Debug)]
pub struct SwitchGuard(&'static Switch);

impl Drop for SwitchGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

use crate::Result;

/// A profiler driven per training step, with annotated ranges (nsys NVTX ranges, torch record
/// functions, ...). Configuration (which steps, ranks, roles, discrete or not) lives with the
/// implementation; see `verl-profiler`.
pub trait Profiler: Send + Sync {
    /// Starts capturing for `step` if this profiler covers it.
    fn start(&self, step: u64) -> Result<()>;
    /// Stops capturing and flushes.
    fn stop(&self) -> Result<()>;
    /// Opens a named range.
    fn range_push(&self, name: &str);
    /// Closes the innermost range.
    fn range_pop(&self);
    /// Whether a capture is under way.
    fn is_active(&self) -> bool;
}

/// Closes its range when dropped.
///
/// ```
/// # use verl_core::traits::{Profiler, ProfileRange};
/// # fn step(p: &dyn Profiler) {
/// let _range = ProfileRange::new(p, "update_actor");
/// // ... work measured under "update_actor"
/// # }
/// ```
pub struct ProfileRange<'a> {
    profiler: &'a dyn Profiler,
}

impl<'a> ProfileRange<'a> {
    pub fn new(profiler: &'a dyn Profiler, name: &str) -> Self {
        profiler.range_push(name);
        Self { profiler }
    }
}

impl Drop for ProfileRange<'_> {
    fn drop(&mut self) {
        self.profiler.range_pop();
    }
}

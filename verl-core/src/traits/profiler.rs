use crate::Result;

/// A worker's profiler, driven per training step (verl's `start_profile` / `stop_profile`),
/// with named ranges inside (nsys NVTX ranges, torch record functions, ...). Which steps,
/// ranks, roles and tool, and whether captures are discrete, live with the implementation:
/// `verl_profiler::RoleProfiler` is verl-rs's.
///
/// ```
/// # use verl_core::traits::{Profiler, ProfileRange};
/// fn one_step(p: &dyn Profiler, step: u64) -> verl_core::Result<()> {
///     p.start_step(step);
///     {
///         let _range = ProfileRange::new(p, "update_actor");
///         // ... the work measured under "update_actor"
///     }
///     p.stop_step(step)
/// }
/// ```
pub trait Profiler: Send + Sync {
    /// Before training step `step`: opens a capture when one begins at `step`.
    fn start_step(&self, step: u64);
    /// After training step `step`: closes the capture that ends at `step` and saves it.
    fn stop_step(&self, step: u64) -> Result<()>;
    /// Opens a named range on this thread.
    fn range_push(&self, name: &str);
    /// Closes this thread's innermost range opened by [`Self::range_push`].
    fn range_pop(&self);
    /// Whether this profiler records anything at all (this role on this rank is profiled).
    fn is_enabled(&self) -> bool;
}

/// Closes its range when dropped.
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

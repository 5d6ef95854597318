//! A count of the times verl-rs's own code reads device memory on the host (each read waits for
//! the device to finish the work before it): `verl bench train-step` prints it per step, so a
//! read that creeps into the step shows up. Reads inside burn itself are not seen here (burn
//! 0.21 reads nothing during a step's operations: its launches are asynchronous).
//!
//! ```
//! use verl_megatron::host_reads;
//! let before = host_reads::count();
//! host_reads::note(2);
//! assert!(host_reads::count() >= before + 2);
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};

static READS: AtomicUsize = AtomicUsize::new(0);

/// Records `n` reads of device memory by the host.
pub fn note(n: usize) {
    READS.fetch_add(n, Ordering::Relaxed);
}

/// The reads recorded so far in this process (read it before and after a step).
pub fn count() -> usize {
    READS.load(Ordering::Relaxed)
}

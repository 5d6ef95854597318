//! Failures that happen on a backend's own threads, out of sight of the rank that caused them.
//!
//! A GPU backend may run its work on a thread of its own (burn-cuda queues every operation to a
//! device thread). When an operation fails there, for instance because the device ran out of
//! memory, the backend logs it and goes on: the rank's tensors then point at nothing, and what
//! the rank reads back later is garbage (a sampled token id of `u32::MAX`, a NaN loss) or a
//! second, unrelated-looking error. A backend records such a failure here (its panic hook calls
//! [`record`]); every rank call that ends after it fails, naming the first one, so the report
//! says "out of device memory" and not whatever broke next.
//!
//! The record is sticky for the process: after a device fault nothing the device computed can be
//! trusted, so every later call fails too.
//!
//! ```
//! use verl_core::worker::device_fault;
//! device_fault::record("DSD-0-0", "out of memory");
//! let fault = device_fault::first().expect("recorded");
//! assert!(fault.to_string().contains("out of memory"));
//! # device_fault::clear();
//! ```

use std::fmt;
use std::sync::Mutex;

use crate::error::{Error, Result};

/// The first failure a backend thread reported, and how many it reported in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFault {
    /// The backend thread it happened on (burn-cuda names them `DS<stage>-<type>-<index>`).
    pub thread: String,
    /// What failed, as the backend describes it (with the fix, where it knows one).
    pub message: String,
    /// Failures recorded in all; the later ones are usually consequences of the first.
    pub count: usize,
}

impl fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the device failed on backend thread `{}`: {}",
            self.thread, self.message
        )?;
        if self.count > 1 {
            write!(f, " ({} more device failures followed)", self.count - 1)?;
        }
        Ok(())
    }
}

static FAULT: Mutex<Option<DeviceFault>> = Mutex::new(None);

/// Records a failure on a backend thread; returns whether it is the process's first (callers
/// print the first in full and keep the rest quiet).
pub fn record(thread: &str, message: &str) -> bool {
    let mut slot = FAULT.lock().unwrap_or_else(|p| p.into_inner());
    match slot.as_mut() {
        Some(fault) => {
            fault.count += 1;
            false
        }
        None => {
            *slot = Some(DeviceFault {
                thread: thread.to_string(),
                message: message.to_string(),
                count: 1,
            });
            true
        }
    }
}

/// The first recorded failure, if any.
pub fn first() -> Option<DeviceFault> {
    FAULT.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Forgets the record (tests that provoke a fault on purpose clean up with this).
pub fn clear() {
    *FAULT.lock().unwrap_or_else(|p| p.into_inner()) = None;
}

/// The report of a rank call that ended after a device fault: the fault first, then what the
/// call itself said (`None` when it seemed to succeed, which after a fault means its results are
/// not to be trusted).
pub fn report(fault: &DeviceFault, call_error: Option<&str>) -> String {
    match call_error {
        Some(e) => format!("{fault}; what failed after it: {e}"),
        None => format!("{fault}; the call's results are not trusted after it"),
    }
}

/// A rank call's result once the process's device fault is taken into account: unchanged
/// when there is none, else an error naming the fault first and then what the call said
/// (the serving loop of each transport passes every call's result through this).
pub fn outrank<T>(result: Result<T>) -> Result<T> {
    match (result, first()) {
        (result, None) => result,
        (result, Some(fault)) => {
            let seen = result.err().map(|e| e.to_string());
            Err(Error::backend("worker", report(&fault, seen.as_deref())))
        }
    }
}

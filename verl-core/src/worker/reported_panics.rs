//! Panics inside a rank's call are reported once, by the driver, under the rank that caused the
//! failure: [`catch_reported`] runs a call with the process's panic hook quiet for it (the
//! message travels in the call's error; the backtrace goes to the debug log, target
//! `verl::panic`). Without it, every peer of a failed rank printed its own collective's panic
//! and backtrace before the driver's one clean line.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, UnwindSafe};
use std::sync::Once;

thread_local! {
    /// Whether this thread runs a call whose panic its caller reports.
    static REPORTED: Cell<bool> = const { Cell::new(false) };
}

/// Installs (once per process) the hook that keeps reported panics off stderr; every other
/// panic goes to the hook that was there before.
fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if REPORTED.with(Cell::get) {
                tracing::debug!(
                    target: "verl::panic",
                    "{info}\n{}",
                    std::backtrace::Backtrace::force_capture()
                );
            } else {
                previous(info);
            }
        }));
    });
}

/// `std::panic::catch_unwind(f)`, with a panic of `f` on this thread left to the caller to
/// report (see the module docs).
pub fn catch_reported<T>(f: impl FnOnce() -> T + UnwindSafe) -> std::thread::Result<T> {
    install();
    let before = REPORTED.with(|r| r.replace(true));
    let out = std::panic::catch_unwind(f);
    REPORTED.with(|r| r.set(before));
    out
}

/// [`catch_reported`] for closures that are not `UnwindSafe` (the caller drops what they
/// touched, or reports it broken, after a panic).
pub fn catch_reported_unchecked<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    catch_reported(AssertUnwindSafe(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reported_panic_comes_back_as_the_result_and_the_flag_is_restored() {
        let out = catch_reported_unchecked(|| -> u32 { panic!("collective failed") });
        let message = crate::error::panic_message(out.unwrap_err());
        assert!(message.contains("collective failed"), "{message}");
        assert!(!REPORTED.with(Cell::get));
        assert_eq!(catch_reported_unchecked(|| 7).unwrap(), 7);
    }
}

//! The panic hook records a panic on a cubecl device thread as the process's device fault,
//! described in the user's terms, and leaves panics on other threads alone.
//!
//! Its own test binary: the hook and the record are process-wide.

use verl_core::worker::device_fault;
use verl_megatron::device_faults::install_panic_hook;

fn panic_on(thread: &str, message: &'static str) {
    let joined = std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || panic!("{message}"))
        .unwrap()
        .join();
    assert!(joined.is_err(), "the thread panicked");
}

#[test]
fn a_panic_on_a_device_thread_becomes_the_device_fault() {
    install_panic_hook();
    install_panic_hook(); // once per process, however often it is asked
    device_fault::clear();

    panic_on("verl-rank-0", "an ordinary panic");
    assert!(device_fault::first().is_none(), "not a device thread");

    panic_on(
        "DSD-0-3",
        "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 9381867520",
    );
    panic_on(
        "DSD-0-3",
        "couldn't find resource for that handle: Memory page 0 doesn't exist",
    );
    let fault = device_fault::first().expect("recorded");
    assert_eq!(fault.thread, "DSD-0-3");
    assert_eq!(fault.count, 2);
    assert!(
        fault.message.starts_with("out of device memory"),
        "{}",
        fault.message
    );
    assert!(fault.message.contains("8.74 GiB"), "{}", fault.message);
    device_fault::clear();
}

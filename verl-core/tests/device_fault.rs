//! A failure on a backend's own thread fails the rank call that ends after it, named first.
//!
//! Its own test binary: the record is process-wide and sticky, so it must not meet other tests.

use verl_core::dispatch::DispatchInfo;
use verl_core::error::Error;
use verl_core::worker::{device_fault, RankContext, Worker, WorkerGroup};

struct Rank;

impl Worker for Rank {
    fn dispatch_info(&self, _mesh: &str) -> Option<DispatchInfo> {
        None
    }
}

/// What a backend's device thread does when an operation fails there: its panic hook records
/// it, and the thread goes on (the rank's own call sees nothing).
fn fail_on_a_device_thread(message: &'static str) {
    std::thread::Builder::new()
        .name("DSD-0-0".into())
        .spawn(move || {
            device_fault::record("DSD-0-0", message);
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn a_device_fault_fails_the_call_that_ends_after_it_and_every_later_one() {
    device_fault::clear();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let group = WorkerGroup::spawn(2, |_ctx: RankContext| Ok(Rank)).unwrap();

    // Before any fault, calls succeed.
    let ok = runtime
        .block_on(
            group.execute_all("actor.compute_log_prob", (), |_w: &mut Rank, ctx, ()| {
                Box::pin(async move { Ok(ctx.rank) })
            }),
        )
        .unwrap();
    assert_eq!(ok, vec![0, 1]);

    // Rank 1's call "succeeds" with garbage after its device ran out of memory: it fails,
    // naming the device fault. Both ranks' calls end after both faults (the record is
    // process-wide: rank 0 ending between them would see only the first).
    let both_recorded = std::sync::Arc::new(std::sync::Barrier::new(2));
    let err = runtime
        .block_on(group.execute_all(
            "actor.generate_sequences",
            both_recorded,
            |_w: &mut Rank, ctx, both_recorded| {
                Box::pin(async move {
                    if ctx.rank == 1 {
                        fail_on_a_device_thread("out of device memory: a block of 8.74 GiB");
                        fail_on_a_device_thread("memory page 0 doesn't exist");
                    }
                    both_recorded.wait();
                    Ok(u32::MAX)
                })
            },
        ))
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, Error::Worker(_) | Error::Backend { .. }),
        "{err:?}"
    );
    assert!(text.contains("actor.generate_sequences"), "{text}");
    assert!(
        text.contains("the device failed on backend thread `DSD-0-0`: out of device memory: a block of 8.74 GiB"),
        "{text}"
    );
    assert!(text.contains("1 more device failures followed"), "{text}");
    assert!(text.contains("not trusted"), "{text}");
    assert!(
        !text.contains("memory page 0"),
        "the first fault is the one named: {text}"
    );

    // The record is sticky: nothing the device computes afterwards is trusted. A call that
    // fails on its own keeps its message behind the fault's.
    let group = WorkerGroup::spawn(1, |_ctx: RankContext| Ok(Rank)).unwrap();
    let err = runtime
        .block_on(
            group.execute_all("actor.update_actor", (), |_w: &mut Rank, _ctx, ()| {
                Box::pin(async move {
                    Err::<(), _>(Error::backend("actor", "token id 4294967295 out of range"))
                })
            }),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of device memory"), "{err}");
    assert!(err.contains("what failed after it: "), "{err}");
    assert!(err.contains("token id 4294967295 out of range"), "{err}");

    // A panicking call too.
    let err = runtime
        .block_on(
            group.execute_all("actor.update_actor", (), |_w: &mut Rank, _ctx, ()| {
                Box::pin(async move {
                    if true {
                        panic!("Element cannot be represented in the target type");
                    }
                    Ok(())
                })
            }),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of device memory"), "{err}");
    assert!(
        err.contains("panicked: Element cannot be represented"),
        "{err}"
    );
    device_fault::clear();
}

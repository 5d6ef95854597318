//! A failure on burn's device thread reported as the rank's error.
//!
//! burn-cuda (through cubecl) queues every operation to a device thread of its own, named
//! `DSU-<type>-<index>` / `DSD-<type>-<index>`. When an operation panics there (the memory pool
//! cannot add a page: the device is out of memory), cubecl logs "Task failed" and carries on;
//! the rank's later reads return garbage or fail with an unrelated message. The hook installed by
//! [`install_panic_hook`] records the first such panic in [`verl_core::worker::device_fault`],
//! described with its fix, prints it once, and keeps the cascade that follows quiet; the rank's
//! call then fails naming it.

use std::sync::Once;

/// Whether `thread` is one of cubecl's device threads.
pub fn is_device_thread(thread: &str) -> bool {
    let Some(rest) = thread.strip_prefix("DS") else {
        return false;
    };
    let mut parts = rest.split('-');
    matches!(parts.next(), Some("U" | "D"))
        && parts.next().is_some_and(|t| t.parse::<u32>().is_ok())
        && parts.next().is_some_and(|i| i.parse::<u32>().is_ok())
        && parts.next().is_none()
}

/// The allocation size in cubecl's out-of-memory panic ("can't allocate buffer of size: N").
fn failed_allocation(message: &str) -> Option<u64> {
    let at = message.find("can't allocate buffer of size:")?;
    let digits: String = message[at + "can't allocate buffer of size:".len()..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

const GIB: f64 = (1u64 << 30) as f64;

/// A device-thread panic message in the user's terms: an out-of-memory is named as such, with
/// the settings that lower a rank's memory; `free_total` is the device's free and total bytes
/// when they could be read.
///
/// ```
/// use verl_megatron::device_faults::describe;
/// let text = describe("can't allocate buffer of size: 9381867520", Some((2 << 30, 150 << 30)));
/// assert!(text.starts_with("out of device memory"));
/// assert!(text.contains("8.74 GiB"));
/// assert!(text.contains("ppo_micro_batch_size_per_gpu"));
/// ```
pub fn describe(message: &str, free_total: Option<(u64, u64)>) -> String {
    let Some(bytes) = failed_allocation(message) else {
        return message.to_string();
    };
    let card = free_total.map_or(String::new(), |(free, total)| {
        format!(
            "; the device had {:.2} GiB free of {:.2} GiB",
            free as f64 / GIB,
            total as f64 / GIB
        )
    });
    format!(
        "out of device memory: burn's memory pool could not add a block of {:.2} GiB ({message}{card}). \
         The pool grows in blocks of up to a quarter of the card, so the request may be larger than \
         the tensor that needed it. To lower a rank's memory: smaller micro-batches \
         (actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, \
         actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu, \
         actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu, or ppo_max_token_len_per_gpu \
         with use_dynamic_bsz), activation recompute \
         (actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full), \
         a larger tensor_model_parallel_size or pipeline_model_parallel_size, \
         actor_rollout_ref.actor.megatron.optimizer_offload=true / param_offload=true, or fewer \
         sequences generated at once (actor_rollout_ref.rollout.max_num_seqs)",
        bytes as f64 / GIB
    )
}

/// Installs (once per process) the panic hook that records panics on cubecl's device threads
/// as the process's device fault. Panics elsewhere go to the hook that was there before.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("");
            if !is_device_thread(name) {
                return previous(info);
            }
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            let described = describe(&message, device_memory());
            if verl_core::worker::device_fault::record(name, &described) {
                eprintln!("device thread `{name}` failed: {described}");
                previous(info);
            }
        }));
    });
}

/// Free and total bytes of the current CUDA device (the device thread has its context current).
#[cfg(feature = "cuda")]
fn device_memory() -> Option<(u64, u64)> {
    cudarc::driver::result::mem_get_info()
        .ok()
        .map(|(free, total)| (free as u64, total as u64))
}

#[cfg(not(feature = "cuda"))]
fn device_memory() -> Option<(u64, u64)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_threads_are_recognised_by_cubecl_names() {
        assert!(is_device_thread("DSD-0-0"));
        assert!(is_device_thread("DSU-3-12"));
        assert!(!is_device_thread("DSD-0"));
        assert!(!is_device_thread("DSX-0-0"));
        assert!(!is_device_thread("DSD-0-0-1"));
        assert!(!is_device_thread("main"));
        assert!(!is_device_thread("verl-rank-link"));
    }

    #[test]
    fn out_of_memory_is_named_with_its_size_and_the_fixes() {
        let text = describe(
            "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 21254373376",
            None,
        );
        assert!(text.starts_with("out of device memory"), "{text}");
        assert!(text.contains("19.79 GiB"), "{text}");
        assert!(text.contains("recompute_granularity=full"), "{text}");
        assert!(!text.contains("free of"), "{text}");
        let with_card = describe(
            "can't allocate buffer of size: 1073741824",
            Some((1 << 29, 80 << 30)),
        );
        assert!(
            with_card.contains("the device had 0.50 GiB free of 80.00 GiB"),
            "{with_card}"
        );
        // Anything else is passed through as it is.
        let other = "couldn't find resource for that handle: Memory page 0 doesn't exist";
        assert_eq!(describe(other, None), other);
    }
}

//! Rank heartbeats: every rank process sends [`Message::Heartbeat`] to the driver each
//! [`HEARTBEAT_INTERVAL`] from a thread of its own, and the driver fails a call as soon as a
//! rank has been silent for the heartbeat timeout (`VERL_HEARTBEAT_TIMEOUT_S`, 30 s by
//! default). A process that is stopped (SIGSTOP, a debugger), frozen or cut off by the network
//! falls silent; its peers would otherwise wait in a collective for `VERL_COMM_TIMEOUT_S`
//! (600 s) and then report themselves, not it. A rank busy computing keeps beating.
//!
//! ```
//! use std::time::Duration;
//! use verl_core::worker::heartbeat::heartbeat_timeout_from;
//! assert_eq!(heartbeat_timeout_from(None)?, Duration::from_secs(30));
//! assert_eq!(heartbeat_timeout_from(Some("5"))?, Duration::from_secs(5));
//! assert!(heartbeat_timeout_from(Some("0")).is_err());
//! # Ok::<(), verl_core::Error>(())
//! ```

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::wire::{Message, WireWriter};

/// How often a rank process says it is alive.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// The environment variable that sets how long a silent rank is waited for.
pub const HEARTBEAT_TIMEOUT_ENV: &str = "VERL_HEARTBEAT_TIMEOUT_S";

/// The heartbeat timeout a `VERL_HEARTBEAT_TIMEOUT_S` value gives: whole seconds, at least 2
/// (twice the interval), 30 without a value.
pub fn heartbeat_timeout_from(value: Option<&str>) -> Result<Duration> {
    let Some(text) = value else {
        return Ok(Duration::from_secs(30));
    };
    match text.trim().parse::<u64>() {
        Ok(s) if s >= 2 => Ok(Duration::from_secs(s)),
        _ => Err(Error::backend(
            "worker",
            format!(
                "{HEARTBEAT_TIMEOUT_ENV}={text:?}: must be a whole number of seconds ≥ 2 (the \
                 default is 30)"
            ),
        )),
    }
}

/// [`heartbeat_timeout_from`] of the process environment.
pub fn heartbeat_timeout() -> Result<Duration> {
    heartbeat_timeout_from(std::env::var(HEARTBEAT_TIMEOUT_ENV).ok().as_deref())
}

/// Starts the rank's heartbeat thread, which beats on `writer` until the connection fails.
pub(crate) fn spawn(rank: usize, writer: Arc<WireWriter>) -> Result<()> {
    std::thread::Builder::new()
        .name("verl-rank-heartbeat".into())
        .spawn(move || loop {
            std::thread::sleep(HEARTBEAT_INTERVAL);
            if writer.send(Message::Heartbeat).is_err() {
                return;
            }
        })
        .map(|_| ())
        .map_err(|e| {
            Error::from(crate::error::WorkerError::Spawn {
                rank,
                message: format!("its heartbeat thread: {e}"),
            })
        })
}

/// What the operating system says about process `pid` when it is not running normally
/// (stopped, traced, a zombie), where it can tell (Linux, a process of this machine).
pub fn process_state(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ...`: the state follows the command's closing parenthesis.
    let state = stat[stat.rfind(')')? + 1..].split_whitespace().next()?;
    let what = match state {
        "T" => "stopped (SIGSTOP or job control)",
        "t" => "stopped by a debugger",
        "Z" => "a zombie (it exited and was not reaped)",
        "X" => "dead",
        _ => return None,
    };
    Some(format!("the process is {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_timeouts_are_refused_naming_the_variable() {
        for bad in ["1", "abc", "-3", ""] {
            let e = heartbeat_timeout_from(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(HEARTBEAT_TIMEOUT_ENV), "{e}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_running_process_has_no_state_to_report() {
        assert_eq!(process_state(std::process::id()), None);
        assert_eq!(process_state(u32::MAX), None);
    }
}

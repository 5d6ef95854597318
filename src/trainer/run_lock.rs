//! One run per output directory: the driver holds `<trainer.default_local_dir>/.verl-run.lock`
//! (its pid, host and start time) from setup to its end. A second run on the same directory
//! would rename the first's metrics and set aside its checkpoints, so it is refused, naming the
//! holder; a lock whose process is gone (same host) is taken over with a warning.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::{setup, TrainError};

const LOCK: &str = ".verl-run.lock";

/// Who holds a run directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Holder {
    pid: u32,
    host: String,
    /// Seconds since the Unix epoch.
    started: u64,
}

/// The held lock; dropping it (the run's end, or a failed setup) removes the file.
#[derive(Debug)]
pub(crate) struct RunLock {
    path: PathBuf,
}

/// This machine's name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Whether process `pid` of this host still runs (on systems without `/proc`, assumed so).
fn running(pid: u32) -> bool {
    if !Path::new("/proc/self").exists() {
        return true;
    }
    Path::new(&format!("/proc/{pid}")).exists()
}

impl RunLock {
    /// Takes `dir`'s lock for this process, making `dir` first.
    pub(crate) fn acquire(dir: &Path) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            setup(format!(
                "trainer.default_local_dir = {}: cannot create it: {e}",
                dir.display()
            ))
        })?;
        let path = dir.join(LOCK);
        let me = Holder {
            pid: std::process::id(),
            host: host_name(),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        // Two tries: the second after taking over a stale lock.
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    let text = serde_json::to_string(&me).unwrap_or_default();
                    f.write_all(text.as_bytes()).map_err(|e| {
                        setup(format!(
                            "{}: cannot write the run lock: {e}",
                            path.display()
                        ))
                    })?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    match serde_json::from_str::<Holder>(&text) {
                        Ok(h) if h.host == me.host && !running(h.pid) => {
                            tracing::warn!(
                                "{}: taking over the lock of a run that is gone (pid {} on {})",
                                path.display(),
                                h.pid,
                                h.host
                            );
                        }
                        Ok(h) => {
                            return Err(setup(format!(
                                "trainer.default_local_dir = {}: another run is using it (pid {} on {}, started at {} s since the epoch); give this run another trainer.default_local_dir, or stop that run (if it crashed on another machine, delete {})",
                                dir.display(),
                                h.pid,
                                h.host,
                                h.started,
                                path.display()
                            )))
                        }
                        Err(_) => tracing::warn!(
                            "{}: taking over an unreadable run lock",
                            path.display()
                        ),
                    }
                    std::fs::remove_file(&path).map_err(|e| {
                        setup(format!(
                            "{}: cannot remove a stale run lock: {e}",
                            path.display()
                        ))
                    })?;
                }
                Err(e) => {
                    return Err(setup(format!(
                        "{}: cannot create the run lock: {e}",
                        path.display()
                    )))
                }
            }
        }
        Err(setup(format!(
            "{}: another run took the lock while this one was taking over a stale one",
            path.display()
        )))
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_holder(dir: &Path, h: &Holder) {
        std::fs::write(dir.join(LOCK), serde_json::to_string(h).unwrap()).unwrap();
    }

    #[test]
    fn a_live_holder_refuses_a_second_run_and_a_released_lock_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        let e = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(e.contains("trainer.default_local_dir"), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        assert!(!dir.path().join(LOCK).exists());
        let again = RunLock::acquire(dir.path()).unwrap();
        drop(again);
    }

    #[test]
    fn a_stale_or_unreadable_lock_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        // A pid beyond Linux's largest (2^22) never runs.
        let gone = Holder {
            pid: 4_194_305,
            host: host_name(),
            started: 1,
        };
        write_holder(dir.path(), &gone);
        let lock = RunLock::acquire(dir.path()).unwrap();
        let now: Holder =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(LOCK)).unwrap()).unwrap();
        assert_eq!(now.pid, std::process::id());
        drop(lock);
        std::fs::write(dir.path().join(LOCK), "{half a lock").unwrap();
        drop(RunLock::acquire(dir.path()).unwrap());
    }

    #[test]
    fn a_holder_on_another_host_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = Holder {
            pid: 1,
            host: format!("{}-elsewhere", host_name()),
            started: 1,
        };
        write_holder(dir.path(), &elsewhere);
        let e = RunLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(e.contains("-elsewhere") && e.contains("delete"), "{e}");
    }
}

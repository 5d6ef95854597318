//! Starting rank worker processes on this node and watching them: the local half of
//! `trainer.launcher=processes` (issue #17). Each rank is a child process with the torchrun
//! variables set ([`crate::megatron::parallel::LaunchEnv`] reads them back), and a watcher
//! thread notices the first child that ends badly: [`LocalRanks::wait`] then stops every other
//! rank within a poll interval and returns an error naming the rank and how it ended, so no rank
//! is left waiting on a collective whose peer is gone. Dropping the handle stops them too (the
//! driver failing). The children stay in the driver's process group, so Ctrl-C in a terminal
//! reaches every rank at once.

use std::process::{Child, Command, ExitStatus};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the watcher looks at the children.
const POLL: Duration = Duration::from_millis(50);

/// What went wrong with the local ranks.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("starting rank {rank} (`{program}`): {message}")]
    Spawn {
        rank: usize,
        program: String,
        message: String,
    },
    #[error("rank {rank} (pid {pid}) {how}; the other ranks were stopped")]
    RankFailed { rank: usize, pid: u32, how: String },
}

/// The rank processes of this node.
pub struct LocalRanks {
    /// `None` once the watcher took the children.
    watcher: Option<JoinHandle<Result<(), LaunchError>>>,
    stop: mpsc::Sender<()>,
    /// The first rank that ended badly: (rank, pid, how), once the watcher saw it.
    failed: Arc<Mutex<Option<(usize, u32, String)>>>,
}

/// Where the job's ranks meet, and this node's place in it.
#[derive(Debug, Clone)]
pub struct NodeLayout {
    pub world_size: usize,
    /// Ranks per node; this node runs ranks `node_rank * per_node ..`.
    pub per_node: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl LocalRanks {
    /// Starts this node's ranks: `command(local_rank)` gives each its program and arguments;
    /// the launcher adds `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
    /// `MASTER_ADDR` and `MASTER_PORT`. A rank that cannot start stops the ones already started.
    pub fn spawn(
        layout: &NodeLayout,
        mut command: impl FnMut(usize) -> Command,
    ) -> Result<Self, LaunchError> {
        let mut children: Vec<(usize, Child)> = Vec::with_capacity(layout.per_node);
        for local in 0..layout.per_node {
            let rank = layout.node_rank * layout.per_node + local;
            if rank >= layout.world_size {
                break;
            }
            let mut cmd = command(local);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", layout.world_size.to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("LOCAL_WORLD_SIZE", layout.per_node.to_string())
                .env("GROUP_RANK", layout.node_rank.to_string())
                .env("MASTER_ADDR", &layout.master_addr)
                .env("MASTER_PORT", layout.master_port.to_string());
            match cmd.spawn() {
                Ok(child) => children.push((rank, child)),
                Err(e) => {
                    stop_all(&mut children);
                    return Err(LaunchError::Spawn {
                        rank,
                        program: cmd.get_program().to_string_lossy().into_owned(),
                        message: e.to_string(),
                    });
                }
            }
        }
        let (stop, stopped) = mpsc::channel();
        let failed = Arc::new(Mutex::new(None));
        let record = failed.clone();
        let watcher = std::thread::spawn(move || {
            let outcome = watch(children, stopped);
            if let Err(LaunchError::RankFailed { rank, pid, how }) = &outcome {
                *record.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((*rank, *pid, how.clone()));
            }
            outcome
        });
        Ok(Self {
            watcher: Some(watcher),
            stop,
            failed,
        })
    }

    /// The first rank that ended badly so far, as an error message (the others are being
    /// stopped).
    pub fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(rank, pid, how)| format!("rank {rank} (pid {pid}) {how}"))
    }

    /// How a rank's process ended, if it is the one that ended badly (callable from any
    /// thread).
    pub fn exit_reports(&self) -> impl Fn(usize) -> Option<String> + Send + Sync + 'static {
        let failed = self.failed.clone();
        move |rank| {
            failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .filter(|(r, _, _)| *r == rank)
                .map(|(_, pid, how)| format!("(pid {pid}) {how}"))
        }
    }

    /// Waits until every rank has exited successfully, or the first failure (the others are
    /// stopped then).
    pub fn wait(mut self) -> Result<(), LaunchError> {
        let watcher = self.watcher.take().expect("waited once");
        watcher.join().unwrap_or_else(|_| {
            Err(LaunchError::RankFailed {
                rank: usize::MAX,
                pid: 0,
                how: "could not be watched (the watcher panicked)".into(),
            })
        })
    }
}

impl Drop for LocalRanks {
    fn drop(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            let _ = self.stop.send(());
            let _ = watcher.join();
        }
    }
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return format!("was killed by signal {signal}");
        }
    }
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => "ended without a status".into(),
    }
}

fn stop_all(children: &mut [(usize, Child)]) {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
    }
    for (_, child) in children.iter_mut() {
        let _ = child.wait();
    }
}

/// Polls the children until all succeed, one fails (the rest are killed), or `stop` says so.
fn watch(mut children: Vec<(usize, Child)>, stop: mpsc::Receiver<()>) -> Result<(), LaunchError> {
    loop {
        let mut i = 0;
        while i < children.len() {
            let (rank, child) = &mut children[i];
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    children.swap_remove(i);
                    continue;
                }
                Ok(Some(status)) => {
                    let (rank, pid) = (*rank, child.id());
                    children.swap_remove(i);
                    stop_all(&mut children);
                    return Err(LaunchError::RankFailed {
                        rank,
                        pid,
                        how: describe(status),
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    let (rank, pid) = (*rank, child.id());
                    stop_all(&mut children);
                    return Err(LaunchError::RankFailed {
                        rank,
                        pid,
                        how: format!("could not be waited on ({e})"),
                    });
                }
            }
            i += 1;
        }
        if children.is_empty() {
            return Ok(());
        }
        match stop.recv_timeout(POLL) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                stop_all(&mut children);
                return Ok(());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::time::Instant;

    fn layout(world: usize) -> NodeLayout {
        NodeLayout {
            world_size: world,
            per_node: world,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29_511,
        }
    }

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.arg("-c").arg(script);
        c
    }

    #[test]
    fn ranks_get_the_torchrun_variables_and_all_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().to_path_buf();
        let ranks = LocalRanks::spawn(&layout(3), |_| {
            sh(&format!(
                "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT \
                 > {}/$RANK",
                out.display()
            ))
        })
        .unwrap();
        ranks.wait().unwrap();
        for r in 0..3 {
            let line = std::fs::read_to_string(dir.path().join(r.to_string())).unwrap();
            assert_eq!(line.trim(), format!("{r} 3 {r} 3 127.0.0.1:29511"));
        }
    }

    /// One rank killed mid-run: the wait ends at once naming it, and the other ranks (which
    /// would run for a minute) are stopped.
    #[test]
    fn a_killed_rank_stops_the_others_and_is_named() {
        let start = Instant::now();
        let ranks = LocalRanks::spawn(&layout(4), |local| {
            if local == 2 {
                sh("sleep 0.3; kill -9 $$")
            } else {
                sh("exec sleep 60")
            }
        })
        .unwrap();
        let err = ranks.wait().unwrap_err();
        assert!(
            matches!(err, LaunchError::RankFailed { rank: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("signal 9"), "{err}");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn a_rank_that_cannot_start_is_named() {
        let err = LocalRanks::spawn(&layout(2), |_| Command::new("/nonexistent/verl-worker"))
            .err()
            .unwrap();
        assert!(matches!(err, LaunchError::Spawn { rank: 0, .. }), "{err}");
        assert!(
            err.to_string().contains("/nonexistent/verl-worker"),
            "{err}"
        );
    }

    /// Dropping the handle (the driver failing) stops every rank.
    #[test]
    fn dropping_the_handle_stops_the_ranks() {
        let start = Instant::now();
        let ranks = LocalRanks::spawn(&layout(2), |_| sh("exec sleep 60")).unwrap();
        drop(ranks);
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

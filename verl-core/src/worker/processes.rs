//! [`ProcessRanks`]: the driver's connections to its rank processes (one per GPU), and
//! fail-fast.
//!
//! Each rank process connects to the driver and says which rank it is; the driver then sends
//! calls (a method name and its encoded argument) and waits for the replies. A reader thread per
//! rank routes replies to the waiting calls and notices a closed connection at once. The first
//! failure of a call (an error, a panic, or a rank whose connection closed because its process
//! died) makes the driver send `Abort` to every rank (each exits on it, even from inside a
//! collective), and the call returns an error naming the rank and the method: no rank is left
//! waiting for a peer that is gone.

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::oneshot;

use crate::error::{Error, Result, WorkerError};
use crate::wire::{split, Message, RemoteError, WireReader, WireWriter};

type ReplySender = oneshot::Sender<std::result::Result<Vec<u8>, RemoteError>>;

struct Pending {
    calls: HashMap<u64, ReplySender>,
    /// Why the connection ended, once it has.
    closed: Option<String>,
    /// When the rank last said anything (a heartbeat or a reply).
    last_heard: Instant,
}

impl Default for Pending {
    fn default() -> Self {
        Self {
            calls: HashMap::new(),
            closed: None,
            last_heard: Instant::now(),
        }
    }
}

struct Link {
    writer: Arc<WireWriter>,
    pending: Arc<Mutex<Pending>>,
    pid: u32,
}

/// The driver's handle on the rank processes of a job.
pub struct ProcessRanks {
    links: Vec<Link>,
    next_id: AtomicU64,
    poisoned: Mutex<Option<String>>,
    timeout: Option<Duration>,
    /// How long a rank may be silent (no heartbeat, no reply) before a call fails naming it.
    heartbeat_timeout: Duration,
    /// Tells how a rank's process ended, when the driver started it (exit status, signal).
    how_ended: Box<dyn Fn(usize) -> Option<String> + Send + Sync>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read_replies(mut reader: WireReader, pending: Arc<Mutex<Pending>>) {
    let why = loop {
        match reader.recv() {
            Ok(Some(Message::Reply { id, result })) => {
                let mut p = lock(&pending);
                p.last_heard = Instant::now();
                if let Some(tx) = p.calls.remove(&id) {
                    let _ = tx.send(result);
                }
            }
            Ok(Some(Message::Heartbeat)) => lock(&pending).last_heard = Instant::now(),
            Ok(Some(other)) => {
                tracing::warn!("unexpected message from a rank: {other:?}");
            }
            Ok(None) => break "its connection closed (the process exited or was killed)".into(),
            Err(e) => break format!("its connection failed: {e}"),
        }
    };
    let mut p = lock(&pending);
    p.closed = Some(why);
    // Dropping the senders wakes every waiting call.
    p.calls.clear();
}

impl ProcessRanks {
    /// Accepts the `world_size` rank processes of a job on `listener` (each says which rank it
    /// is), within `timeout`. `alive` is asked while waiting: a rank that ended before
    /// connecting (it returns how) fails the wait at once.
    pub fn accept(
        listener: &TcpListener,
        world_size: usize,
        timeout: Duration,
        alive: impl Fn() -> Option<String>,
    ) -> Result<Self> {
        let spawn_err =
            |rank: usize, message: String| -> Error { WorkerError::Spawn { rank, message }.into() };
        listener
            .set_nonblocking(true)
            .map_err(|e| spawn_err(0, e.to_string()))?;
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<Link>> = (0..world_size).map(|_| None).collect();
        let mut joined = 0;
        while joined < world_size {
            if let Some(how) = alive() {
                return Err(spawn_err(usize::MAX, how));
            }
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> =
                            (0..world_size).filter(|&r| links[r].is_none()).collect();
                        return Err(spawn_err(
                            missing[0],
                            format!(
                                "ranks {missing:?} did not connect within {}s (are they \
                                 started, with MASTER_ADDR/MASTER_PORT pointing here?)",
                                timeout.as_secs()
                            ),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(e) => return Err(spawn_err(0, format!("accepting a rank: {e}"))),
            };
            stream
                .set_nonblocking(false)
                .map_err(|e| spawn_err(0, e.to_string()))?;
            let (mut reader, writer) = split(stream)?;
            let (rank, pid) = match reader.recv()? {
                Some(Message::Hello { rank, pid }) => (rank, pid),
                other => {
                    return Err(spawn_err(
                        0,
                        format!("a connection began with {other:?}, not a rank's hello"),
                    ))
                }
            };
            if rank >= world_size || links[rank].is_some() {
                return Err(spawn_err(
                    rank,
                    format!(
                        "a process (pid {pid}) says it is rank {rank}, but the job has ranks \
                         0..{world_size} and that one {}",
                        if rank < world_size {
                            "already joined"
                        } else {
                            "does not exist"
                        }
                    ),
                ));
            }
            let pending = Arc::new(Mutex::new(Pending::default()));
            let routed = pending.clone();
            std::thread::Builder::new()
                .name(format!("verl-driver-rank{rank}"))
                .spawn(move || read_replies(reader, routed))
                .map_err(|e| spawn_err(rank, e.to_string()))?;
            links[rank] = Some(Link {
                writer: Arc::new(writer),
                pending,
                pid,
            });
            joined += 1;
        }
        Ok(Self {
            links: links.into_iter().map(|l| l.expect("all joined")).collect(),
            next_id: AtomicU64::new(1),
            poisoned: Mutex::new(None),
            timeout: None,
            heartbeat_timeout: Duration::from_secs(30),
            how_ended: Box::new(|_| None),
        })
    }

    /// Fails (and aborts) a call that runs longer than `timeout`.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Fails a call naming a rank silent for `timeout` (see [`super::heartbeat`]).
    pub fn with_heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.heartbeat_timeout = timeout;
        self
    }

    /// A rank silent for longer than the heartbeat timeout, and how long it has been silent.
    fn silent_rank(&self) -> Option<(usize, Duration)> {
        self.links.iter().enumerate().find_map(|(rank, link)| {
            let p = lock(&link.pending);
            let quiet = p.last_heard.elapsed();
            (p.closed.is_none() && quiet > self.heartbeat_timeout).then_some((rank, quiet))
        })
    }

    /// How the driver learns how a lost rank's process ended (its launcher's exit status).
    pub fn with_exit_reports(
        mut self,
        f: impl Fn(usize) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.how_ended = Box::new(f);
        self
    }

    pub fn world_size(&self) -> usize {
        self.links.len()
    }

    /// The rank processes' ids, in rank order.
    pub fn pids(&self) -> Vec<u32> {
        self.links.iter().map(|l| l.pid).collect()
    }

    /// Runs `method` on every rank with a payload (`payloads[r]` = `Some`) and returns each
    /// rank's reply. On the first failure every rank is aborted and the job is over.
    pub async fn call(
        &self,
        method: &str,
        payloads: Vec<Option<Vec<u8>>>,
    ) -> Result<Vec<Option<Vec<u8>>>> {
        if let Some(m) = lock(&self.poisoned).clone() {
            return Err(WorkerError::Poisoned { method: m }.into());
        }
        let n = self.world_size();
        let mut waiting = FuturesUnordered::new();
        let mut outputs: Vec<Option<Vec<u8>>> = (0..n).map(|_| None).collect();
        for (rank, payload) in payloads.into_iter().enumerate() {
            let Some(payload) = payload else { continue };
            let link = &self.links[rank];
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            {
                let mut p = lock(&link.pending);
                if let Some(why) = &p.closed {
                    let why = why.clone();
                    drop(p);
                    return Err(self.fail(rank, method, None, why));
                }
                p.calls.insert(id, tx);
            }
            let sent = link.writer.send(Message::Call {
                id,
                method: method.to_string(),
                payload,
            });
            if let Err(e) = sent {
                return Err(self.fail(rank, method, None, format!("sending the call: {e}")));
            }
            waiting.push(async move { (rank, rx.await) });
        }
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        // After a first failure, a short grace for the others: when a process dies, its peers
        // fail in their collectives too, and the lost rank (the cause) is the one to name.
        let mut failures: Vec<(usize, Option<String>, String)> = Vec::new();
        let mut grace: Option<tokio::time::Instant> = None;
        while !waiting.is_empty() {
            if grace.is_none() {
                if let Some((rank, quiet)) = self.silent_rank() {
                    let pid = self.links[rank].pid;
                    let state = super::heartbeat::process_state(pid)
                        .map_or_else(String::new, |s| format!("; {s}"));
                    let how = format!(
                        "its process (pid {pid}) has not answered for {:.0}s, more than {} allows \
                         ({}s){state}",
                        quiet.as_secs_f64(),
                        super::heartbeat::HEARTBEAT_TIMEOUT_ENV,
                        self.heartbeat_timeout.as_secs()
                    );
                    return Err(self.fail(rank, method, None, how));
                }
            }
            // Wake at least once a heartbeat interval to look for a silent rank.
            let beat = tokio::time::Instant::now() + super::heartbeat::HEARTBEAT_INTERVAL;
            let until = match (deadline, grace) {
                (Some(d), Some(g)) => d.min(g),
                (Some(d), None) => d.min(beat),
                (None, Some(g)) => g,
                (None, None) => beat,
            };
            let next = match tokio::time::timeout_at(until, waiting.next()).await {
                Ok(n) => n,
                Err(_) if grace.is_some() => break,
                // A heartbeat wake-up: look for a silent rank again.
                Err(_) if deadline.is_none_or(|d| tokio::time::Instant::now() < d) => continue,
                Err(_) => {
                    let secs = self.timeout.map_or(0.0, |t| t.as_secs_f64());
                    self.abort(&format!("`{method}` timed out after {secs:.0}s"));
                    return Err(WorkerError::Timeout {
                        method: method.into(),
                        timeout_s: secs,
                        pending: (0..n).filter(|&r| outputs[r].is_none()).collect(),
                    }
                    .into());
                }
            };
            let Some((rank, reply)) = next else { break };
            match reply {
                Ok(Ok(bytes)) => outputs[rank] = Some(bytes),
                Ok(Err(remote)) => failures.push((rank, Some(remote.message), String::new())),
                Err(_) => {
                    let why = lock(&self.links[rank].pending)
                        .closed
                        .clone()
                        .unwrap_or_else(|| "its connection closed".into());
                    failures.push((rank, None, why));
                }
            }
            if !failures.is_empty() && grace.is_none() {
                grace = Some(tokio::time::Instant::now() + Duration::from_millis(300));
            }
        }
        if !failures.is_empty() {
            // The root cause is a rank whose process was lost rather than one that reported an
            // error, and among lost ranks one killed by a signal: its peers may exit on their
            // own when its collectives break, and their connections can close first.
            let lost = |f: &&(usize, Option<String>, String)| f.1.is_none();
            // Under load the killed rank's own connection can close after the grace; a rank the
            // launcher saw killed by a signal is still the cause (it may take the launcher a
            // moment to see it end).
            if failures.iter().any(|f| lost(&f)) {
                if let Some(rank) = self.signalled_rank(Duration::from_millis(500)) {
                    if !failures.iter().any(|f| f.0 == rank) {
                        failures.push((rank, None, "its connection closed".into()));
                    }
                }
            }
            let killed = failures.iter().position(|f| {
                lost(&f) && (self.how_ended)(f.0).is_some_and(|h| h.contains("signal"))
            });
            let pick = killed
                .or_else(|| failures.iter().position(|f| lost(&f)))
                .unwrap_or(0);
            let (rank, remote, how) = failures.swap_remove(pick);
            return Err(self.fail(rank, method, remote, how));
        }
        Ok(outputs)
    }

    /// A rank whose process the launcher saw killed by a signal, waiting up to `patience` for
    /// one to show.
    fn signalled_rank(&self, patience: Duration) -> Option<usize> {
        let deadline = Instant::now() + patience;
        loop {
            let found = (0..self.links.len())
                .find(|&r| (self.how_ended)(r).is_some_and(|h| h.contains("signal")));
            if found.is_some() || Instant::now() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Aborts the job after `rank` failed in `method` (with `remote`'s error, or lost with
    /// `how`), and the error that says so.
    fn fail(&self, rank: usize, method: &str, remote: Option<String>, how: String) -> Error {
        let err: Error = match remote {
            Some(message) => WorkerError::Remote {
                rank,
                method: method.into(),
                message,
            }
            .into(),
            None => {
                // The launcher may need a moment to see the process end.
                let deadline = Instant::now() + Duration::from_millis(500);
                let how = loop {
                    if let Some(h) = (self.how_ended)(rank) {
                        break format!("its process {h}");
                    }
                    if Instant::now() > deadline {
                        break how;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                };
                WorkerError::Lost {
                    rank,
                    method: method.into(),
                    how,
                }
                .into()
            }
        };
        self.abort(&format!("{err}"));
        err
    }

    /// Tells every rank to stop now (they exit, even mid-collective); later calls are refused.
    pub fn abort(&self, reason: &str) {
        lock(&self.poisoned).get_or_insert_with(|| reason.to_string());
        for link in &self.links {
            let _ = link.writer.send(Message::Abort {
                reason: reason.to_string(),
            });
            link.writer.close();
        }
    }

    /// Tells every rank the run is over (they exit cleanly).
    pub fn shutdown(&self) {
        lock(&self.poisoned).get_or_insert_with(|| "the run is over".to_string());
        for link in &self.links {
            let _ = link.writer.send(Message::Shutdown);
        }
    }
}

impl Drop for ProcessRanks {
    fn drop(&mut self) {
        // A driver that stops without a shutdown (an error, Ctrl-C) takes its ranks with it.
        if lock(&self.poisoned).is_none() {
            self.abort("the driver stopped");
        }
    }
}

//! [`serve_rank`]: the body of a rank process. It connects to the driver, builds its roles from
//! the driver's setup message, and runs the calls it is sent, one at a time, on this thread
//! (which owns the device). A second thread reads the connection, so that an `Abort` from the
//! driver, or the driver going away, ends the process at once, even while a call is stuck in a
//! collective whose peer died. A third beats once a second ([`super::heartbeat`]), so the
//! driver tells a stopped or frozen rank from a busy one.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use burn::prelude::Backend;
use futures::future::LocalBoxFuture;

use super::methods::Method;
use super::{panic_message, MethodTable, RankContext, Worker};
use crate::error::{Error, Result, WorkerError};
use crate::wire::{connect, split, Message, RemoteError, WireReader};
use crate::DataProto;

/// The exit status of a rank process that stopped because the driver aborted the job (or went
/// away): the failure is reported by the driver, under the rank that caused it.
pub const EXIT_ABORTED: i32 = 75;

/// The name of the first call a rank process gets: its roles' setup.
pub const SETUP: &str = "setup";

/// One role served by a rank process, called by method name with an encoded argument.
pub trait ServedRole {
    fn call<'a>(
        &'a mut self,
        method: &'a str,
        ctx: RankContext,
        payload: Vec<u8>,
    ) -> LocalBoxFuture<'a, Result<Vec<u8>>>;
}

/// A worker and its method table, as a served role; `DataProto` arguments land on `device`.
pub struct Served<W, B: Backend> {
    pub worker: W,
    pub table: Arc<MethodTable<W, B>>,
    pub device: B::Device,
}

impl<W: Worker, B: Backend> ServedRole for Served<W, B> {
    fn call<'a>(
        &'a mut self,
        method: &'a str,
        ctx: RankContext,
        payload: Vec<u8>,
    ) -> LocalBoxFuture<'a, Result<Vec<u8>>> {
        Box::pin(async move {
            match self.table.get(method)? {
                Method::Proto(f) => {
                    let f = f.clone();
                    let data = DataProto::<B>::from_wire(&payload, &self.device)?;
                    let out = f(&mut self.worker, ctx, data).await?;
                    Ok(out.to_wire()?)
                }
                Method::Value(f) => {
                    let f = f.clone();
                    let v = serde_json::from_slice(&payload).map_err(|e| {
                        Error::backend("worker", format!("method `{method}`: its argument: {e}"))
                    })?;
                    let out = f(&mut self.worker, ctx, v).await?;
                    serde_json::to_vec(&out).map_err(|e| {
                        Error::backend("worker", format!("method `{method}`: its result: {e}"))
                    })
                }
            }
        })
    }
}

/// Where this rank process stands in the job, as its setup sees it.
#[derive(Debug, Clone)]
pub struct RankLink {
    pub rank: usize,
    pub world_size: usize,
    /// This process's address on the interface that reaches the driver: where its peers can
    /// reach it too (for the CPU collectives' listeners).
    pub host: IpAddr,
}

/// Roles by name, as a rank's setup builds them.
pub type Roles = BTreeMap<String, Box<dyn ServedRole>>;

enum Incoming {
    Call {
        id: u64,
        method: String,
        payload: Vec<u8>,
    },
    Shutdown,
}

/// Runs rank `rank` of `world_size`: connects to the driver at `driver` (retrying for
/// `connect_timeout` while it starts), builds the roles with `setup` from the driver's setup
/// payload, then serves calls named `role.method` until the driver's shutdown. Returns when
/// the run is over; exits the process with [`EXIT_ABORTED`] when the driver aborts or goes away.
pub fn serve_rank<S>(
    driver: &str,
    rank: usize,
    world_size: usize,
    connect_timeout: Duration,
    setup: S,
) -> Result<()>
where
    S: FnOnce(&[u8], &RankLink) -> Result<Roles>,
{
    let stream = connect(driver, connect_timeout)?;
    let host = stream
        .local_addr()
        .map_err(|e| Error::backend("worker", format!("connection to {driver}: {e}")))?
        .ip();
    let (reader, writer) = split(stream)?;
    writer.send(Message::Hello {
        rank,
        pid: std::process::id(),
    })?;
    let writer = Arc::new(writer);
    super::heartbeat::spawn(rank, writer.clone())?;
    let calls = spawn_link_reader(rank, reader)?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::backend("worker", e.to_string()))?;
    let ctx = RankContext::detached(rank, world_size);
    let link = RankLink {
        rank,
        world_size,
        host,
    };
    let reply = |id: u64, method: &str, result: Result<Vec<u8>>| {
        let result = result.map_err(|e| RemoteError {
            rank,
            method: method.to_string(),
            message: e.to_string(),
        });
        writer.send(Message::Reply { id, result })
    };
    let mut roles: Option<Roles> = None;
    let mut setup = Some(setup);
    while let Ok(incoming) = calls.recv() {
        let (id, method, payload) = match incoming {
            Incoming::Shutdown => return Ok(()),
            Incoming::Call {
                id,
                method,
                payload,
            } => (id, method, payload),
        };
        let outcome =
            super::reported_panics::catch_reported(AssertUnwindSafe(|| -> Result<Vec<u8>> {
                if method == SETUP {
                    let build = setup.take().ok_or_else(|| {
                        Error::backend("worker", "the driver sent a second setup")
                    })?;
                    roles = Some(build(&payload, &link)?);
                    return Ok(Vec::new());
                }
                let served = role_of(roles.as_mut(), &method)?;
                let name = method.split_once('.').map_or("", |(_, name)| name);
                runtime.block_on(served.call(name, ctx.clone(), payload))
            }));
        let result = outcome.unwrap_or_else(|p| {
            Err(Error::backend(
                "worker",
                format!("panicked: {}", panic_message(p)),
            ))
        });
        // A failure on a backend thread outranks whatever the call saw after it.
        let result = super::device_fault::outrank(result);
        let failed_setup = method == SETUP && result.is_err();
        reply(id, &method, result)?;
        if failed_setup {
            // The driver aborts the job; wait for it rather than racing its report.
            std::thread::sleep(Duration::from_secs(30));
            return Err(Error::backend("worker", "the setup failed"));
        }
    }
    Ok(())
}

/// Reads the driver's messages on a thread of their own and hands calls to the rank's loop; an
/// abort, an unexpected message or a lost connection ends the process at once (the rank may be
/// blocked in a collective that will never complete).
fn spawn_link_reader(rank: usize, mut reader: WireReader) -> Result<mpsc::Receiver<Incoming>> {
    let (calls_tx, calls) = mpsc::channel::<Incoming>();
    std::thread::Builder::new()
        .name("verl-rank-link".into())
        .spawn(move || loop {
            let stop = |why: String| -> ! {
                eprintln!("rank {rank}: stopping: {why}");
                std::process::exit(EXIT_ABORTED)
            };
            match reader.recv() {
                Ok(Some(Message::Call {
                    id,
                    method,
                    payload,
                })) => {
                    let _ = calls_tx.send(Incoming::Call {
                        id,
                        method,
                        payload,
                    });
                }
                Ok(Some(Message::Shutdown)) => {
                    let _ = calls_tx.send(Incoming::Shutdown);
                    return;
                }
                Ok(Some(Message::Abort { reason })) => {
                    // The driver reports the failure once, under the rank that caused it.
                    tracing::debug!("rank {rank}: stopping: the driver aborted: {reason}");
                    std::process::exit(EXIT_ABORTED)
                }
                Ok(Some(other)) => stop(format!("unexpected message from the driver: {other:?}")),
                Ok(None) => stop("the driver went away".into()),
                Err(e) => stop(format!("the driver's connection failed: {e}")),
            }
        })
        .map_err(|e| {
            Error::from(WorkerError::Spawn {
                rank,
                message: e.to_string(),
            })
        })?;
    Ok(calls)
}

/// The role a call `role.method` is for, or an error naming what is wrong with the call.
fn role_of<'a>(roles: Option<&'a mut Roles>, method: &str) -> Result<&'a mut Box<dyn ServedRole>> {
    let roles = roles.ok_or_else(|| {
        Error::backend("worker", format!("`{method}` was called before the setup"))
    })?;
    let (role, _) = method.split_once('.').ok_or_else(|| {
        Error::backend(
            "worker",
            format!("`{method}` is not of the form role.method"),
        )
    })?;
    let known = roles.keys().cloned().collect::<Vec<_>>().join(", ");
    roles.get_mut(role).ok_or_else(|| {
        Error::backend(
            "worker",
            format!("no role `{role}` on this rank (it has: {known})"),
        )
    })
}

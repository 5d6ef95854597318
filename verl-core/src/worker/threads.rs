//! [`WorkerGroup`]: a role's ranks as threads of this process.
//!
//! Each rank runs on its own OS thread, which builds and owns the worker (and so its device and
//! memory) and drives the worker's async methods on a current-thread runtime. The controller calls
//! a method on the group with a dispatch mode: the input is split, the ranks run concurrently, and
//! the outputs come back in rank order (or concatenated, for the data-parallel modes).
//!
//! When a rank fails or panics, the group signals every other rank to cancel (at its next await
//! point: collectives are await points), waits for them up to the timeout, and returns a typed
//! error naming the rank and the method. A rank that neither finishes nor cancels in time makes
//! the group *poisoned*: later calls are refused rather than left to hang.
//!
//! ```
//! use verl_core::dispatch::DispatchInfo;
//! use verl_core::worker::{RankContext, Worker, WorkerGroup};
//!
//! struct Echo { rank: usize }
//! impl Worker for Echo {
//!     fn dispatch_info(&self, _mesh: &str) -> Option<DispatchInfo> { None }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let group = WorkerGroup::spawn(4, |ctx: RankContext| Ok(Echo { rank: ctx.rank }))?;
//! let ranks = group
//!     .execute_all("whoami", (), |w: &mut Echo, _ctx, ()| Box::pin(async move { Ok(w.rank) }))
//!     .await?;
//! assert_eq!(ranks, vec![0, 1, 2, 3]);
//! # Ok::<(), verl_core::Error>(())
//! # }).unwrap();
//! ```

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::prelude::Backend;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{oneshot, watch};

use super::{panic_message, AbortHook, MethodFuture, RankContext, Worker, AUTO_PADDING_KEY};
use crate::dispatch::{DispatchInfo, DispatchMode, DispatchPlan};
use crate::error::{DispatchError, Error, Result, WorkerError};
use crate::DataProto;

type Job<W> =
    Box<dyn FnOnce(&mut W, &tokio::runtime::Runtime, watch::Receiver<bool>, &AbortHook) + Send>;

enum RankOutcome<O> {
    Done(Result<O>),
    Cancelled,
    Panicked(String),
}

/// One rank's share of a [`WorkerGroup::run`] call.
struct RankCall {
    rank: usize,
    world_size: usize,
    method: String,
    cancel: watch::Receiver<bool>,
    /// The rank that failed first (set by the first to fail).
    origin: Arc<Mutex<Option<usize>>>,
}

impl RankCall {
    /// The job the rank's thread runs: `f` on its worker, cancelled with the call, a panic
    /// caught; the first rank to fail aborts its collectives at once, so that peers blocked in
    /// one learn why in milliseconds rather than after the peer timeout.
    fn job<W, I, O, F>(self, f: Arc<F>, input: I, tx: oneshot::Sender<RankOutcome<O>>) -> Job<W>
    where
        W: Worker,
        I: Send + 'static,
        O: Send + 'static,
        F: for<'a> Fn(&'a mut W, RankContext, I) -> MethodFuture<'a, O> + Send + Sync + 'static,
    {
        Box::new(move |worker, runtime, _, hook| {
            let RankCall {
                rank,
                world_size,
                method,
                cancel,
                origin,
            } = self;
            let ctx = RankContext::new(rank, world_size, cancel, hook.clone());
            let outcome = super::reported_panics::catch_reported(AssertUnwindSafe(|| {
                runtime.block_on(async {
                    let stop = ctx.clone();
                    tokio::select! {
                        r = f(worker, ctx, input) => RankOutcome::Done(r),
                        _ = stop.cancelled() => RankOutcome::Cancelled,
                    }
                })
            }));
            let outcome = outcome.unwrap_or_else(|p| RankOutcome::Panicked(panic_message(p)));
            // A failure on a backend thread outranks whatever the call saw after it.
            let outcome = match outcome {
                RankOutcome::Done(r) => RankOutcome::Done(super::device_fault::outrank(r)),
                RankOutcome::Panicked(m) if super::device_fault::first().is_some() => {
                    let panicked = Error::backend("worker", format!("panicked: {m}"));
                    RankOutcome::Done(super::device_fault::outrank(Err(panicked)))
                }
                other => other,
            };
            let failure = match &outcome {
                RankOutcome::Done(Err(e)) => Some(e.to_string()),
                RankOutcome::Panicked(m) => Some(format!("panicked: {m}")),
                _ => None,
            };
            if let Some(why) = failure {
                let first = origin.lock().map(|mut o| *o.get_or_insert(rank) == rank);
                if first.unwrap_or(false) {
                    hook.fire(&format!("rank {rank} failed in {method}: {why}"));
                }
            }
            let _ = tx.send(outcome);
        })
    }
}

/// Keeps the root cause of a failed call: the rank that failed first, else anything but a
/// cancellation (only a consequence).
fn keep_root_cause(first: &mut Option<Error>, e: Error, is_origin: bool) {
    let is_cancel = matches!(e, Error::Worker(WorkerError::Cancelled { .. }));
    let first_is_cancel = matches!(first, Some(Error::Worker(WorkerError::Cancelled { .. })));
    if is_origin || first.is_none() || (!is_cancel && first_is_cancel) {
        *first = Some(e);
    }
}

/// A rank's thread: builds its worker with `factory` (reporting on `ready`), then runs the
/// jobs sent to it until the group is dropped.
fn run_rank_thread<W, F>(
    rank: usize,
    world_size: usize,
    factory: &F,
    ready: mpsc::Sender<(usize, Result<()>)>,
    job_rx: mpsc::Receiver<Job<W>>,
) where
    F: Fn(RankContext) -> Result<W>,
{
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send((
                rank,
                Err(WorkerError::Spawn {
                    rank,
                    message: e.to_string(),
                }
                .into()),
            ));
            return;
        }
    };
    let (_never, cancel) = watch::channel(false);
    let hook = AbortHook::default();
    let ctx = RankContext::new(rank, world_size, cancel, hook.clone());
    let built = std::panic::catch_unwind(AssertUnwindSafe(|| factory(ctx)));
    let mut worker = match built {
        Ok(Ok(w)) => {
            let _ = ready.send((rank, Ok(())));
            w
        }
        Ok(Err(e)) => {
            let _ = ready.send((rank, Err(e)));
            return;
        }
        Err(p) => {
            let message = format!("worker constructor panicked: {}", panic_message(p));
            let _ = ready.send((rank, Err(WorkerError::Spawn { rank, message }.into())));
            return;
        }
    };
    drop(ready);
    while let Ok(job) = job_rx.recv() {
        job(&mut worker, &runtime, _never.subscribe(), &hook);
    }
}

struct RankHandle<W> {
    jobs: mpsc::Sender<Job<W>>,
    thread: Option<JoinHandle<()>>,
}

/// One worker per rank, each on its own thread. See the module docs.
pub struct WorkerGroup<W: Worker> {
    ranks: Vec<RankHandle<W>>,
    timeout: Option<Duration>,
    auto_padding: bool,
    poisoned: Mutex<Option<String>>,
    plans: Mutex<HashMap<String, DispatchPlan>>,
}

impl<W: Worker> WorkerGroup<W> {
    /// Starts `world_size` ranks; `factory` builds each rank's worker on that rank's thread.
    pub fn spawn<F>(world_size: usize, factory: F) -> Result<Self>
    where
        F: Fn(RankContext) -> Result<W> + Send + Sync + 'static,
    {
        if world_size == 0 {
            return Err(WorkerError::Spawn {
                rank: 0,
                message: "world_size must be at least 1".into(),
            }
            .into());
        }
        let factory = Arc::new(factory);
        let (ready_tx, ready_rx) = mpsc::channel::<(usize, Result<()>)>();
        let mut ranks = Vec::with_capacity(world_size);
        for rank in 0..world_size {
            let (jobs, job_rx) = mpsc::channel::<Job<W>>();
            let factory = factory.clone();
            let ready = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("verl-rank-{rank}"))
                .spawn(move || run_rank_thread(rank, world_size, factory.as_ref(), ready, job_rx))
                .map_err(|e| WorkerError::Spawn {
                    rank,
                    message: e.to_string(),
                })?;
            ranks.push(RankHandle {
                jobs,
                thread: Some(thread),
            });
        }
        drop(ready_tx);
        let mut first_error = None;
        for _ in 0..world_size {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((rank, Err(e))) => {
                    first_error.get_or_insert(match e {
                        Error::Worker(w) => Error::Worker(w),
                        other => WorkerError::Spawn {
                            rank,
                            message: other.to_string(),
                        }
                        .into(),
                    });
                }
                Err(_) => break,
            }
        }
        let group = Self {
            ranks,
            timeout: None,
            auto_padding: false,
            poisoned: Mutex::new(None),
            plans: Mutex::new(HashMap::new()),
        };
        match first_error {
            Some(e) => Err(e),
            None => Ok(group),
        }
    }

    /// Fails (and cancels) a call that runs longer than `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Pads batches that do not divide the dp size instead of refusing them.
    pub fn with_auto_padding(mut self, on: bool) -> Self {
        self.auto_padding = on;
        self
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Whether an earlier failure left the group unusable.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.lock().map(|p| p.is_some()).unwrap_or(true)
    }

    /// Runs `f` on every rank that has an input (`inputs[r]` = `Some`), concurrently, and
    /// returns each rank's output (`None` where a rank was not asked).
    pub async fn run<I, O, F>(
        &self,
        method: &str,
        inputs: Vec<Option<I>>,
        f: F,
    ) -> Result<Vec<Option<O>>>
    where
        I: Send + 'static,
        O: Send + 'static,
        F: for<'a> Fn(&'a mut W, RankContext, I) -> MethodFuture<'a, O> + Send + Sync + 'static,
    {
        self.ensure_runnable(method, inputs.len())?;
        let f = Arc::new(f);
        let world_size = self.world_size();
        let (cancel_tx, _) = watch::channel(false);
        // The rank that failed first: its error is the cause, the others' the consequence.
        let origin: Arc<Mutex<Option<usize>>> = Arc::new(Mutex::new(None));
        let mut pending = FuturesUnordered::new();
        let mut outputs: Vec<Option<O>> = (0..world_size).map(|_| None).collect();
        let mut running: Vec<usize> = Vec::new();
        for (rank, input) in inputs.into_iter().enumerate() {
            let Some(input) = input else { continue };
            let (tx, rx) = oneshot::channel::<RankOutcome<O>>();
            let call = RankCall {
                rank,
                world_size,
                method: method.to_string(),
                cancel: cancel_tx.subscribe(),
                origin: origin.clone(),
            };
            self.ranks[rank]
                .jobs
                .send(call.job(f.clone(), input, tx))
                .map_err(|_| WorkerError::RankGone { rank })?;
            running.push(rank);
            pending.push(async move { (rank, rx.await) });
        }
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        let mut first_error: Option<Error> = None;
        while !pending.is_empty() {
            let next = match deadline {
                Some(d) => match tokio::time::timeout_at(d, pending.next()).await {
                    Ok(n) => n,
                    Err(_) => {
                        let _ = cancel_tx.send(true);
                        return Err(first_error.unwrap_or(self.timed_out(method, &running)));
                    }
                },
                None => pending.next().await,
            };
            let Some((rank, outcome)) = next else { break };
            running.retain(|&r| r != rank);
            let failure = match outcome {
                Ok(RankOutcome::Done(Ok(o))) => {
                    outputs[rank] = Some(o);
                    None
                }
                other => Some(self.rank_error(rank, method, other)),
            };
            if let Some(e) = failure {
                let _ = cancel_tx.send(true);
                let is_origin = origin.lock().ok().and_then(|o| *o) == Some(rank);
                keep_root_cause(&mut first_error, e, is_origin);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(outputs),
        }
    }

    /// Refuses a call on a poisoned group, or one without an input slot per rank.
    fn ensure_runnable(&self, method: &str, inputs: usize) -> Result<()> {
        if let Some(m) = self
            .poisoned
            .lock()
            .map_err(|_| WorkerError::Poisoned {
                method: method.into(),
            })?
            .clone()
        {
            return Err(WorkerError::Poisoned { method: m }.into());
        }
        if inputs != self.world_size() {
            return Err(DispatchError::InputCount {
                mode: method.into(),
                inputs,
                world_size: self.world_size(),
            }
            .into());
        }
        Ok(())
    }

    /// The group's timeout ran out with `running` ranks still at `method`: the group is
    /// poisoned (its ranks may be stuck in a collective) and the error names them.
    fn timed_out(&self, method: &str, running: &[usize]) -> Error {
        self.poison(method);
        let mut still = running.to_vec();
        still.sort_unstable();
        WorkerError::Timeout {
            method: method.into(),
            timeout_s: self.timeout.map_or(0.0, |t| t.as_secs_f64()),
            pending: still,
        }
        .into()
    }

    /// The error of a rank whose call did not return a value (a panic poisons the group).
    fn rank_error<O>(
        &self,
        rank: usize,
        method: &str,
        outcome: std::result::Result<RankOutcome<O>, oneshot::error::RecvError>,
    ) -> Error {
        match outcome {
            Err(_) => WorkerError::RankGone { rank }.into(),
            Ok(RankOutcome::Done(Ok(_))) => unreachable!("a value is no failure"),
            Ok(RankOutcome::Done(Err(e))) => WorkerError::Failed {
                rank,
                method: method.into(),
                source: Box::new(e),
            }
            .into(),
            Ok(RankOutcome::Cancelled) => WorkerError::Cancelled {
                rank,
                method: method.into(),
            }
            .into(),
            Ok(RankOutcome::Panicked(message)) => {
                self.poison(method);
                WorkerError::Panicked {
                    rank,
                    method: method.into(),
                    message,
                }
                .into()
            }
        }
    }

    fn poison(&self, method: &str) {
        if let Ok(mut p) = self.poisoned.lock() {
            p.get_or_insert_with(|| method.to_string());
        }
    }

    /// `OneToAll`: the same input to every rank; every output, in rank order.
    pub async fn execute_all<I, O, F>(&self, method: &str, input: I, f: F) -> Result<Vec<O>>
    where
        I: Clone + Send + 'static,
        O: Send + 'static,
        F: for<'a> Fn(&'a mut W, RankContext, I) -> MethodFuture<'a, O> + Send + Sync + 'static,
    {
        let inputs = (0..self.world_size())
            .map(|_| Some(input.clone()))
            .collect();
        Ok(self
            .run(method, inputs, f)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// `AllToAll` / `DpCompute`: one input per rank; one output per rank.
    pub async fn execute_per_rank<I, O, F>(
        &self,
        method: &str,
        inputs: Vec<I>,
        f: F,
    ) -> Result<Vec<O>>
    where
        I: Send + 'static,
        O: Send + 'static,
        F: for<'a> Fn(&'a mut W, RankContext, I) -> MethodFuture<'a, O> + Send + Sync + 'static,
    {
        Ok(self
            .run(method, inputs.into_iter().map(Some).collect(), f)
            .await?
            .into_iter()
            .flatten()
            .collect())
    }

    /// `RankZero`: the same input to every rank (so collectives inside still match); rank 0's output.
    pub async fn execute_rank_zero<I, O, F>(&self, method: &str, input: I, f: F) -> Result<O>
    where
        I: Clone + Send + 'static,
        O: Send + 'static,
        F: for<'a> Fn(&'a mut W, RankContext, I) -> MethodFuture<'a, O> + Send + Sync + 'static,
    {
        let mut all = self.execute_all(method, input, f).await?;
        Ok(all.swap_remove(0))
    }

    /// The checked plan of a data-parallel mode, asking the ranks for their dispatch info once per mesh.
    pub async fn plan(&self, mode: &DispatchMode) -> Result<DispatchPlan> {
        let Some(mesh) = mode.mesh() else {
            return plan_from_infos(mode, None, self.world_size());
        };
        if let Some(p) = self.plans.lock().ok().and_then(|p| p.get(mesh).cloned()) {
            return Ok(p);
        }
        let infos = self
            .execute_all(
                "dispatch_info",
                mesh.to_string(),
                |w: &mut W, _ctx, mesh: String| Box::pin(async move { Ok(w.dispatch_info(&mesh)) }),
            )
            .await?;
        let plan = plan_from_infos(mode, Some(infos), self.world_size())?;
        if let Ok(mut p) = self.plans.lock() {
            p.insert(mesh.to_string(), plan.clone());
        }
        Ok(plan)
    }

    /// Calls a `DataProto` method in a data-parallel mode (`DpComputeProto`, `MegatronCompute`,
    /// `MegatronPpAsDp`, `Nd`): split, run on every rank, collect.
    pub async fn call_proto<B, F>(
        &self,
        mode: &DispatchMode,
        method: &str,
        data: DataProto<B>,
        f: F,
    ) -> Result<DataProto<B>>
    where
        B: Backend,
        DataProto<B>: Send,
        F: for<'a> Fn(&'a mut W, RankContext, DataProto<B>) -> MethodFuture<'a, DataProto<B>>
            + Send
            + Sync
            + 'static,
    {
        let plan = self.plan(mode).await?;
        let auto_pad = self.auto_padding
            || data
                .meta_info
                .get(AUTO_PADDING_KEY)
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
        let (per_rank, padding) = plan.split(&data, auto_pad)?;
        let outputs = self
            .run(method, per_rank.into_iter().map(Some).collect(), f)
            .await?;
        plan.collect(outputs, padding)
    }
}

impl<W: Worker> Drop for WorkerGroup<W> {
    fn drop(&mut self) {
        let stuck = self.is_poisoned();
        for r in &mut self.ranks {
            // Closing the job channel ends the rank's loop.
            let (dead, _) = mpsc::channel();
            r.jobs = dead;
            if let Some(t) = r.thread.take() {
                // A poisoned group may have a rank stuck in synchronous code: do not wait on it.
                if !stuck {
                    let _ = t.join();
                }
            }
        }
    }
}

/// The plan of `mode` from the ranks' dispatch info for its mesh (`None` for the mesh-less
/// `DpComputeProto`, which splits over all `world_size` ranks).
pub(crate) fn plan_from_infos(
    mode: &DispatchMode,
    infos: Option<Vec<Option<DispatchInfo>>>,
    world_size: usize,
) -> Result<DispatchPlan> {
    let name = mode.name();
    let (Some(mesh), Some(infos)) = (mode.mesh(), infos) else {
        return match mode {
            DispatchMode::DpComputeProto => DispatchPlan::new(
                &name,
                (0..world_size)
                    .map(|r| DispatchInfo::per_rank(r, world_size))
                    .collect(),
            ),
            other => Err(DispatchError::Plan {
                mode: other.name(),
                message: "is not a data-parallel DataProto mode; use execute_all / execute_per_rank / execute_rank_zero".into(),
            }
            .into()),
        };
    };
    let infos = infos
        .into_iter()
        .enumerate()
        .map(|(rank, i)| {
            i.ok_or_else(|| DispatchError::NoMeshInfo {
                mode: name.clone(),
                mesh: mesh.to_string(),
                rank,
            })
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    DispatchPlan::new(&name, infos)
}

//! A worker's profiler for one role on one rank: verl's `DistProfiler`. The trainer calls
//! [`RoleProfiler::start_step`] / [`RoleProfiler::stop_step`] on every rank around each
//! training step (verl's `start_profile` / `stop_profile`); worker methods run under
//! [`RoleProfiler::annotate`], which names them with a span and, in `discrete` mode, captures
//! each call on its own.
//!
//! What a capture is depends on the tool: `torch` writes a Chrome trace
//! (`<label>_prof_rank-<r>.json.gz`), `torch_memory` a memory timeline
//! (`<label>_memory_rank-<r>.json` and `.png`), `nsys` mirrors spans as NVTX ranges and opens
//! the CUDA profiler's capture range (Nsight Systems writes the report).

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tracing::Instrument;
use verl_core::config::{
    GlobalProfilerConfig, ProfilerTool, RoleProfilerConfig, TorchMemoryToolConfig,
};

use crate::{Capture, CapturePlan, Contents, MemoryCapture, NsysCapture, ProfilerError};

/// See the module documentation. Clones share their state.
#[derive(Clone)]
pub struct RoleProfiler {
    role: Arc<str>,
    rank: usize,
    /// `None` when this rank of this role is not profiled.
    state: Option<Arc<Mutex<State>>>,
}

struct State {
    tool: ProfilerTool,
    plan: CapturePlan,
    discrete: bool,
    contents: Contents,
    memory: TorchMemoryToolConfig,
    save_path: PathBuf,
    /// The open step capture and the step it began at.
    open: Option<(Open, u64)>,
    /// Calls of each method in each step (discrete file names).
    calls: HashMap<(u64, String), usize>,
    written: Vec<PathBuf>,
    /// The first failure to write a capture (reported at the next stop).
    failed: Option<ProfilerError>,
}

/// An open capture of whichever tool.
enum Open {
    Trace(Capture),
    Memory(MemoryCapture),
    Nsys(NsysCapture),
}

impl State {
    fn begin(&self, role: &str, rank: usize) -> Open {
        match self.tool {
            ProfilerTool::TorchMemory => Open::Memory(MemoryCapture::begin(
                role,
                rank,
                self.memory.trace_alloc_max_entries,
                self.memory.stack_depth,
            )),
            ProfilerTool::Nsys => Open::Nsys(NsysCapture::begin(role, rank)),
            _ => Open::Trace(Capture::begin_with(role, rank, self.contents)),
        }
    }

    /// Closes `open` and writes its files (none for nsys).
    fn finish(&mut self, open: Open, label: &str, rank: usize) -> Result<(), ProfilerError> {
        match open {
            Open::Trace(c) => {
                let path = self
                    .save_path
                    .join(format!("{label}_prof_rank-{rank}.json.gz"));
                c.finish().write(&path)?;
                self.written.push(path);
            }
            Open::Memory(c) => {
                let base = self.save_path.join(format!("{label}_memory_rank-{rank}"));
                self.written.extend(c.finish().write(&base)?);
            }
            Open::Nsys(c) => drop(c),
        }
        Ok(())
    }
}

impl RoleProfiler {
    /// A profiler that records nothing (the role's spans still name its methods).
    pub fn disabled(role: &str, rank: usize) -> Self {
        Self {
            role: role.into(),
            rank,
            state: None,
        }
    }

    /// The profiler of `role` (`actor`, `ref`, `critic`: the directory its files go to) on
    /// `rank`, from the role's block after `inherit` and the global block. Profiles when the
    /// block is enabled, covers the rank, a tool is chosen and steps are listed (the config
    /// check refuses the tools and settings it cannot honour).
    pub fn new(
        role: &str,
        rank: usize,
        cfg: &RoleProfilerConfig,
        global: &GlobalProfilerConfig,
    ) -> Self {
        let tool = cfg.tool.or(global.tool);
        let steps = global.steps.clone().unwrap_or_default();
        let Some(tool) = tool.filter(|t| *t != ProfilerTool::Npu) else {
            return Self::disabled(role, rank);
        };
        if !cfg.covers_rank(rank) || steps.is_empty() {
            return Self::disabled(role, rank);
        }
        let tools = cfg
            .tool_config
            .clone()
            .unwrap_or_else(|| global.global_tool_config.clone());
        let save_path = cfg
            .save_path
            .clone()
            .unwrap_or_else(|| global.save_path.clone());
        Self {
            role: role.into(),
            rank,
            state: Some(Arc::new(Mutex::new(State {
                tool,
                plan: CapturePlan::new(&steps, global.profile_continuous_steps),
                discrete: tools.discrete(tool),
                contents: Contents::from_torch(&tools.torch.contents),
                memory: tools.torch_memory.clone(),
                save_path: PathBuf::from(save_path).join(role),
                open: None,
                calls: HashMap::new(),
                written: Vec::new(),
                failed: None,
            }))),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.state.is_some()
    }

    fn lock(&self) -> Option<std::sync::MutexGuard<'_, State>> {
        self.state
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Before training step `step`: opens a capture when `step` begins one (not in discrete
    /// mode, where each method call is its own capture).
    pub fn start_step(&self, step: u64) {
        if let Some(mut s) = self.lock() {
            if !s.discrete && s.open.is_none() && s.plan.starts_at(step) {
                let open = s.begin(&self.role, self.rank);
                s.open = Some((open, step));
            }
        }
    }

    /// After training step `step`: closes the capture when `step` ends it and writes its
    /// files; the files written. A write that failed in a discrete capture is reported here
    /// (after this step's own capture is closed either way).
    pub fn stop_step(&self, step: u64) -> Result<Vec<PathBuf>, ProfilerError> {
        let Some(mut s) = self.lock() else {
            return Ok(Vec::new());
        };
        let mut result = Ok(Vec::new());
        if s.plan.stops_after(step) {
            if let Some((open, first)) = s.open.take() {
                let before = s.written.len();
                result = s
                    .finish(open, &CapturePlan::label(&(first..=step)), self.rank)
                    .map(|()| s.written[before..].to_vec());
            }
        }
        match s.failed.take() {
            Some(e) => Err(e),
            None => result,
        }
    }

    /// Runs a worker method under a span named `method` (tagged with this role and rank, so
    /// captures find it and what runs inside it); in discrete mode, a profiled `step` gets a
    /// capture of this call alone.
    pub async fn annotate<T>(
        &self,
        method: &str,
        step: Option<u64>,
        work: impl Future<Output = T>,
    ) -> T {
        let span = tracing::info_span!(
            "method",
            otel.name = method,
            role = &*self.role,
            rank = self.rank as u64
        );
        let own = match (self.lock(), step) {
            (Some(mut s), Some(step)) if s.discrete && s.plan.profiles(step) => {
                let n = s.calls.entry((step, method.to_string())).or_insert(0);
                *n += 1;
                let label = match *n {
                    1 => format!("{}_{method}", CapturePlan::label(&(step..=step))),
                    n => format!("{}_{method}_{n}", CapturePlan::label(&(step..=step))),
                };
                Some((s.begin(&self.role, self.rank), label))
            }
            _ => None,
        };
        let out = work.instrument(span).await;
        if let Some((open, label)) = own {
            if let Some(mut s) = self.lock() {
                if let Err(e) = s.finish(open, &label, self.rank) {
                    tracing::warn!("profiler: {e}");
                    s.failed.get_or_insert(e);
                }
            }
        }
        out
    }

    /// Every file written so far.
    pub fn written(&self) -> Vec<PathBuf> {
        self.lock().map(|s| s.written.clone()).unwrap_or_default()
    }
}

thread_local! {
    /// Ranges opened through [`verl_core::traits::Profiler::range_push`] on this thread.
    static RANGES: std::cell::RefCell<Vec<tracing::span::EnteredSpan>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl verl_core::traits::Profiler for RoleProfiler {
    fn start_step(&self, step: u64) {
        RoleProfiler::start_step(self, step);
    }

    fn stop_step(&self, step: u64) -> verl_core::Result<()> {
        RoleProfiler::stop_step(self, step)
            .map(drop)
            .map_err(|e| verl_core::Error::backend("profiler", e))
    }

    /// A span tagged with this role and rank, entered until [`Self::range_pop`]: captures,
    /// memory samples and NVTX ranges see it as they see worker methods.
    fn range_push(&self, name: &str) {
        let span = tracing::info_span!(
            "range",
            otel.name = name,
            role = &*self.role,
            rank = self.rank as u64
        )
        .entered();
        RANGES.with(|r| r.borrow_mut().push(span));
    }

    fn range_pop(&self) {
        // Taken out first: the span's exit runs with the list unborrowed. At thread exit the
        // list may be gone already.
        let span = RANGES.try_with(|r| r.borrow_mut().pop()).ok().flatten();
        drop(span);
    }

    fn is_enabled(&self) -> bool {
        RoleProfiler::is_enabled(self)
    }
}

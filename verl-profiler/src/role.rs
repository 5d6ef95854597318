//! A worker's profiler for one role on one rank: verl's `DistProfiler` with the "torch" tool.
//! The trainer calls [`RoleProfiler::start_step`] / [`RoleProfiler::stop_step`] on every rank
//! around each training step (verl's `start_profile` / `stop_profile`); worker methods run
//! under [`RoleProfiler::annotate`], which names them with a span and, in `discrete` mode,
//! captures each call on its own.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tracing::Instrument;
use verl_core::config::{GlobalProfilerConfig, ProfilerTool, RoleProfilerConfig};

use crate::{Capture, CapturePlan, ProfilerError};

/// See the module documentation. Clones share their state.
#[derive(Clone)]
pub struct RoleProfiler {
    role: Arc<str>,
    rank: usize,
    /// `None` when this rank of this role is not profiled.
    state: Option<Arc<Mutex<State>>>,
}

struct State {
    plan: CapturePlan,
    discrete: bool,
    save_path: PathBuf,
    /// The open step capture and the step it began at.
    open: Option<(Capture, u64)>,
    /// Calls of each method in each step (discrete file names).
    calls: HashMap<(u64, String), usize>,
    written: Vec<PathBuf>,
    /// The first failure to write a capture (reported at the next stop).
    failed: Option<ProfilerError>,
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
    /// block is enabled, covers the rank, the tool is `torch` and steps are listed (the
    /// config check refuses the tools and settings it cannot honour).
    pub fn new(
        role: &str,
        rank: usize,
        cfg: &RoleProfilerConfig,
        global: &GlobalProfilerConfig,
    ) -> Self {
        let tool = cfg.tool.or(global.tool);
        let steps = global.steps.clone().unwrap_or_default();
        if tool != Some(ProfilerTool::Torch) || !cfg.covers_rank(rank) || steps.is_empty() {
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
                plan: CapturePlan::new(&steps, global.profile_continuous_steps),
                discrete: tools.torch.discrete,
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
                s.open = Some((Capture::begin(&self.role, self.rank), step));
            }
        }
    }

    /// After training step `step`: closes and writes the capture when `step` ends it; the
    /// file written, if any. A write that failed in a discrete capture is reported here.
    pub fn stop_step(&self, step: u64) -> Result<Option<PathBuf>, ProfilerError> {
        let Some(mut s) = self.lock() else {
            return Ok(None);
        };
        if let Some(e) = s.failed.take() {
            return Err(e);
        }
        if !s.plan.stops_after(step) {
            return Ok(None);
        }
        let Some((capture, first)) = s.open.take() else {
            return Ok(None);
        };
        let label = CapturePlan::label(&(first..=step));
        let path = file(&s.save_path, &label, self.rank);
        capture.finish().write(&path)?;
        s.written.push(path.clone());
        Ok(Some(path))
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
                Some((Capture::begin(&self.role, self.rank), label))
            }
            _ => None,
        };
        let out = work.instrument(span).await;
        if let Some((capture, label)) = own {
            let trace = capture.finish();
            if let Some(mut s) = self.lock() {
                let path = file(&s.save_path, &label, self.rank);
                match trace.write(&path) {
                    Ok(()) => s.written.push(path),
                    Err(e) => {
                        s.failed.get_or_insert(e);
                    }
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

/// verl's torch profiler names: `<save_path>/<role>/<label>_prof_rank-<rank>.json.gz`.
fn file(dir: &Path, label: &str, rank: usize) -> PathBuf {
    dir.join(format!("{label}_prof_rank-{rank}.json.gz"))
}

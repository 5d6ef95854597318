//! The experiment trackers of verl's `trainer.logger` beyond the console and `metrics.jsonl`
//! (which every run writes): `file` (verl's JSON-lines file logger, native) and the Python
//! ones, `wandb`, `mlflow`, `tensorboard`, `swanlab`, `trackio` and `clearml`
//! ([`crate::python::PythonTrackers`]).
//! They are started before training, where one that cannot start stops the run naming it, and
//! fed every step's metrics by [`super::log::RunLog::record`]; one that fails later is
//! dropped with a warning (`metrics.jsonl` still holds every step).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;

use verl_core::config::VerlConfig;

use super::error::{setup, TrainError};
use crate::python::{PythonTrackers, PYTHON_TRACKERS};

/// One tracker a run logs to.
pub(crate) enum Tracker {
    File(FileTracker),
    Python(PythonTrackers),
}

impl Tracker {
    pub(crate) fn name(&self) -> String {
        match self {
            Tracker::File(f) => format!("file ({})", f.path.display()),
            Tracker::Python(p) => p.names(),
        }
    }

    pub(crate) fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<(), String> {
        match self {
            Tracker::File(f) => f.log(step, metrics),
            Tracker::Python(p) => p.log(step, metrics),
        }
    }

    /// Validation samples, to the trackers verl logs them to (not the file logger).
    pub(crate) fn log_generations(
        &mut self,
        step: u64,
        samples: &[(String, String, f64)],
    ) -> Result<(), String> {
        match self {
            Tracker::File(_) => Ok(()),
            Tracker::Python(p) => p.log_generations(step, samples),
        }
    }
}

/// verl's `file` logger: one line `{"step": n, "data": {...}}` per step, at
/// `VERL_FILE_LOGGER_PATH`, else `<VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl`.
pub(crate) struct FileTracker {
    path: PathBuf,
    file: std::fs::File,
}

impl FileTracker {
    fn open(project: &str, experiment: &str) -> Result<Self, String> {
        let path = match std::env::var_os("VERL_FILE_LOGGER_PATH") {
            Some(p) => PathBuf::from(p),
            None => {
                let root = std::env::var_os("VERL_FILE_LOGGER_ROOT")
                    .map_or_else(|| PathBuf::from("."), PathBuf::from);
                root.join(project).join(format!("{experiment}.jsonl"))
            }
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self { path, file })
    }

    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<(), String> {
        let mut line = serde_json::json!({"step": step, "data": metrics}).to_string();
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| format!("{}: {e}", self.path.display()))
    }
}

/// Starts the trackers `cfg.trainer.logger` names (`console` and `jsonl` need none).
pub(crate) fn open(cfg: &VerlConfig) -> Result<Vec<Tracker>, TrainError> {
    let t = &cfg.trainer;
    let mut trackers = Vec::new();
    if t.logger.iter().any(|l| l == "file") {
        let file = FileTracker::open(&t.project_name, &t.experiment_name)
            .map_err(|e| setup(format!("trainer.logger `file`: {e}")))?;
        trackers.push(Tracker::File(file));
    }
    let python: Vec<String> = t
        .logger
        .iter()
        .filter(|l| PYTHON_TRACKERS.contains(&l.as_str()))
        .cloned()
        .collect();
    if !python.is_empty() {
        let config = serde_json::to_value(cfg).map_err(setup)?;
        let p = PythonTrackers::start(&python, &t.project_name, &t.experiment_name, &config)
            .map_err(|e| {
                setup(format!(
                    "{e}\n(install the package in the interpreter VERL_PYTHON or python3 names; \
                     WANDB_MODE=offline logs wandb without a network; or remove it from \
                     trainer.logger)"
                ))
            })?;
        trackers.push(Tracker::Python(p));
    }
    Ok(trackers)
}

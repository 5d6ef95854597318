//! verl's Python experiment trackers (`trainer.logger` entries `wandb`, `mlflow`,
//! `tensorboard`, `swanlab`, `trackio`, `clearml`), run by one `python3` worker (`tracking_worker.py`) that sets them
//! up as verl does and logs each step's metrics to all of them.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::worker::Worker;

/// The worker: the shared frames (`frames.py`) and then its own code.
const SCRIPT: &str = concat!(
    include_str!("frames.py"),
    include_str!("tracking_worker.py")
);

/// The trackers verl sets up in Python (the config's list, which `trainer.logger` is checked
/// against).
pub use verl_core::config::PYTHON_LOGGERS as PYTHON_TRACKERS;

/// How long a tracker may take to start (a wandb login, an mlflow store) and to log a step.
const START_DEADLINE: Duration = Duration::from_secs(300);
const LOG_DEADLINE: Duration = Duration::from_secs(120);

/// The running worker and the trackers it feeds.
pub struct PythonTrackers {
    worker: Worker,
    names: Vec<String>,
}

impl PythonTrackers {
    /// Starts the worker and the trackers `names` for run `experiment` of `project`, each given
    /// `config` (the resolved run config) as verl gives it. A tracker that cannot start (its
    /// package missing, a login refused) is an error naming it, with what the library said.
    pub fn start(
        names: &[String],
        project: &str,
        experiment: &str,
        config: &Value,
    ) -> Result<Self, String> {
        let mut worker = Worker::start(SCRIPT, &[&names.join(",")])?;
        let init = json!({"project": project, "experiment": experiment, "config": config});
        let answer = worker
            .ask(&init, START_DEADLINE)
            .map_err(|e| format!("the tracking worker ({}): {e}", names.join(", ")))?;
        if answer.get("ready").and_then(Value::as_bool) != Some(true) {
            let backend = answer.get("backend").and_then(Value::as_str).unwrap_or("?");
            let error = answer.get("error").and_then(Value::as_str).unwrap_or("");
            return Err(format!(
                "trainer.logger `{backend}` could not start in Python: {}",
                error.trim_end()
            ));
        }
        Ok(Self {
            worker,
            names: names.to_vec(),
        })
    }

    /// The trackers' names, comma-separated.
    pub fn names(&self) -> String {
        self.names.join(", ")
    }

    /// Logs step `step`'s `metrics` to every tracker.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<(), String> {
        self.send(&json!({"step": step, "data": metrics}))
    }

    /// Logs validation samples `(input, output, score)` of step `step` as verl's
    /// `ValidationGenerationsLogger` does (a wandb table, a swanlab table, an mlflow artifact,
    /// a clearml table, tensorboard text).
    pub fn log_generations(
        &mut self,
        step: u64,
        samples: &[(String, String, f64)],
    ) -> Result<(), String> {
        self.send(&json!({"step": step, "generations": samples}))
    }

    /// One message to the worker; its error, if the trackers raised one.
    fn send(&mut self, message: &Value) -> Result<(), String> {
        let answer = self
            .worker
            .ask(message, LOG_DEADLINE)
            .map_err(|e| e.to_string())?;
        match answer.get("error").and_then(Value::as_str) {
            Some(e) => Err(e.trim_end().to_string()),
            None => Ok(()),
        }
    }
}

impl Drop for PythonTrackers {
    /// Finishes the trackers (wandb uploads what it holds, tensorboard flushes) before the
    /// worker goes.
    fn drop(&mut self) {
        if let Err(e) = self.worker.ask(&json!({"finish": true}), LOG_DEADLINE) {
            tracing::warn!("trainer.logger {}: finishing failed: {e}", self.names());
        }
    }
}

//! verl's `custom_reward_function` (`path` + `name`): the user's Python reward function, scored
//! by a pool of `python3` workers (`reward_worker.py`). Each batch is split into one contiguous
//! part per worker; a worker that crashes or misses its deadline is replaced and its part tried
//! once more; an exception in the function is an error naming the file, the function, the row
//! and the Python traceback. verl's `prime` reward manager ([`RewardCalls::Prime`]) instead
//! gives each row a time limit and scores a row that raises or runs out of time as 0, as its
//! process pool does.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Value};
use verl_core::traits::{BatchRewardFn, RewardInput, RewardScore};

use super::worker::{Worker, WorkerFailure};

/// The worker: the shared frames (`frames.py`) and then its own code.
const SCRIPT: &str = concat!(include_str!("frames.py"), include_str!("reward_worker.py"));

/// How long one worker may take to import the file and to score its part of a batch, and
/// under the prime manager each row's limit: `VERL_REWARD_TIMEOUT_S`, 300 s by default (verl's
/// prime row limit).
pub fn reward_timeout() -> Duration {
    Duration::from_secs(
        std::env::var("VERL_REWARD_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300),
    )
}

/// A Python reward function served by worker processes.
///
/// ```no_run
/// use verl::python::PythonReward;
/// use verl::traits::{BatchRewardFn, RewardInput};
///
/// // my_reward.py: def compute_score(data_source, solution_str, ground_truth, extra_info): ...
/// let reward = PythonReward::start("my_reward.py", "compute_score", false, 2)?;
/// let extra = serde_json::Value::Null;
/// let input = RewardInput { data_source: "gsm8k", solution_str: "#### 4", ground_truth: "4", extra_info: &extra };
/// let scores = futures::executor::block_on(reward.score_batch(&[input]))?;
/// # Ok::<(), verl::Error>(())
/// ```
pub struct PythonReward {
    path: PathBuf,
    name: String,
    calls: RewardCalls,
    workers: Vec<Mutex<Option<Worker>>>,
    deadline: Duration,
}

/// How the function is called: verl's reward managers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewardCalls {
    /// One row at a time (`naive`, `dapo`); an exception is an error naming the row.
    PerRow,
    /// The whole batch as lists (`batch`).
    Batched,
    /// One row at a time with a time limit each (`prime`): a row that raises or runs past
    /// `row_timeout` scores 0 and is reported as a warning, the others keep their scores; a
    /// tuple or list result counts its first element.
    Prime { row_timeout: Duration },
}

impl RewardCalls {
    /// The worker's argument naming the mode.
    fn arg(self) -> String {
        match self {
            RewardCalls::PerRow => "0".into(),
            RewardCalls::Batched => "1".into(),
            RewardCalls::Prime { row_timeout } => format!("prime:{}", row_timeout.as_secs_f64()),
        }
    }
}

fn reward_error(message: String) -> verl_core::Error {
    verl_core::Error::backend("reward", message)
}

impl PythonReward {
    /// Starts `workers` processes that load function `name` of the Python file `path`
    /// (`batched`: verl's batch reward signature, with lists). A file that does not load, or
    /// has no such function, is an error here, with Python's message.
    pub fn start(
        path: impl AsRef<Path>,
        name: &str,
        batched: bool,
        workers: usize,
    ) -> verl_core::Result<Self> {
        let calls = if batched {
            RewardCalls::Batched
        } else {
            RewardCalls::PerRow
        };
        Self::start_with(path, name, calls, workers)
    }

    /// [`Self::start`] with the calling convention of one of verl's reward managers.
    pub fn start_with(
        path: impl AsRef<Path>,
        name: &str,
        calls: RewardCalls,
        workers: usize,
    ) -> verl_core::Result<Self> {
        let path = path.as_ref().to_path_buf();
        if !path.is_file() {
            return Err(reward_error(format!(
                "custom_reward_function.path = {}: no such file",
                path.display()
            )));
        }
        let reward = Self {
            path,
            name: name.to_string(),
            calls,
            workers: (0..workers.max(1)).map(|_| Mutex::new(None)).collect(),
            deadline: reward_timeout(),
        };
        for slot in &reward.workers {
            let worker = reward.spawn()?;
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(worker);
        }
        Ok(reward)
    }

    /// How long a worker may take over one part of a batch from now on (default:
    /// `VERL_REWARD_TIMEOUT_S`, else 300 s).
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    fn what(&self) -> String {
        format!("{}::{}", self.path.display(), self.name)
    }

    /// A new worker, once it has loaded the function.
    fn spawn(&self) -> verl_core::Result<Worker> {
        let path = self.path.display().to_string();
        let mode = self.calls.arg();
        let mut worker =
            Worker::start(SCRIPT, &[&path, &self.name, &mode]).map_err(reward_error)?;
        let ready = worker.receive(self.deadline).map_err(|e| {
            reward_error(format!(
                "{}: the reward worker did not start: {e}",
                self.what()
            ))
        })?;
        if ready["ready"] == Value::Bool(true) {
            Ok(worker)
        } else {
            Err(reward_error(format!(
                "{}: could not load the reward function:\n{}",
                self.what(),
                ready["error"].as_str().unwrap_or("(no message)")
            )))
        }
    }

    /// Scores of `rows` (the batch's rows from `first` on) on worker `slot`: a worker that
    /// crashes or misses its deadline is replaced, and the part tried once more.
    fn score_part(
        &self,
        slot: &Mutex<Option<Worker>>,
        rows: &[RewardInput<'_>],
        first: usize,
    ) -> verl_core::Result<Vec<RewardScore>> {
        let request = json!({
            "rows": rows
                .iter()
                .map(|r| json!({
                    "data_source": r.data_source,
                    "solution_str": r.solution_str,
                    "ground_truth": r.ground_truth,
                    "extra_info": r.extra_info,
                }))
                .collect::<Vec<_>>()
        });
        let mut worker = slot.lock().unwrap_or_else(|p| p.into_inner());
        let mut failure: Option<WorkerFailure> = None;
        for _attempt in 0..2 {
            if worker.is_none() {
                *worker = Some(self.spawn()?);
            }
            let Some(w) = worker.as_mut() else {
                continue;
            };
            // With a limit per row, the part may take every row's limit.
            let deadline = match self.calls {
                RewardCalls::Prime { row_timeout } => {
                    self.deadline + row_timeout * rows.len() as u32
                }
                _ => self.deadline,
            };
            match w.ask(&request, deadline) {
                Ok(answer) => return self.scores_of(&answer, rows, first),
                Err(e) => {
                    tracing::warn!(reward = %self.what(), error = %e, "reward worker replaced");
                    *worker = None;
                    failure = Some(e);
                }
            }
        }
        Err(reward_error(format!(
            "{}: rows {}..{} got no score twice (last: {})",
            self.what(),
            first,
            first + rows.len(),
            failure.map_or_else(|| "-".into(), |e| e.to_string())
        )))
    }

    fn scores_of(
        &self,
        answer: &Value,
        rows: &[RewardInput<'_>],
        first: usize,
    ) -> verl_core::Result<Vec<RewardScore>> {
        if let Some(error) = answer["error"].as_str() {
            let at = answer["row"].as_u64().unwrap_or(0) as usize;
            let source = rows.get(at).map_or("?", |r| r.data_source);
            return Err(reward_error(format!(
                "{} raised on row {} (data_source `{source}`):\n{error}",
                self.what(),
                first + at
            )));
        }
        let scores = answer["scores"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        if scores.len() != rows.len() {
            return Err(reward_error(format!(
                "{} returned {} scores for {} rows",
                self.what(),
                scores.len(),
                rows.len()
            )));
        }
        let failed: Vec<(usize, &str)> = scores
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((first + i, s["failed"].as_str()?)))
            .collect();
        if let Some((row, why)) = failed.first() {
            tracing::warn!(
                reward = %self.what(),
                rows = failed.len(),
                first_row = row,
                first_failure = why,
                "reward rows scored 0 after an exception or their time limit (prime)"
            );
        }
        scores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let score = s["score"].as_f64().ok_or_else(|| {
                    reward_error(format!(
                        "{}: row {} has no numeric score",
                        self.what(),
                        first + i
                    ))
                })?;
                let extra = s["extra"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                            .collect()
                    })
                    .unwrap_or_default();
                let pred = s["pred"].as_str().map(str::to_owned);
                Ok(RewardScore { score, extra, pred })
            })
            .collect()
    }

    /// One score per row, the rows split among the workers.
    pub fn score_rows(&self, rows: &[RewardInput<'_>]) -> verl_core::Result<Vec<RewardScore>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        // A batched function sees the whole batch, as verl's batch reward manager gives it.
        let parts = if self.calls == RewardCalls::Batched {
            1
        } else {
            self.workers.len().min(rows.len())
        };
        let per = rows.len().div_ceil(parts);
        let results: Vec<verl_core::Result<Vec<RewardScore>>> = std::thread::scope(|s| {
            let handles: Vec<_> = rows
                .chunks(per)
                .zip(&self.workers)
                .enumerate()
                .map(|(i, (part, slot))| s.spawn(move || self.score_part(slot, part, i * per)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(reward_error("a reward thread panicked".into())))
                })
                .collect()
        });
        let mut scores = Vec::with_capacity(rows.len());
        for part in results {
            scores.extend(part?);
        }
        Ok(scores)
    }
}

#[async_trait::async_trait]
impl BatchRewardFn for PythonReward {
    async fn score_batch(&self, inputs: &[RewardInput<'_>]) -> verl_core::Result<Vec<RewardScore>> {
        self.score_rows(inputs)
    }
}

//! What a run writes as it goes: `metrics.jsonl` (one JSON object per step: `step` plus the
//! metric names) and a progress bar on the terminal.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use super::plot::{self, History};
use super::trackers::Tracker;

/// A failure to write the run's log, naming the directory or file.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error(
        "output directory {path}: {source}; set trainer.default_local_dir to a writable directory"
    )]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Maps an I/O error to one naming the file `path`.
fn file_error(path: &Path) -> impl FnOnce(std::io::Error) -> LogError + '_ {
    move |source| LogError::File {
        path: path.to_path_buf(),
        source,
    }
}

/// Maps an I/O error to one naming the output directory `dir`.
fn dir_error(dir: &Path) -> impl FnOnce(std::io::Error) -> LogError + '_ {
    move |source| LogError::Dir {
        path: dir.to_path_buf(),
        source,
    }
}

/// The run's metric sink.
pub struct RunLog {
    path: PathBuf,
    file: File,
    bar: ProgressBar,
    history: History,
    title: String,
    /// `trainer.logger`'s trackers besides the console and this file.
    trackers: Vec<Tracker>,
}

impl RunLog {
    /// Creates `dir/metrics.jsonl`. A previous run's file is kept, renamed `metrics.<k>.jsonl`.
    pub fn create(dir: &Path, total_steps: u64, title: &str) -> Result<Self, LogError> {
        std::fs::create_dir_all(dir).map_err(dir_error(dir))?;
        let path = dir.join("metrics.jsonl");
        if path.exists() {
            let mut k = 1;
            while dir.join(format!("metrics.{k}.jsonl")).exists() {
                k += 1;
            }
            std::fs::rename(&path, dir.join(format!("metrics.{k}.jsonl")))
                .map_err(file_error(&path))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(file_error(&path))?;
        let bar = ProgressBar::new(total_steps);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("a valid template"),
        );
        Ok(Self {
            path,
            file,
            bar,
            history: History::default(),
            title: title.to_string(),
            trackers: Vec::new(),
        })
    }

    /// The log feeding `trackers` every step too.
    pub(crate) fn with_trackers(mut self, trackers: Vec<Tracker>) -> Self {
        self.trackers = trackers;
        self
    }

    pub fn metrics_path(&self) -> &Path {
        &self.path
    }

    /// Where the plot is drawn: `metrics.png` next to `metrics.jsonl`.
    pub fn plot_path(&self) -> PathBuf {
        self.path.with_extension("png")
    }

    /// Redraws the plot; a failure is reported, never fatal to training.
    pub fn redraw(&self) {
        if let Err(e) = plot::draw(&self.plot_path(), &self.history, &self.title) {
            tracing::warn!("could not draw {}: {e}", self.plot_path().display());
        }
    }

    /// Reopens `dir/metrics.jsonl` of a run resumed after step `step`: lines of later steps
    /// (written after that checkpoint) and a torn line (a kill mid-write) are dropped, the
    /// earlier ones kept and replotted.
    pub fn resume(dir: &Path, total_steps: u64, title: &str, step: u64) -> Result<Self, LogError> {
        let path = dir.join("metrics.jsonl");
        // Read as bytes: a kill mid-write can cut a character, and only that torn line should
        // go (it fails to parse below), not the whole file.
        let kept: Vec<String> = match std::fs::read(&path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes)
                .lines()
                .filter(|l| match serde_json::from_str::<serde_json::Value>(l) {
                    Ok(serde_json::Value::Object(obj)) => obj
                        .get("step")
                        .and_then(serde_json::Value::as_u64)
                        .is_none_or(|s| s <= step),
                    _ => false,
                })
                .map(str::to_string)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            // Any other failure must stop the run: starting an empty log would replace the
            // previous steps' lines.
            Err(e) => return Err(file_error(&path)(e)),
        };
        std::fs::create_dir_all(dir).map_err(dir_error(dir))?;
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(
            &tmp,
            kept.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )
        .map_err(file_error(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(file_error(&path))?;
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(file_error(&path))?;
        let bar = ProgressBar::new(total_steps);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .expect("a valid template"),
        );
        bar.set_position(step);
        let mut log = Self {
            path,
            file,
            bar,
            history: History::default(),
            title: title.to_string(),
            trackers: Vec::new(),
        };
        for line in &kept {
            let Ok(serde_json::Value::Object(obj)) = serde_json::from_str(line) else {
                continue;
            };
            let Some(s) = obj.get("step").and_then(serde_json::Value::as_u64) else {
                continue;
            };
            let m: BTreeMap<String, f64> = obj
                .iter()
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect();
            log.remember(s, &m);
        }
        Ok(log)
    }

    /// Appends one line in a single `write` and flushes it: a kill leaves at most one torn
    /// last line, which [`Self::resume`] drops.
    fn append(&mut self, line: serde_json::Value) -> Result<(), LogError> {
        let mut text = line.to_string();
        text.push('\n');
        self.file
            .write_all(text.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(file_error(&self.path))
    }

    /// Adds a step's plotted metrics to the history.
    fn remember(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        let get = |k: &str| metrics.get(k).copied();
        let x = step as f64;
        if let Some(v) = get("critic/score/mean") {
            self.history.score.push((x, v));
        }
        if let Some(v) = get("val/score/mean") {
            self.history.val_score.push((x, v));
        }
        if let Some(v) = get("response_length/mean") {
            self.history.response_length.push((x, v));
        }
    }

    /// Hands validation samples `(input, output, score)` of step `step` to the trackers that
    /// take them (`trainer.log_val_generations`); a tracker that fails is dropped, as in
    /// [`Self::record`].
    pub(crate) fn record_generations(&mut self, step: u64, samples: &[(String, String, f64)]) {
        self.trackers
            .retain_mut(|t| match t.log_generations(step, samples) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(
                        "trainer.logger {} failed logging validation generations at step \
                         {step}, and logs no more: {e}",
                        t.name()
                    );
                    false
                }
            });
    }

    /// Appends step `step`'s metrics and advances the bar.
    pub fn record(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<(), LogError> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            if v.is_finite() {
                obj.insert(k.clone(), (*v).into());
            }
        }
        self.append(serde_json::Value::Object(obj))?;
        self.remember(step, metrics);
        let finite: BTreeMap<String, f64> = metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        // A tracker that fails is dropped, not the run: metrics.jsonl has every step.
        self.trackers.retain_mut(|t| match t.log(step, &finite) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "trainer.logger {} failed at step {step}, and logs no more (metrics.jsonl \
                     keeps every step): {e}",
                    t.name()
                );
                false
            }
        });
        let get = |k: &str| metrics.get(k).copied();
        // Redraw at validations and every 10 steps: cheap next to a training step.
        if get("val/score/mean").is_some() || step.is_multiple_of(10) {
            self.redraw();
        }
        let mut msg = String::new();
        if let Some(s) = get("critic/score/mean") {
            msg += &format!("score {s:.3} ");
        }
        if let Some(v) = get("val/score/mean") {
            msg += &format!("val {v:.3} ");
        }
        if let Some(l) = get("response_length/mean") {
            msg += &format!("len {l:.1} ");
        }
        if let Some(t) = get("timing_s/step") {
            msg += &format!("{t:.2}s/step");
        }
        if step > 0 {
            self.bar.set_position(step);
        }
        // Without a terminal the bar draws nothing: one log line per step instead (an info
        // event, so an embedding program's subscriber decides whether it shows).
        if step > 0 && !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            let total = self.bar.length().unwrap_or(0);
            tracing::info!(target: "verl::progress", "step {step}/{total}: {}", msg.trim_end());
        }
        self.bar.set_message(msg);
        Ok(())
    }

    /// Reports a warm-up step on the bar's message line (and in the metrics file, as
    /// `sft_step`).
    pub fn sft(
        &mut self,
        step: u64,
        total: u64,
        m: &BTreeMap<String, f64>,
    ) -> Result<(), LogError> {
        let mut obj = serde_json::Map::new();
        obj.insert("sft_step".into(), step.into());
        for (k, v) in m {
            obj.insert(k.clone(), (*v).into());
        }
        self.append(serde_json::Value::Object(obj))?;
        self.bar.set_message(format!(
            "warm-up {step}/{total} loss {:.3}",
            m.get("sft/loss").copied().unwrap_or(f64::NAN)
        ));
        self.bar.tick();
        Ok(())
    }

    pub fn finish(&self) {
        self.redraw();
        self.bar.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::checkpoint::{write_loop_state, LoopState};

    /// A path under a regular file, where no directory can be made; the guard keeps it.
    fn blocked() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a_file");
        std::fs::write(&file, "").unwrap();
        (dir, file.join("out"))
    }

    #[test]
    fn output_directory_errors_name_the_path() {
        let (_guard, out) = blocked();
        let shown = out.display().to_string();
        let e = RunLog::create(&out, 1, "t").err().unwrap();
        assert!(matches!(e, LogError::Dir { .. }), "{e}");
        assert!(e.to_string().contains(&shown), "{e}");
        let e = RunLog::resume(&out, 1, "t", 1).err().unwrap();
        assert!(e.to_string().contains(&shown), "{e}");
        let e = write_loop_state(&out.join("global_step_1"), &LoopState::fresh(2, 0.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&shown), "{e}");
    }

    /// A kill mid-write can cut a multi-byte character: only that torn line goes on resume.
    #[test]
    fn a_torn_line_with_a_cut_character_drops_only_that_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let bytes = b"{\"step\":1,\"x\":1.0}\n{\"step\":2,\"x\":2.0}\n{\"step\":3,\"note\":\"\xC3";
        std::fs::write(&path, bytes).unwrap();
        // Resumed after step 5, so only tearing can drop a line.
        if let Err(e) = RunLog::resume(dir.path(), 8, "t", 5) {
            panic!("{e}");
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"step\":1,\"x\":1.0}\n{\"step\":2,\"x\":2.0}\n");
    }
}

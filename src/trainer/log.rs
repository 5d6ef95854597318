//! What a run writes as it goes: `metrics.jsonl` (one JSON object per step: `step` plus the
//! metric names) and a progress bar on the terminal.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

use super::plot::{self, History};

/// The run's metric sink.
pub struct RunLog {
    path: PathBuf,
    file: File,
    bar: ProgressBar,
    history: History,
    title: String,
}

impl RunLog {
    /// Creates `dir/metrics.jsonl`. A previous run's file is kept, renamed `metrics.<k>.jsonl`.
    pub fn create(dir: &Path, total_steps: u64, title: &str) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("metrics.jsonl");
        if path.exists() {
            let mut k = 1;
            while dir.join(format!("metrics.{k}.jsonl")).exists() {
                k += 1;
            }
            std::fs::rename(&path, dir.join(format!("metrics.{k}.jsonl")))?;
        }
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
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
        })
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
    /// (written after that checkpoint) are dropped, the earlier ones kept and replotted.
    pub fn resume(dir: &Path, total_steps: u64, title: &str, step: u64) -> std::io::Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept: Vec<String> = match std::fs::read_to_string(&path) {
            Ok(text) => text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l)
                        .ok()
                        .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
                        .is_none_or(|s| s <= step)
                })
                .map(str::to_string)
                .collect(),
            Err(_) => Vec::new(),
        };
        std::fs::create_dir_all(dir)?;
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(
            &tmp,
            kept.iter().map(|l| format!("{l}\n")).collect::<String>(),
        )?;
        std::fs::rename(&tmp, &path)?;
        let file = OpenOptions::new().append(true).open(&path)?;
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

    /// Appends step `step`'s metrics and advances the bar.
    pub fn record(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> std::io::Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        for (k, v) in metrics {
            if v.is_finite() {
                obj.insert(k.clone(), (*v).into());
            }
        }
        writeln!(self.file, "{}", serde_json::Value::Object(obj))?;
        self.file.flush()?;
        self.remember(step, metrics);
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
        self.bar.set_message(msg);
        Ok(())
    }

    /// Reports a warm-up step on the bar's message line (and in the metrics file, as
    /// `sft_step`).
    pub fn sft(&mut self, step: u64, total: u64, m: &BTreeMap<String, f64>) -> std::io::Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("sft_step".into(), step.into());
        for (k, v) in m {
            obj.insert(k.clone(), (*v).into());
        }
        writeln!(self.file, "{}", serde_json::Value::Object(obj))?;
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

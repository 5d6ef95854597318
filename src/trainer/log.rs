//! What a run writes as it goes: `metrics.jsonl` (one JSON object per step: `step` plus the
//! metric names) and a progress bar on the terminal.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};

/// The run's metric sink.
pub struct RunLog {
    path: PathBuf,
    file: File,
    bar: ProgressBar,
}

impl RunLog {
    /// Creates `dir/metrics.jsonl`. A previous run's file is kept, renamed `metrics.<k>.jsonl`.
    pub fn create(dir: &Path, total_steps: u64) -> std::io::Result<Self> {
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
        Ok(Self { path, file, bar })
    }

    pub fn metrics_path(&self) -> &Path {
        &self.path
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
        let get = |k: &str| metrics.get(k).copied();
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
        self.bar.finish();
    }
}

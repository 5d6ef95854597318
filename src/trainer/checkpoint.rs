//! The run's checkpoints in verl's layout, for exact resume:
//!
//! ```text
//! <trainer.default_local_dir>/
//!   latest_checkpointed_iteration.txt     the newest complete step (written last)
//!   global_step_<N>/
//!     trainer.json                        data order and position, KL coefficient, step
//!     actor/dist_ckpt/rank_<r>/           weights, AdamW moments, counters (f32)
//!     actor/ref/rank_<r>/                 the frozen reference policy
//!     actor/huggingface/                  with `hf_model` in save_contents
//!     critic/...                          likewise, when there is a critic
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use verl_core::config::CheckpointConfig;
use verl_core::traits::CheckpointContents;

use super::{setup, TrainError};

/// Where the fit loop stands: what a resumed run continues from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// The last completed step.
    pub step: u64,
    pub epoch: u64,
    /// The position in `order` of the next batch.
    pub cursor: usize,
    /// The current epoch's (shuffled) order of training rows.
    pub order: Vec<usize>,
    /// The in-reward KL coefficient β (the adaptive controller moves it).
    pub kl_coef: f64,
    /// `val/score/mean` before training, if it was measured.
    pub val_before: Option<f64>,
}

impl LoopState {
    /// A run's start: no step done, the order to be shuffled at the first batch.
    pub fn fresh(rows: usize, kl_coef: f64) -> Self {
        Self {
            step: 0,
            epoch: 0,
            cursor: rows,
            order: (0..rows).collect(),
            kl_coef,
            val_before: None,
        }
    }
}

/// The parts `save_contents` / `load_contents` name (`model`, `optimizer`, `extra`,
/// `hf_model`), as checkpoint contents and whether to write the HF copy.
pub fn contents_of(
    cfg: &CheckpointConfig,
    role: &str,
    save: bool,
) -> Result<(CheckpointContents, bool), TrainError> {
    let (list, key) = if save {
        (&cfg.save_contents, "save_contents")
    } else {
        (&cfg.load_contents, "load_contents")
    };
    if cfg.async_save {
        return Err(setup(format!(
            "{role}.checkpoint.async_save=true: checkpoints are written synchronously here; set it to false"
        )));
    }
    let mut c = CheckpointContents {
        model: false,
        optimizer: false,
        extra: false,
    };
    let mut hf = false;
    for item in list {
        match item.as_str() {
            "model" => c.model = true,
            "optimizer" => c.optimizer = true,
            "extra" => c.extra = true,
            "hf_model" => hf = true,
            other => {
                return Err(setup(format!(
                    "{role}.checkpoint.{key} has `{other}`; the parts are model, optimizer, extra, hf_model"
                )))
            }
        }
    }
    Ok((c, hf))
}

/// `<dir>/global_step_<step>`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("global_step_{step}"))
}

const LATEST: &str = "latest_checkpointed_iteration.txt";

/// The newest complete checkpoint under `dir`, from `latest_checkpointed_iteration.txt`.
pub fn latest(dir: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(dir.join(LATEST)).ok()?;
    let step: u64 = text.trim().parse().ok()?;
    let d = step_dir(dir, step);
    d.join("trainer.json").exists().then_some(d)
}

/// Marks `step` as the newest complete checkpoint (after everything else is written).
pub fn mark_latest(dir: &Path, step: u64) -> std::io::Result<()> {
    let tmp = dir.join(format!("{LATEST}.tmp"));
    std::fs::write(&tmp, step.to_string())?;
    std::fs::rename(tmp, dir.join(LATEST))
}

/// Removes the oldest `global_step_*` directories so that at most `keep` remain.
pub fn prune(dir: &Path, keep: usize) -> std::io::Result<()> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("global_step_")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort_unstable();
    let excess = steps.len().saturating_sub(keep.max(1));
    for s in &steps[..excess] {
        std::fs::remove_dir_all(step_dir(dir, *s))?;
    }
    Ok(())
}

/// Reads `<step dir>/trainer.json`.
pub fn read_loop_state(step_dir: &Path) -> Result<LoopState, TrainError> {
    let p = step_dir.join("trainer.json");
    let text = std::fs::read_to_string(&p).map_err(|e| {
        setup(format!(
            "{}: {e}; trainer.resume_from_path must be a global_step_<N> directory of a saved run",
            p.display()
        ))
    })?;
    serde_json::from_str(&text).map_err(|e| setup(format!("{}: {e}", p.display())))
}

/// Writes `<step dir>/trainer.json`.
pub fn write_loop_state(step_dir: &Path, state: &LoopState) -> Result<(), TrainError> {
    std::fs::create_dir_all(step_dir).map_err(setup)?;
    let p = step_dir.join("trainer.json");
    let text = serde_json::to_string(state).map_err(setup)?;
    std::fs::write(&p, text).map_err(|e| setup(format!("{}: {e}", p.display())))
}

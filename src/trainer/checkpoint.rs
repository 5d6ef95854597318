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

use super::error::{setup, TrainError};

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
/// Every file of a step directory with its size and CRC-32, written after everything else.
const CHECKSUMS: &str = "checksums.json";

/// A file's size and CRC-32 (enough to catch a torn write or a flipped bit, cheap to compute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct FileSum {
    bytes: u64,
    crc32: u32,
}

fn sum_of(path: &Path) -> std::io::Result<FileSum> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        h.update(&buf[..n]);
    }
    Ok(FileSum {
        bytes,
        crc32: h.finalize(),
    })
}

/// The regular files under `dir`, as `/`-separated paths relative to it, sorted.
fn files_under(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in std::fs::read_dir(dir.join(&rel))? {
            let entry = entry?;
            let kind = entry.file_type()?;
            let name = rel.join(entry.file_name());
            if kind.is_dir() {
                stack.push(name);
            } else if kind.is_file() {
                let text = name.to_string_lossy().replace('\\', "/");
                if text != CHECKSUMS {
                    out.push(text);
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Writes `<step dir>/checksums.json`: every file of the checkpoint with its size and CRC-32.
pub fn write_checksums(step_dir: &Path) -> Result<(), TrainError> {
    let io = |e: std::io::Error| setup(format!("{}: {e}", step_dir.display()));
    let mut sums = std::collections::BTreeMap::new();
    for rel in files_under(step_dir).map_err(io)? {
        sums.insert(rel.clone(), sum_of(&step_dir.join(&rel)).map_err(io)?);
    }
    let tmp = step_dir.join(format!("{CHECKSUMS}.tmp"));
    let text = serde_json::to_string_pretty(&sums).map_err(setup)?;
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, step_dir.join(CHECKSUMS)).map_err(io)
}

/// Whether `step_dir` holds a complete, undamaged checkpoint: `trainer.json` (written after
/// every shard) naming the step of the directory's name, and `checksums.json` with every file
/// it lists at its size and CRC-32. A checkpoint saved before checksums existed (its
/// `trainer.json` without the `checksummed` flag) is accepted without them; one saved with
/// the flag and missing the file did not finish. `Err` says what is wrong, naming the file.
pub fn verify(step_dir: &Path) -> Result<(), String> {
    if !step_dir.is_dir() {
        return Err(format!("{} does not exist", step_dir.display()));
    }
    let state_path = step_dir.join("trainer.json");
    if !state_path.is_file() {
        return Err(format!(
            "{} has no trainer.json (its save did not finish)",
            step_dir.display()
        ));
    }
    let state: serde_json::Value = verl_core::files::read_text(&state_path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| format!("{} is damaged: {e}", state_path.display()))?;
    // The directory's name, the loop state and (through `latest`) the marker must agree on
    // the step, or a resume would continue a step's state under another step's number.
    let named = step_dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("global_step_"))
        .and_then(|n| n.parse::<u64>().ok());
    let saved = state.get("step").and_then(serde_json::Value::as_u64);
    if let (Some(named), Some(saved)) = (named, saved) {
        if named != saved {
            return Err(format!(
                "{} is of step {saved}, but its directory is step {named}'s",
                state_path.display()
            ));
        }
    }
    let checksummed = state
        .get("checksummed")
        .and_then(serde_json::Value::as_bool)
        == Some(true);
    let text = match std::fs::read_to_string(step_dir.join(CHECKSUMS)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !checksummed => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "{}/{CHECKSUMS} is missing, though this checkpoint was saved with one (its save \
                 did not finish, or the file was removed)",
                step_dir.display()
            ))
        }
        Err(e) => return Err(format!("{}/{CHECKSUMS}: {e}", step_dir.display())),
    };
    let sums: std::collections::BTreeMap<String, FileSum> = serde_json::from_str(&text)
        .map_err(|e| format!("{}/{CHECKSUMS} is damaged: {e}", step_dir.display()))?;
    for (rel, want) in &sums {
        if rel.split('/').any(|part| part == ".." || part.is_empty()) {
            return Err(format!(
                "{}/{CHECKSUMS} names `{rel}`, outside the checkpoint",
                step_dir.display()
            ));
        }
        let path = step_dir.join(rel);
        let got = sum_of(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if got != *want {
            return Err(format!(
                "{} is damaged: {} bytes with CRC-32 {:08x}, saved as {} bytes with {:08x}",
                path.display(),
                got.bytes,
                got.crc32,
                want.bytes,
                want.crc32
            ));
        }
    }
    Ok(())
}

/// The `global_step_<N>` directories under `dir`, newest first.
pub fn saved_steps(dir: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("global_step_")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps
}

/// The checkpoint a resumed run continues from, and what was passed over on the way.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    pub dir: PathBuf,
    pub step: u64,
    /// Why the marker, or a newer directory, was not used (empty when the marker was good).
    pub passed_over: Vec<String>,
}

/// The newest complete, undamaged checkpoint under `dir`: the one
/// `latest_checkpointed_iteration.txt` names when it verifies, else the newest `global_step_<N>`
/// that does (the marker missing, garbled, naming a missing or damaged step). `None` when no
/// directory verifies.
pub fn latest(dir: &Path) -> Option<Found> {
    let mut passed_over = Vec::new();
    let marker = match std::fs::read_to_string(dir.join(LATEST)) {
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(step) => Some(step),
            Err(_) => {
                passed_over.push(format!(
                    "{} holds `{}`, not a step number",
                    dir.join(LATEST).display(),
                    text.trim().chars().take(40).collect::<String>()
                ));
                None
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            passed_over.push(format!("{}: {e}", dir.join(LATEST).display()));
            None
        }
    };
    let steps = saved_steps(dir);
    if marker.is_none() && passed_over.is_empty() && !steps.is_empty() {
        passed_over.push(format!("{} is missing", dir.join(LATEST).display()));
    }
    // The marker's step first, then every other step, newest first.
    let candidates = marker
        .into_iter()
        .chain(steps.into_iter().filter(|&s| Some(s) != marker));
    for step in candidates {
        let d = step_dir(dir, step);
        match verify(&d) {
            Ok(()) => {
                return Some(Found {
                    dir: d,
                    step,
                    passed_over,
                })
            }
            Err(why) if Some(step) == marker => {
                passed_over.push(format!("the marker names step {step}, but {why}"))
            }
            Err(why) => passed_over.push(why),
        }
    }
    None
}

/// Marks `step` as the newest complete checkpoint (after everything else is written).
pub fn mark_latest(dir: &Path, step: u64) -> std::io::Result<()> {
    let tmp = dir.join(format!("{LATEST}.tmp"));
    std::fs::write(&tmp, step.to_string())?;
    std::fs::rename(tmp, dir.join(LATEST))
}

/// Moves `global_step_<step>` out of the way (to `global_step_<step>.aside-<k>`) when this run
/// is about to save that step over a directory it did not write: nothing it did not write is
/// ever overwritten or deleted. Returns where it went.
pub fn set_aside(dir: &Path, step: u64) -> std::io::Result<Option<PathBuf>> {
    let d = step_dir(dir, step);
    if !d.exists() {
        return Ok(None);
    }
    let mut k = 1;
    let to = loop {
        let to = dir.join(format!("global_step_{step}.aside-{k}"));
        if !to.exists() {
            break to;
        }
        k += 1;
    };
    std::fs::rename(&d, &to)?;
    Ok(Some(to))
}

/// How many of its own step directories a run keeps, from `trainer.max_actor_ckpt_to_keep` and
/// `trainer.max_critic_ckpt_to_keep` (`critic`: `None` too when the run has no critic); `None`
/// keeps every one.
///
/// verl prunes each role's checkpoints on its own, `None` or 0 keeping all. Here one
/// `global_step_<N>` holds both roles and resumes only whole, so a step directory goes only when
/// every role's limit lets it go: an unset limit has no say, 0 keeps all whatever the other
/// says, and otherwise the larger limit wins. Both unset: keep all (verl's default).
///
/// ```
/// use verl::trainer::checkpoint::keep_limit;
/// assert_eq!(keep_limit(None, None), None);
/// assert_eq!(keep_limit(Some(0), Some(2)), None);
/// assert_eq!(keep_limit(Some(1), Some(3)), Some(3));
/// assert_eq!(keep_limit(Some(2), None), Some(2));
/// ```
pub fn keep_limit(actor: Option<usize>, critic: Option<usize>) -> Option<usize> {
    let set = [actor, critic].into_iter().flatten();
    if set.clone().any(|k| k == 0) {
        return None;
    }
    set.max()
}

/// Removes the oldest of `written` (the steps this run saved, oldest first) so that `keep`
/// remain; `keep = 0` keeps every one (verl's meaning of 0). Checkpoints of earlier runs are
/// never touched.
pub fn prune(dir: &Path, written: &mut Vec<u64>, keep: usize) -> std::io::Result<()> {
    if keep == 0 {
        return Ok(());
    }
    while written.len() > keep {
        let s = written.remove(0);
        let d = step_dir(dir, s);
        if d.exists() {
            std::fs::remove_dir_all(d)?;
        }
    }
    Ok(())
}

/// Reads `<step dir>/trainer.json`.
pub fn read_loop_state(step_dir: &Path) -> Result<LoopState, TrainError> {
    let p = step_dir.join("trainer.json");
    let text = verl_core::files::read_text(&p).map_err(|e| {
        setup(format!(
            "{}: {e}; trainer.resume_from_path must be a global_step_<N> directory of a saved run",
            p.display()
        ))
    })?;
    let state: LoopState =
        serde_json::from_str(&text).map_err(|e| setup(format!("{}: {e}", p.display())))?;
    // Positions index the training rows: `order` must be a permutation of 0..len and the
    // cursor within it, or a resume would index outside the data.
    let len = state.order.len();
    let mut seen = vec![false; len];
    for &i in &state.order {
        if i >= len || std::mem::replace(&mut seen[i], true) {
            return Err(setup(format!(
                "{}: `order` is not a permutation of the {len} training rows (entry {i}); the file is damaged",
                p.display()
            )));
        }
    }
    if state.cursor > len {
        return Err(setup(format!(
            "{}: `cursor` {} is past the {len} training rows; the file is damaged",
            p.display(),
            state.cursor
        )));
    }
    Ok(state)
}

/// Writes `<step dir>/trainer.json`.
pub fn write_loop_state(step_dir: &Path, state: &LoopState) -> Result<(), TrainError> {
    std::fs::create_dir_all(step_dir)
        .map_err(|e| setup(format!("checkpoint directory {}: {e}", step_dir.display())))?;
    let p = step_dir.join("trainer.json");
    let mut value = serde_json::to_value(state).map_err(setup)?;
    // Says that this save writes checksums.json next: a checkpoint with the flag and without
    // the file did not finish (see `verify`).
    value["checksummed"] = serde_json::Value::Bool(true);
    std::fs::write(&p, value.to_string()).map_err(|e| setup(format!("{}: {e}", p.display())))
}

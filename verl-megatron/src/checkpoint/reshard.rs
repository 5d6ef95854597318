//! Loading a dist checkpoint on another layout (Megatron's resharding on load).
//!
//! Every rank's `extra.json` records where each of its tensors sits in the full tensor
//! (`shards`: name → [`ShardSlice`]) and the layout it ran on (`layout`). A rank of the new
//! layout asks for its own slices; each is assembled from whichever saved shards overlap it,
//! reading only the overlapping bytes of the memory-mapped files (one tensor at a time, so the
//! extra memory is one shard). Optimizer moments (`<label>/<name>.exp_avg{,_sq}`) share their
//! parameter's slice; with Megatron's distributed optimizer each data-parallel rank saved only
//! the moments it owned, and the union over ranks is the whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::tensor::TensorData;
use serde_json::{Map, Value};
use verl_core::traits::{CheckpointContents, CheckpointState};
use verl_core::weights::ShardSlice;
use verl_core::NamedTensor;

use super::io;
use crate::hf::HfCheckpoint;
use crate::MegatronError;

/// The tensor- and pipeline-parallel place a rank saved from (`extra.layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedLayout {
    pub tp_rank: usize,
    pub tp_size: usize,
    pub pp_stage: usize,
    pub pp_stages: usize,
    /// Expert parallel place (which routed experts the rank holds, and its slice of them);
    /// absent in checkpoints saved before expert parallelism (read as a single rank).
    #[serde(default)]
    pub ep_rank: usize,
    #[serde(default = "one")]
    pub ep_size: usize,
    #[serde(default)]
    pub etp_rank: usize,
    /// `0` in checkpoints saved before expert parallelism: the experts then followed tp.
    #[serde(default)]
    pub etp_size: usize,
}

fn one() -> usize {
    1
}

/// One tensor this rank wants: its name, where it sits in the full tensor, and the shape of
/// this rank's shard (padding included).
#[derive(Debug, Clone, PartialEq)]
pub struct ShardTarget {
    pub name: String,
    pub slice: ShardSlice,
    pub shape: Vec<usize>,
}

/// One saved rank: its index and, opened on first use, its tensor files.
struct SavedRank {
    dir: PathBuf,
    extra: Value,
    shards: BTreeMap<String, ShardSlice>,
    model: std::cell::OnceCell<Option<HfCheckpoint>>,
    optim: std::cell::OnceCell<Option<HfCheckpoint>>,
}

impl SavedRank {
    fn file(&self, optimizer: bool) -> Result<Option<&HfCheckpoint>, MegatronError> {
        let (cell, name) = if optimizer {
            (&self.optim, "optim.safetensors")
        } else {
            (&self.model, "model.safetensors")
        };
        if cell.get().is_none() {
            let path = self.dir.join(name);
            let opened = if path.is_file() {
                Some(HfCheckpoint::open_file(&path)?)
            } else {
                None
            };
            let _ = cell.set(opened);
        }
        Ok(cell.get().and_then(Option::as_ref))
    }
}

/// A dist checkpoint directory (`rank_*/`), opened for loading on any layout.
///
/// ```no_run
/// use verl_megatron::checkpoint::ShardedCheckpoint;
/// let ckpt = ShardedCheckpoint::open("ckpt/global_step_2/actor/dist_ckpt")?;
/// println!("saved by {} ranks", ckpt.ranks());
/// # Ok::<(), verl_megatron::MegatronError>(())
/// ```
pub struct ShardedCheckpoint {
    dir: PathBuf,
    /// By rank number, in order.
    ranks: BTreeMap<usize, SavedRank>,
}

impl ShardedCheckpoint {
    /// Reads every rank's `extra.json` under `dir` (the tensor files are mapped when read).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, MegatronError> {
        let dir = dir.as_ref().to_path_buf();
        let entries = std::fs::read_dir(&dir).map_err(|e| io(&dir, e))?;
        let mut ranks = BTreeMap::new();
        for entry in entries {
            let path = entry.map_err(|e| io(&dir, e))?.path();
            let Some(rank) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("rank_"))
                .and_then(|n| n.parse::<usize>().ok())
            else {
                continue;
            };
            if !path.is_dir() {
                continue;
            }
            let p = path.join("extra.json");
            let extra: Value = match std::fs::read_to_string(&p) {
                Ok(text) => serde_json::from_str(&text).map_err(|e| io(&p, e))?,
                Err(_) => Value::Null,
            };
            let shards: BTreeMap<String, ShardSlice> = match extra.get("shards") {
                Some(s) => serde_json::from_value(s.clone()).map_err(|e| io(&p, e))?,
                None => BTreeMap::new(),
            };
            // The slices are read from disk: each must lie inside its full tensor before any
            // arithmetic trusts it.
            for (name, slice) in &shards {
                let fits = match slice.dim {
                    None => true,
                    Some(d) => slice.global_shape.get(d).is_some_and(|&full| {
                        slice
                            .start
                            .checked_add(slice.len)
                            .is_some_and(|end| end <= full)
                    }),
                };
                let elements = slice
                    .global_shape
                    .iter()
                    .try_fold(1usize, |a, &x| a.checked_mul(x));
                if !fits || elements.is_none() {
                    return Err(io(
                        &p,
                        format!("shard `{name}` records a slice outside its tensor: {slice:?}"),
                    ));
                }
            }
            ranks.insert(
                rank,
                SavedRank {
                    dir: path,
                    extra,
                    shards,
                    model: Default::default(),
                    optim: Default::default(),
                },
            );
        }
        if ranks.is_empty() {
            return Err(MegatronError::Checkpoint {
                message: format!("{} holds no rank_* directories", dir.display()),
            });
        }
        Ok(Self { dir, ranks })
    }

    /// How many ranks saved it.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The layout `rank` saved from, when it recorded one.
    pub fn layout_of(&self, rank: usize) -> Option<SavedLayout> {
        let v = self.ranks.get(&rank)?.extra.get("layout")?;
        serde_json::from_value(v.clone()).ok()
    }

    /// Whether every rank recorded where its tensors sit (checkpoints written before that
    /// load only on the layout they were saved on).
    pub fn is_indexed(&self) -> bool {
        self.ranks.values().all(|r| !r.shards.is_empty())
    }

    /// The `extra` that `rank` saved, if it saved one.
    pub fn extra_of(&self, rank: usize) -> Option<&Value> {
        self.ranks.get(&rank).map(|r| &r.extra)
    }

    /// Refuses an assembled tensor with a gap: no saved shard covered index `gap` of its
    /// split dimension.
    fn check_covered(
        &self,
        covered: &[bool],
        key: &str,
        want: &ShardSlice,
    ) -> Result<(), MegatronError> {
        if let Some(gap) = covered.iter().position(|c| !c) {
            return Err(MegatronError::Checkpoint {
                message: format!(
                    "{} holds no shard of `{key}` covering index {} of dimension {}: is a \
                 rank_* directory missing or incomplete?",
                    self.dir.display(),
                    want.dim.map_or(gap, |_| want.start + gap),
                    want.dim.unwrap_or(0),
                ),
            });
        }
        Ok(())
    }

    /// The values of `target` (row-major, in its shard shape, zero padding) of the tensor
    /// stored under `key` (`name` for weights, `<label>/<name>.<moment>` for optimizer state,
    /// which shares `name`'s slices), assembled from the saved shards that overlap it.
    pub fn read(
        &self,
        key: &str,
        optimizer: bool,
        target: &ShardTarget,
    ) -> Result<Vec<f32>, MegatronError> {
        let want = &target.slice;
        let mut out = vec![0.0f32; target.shape.iter().product()];
        // The dimension the tensor is split along, by either layout (one per tensor name).
        let mut covered = vec![false; want.dim.map_or(1, |_| want.len)];
        let mut used: Vec<&ShardSlice> = Vec::new();
        for saved in self.ranks.values() {
            let Some(have) = saved.shards.get(&target.name) else {
                continue;
            };
            if used.contains(&have) {
                continue; // a data-parallel replica, or the tied embedding's other stage
            }
            let Some(file) = saved.file(optimizer)? else {
                continue;
            };
            if !file.contains(key) {
                continue; // a distributed optimizer's rank that did not own it
            }
            if have.global_shape != want.global_shape {
                return Err(MegatronError::Checkpoint {
                    message: format!(
                        "`{}` is {:?} in {}, but {:?} in this model: was it saved from another model?",
                        target.name,
                        have.global_shape,
                        saved.dir.display(),
                        want.global_shape
                    ),
                });
            }
            used.push(have);
            let dim = match (want.dim, have.dim) {
                (None, None) => {
                    let (values, _) = file.read_f32(key)?;
                    if values.len() != out.len() {
                        return Err(shape_error(key, file, &target.shape));
                    }
                    out = values;
                    covered[0] = true;
                    continue;
                }
                (Some(d), _) | (None, Some(d)) => d,
            };
            // Both extents along `dim`, in the full tensor's coordinates.
            let (want_start, want_len) = want
                .dim
                .map_or((0, want.global_shape[dim]), |_| (want.start, want.len));
            let (have_start, have_len) = have
                .dim
                .map_or((0, have.global_shape[dim]), |_| (have.start, have.len));
            let from = want_start.max(have_start);
            let to = (want_start + want_len).min(have_start + have_len);
            if from >= to {
                continue;
            }
            let (part, part_shape) =
                file.read_part_f32(key, dim, Some((from - have_start, to - from)))?;
            // The stored tensor must agree with the slice extra.json records for it.
            if !part_agrees(
                &part_shape,
                &target.shape,
                dim,
                from - want_start,
                to - from,
            ) {
                return Err(shape_error(key, file, &target.shape));
            }
            write_along(
                &mut out,
                &target.shape,
                dim,
                from - want_start,
                &part,
                to - from,
            );
            let marks = if want.dim.is_some() {
                &mut covered[from - want_start..to - want_start]
            } else {
                // A whole target assembled from split shards: count rows of the full extent.
                if covered.len() != want.global_shape[dim] {
                    covered = vec![false; want.global_shape[dim]];
                }
                &mut covered[from..to]
            };
            marks.iter_mut().for_each(|c| *c = true);
        }
        self.check_covered(&covered, key, want)?;
        Ok(out)
    }

    /// The state a rank holding `targets` loads: its weights assembled from every saved rank,
    /// the optimizer moments of those weights (merged over a distributed optimizer's ranks),
    /// and the counters (`extra`) of `rank` as saved, else of the first saved rank.
    pub fn load_for<B: Backend>(
        &self,
        rank: usize,
        targets: &[ShardTarget],
        contents: CheckpointContents,
        device: &B::Device,
    ) -> Result<CheckpointState<B>, MegatronError> {
        let to_tensor = |key: String, target: &ShardTarget, values: Vec<f32>| NamedTensor {
            name: key,
            shape: target.shape.clone(),
            values: Tensor::<B, 1>::from_data(
                TensorData::new(values, [target.shape.iter().product::<usize>()]),
                device,
            ),
        };
        let mut model = Vec::new();
        if contents.model {
            for t in targets {
                model.push(to_tensor(t.name.clone(), t, self.read(&t.name, false, t)?));
            }
        }
        let mut extra = self
            .ranks
            .get(&rank)
            .or_else(|| self.ranks.values().next())
            .map(|r| r.extra.clone())
            .unwrap_or(Value::Null);
        let mut optimizer = Vec::new();
        if contents.optimizer {
            let merged = self.merged_optimizers(targets);
            for (label, state) in &merged {
                let updated = state["moment_updates"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                for t in targets.iter().filter(|t| updated.contains_key(&t.name)) {
                    for moment in ["exp_avg", "exp_avg_sq"] {
                        let key = format!("{label}/{}.{moment}", t.name);
                        let values = self.read(&key, true, t)?;
                        optimizer.push(to_tensor(key, t, values));
                    }
                }
            }
            if let Some(e) = extra.as_object_mut() {
                e.insert("optimizers".into(), Value::Object(merged));
            }
        }
        if let Some(e) = extra.as_object_mut() {
            // They described the saving rank, not this one.
            e.remove("shards");
            e.remove("layout");
        }
        Ok(CheckpointState {
            model,
            optimizer,
            extra,
        })
    }

    /// Every optimizer label's step and the update counts of the moments of `targets`, merged
    /// over all saved ranks (each data-parallel rank of a distributed optimizer saved its own).
    fn merged_optimizers(&self, targets: &[ShardTarget]) -> Map<String, Value> {
        let mut merged = Map::new();
        for saved in self.ranks.values() {
            let Some(optims) = saved.extra.get("optimizers").and_then(Value::as_object) else {
                continue;
            };
            for (label, state) in optims {
                let entry = merged.entry(label.clone()).or_insert_with(|| {
                    serde_json::json!({ "step": state.get("step").cloned().unwrap_or(Value::Null),
                                        "moment_updates": {} })
                });
                let Some(times) = state.get("moment_updates").and_then(Value::as_object) else {
                    continue;
                };
                let into = entry["moment_updates"].as_object_mut().expect("made above");
                for (name, t) in times {
                    if targets.iter().any(|x| &x.name == name) {
                        into.entry(name.clone()).or_insert_with(|| t.clone());
                    }
                }
            }
        }
        merged
    }
}

fn shape_error(key: &str, file: &HfCheckpoint, expected: &[usize]) -> MegatronError {
    MegatronError::TensorShape {
        name: key.into(),
        file: file.file_of(key).map(Path::to_path_buf).unwrap_or_default(),
        expected: expected.to_vec(),
        found: file.shape(key).map(<[usize]>::to_vec).unwrap_or_default(),
    }
}

/// Writes `part` (`dst_shape` with `len` along `dim`) into `dst` at `offset` along `dim`.
fn write_along(
    dst: &mut [f32],
    dst_shape: &[usize],
    dim: usize,
    offset: usize,
    part: &[f32],
    len: usize,
) {
    let outer: usize = dst_shape[..dim].iter().product();
    let extent = dst_shape[dim];
    let inner: usize = dst_shape[dim + 1..].iter().product();
    for o in 0..outer {
        let to = (o * extent + offset) * inner;
        let from = o * len * inner;
        dst[to..to + len * inner].copy_from_slice(&part[from..from + len * inner]);
    }
}

/// Whether a part read along `dim` (`len` rows written at `offset`) has the target's shape in
/// every other dimension and fits inside it.
fn part_agrees(part: &[usize], target: &[usize], dim: usize, offset: usize, len: usize) -> bool {
    part.len() == target.len()
        && dim < part.len()
        && part
            .iter()
            .zip(target)
            .enumerate()
            .all(|(d, (&p, &t))| if d == dim { p == len } else { p == t })
        && offset + len <= target[dim]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_along_places_columns() {
        // A [2, 4] tensor, columns 1..3 written.
        let mut dst = vec![0.0; 8];
        write_along(&mut dst, &[2, 4], 1, 1, &[1., 2., 3., 4.], 2);
        assert_eq!(dst, vec![0., 1., 2., 0., 0., 3., 4., 0.]);
    }
}

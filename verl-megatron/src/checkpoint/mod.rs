//! The two checkpoint formats behind `verl_core::traits::CheckpointBackend`:
//!
//! - [`DistCheckpoint`]: each rank's model shard, AdamW moments and counters, in f32, for an
//!   exact resume (verl's `dist_ckpt`).
//!   A dist checkpoint loads on any other layout too ([`ShardedCheckpoint`]): each rank
//!   records where its tensors sit in the full ones.
//! - [`HfCheckpointer`]: the model alone in Hugging Face layout (config.json + safetensors),
//!   loadable by `transformers` with no conversion (what mbridge gives verl).
//!
//! Both write into `<dir>.partial` and swap it in only once complete, so a crash while saving
//! never destroys the checkpoint already there.

mod dist;
mod hf;
mod reshard;

pub use dist::DistCheckpoint;
pub use hf::HfCheckpointer;
pub use reshard::{SavedLayout, ShardTarget, ShardedCheckpoint};

use std::path::{Path, PathBuf};

use burn::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use verl_core::NamedTensor;

use crate::MegatronError;

fn io(path: &Path, e: impl std::fmt::Display) -> MegatronError {
    MegatronError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{suffix}"));
    dir.with_file_name(name)
}

/// Fills `<dir>.partial` with `fill`, then puts it in `dir`'s place; the old `dir` is removed
/// only after the new one is there.
pub(crate) fn replace_dir(
    dir: &Path,
    fill: impl FnOnce(&Path) -> Result<(), MegatronError>,
) -> Result<(), MegatronError> {
    let partial = sibling(dir, "partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| io(&partial, e))?;
    fill(&partial)?;
    if dir.exists() {
        let old = sibling(dir, "old");
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        }
        std::fs::rename(dir, &old).map_err(|e| io(dir, e))?;
        std::fs::rename(&partial, dir).map_err(|e| io(dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    } else {
        std::fs::rename(&partial, dir).map_err(|e| io(dir, e))?;
    }
    Ok(())
}

/// Writes `tensors` to one f32 safetensors file (bit-exact, for resume).
pub(crate) fn write_f32_tensors<B: Backend>(
    path: &Path,
    tensors: &[NamedTensor<B>],
) -> Result<(), MegatronError> {
    let encoded: Vec<(&str, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let bytes = t
                .values
                .to_data()
                .convert::<f32>()
                .iter::<f32>()
                .flat_map(f32::to_le_bytes)
                .collect();
            (t.name.as_str(), t.shape.clone(), bytes)
        })
        .collect();
    let views = encoded
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.to_string(), v))
                .map_err(|e| io(path, e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| io(path, e))
}

/// Reads every tensor of an f32 safetensors file written by [`write_f32_tensors`].
pub(crate) fn read_f32_tensors<B: Backend>(
    path: &Path,
    device: &B::Device,
) -> Result<Vec<NamedTensor<B>>, MegatronError> {
    let bytes = verl_core::files::read_regular(path, u64::MAX).map_err(|e| io(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| io(path, e))?;
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let view = st.tensor(&name).map_err(|e| io(path, e))?;
            if view.dtype() != Dtype::F32 {
                return Err(MegatronError::TensorDtype {
                    name,
                    file: path.to_path_buf(),
                    dtype: format!("{:?}", view.dtype()),
                });
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let shape = view.shape().to_vec();
            let t = Tensor::<B, 1>::from_data(
                burn::tensor::TensorData::new(values, [shape.iter().product::<usize>()]),
                device,
            );
            Ok(NamedTensor {
                name,
                shape,
                values: t,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_save_leaves_the_old_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        replace_dir(&dir, |d| {
            std::fs::write(d.join("a"), "old").map_err(|e| io(d, e))
        })
        .unwrap();
        let err = replace_dir(&dir, |d| {
            std::fs::write(d.join("a"), "new").map_err(|e| io(d, e))?;
            Err(MegatronError::Checkpoint {
                message: "disk full".into(),
            })
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read_to_string(dir.join("a")).unwrap(), "old");
        // The next save replaces it completely.
        replace_dir(&dir, |d| {
            std::fs::write(d.join("b"), "new").map_err(|e| io(d, e))
        })
        .unwrap();
        assert!(!dir.join("a").exists());
        assert_eq!(std::fs::read_to_string(dir.join("b")).unwrap(), "new");
    }
}

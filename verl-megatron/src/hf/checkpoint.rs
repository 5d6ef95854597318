//! Reading Hugging Face safetensors checkpoints — `model.safetensors`, or shards listed in
//! `model.safetensors.index.json` — memory-mapped, one tensor at a time, converting bf16 / f16
//! to f32. The extra memory of loading a tensor is that tensor's f32 copy, nothing more.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::tensor::TensorData;
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::config::HfModelConfig;
use super::tensor_map::hf_tensor_specs;
use crate::error::MegatronError;

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Where one tensor lives.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the mapped file.
    start: usize,
    end: usize,
}

/// An open checkpoint directory.
pub struct HfCheckpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    entries: BTreeMap<String, Entry>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> MegatronError {
    MegatronError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

impl HfCheckpoint {
    /// Opens `dir`, reading only the safetensors headers.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, MegatronError> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(INDEX);
        let file_names: Vec<String> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| io(&index_path, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| io(&index_path, e))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| io(&index_path, "no `weight_map` object"))?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec![SINGLE.to_string()]
        };
        Self::open_files(dir, &file_names)
    }

    /// Opens one safetensors file (a dist checkpoint's `model.safetensors` or
    /// `optim.safetensors`), reading only its header.
    pub fn open_file(path: impl AsRef<Path>) -> Result<Self, MegatronError> {
        let path = path.as_ref();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| io(path, "not a file name"))?;
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        Self::open_files(dir, &[name])
    }

    fn open_files(dir: PathBuf, file_names: &[String]) -> Result<Self, MegatronError> {
        let mut files = Vec::new();
        let mut entries = BTreeMap::new();
        for (i, name) in file_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(|e| io(&path, e))?;
            // SAFETY: the mapping is read-only; a checkpoint must not be rewritten while it is
            // open (the same contract every mmap-based loader, safetensors' own included, has).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io(&path, e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&mmap[..])
                .map_err(|e| io(&path, format!("not a safetensors file: {e}")))?;
            let base = 8 + header_len;
            for (tname, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                entries.insert(
                    tname,
                    Entry {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + s,
                        end: base + e,
                    },
                );
            }
            files.push((path, mmap));
        }
        Ok(Self {
            dir,
            files,
            entries,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The stored shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// The file that holds `name`.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.entries
            .get(name)
            .map(|e| self.files[e.file].0.as_path())
    }

    /// The values of `name` as f32, with its shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), MegatronError> {
        self.read_part_f32(name, 0, None)
    }

    /// The values of `name` as f32 restricted to `part` = `(start, len)` of dimension `dim`
    /// (the whole tensor for `None`), with the part's shape. Only the part's bytes are read
    /// from the mapped file: how a tensor-parallel rank loads its shard.
    pub fn read_part_f32(
        &self,
        name: &str,
        dim: usize,
        part: Option<(usize, usize)>,
    ) -> Result<(Vec<f32>, Vec<usize>), MegatronError> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| MegatronError::MissingTensor {
                name: name.into(),
                dir: self.dir.clone(),
            })?;
        let (path, mmap) = &self.files[e.file];
        let width = match e.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(MegatronError::TensorDtype {
                    name: name.into(),
                    file: path.clone(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let mut shape = e.shape.clone();
        let (start, len) = match part {
            Some((start, len)) if dim < shape.len() && start + len <= shape[dim] => (start, len),
            Some(_) => {
                return Err(MegatronError::TensorShape {
                    name: name.into(),
                    file: path.clone(),
                    expected: vec![],
                    found: shape,
                })
            }
            None => (0, shape.first().copied().unwrap_or(1)),
        };
        let dim = if part.is_some() { dim } else { 0 };
        let full = shape.get(dim).copied().unwrap_or(1);
        let outer: usize = shape[..dim.min(shape.len())].iter().product();
        let inner: usize = shape.get(dim + 1..).map_or(1, |s| s.iter().product());
        let bytes = &mmap[e.start..e.end];
        let mut values = Vec::with_capacity(outer * len * inner);
        for o in 0..outer {
            let from = (o * full + start) * inner * width;
            let run = &bytes[from..from + len * inner * width];
            match e.dtype {
                Dtype::F32 => values.extend(
                    run.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
                Dtype::BF16 => values.extend(
                    run.chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
                _ => values.extend(
                    run.chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
            }
        }
        if let Some(d) = shape.get_mut(dim) {
            *d = len;
        }
        Ok((values, shape))
    }

    /// Loads `name` onto `device` as a rank-`D` float tensor.
    pub fn load<B: Backend, const D: usize>(
        &self,
        name: &str,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, MegatronError> {
        self.load_part(name, 0, None, device)
    }

    /// Loads `part` = `(start, len)` of dimension `dim` of `name` (all of it for `None`).
    pub fn load_part<B: Backend, const D: usize>(
        &self,
        name: &str,
        dim: usize,
        part: Option<(usize, usize)>,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, MegatronError> {
        let (values, shape) = self.read_part_f32(name, dim, part)?;
        if shape.len() != D {
            let file = self
                .file_of(name)
                .map(Path::to_path_buf)
                .unwrap_or_default();
            return Err(MegatronError::TensorShape {
                name: name.into(),
                file,
                expected: vec![0; D],
                found: shape,
            });
        }
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// Checks the checkpoint against the tensors `cfg` implies: every tensor present, none
    /// extra, every shape right. Errors name the tensor, both shapes and the file.
    pub fn verify(&self, cfg: &HfModelConfig) -> Result<(), MegatronError> {
        let specs = hf_tensor_specs(cfg);
        for spec in &specs {
            match self.entries.get(&spec.name) {
                None if spec.optional => {}
                None => {
                    return Err(MegatronError::MissingTensor {
                        name: spec.name.clone(),
                        dir: self.dir.clone(),
                    })
                }
                Some(e) if e.shape != spec.shape => {
                    return Err(MegatronError::TensorShape {
                        name: spec.name.clone(),
                        file: self.files[e.file].0.clone(),
                        expected: spec.shape.clone(),
                        found: e.shape.clone(),
                    })
                }
                Some(_) => {}
            }
        }
        for (name, e) in &self.entries {
            if !specs.iter().any(|s| &s.name == name) {
                return Err(MegatronError::UnexpectedTensor {
                    name: name.clone(),
                    file: self.files[e.file].0.clone(),
                });
            }
        }
        Ok(())
    }
}

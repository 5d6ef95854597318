//! Saving a [`DataProto`] to a directory and loading it back: tensors as safetensors, the rest as JSON.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::tensor::TensorData;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{Column, ColumnKind, DataProto};
use crate::error::DataProtoError;

const TENSORS_FILE: &str = "batch.safetensors";
const META_FILE: &str = "data_proto.json";
const FORMAT_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Manifest {
    version: u32,
    columns: BTreeMap<String, ColumnKind>,
    non_tensor: BTreeMap<String, Vec<Value>>,
    meta_info: Map<String, Value>,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> DataProtoError {
    DataProtoError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn format_err(path: &Path, message: impl Into<String>) -> DataProtoError {
    DataProtoError::Format {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a crash never leaves a
/// half-written file in place of a good one.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataProtoError> {
    let tmp: PathBuf = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| io_err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

impl<B: Backend> DataProto<B> {
    /// Saves to directory `dir` (created if needed): `batch.safetensors` holds the tensors (float as
    /// f32, int as i64, bool as u8) and `data_proto.json` the kinds, non-tensor columns and meta_info.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<(), DataProtoError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let host: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = self
            .columns()
            .iter()
            .map(|(k, c)| {
                let data = c.to_data();
                let (dtype, bytes) = match c.kind() {
                    ColumnKind::Float => (Dtype::F32, data.convert::<f32>().into_bytes().to_vec()),
                    ColumnKind::Int => (Dtype::I64, data.convert::<i64>().into_bytes().to_vec()),
                    ColumnKind::Bool => {
                        let v: Vec<u8> = data.iter::<bool>().map(u8::from).collect();
                        (Dtype::U8, v)
                    }
                };
                (k.clone(), dtype, c.shape().to_vec(), bytes)
            })
            .collect();
        let views = host
            .iter()
            .map(|(k, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (k.clone(), v))
                    .map_err(|e| io_err(dir, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let serialized = safetensors::serialize(views, None::<HashMap<String, String>>)
            .map_err(|e| io_err(dir, e))?;
        write_atomic(&dir.join(TENSORS_FILE), &serialized)?;
        let manifest = Manifest {
            version: FORMAT_VERSION,
            columns: self
                .columns()
                .iter()
                .map(|(k, c)| (k.clone(), c.kind()))
                .collect(),
            non_tensor: self.non_tensor_columns().clone(),
            meta_info: self.meta_info.clone(),
        };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| io_err(dir, e))?;
        write_atomic(&dir.join(META_FILE), &json)
    }

    /// Loads a batch saved by [`DataProto::save`] onto `device`.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, DataProtoError> {
        let dir = dir.as_ref();
        let meta_path = dir.join(META_FILE);
        let manifest: Manifest =
            serde_json::from_slice(&std::fs::read(&meta_path).map_err(|e| io_err(&meta_path, e))?)
                .map_err(|e| format_err(&meta_path, e.to_string()))?;
        if manifest.version != FORMAT_VERSION {
            return Err(format_err(
                &meta_path,
                format!(
                    "format version {} is not supported (expected {FORMAT_VERSION})",
                    manifest.version
                ),
            ));
        }
        let tensors_path = dir.join(TENSORS_FILE);
        let bytes = std::fs::read(&tensors_path).map_err(|e| io_err(&tensors_path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| format_err(&tensors_path, e.to_string()))?;
        let mut batch = BTreeMap::new();
        for (key, kind) in &manifest.columns {
            let view = st
                .tensor(key)
                .map_err(|e| format_err(&tensors_path, format!("tensor `{key}`: {e}")))?;
            let shape = view.shape().to_vec();
            let data = match (kind, view.dtype()) {
                (ColumnKind::Float, Dtype::F32) => TensorData::from_bytes_vec(
                    view.data().to_vec(),
                    shape,
                    burn::tensor::DType::F32,
                ),
                (ColumnKind::Int, Dtype::I64) => TensorData::from_bytes_vec(
                    view.data().to_vec(),
                    shape,
                    burn::tensor::DType::I64,
                ),
                (ColumnKind::Bool, Dtype::U8) => TensorData::new(
                    view.data().iter().map(|&b| b != 0).collect::<Vec<bool>>(),
                    shape,
                ),
                (kind, dtype) => {
                    return Err(format_err(
                        &tensors_path,
                        format!(
                            "tensor `{key}` is {dtype:?} but the manifest says {}",
                            kind.name()
                        ),
                    ))
                }
            };
            batch.insert(key.clone(), Column::from_data(key, *kind, data, device)?);
        }
        let out = DataProto::from_parts(batch, manifest.non_tensor, manifest.meta_info);
        let len = out.len();
        for (k, c) in out.columns() {
            if c.len() != len {
                return Err(DataProtoError::LengthMismatch {
                    key: k.clone(),
                    expected: len,
                    found: c.len(),
                });
            }
        }
        for (k, v) in out.non_tensor_columns() {
            if v.len() != len {
                return Err(DataProtoError::LengthMismatch {
                    key: k.clone(),
                    expected: len,
                    found: v.len(),
                });
            }
        }
        Ok(out)
    }
}

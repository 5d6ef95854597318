//! Saving a [`DataProto`] to a directory and loading it back (tensors as safetensors, the rest as
//! JSON), and the same encoding as one byte buffer for another process ([`DataProto::to_wire`]).

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

/// The safetensors metadata key under which [`DataProto::to_wire`] keeps the manifest.
const WIRE_MANIFEST_KEY: &str = "verl.data_proto";

/// Where a decode error is reported: the file, or the wire (for bytes from another process).
const WIRE_PATH: &str = "<wire>";

impl<B: Backend> DataProto<B> {
    /// The kinds, non-tensor columns and meta_info: what the tensors' buffer does not hold.
    fn manifest(&self) -> Manifest {
        Manifest {
            version: FORMAT_VERSION,
            columns: self
                .columns()
                .iter()
                .map(|(k, c)| (k.clone(), c.kind()))
                .collect(),
            non_tensor: self.non_tensor_columns().clone(),
            meta_info: self.meta_info.clone(),
        }
    }

    /// The tensors as one safetensors buffer (float as f32, int as i64, bool as u8), with
    /// `metadata` in its header.
    fn encode(
        &self,
        metadata: Option<HashMap<String, String>>,
        at: &Path,
    ) -> Result<Vec<u8>, DataProtoError> {
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
                    .map_err(|e| io_err(at, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::serialize(views, metadata).map_err(|e| io_err(at, e))
    }

    /// The batch back from its manifest and its tensors' parsed safetensors buffer, checked for
    /// a supported version, matching dtypes and one batch size; errors name `at`.
    fn decode(
        manifest: Manifest,
        st: &SafeTensors<'_>,
        at: &Path,
        device: &B::Device,
    ) -> Result<Self, DataProtoError> {
        if manifest.version != FORMAT_VERSION {
            return Err(format_err(
                at,
                format!(
                    "format version {} is not supported (expected {FORMAT_VERSION})",
                    manifest.version
                ),
            ));
        }
        let mut batch = BTreeMap::new();
        for (key, kind) in &manifest.columns {
            let view = st
                .tensor(key)
                .map_err(|e| format_err(at, format!("tensor `{key}`: {e}")))?;
            let shape = view.shape().to_vec();
            let data = match (kind, view.dtype()) {
                (ColumnKind::Float, Dtype::F32) => TensorData::from_bytes_vec(
                    view.data().to_vec(),
                    shape,
                    burn::tensor::DType::F32,
                ),
                (ColumnKind::Int, Dtype::I64) => {
                    // Backends keep ints in 32 bits (token ids, positions and counts fit):
                    // a wider value is a damaged or foreign buffer, refused by name rather
                    // than left to panic in the backend's conversion.
                    let wide = view.data().chunks_exact(8).find_map(|b| {
                        let v = i64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                        i32::try_from(v).is_err().then_some(v)
                    });
                    if let Some(v) = wide {
                        return Err(format_err(
                            at,
                            format!("tensor `{key}` holds {v}, beyond 32-bit integers"),
                        ));
                    }
                    TensorData::from_bytes_vec(
                        view.data().to_vec(),
                        shape,
                        burn::tensor::DType::I64,
                    )
                }
                (ColumnKind::Bool, Dtype::U8) => TensorData::new(
                    view.data().iter().map(|&b| b != 0).collect::<Vec<bool>>(),
                    shape,
                ),
                (kind, dtype) => {
                    return Err(format_err(
                        at,
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

    /// Saves to directory `dir` (created if needed): `batch.safetensors` holds the tensors (float as
    /// f32, int as i64, bool as u8) and `data_proto.json` the kinds, non-tensor columns and meta_info.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<(), DataProtoError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        write_atomic(&dir.join(TENSORS_FILE), &self.encode(None, dir)?)?;
        let json = serde_json::to_vec_pretty(&self.manifest()).map_err(|e| io_err(dir, e))?;
        write_atomic(&dir.join(META_FILE), &json)
    }

    /// Loads a batch saved by [`DataProto::save`] onto `device`.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self, DataProtoError> {
        let dir = dir.as_ref();
        let meta_path = dir.join(META_FILE);
        let manifest: Manifest = serde_json::from_slice(
            &crate::files::read_regular(&meta_path, crate::files::TEXT_LIMIT)
                .map_err(|e| io_err(&meta_path, e))?,
        )
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
        let bytes = crate::files::read_regular(&tensors_path, u64::MAX)
            .map_err(|e| io_err(&tensors_path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| format_err(&tensors_path, e.to_string()))?;
        Self::decode(manifest, &st, &tensors_path, device)
    }

    /// The batch as one byte buffer for another process (a rank worker, the driver): a
    /// safetensors buffer of the tensors (float as f32, int as i64, bool as u8, shapes kept)
    /// whose header carries the kinds, the non-tensor columns and `meta_info` as JSON.
    /// [`DataProto::from_wire`] reads it back.
    ///
    /// ```
    /// use burn::tensor::{Int, Tensor};
    /// use verl_core::backend::CpuBackend as B;
    /// use verl_core::DataProto;
    /// let device = Default::default();
    /// let mut batch = DataProto::<B>::new();
    /// batch.insert_int("input_ids", Tensor::<B, 2, Int>::from_ints([[1, 2], [3, 4]], &device))?;
    /// batch.insert_non_tensor("uid", vec!["a".into(), "b".into()])?;
    /// let back = DataProto::<B>::from_wire(&batch.to_wire()?, &device)?;
    /// assert_eq!(back.to_data("input_ids")?, batch.to_data("input_ids")?);
    /// assert_eq!(back.non_tensor("uid")?, batch.non_tensor("uid")?);
    /// # Ok::<(), verl_core::error::DataProtoError>(())
    /// ```
    pub fn to_wire(&self) -> Result<Vec<u8>, DataProtoError> {
        let at = Path::new(WIRE_PATH);
        let json = serde_json::to_string(&self.manifest()).map_err(|e| io_err(at, e))?;
        let metadata = HashMap::from([(WIRE_MANIFEST_KEY.to_string(), json)]);
        self.encode(Some(metadata), at)
    }

    /// A batch from [`DataProto::to_wire`]'s bytes, onto `device`.
    pub fn from_wire(bytes: &[u8], device: &B::Device) -> Result<Self, DataProtoError> {
        let at = Path::new(WIRE_PATH);
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| format_err(at, e.to_string()))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(WIRE_MANIFEST_KEY))
            .ok_or_else(|| format_err(at, format!("no `{WIRE_MANIFEST_KEY}` in the header")))?;
        let manifest: Manifest =
            serde_json::from_str(json).map_err(|e| format_err(at, e.to_string()))?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| format_err(at, e.to_string()))?;
        Self::decode(manifest, &st, at, device)
    }
}

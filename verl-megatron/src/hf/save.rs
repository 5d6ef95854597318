//! Writing a model back in Hugging Face layout — `model.safetensors`, or shards plus
//! `model.safetensors.index.json` — with `config.json` and the chosen dtype, so that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};
use verl_core::NamedTensor;

use super::config::WeightDtype;
use crate::error::MegatronError;

/// How to write a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SaveOptions {
    pub dtype: WeightDtype,
    /// Start a new shard once a shard would exceed this many bytes (transformers' `max_shard_size`).
    pub max_shard_bytes: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            dtype: WeightDtype::F32,
            max_shard_bytes: 5 * 1024 * 1024 * 1024,
        }
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> MegatronError {
    MegatronError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn encode<B: Backend>(t: &NamedTensor<B>, dtype: WeightDtype) -> (Dtype, Vec<u8>) {
    let values = t.values.to_data();
    let it = values.iter::<f32>();
    match dtype {
        WeightDtype::F32 => (Dtype::F32, it.flat_map(f32::to_le_bytes).collect()),
        WeightDtype::BF16 => (
            Dtype::BF16,
            it.flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        ),
        WeightDtype::F16 => (
            Dtype::F16,
            it.flat_map(|v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
        ),
    }
}

/// Writes through a temporary name and a rename, so a crash never leaves a torn file.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), MegatronError> {
    let tmp: PathBuf = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// Saves `weights` (HF names) into `dir` with `config_json` (the source model's config, whose
/// dtype keys are updated). Tensors are encoded one at a time; a shard's bytes are held until it
/// is written.
pub fn save_pretrained<B: Backend>(
    weights: &[NamedTensor<B>],
    config_json: &Value,
    dir: impl AsRef<Path>,
    options: SaveOptions,
) -> Result<(), MegatronError> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    // Plan shards by size, in the order given.
    let bytes_per = match options.dtype {
        WeightDtype::F32 => 4,
        _ => 2,
    };
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut current = 0usize;
    for (i, w) in weights.iter().enumerate() {
        let size = w.numel() * bytes_per;
        if current > 0 && current + size > options.max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        shards.last_mut().expect("one shard exists").push(i);
        current += size;
    }
    let n = shards.len();
    let file_name = |k: usize| {
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
        }
    };
    // The stored names of the config's architecture (Mixtral names its experts otherwise).
    let architecture = config_json["architectures"][0]
        .as_str()
        .filter(|a| a.starts_with("Mixtral"))
        .map(|_| super::Architecture::Mixtral);
    let stored = |name: &str| match architecture {
        Some(a) => super::names::to_stored_name(a, name).into_owned(),
        None => name.to_string(),
    };
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (k, members) in shards.iter().enumerate() {
        let encoded: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = members
            .iter()
            .map(|&i| {
                let w = &weights[i];
                let (dtype, bytes) = encode(w, options.dtype);
                (stored(&w.name), dtype, w.shape.clone(), bytes)
            })
            .collect();
        let views = encoded
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| io(dir, e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| io(dir, e))?;
        write_atomic(&dir.join(file_name(k)), &bytes)?;
        for (name, _, _, b) in &encoded {
            total += b.len();
            weight_map.insert(name.clone(), file_name(k));
        }
    }
    let index_path = dir.join("model.safetensors.index.json");
    if n > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        write_atomic(
            &index_path,
            serde_json::to_string_pretty(&index)
                .map_err(|e| io(dir, e))?
                .as_bytes(),
        )?;
    } else if index_path.exists() {
        std::fs::remove_file(&index_path).map_err(|e| io(&index_path, e))?;
    }
    let mut config = config_json.clone();
    if let Some(map) = config.as_object_mut() {
        let name = match options.dtype {
            WeightDtype::F32 => "float32",
            WeightDtype::F16 => "float16",
            WeightDtype::BF16 => "bfloat16",
        };
        // Write the dialect the source used.
        let key = if map.contains_key("torch_dtype") {
            "torch_dtype"
        } else {
            "dtype"
        };
        map.insert(key.to_string(), Value::String(name.to_string()));
    }
    write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&config)
            .map_err(|e| io(dir, e))?
            .as_bytes(),
    )
}

/// Reads `dir/config.json` as raw JSON, to be written back by [`save_pretrained`].
pub fn read_config_json(dir: impl AsRef<Path>) -> Result<Value, MegatronError> {
    let path = dir.as_ref().join("config.json");
    let text = verl_core::files::read_text(&path).map_err(|e| io(&path, e))?;
    serde_json::from_str(&text).map_err(|e| io(&path, e))
}

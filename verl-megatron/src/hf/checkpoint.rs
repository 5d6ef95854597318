//! Reading Hugging Face safetensors checkpoints — `model.safetensors`, or shards listed in
//! `model.safetensors.index.json` — memory-mapped, one tensor at a time, bf16 / f16 widened to
//! f32 (on the device where the backend holds half precision, else on the host). The extra host
//! memory of loading a tensor is one copy of that tensor, nothing more.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::prelude::*;
use burn::tensor::{DType, FloatDType, TensorData};
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::config::HfModelConfig;
use super::tensor_map::hf_tensor_specs;
use crate::error::MegatronError;
use crate::parallel::ParallelBackend;

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Refuses a weight file `name` (a shard named by the index, or the single
/// `model.safetensors`) that would be read outside `dir`: an absolute path, `..`, or a
/// symbolic link that leads out. `named_by` is the file that names it, for the error. A link
/// into the blobs of the Hugging Face hub cache that holds `dir` as one of its snapshots is
/// inside (every file of a snapshot is one: `snapshots/<revision>/x -> ../../blobs/<hash>`).
fn check_inside(dir: &Path, name: &str, named_by: &Path) -> Result<(), MegatronError> {
    use std::path::Component;
    let plain = !name.is_empty()
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(io(
            named_by,
            format!("shard `{name}` is not a file inside the model directory; the index may only name files next to it"),
        ));
    }
    let path = dir.join(name);
    if let (Ok(real_dir), Ok(real)) = (dir.canonicalize(), path.canonicalize()) {
        if !real.starts_with(&real_dir) && !is_hub_blob(&real_dir, &real) {
            let what = if name == SINGLE {
                "weight file"
            } else {
                "shard"
            };
            return Err(io(
                named_by,
                format!(
                    "{what} `{name}` leads to {} outside the model directory (a symbolic link); copy the file in instead",
                    real.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Whether `real` is a file of the `blobs` folder of the Hugging Face hub cache repository
/// that holds `real_dir` under its `snapshots` folder (both paths canonical).
fn is_hub_blob(real_dir: &Path, real: &Path) -> bool {
    real_dir
        .ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .is_some_and(|repo| real.parent() == Some(repo.join("blobs").as_path()))
}

/// When safetensors refuses a header, the first tensor whose byte range disagrees with its
/// shape and dtype (safetensors' own error does not name it), or a range past the file's end.
fn first_bad_tensor(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = bytes.get(8..8usize.checked_add(n)?)?;
    let v: serde_json::Value = serde_json::from_slice(header).ok()?;
    let data_len = bytes.len() - 8 - n;
    for (name, info) in v.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let width: u128 = match info.get("dtype")?.as_str()? {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "F16" | "BF16" | "I16" | "U16" => 2,
            "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
            _ => continue,
        };
        // Checked: the dimensions come from the file and may multiply past any integer.
        let needed: Option<u128> = info
            .get("shape")?
            .as_array()?
            .iter()
            .try_fold(width, |acc, d| acc.checked_mul(u128::from(d.as_u64()?)));
        let offsets = info.get("data_offsets")?.as_array()?;
        let (start, end) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
        let len = u128::from(end.saturating_sub(start));
        if needed != Some(len) {
            let needs = needed.map_or("more than 2^128".to_string(), |n| n.to_string());
            return Some(format!(
                "tensor `{name}` ({} of shape {}) needs {needs} bytes but its data_offsets give {len}",
                info["dtype"], info["shape"],
            ));
        }
        if end > data_len as u64 {
            return Some(format!(
                "tensor `{name}` ends at byte {end} of the data, past its end ({data_len}): the file is truncated"
            ));
        }
    }
    None
}

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

/// `shape` (of rank `D`, checked by the caller) as burn's array.
pub(crate) fn dims<const D: usize>(shape: &[usize]) -> [usize; D] {
    let mut out = [0; D];
    out.copy_from_slice(shape);
    out
}

/// A part of one stored tensor: `outer` runs of `len * inner` elements, run `o` starting at
/// element `(o * full + start) * inner` of the tensor's bytes.
struct PartView<'a> {
    bytes: &'a [u8],
    dtype: Dtype,
    /// The part's shape.
    shape: Vec<usize>,
    /// Bytes per element.
    width: usize,
    outer: usize,
    full: usize,
    start: usize,
    len: usize,
    inner: usize,
}

impl PartView<'_> {
    fn elements(&self) -> usize {
        self.outer * self.len * self.inner
    }

    /// Where run `o` starts in the tensor's bytes.
    fn run_start(&self, o: usize) -> usize {
        (o * self.full + self.start) * self.inner * self.width
    }

    /// The part's bytes, one contiguous run per index of the dimensions before the split one.
    fn runs(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let run = self.len * self.inner * self.width;
        (0..self.outer).map(move |o| {
            let from = self.run_start(o);
            &self.bytes[from..from + run]
        })
    }

    /// The part's bytes in one buffer. Above 32 MiB the copy is split over up to 8 threads
    /// (whole runs, or byte ranges of a single run), each faulting in its own pages.
    fn gather(&self) -> Vec<u8> {
        const PARALLEL_ABOVE: usize = 32 << 20;
        let total = self.elements() * self.width;
        let mut out = vec![0u8; total];
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8);
        if total <= PARALLEL_ABOVE || threads == 1 {
            let mut at = 0;
            for run in self.runs() {
                out[at..at + run.len()].copy_from_slice(run);
                at += run.len();
            }
            return out;
        }
        // Destination offsets follow the runs in order; cut the output into equal slices and
        // let each thread copy the source bytes that land in its slice.
        let run_len = self.len * self.inner * self.width;
        let slice = total.div_ceil(threads);
        std::thread::scope(|s| {
            for (i, dst) in out.chunks_mut(slice).enumerate() {
                s.spawn(move || {
                    let mut at = i * slice;
                    let end = at + dst.len();
                    while at < end {
                        let (o, within) = (at / run_len, at % run_len);
                        let take = (run_len - within).min(end - at);
                        let from = self.run_start(o) + within;
                        let d = at - i * slice;
                        dst[d..d + take].copy_from_slice(&self.bytes[from..from + take]);
                        at += take;
                    }
                });
            }
        });
        out
    }
}

/// An open checkpoint directory.
pub struct HfCheckpoint {
    dir: PathBuf,
    files: Vec<(PathBuf, Mmap)>,
    entries: BTreeMap<String, Entry>,
    /// Widen half-precision weights to f32 on the host even where the device could.
    widen_on_host: bool,
    /// Bytes [`Self::load_part`] read, and nanoseconds it spent reading them out of the
    /// mapping and handing them to the device: what [`Self::load_stats`] reports.
    loaded: [std::sync::atomic::AtomicU64; 3],
}

/// What loading from a checkpoint has cost so far ([`HfCheckpoint::load_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadStats {
    /// Bytes of stored tensors read.
    pub bytes: u64,
    /// Seconds reading them out of the mapped files (page faults and copies: the disk or page
    /// cache side).
    pub read_seconds: f64,
    /// Seconds handing them to the device (upload, widening to f32; enqueued, not waited for).
    pub device_seconds: f64,
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
            let text = verl_core::files::read_text(&index_path).map_err(|e| io(&index_path, e))?;
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
            for name in &names {
                check_inside(&dir, name, &index_path)?;
            }
            names
        } else {
            check_inside(&dir, SINGLE, &dir.join(SINGLE))?;
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
            let file = verl_core::files::open_regular(&path).map_err(|e| io(&path, e))?;
            // SAFETY: the mapping is read-only; a checkpoint must not be rewritten while it is
            // open (the same contract every mmap-based loader, safetensors' own included, has).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io(&path, e))?;
            // Our own check first, in checked arithmetic: it names the tensor, and absurd
            // dimensions never reach the safetensors crate's unchecked products.
            if let Some(why) = first_bad_tensor(&mmap[..]) {
                return Err(io(&path, why));
            }
            let (header_len, meta) = SafeTensors::read_metadata(&mmap[..])
                .map_err(|e| io(&path, format!("not a safetensors file: {e}")))?;
            let base = 8 + header_len;
            for (tname, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                // Stored names the decoder calls otherwise (Mixtral's experts) are renamed.
                entries.insert(
                    super::names::to_decoder_name(&tname).into_owned(),
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
            widen_on_host: std::env::var("VERL_LOAD_WIDEN_ON_HOST").is_ok_and(|v| v == "1"),
            loaded: Default::default(),
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
        let p = self.part(name, dim, part)?;
        let mut values = Vec::with_capacity(p.elements());
        for run in p.runs() {
            match p.dtype {
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
        Ok((values, p.shape))
    }

    /// The stored (little-endian) bytes of `part` of `name`, unconverted, with the part's
    /// shape and the stored dtype. A large part is copied by several threads: on a warm page
    /// cache one thread's copy out of the mapping is what bounds loading a 7B checkpoint.
    pub fn read_part_bytes(
        &self,
        name: &str,
        dim: usize,
        part: Option<(usize, usize)>,
    ) -> Result<(Vec<u8>, Vec<usize>, Dtype), MegatronError> {
        let p = self.part(name, dim, part)?;
        let bytes = p.gather();
        Ok((bytes, p.shape, p.dtype))
    }

    /// Where `part` of `name` lies in its mapped file, checked against the stored shape.
    fn part(
        &self,
        name: &str,
        dim: usize,
        part: Option<(usize, usize)>,
    ) -> Result<PartView<'_>, MegatronError> {
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
        let bad_shape = |shape: Vec<usize>| MegatronError::TensorShape {
            name: name.into(),
            file: path.clone(),
            expected: vec![],
            found: shape,
        };
        let (start, len) = match part {
            Some((start, len))
                if dim < shape.len() && start.checked_add(len).is_some_and(|e| e <= shape[dim]) =>
            {
                (start, len)
            }
            Some(_) => return Err(bad_shape(shape)),
            None => (0, shape.first().copied().unwrap_or(1)),
        };
        let dim = if part.is_some() { dim } else { 0 };
        let full = shape.get(dim).copied().unwrap_or(1);
        // Checked products: a tensor with a zero dimension is valid to safetensors whatever
        // its other dimensions, and holds nothing.
        let product = |dims: &[usize]| dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let (outer, inner) = if shape.contains(&0) || len == 0 {
            (0, 0)
        } else {
            let (Some(outer), Some(inner)) = (
                product(&shape[..dim.min(shape.len())]),
                shape.get(dim + 1..).map_or(Some(1), product),
            ) else {
                return Err(bad_shape(shape));
            };
            (outer, inner)
        };
        if let Some(d) = shape.get_mut(dim) {
            *d = len;
        }
        Ok(PartView {
            bytes: &mmap[e.start..e.end],
            dtype: e.dtype,
            shape,
            width,
            outer,
            full,
            start,
            len,
            inner,
        })
    }

    /// Loads `name` onto `device` as a rank-`D` float tensor.
    pub fn load<B: ParallelBackend, const D: usize>(
        &self,
        name: &str,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, MegatronError> {
        self.load_part(name, 0, None, device)
    }

    /// Loads `part` = `(start, len)` of dimension `dim` of `name` (all of it for `None`).
    pub fn load_part<B: ParallelBackend, const D: usize>(
        &self,
        name: &str,
        dim: usize,
        part: Option<(usize, usize)>,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, MegatronError> {
        let rank_check = |shape: Vec<usize>| match shape.len() == D {
            true => Ok(shape),
            false => Err(MegatronError::TensorShape {
                name: name.into(),
                file: self
                    .file_of(name)
                    .map(Path::to_path_buf)
                    .unwrap_or_default(),
                expected: vec![0; D],
                found: shape,
            }),
        };
        let started = std::time::Instant::now();
        match self.device_half::<B>(name, device) {
            // Half-precision weights go to the device as stored (half the bytes over the bus,
            // no per-element work on the host) and are widened there: bf16 / f16 to f32 is
            // exact, so the tensor is the one the host path builds.
            // Both paths upload one flat run and reshape on the device: burn-cuda pads the rows
            // of a matrix it creates, and the row-by-row copy from pageable memory that
            // padding takes ran at ~0.5 GB/s (28 s of a 7B load).
            Some(dtype) => {
                let view = self.part(name, dim, part)?;
                let shape = rank_check(view.shape.clone())?;
                let flat = [shape.iter().product::<usize>()];
                // Straight from the mapped file where the backend can (its own staging reads
                // the pages: all of it counts as the device side); else one host buffer.
                let runs: Vec<&[u8]> = view.runs().collect();
                let (t, read) = match B::upload_runs(&runs, flat[0], dtype, device) {
                    Some(t) => {
                        self.count_read(flat[0] * view.width, std::time::Instant::now());
                        (t, started)
                    }
                    None => {
                        let bytes = view.gather();
                        let read = self.count_read(bytes.len(), started);
                        let data = TensorData::from_bytes_vec(bytes, flat, dtype);
                        (B::upload_flat(data, device), read)
                    }
                };
                let uploaded = read.elapsed().as_secs_f64();
                let t = t.cast(FloatDType::F32).reshape(dims::<D>(&shape));
                tracing::debug!(
                    target: "verl_megatron::load",
                    name,
                    elements = flat[0],
                    upload_s = uploaded,
                    widen_s = read.elapsed().as_secs_f64() - uploaded,
                    "to the device"
                );
                self.count_device(read);
                Ok(t)
            }
            None => {
                let (values, shape) = self.read_part_f32(name, dim, part)?;
                let width = match self.entries.get(name).map(|e| e.dtype) {
                    Some(Dtype::F32) => 4,
                    _ => 2,
                };
                let read = self.count_read(values.len() * width, started);
                let shape = rank_check(shape)?;
                let flat = [values.len()];
                let t = B::upload_flat(TensorData::new(values, flat), device)
                    .reshape(dims::<D>(&shape));
                self.count_device(read);
                Ok(t)
            }
        }
    }

    fn count_read(&self, bytes: usize, since: std::time::Instant) -> std::time::Instant {
        use std::sync::atomic::Ordering::Relaxed;
        self.loaded[0].fetch_add(bytes as u64, Relaxed);
        self.loaded[1].fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
        std::time::Instant::now()
    }

    fn count_device(&self, since: std::time::Instant) {
        use std::sync::atomic::Ordering::Relaxed;
        self.loaded[2].fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
    }

    /// What [`Self::load_part`] has cost so far on this checkpoint: bytes, and seconds on the
    /// host side and the device side (the two loading figures `verl generate` and the workers
    /// log).
    pub fn load_stats(&self) -> LoadStats {
        use std::sync::atomic::Ordering::Relaxed;
        LoadStats {
            bytes: self.loaded[0].load(Relaxed),
            read_seconds: self.loaded[1].load(Relaxed) as f64 * 1e-9,
            device_seconds: self.loaded[2].load(Relaxed) as f64 * 1e-9,
        }
    }

    /// With `true`, [`Self::load_part`] widens half-precision weights to f32 on the host, as
    /// it does for a backend without half precision (the fallback path; the environment
    /// variable `VERL_LOAD_WIDEN_ON_HOST=1` sets it for every checkpoint opened).
    ///
    /// ```no_run
    /// # use verl_megatron::hf::HfCheckpoint;
    /// let ckpt = HfCheckpoint::open("/models/qwen2.5-7b")?.with_widening_on_host(true);
    /// # Ok::<(), verl_megatron::MegatronError>(())
    /// ```
    pub fn with_widening_on_host(mut self, on: bool) -> Self {
        self.widen_on_host = on;
        self
    }

    /// The stored half-precision dtype of `name` when the backend holds it on `device`
    /// (burn-cuda and the CPU backend do) and host widening was not asked for.
    fn device_half<B: Backend>(&self, name: &str, device: &B::Device) -> Option<DType> {
        let dtype = match self.entries.get(name)?.dtype {
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            _ => return None,
        };
        (!self.widen_on_host
            && B::supports_dtype(device, dtype)
            && B::supports_dtype(device, DType::F32))
        .then_some(dtype)
    }

    /// The layer and expert counts of `config.json` against the tensors on disk, before any
    /// list as long as them is built (a `num_hidden_layers` of 10¹² must not allocate).
    fn check_counts(&self, cfg: &HfModelConfig) -> Result<(), MegatronError> {
        let index_after = |name: &str, key: &str| -> Option<usize> {
            let rest = &name[name.find(key)? + key.len()..];
            rest.split('.').next()?.parse().ok()
        };
        let count = |key: &str| {
            self.entries
                .keys()
                .filter_map(|n| index_after(n, key))
                .max()
                .map_or(0, |i| i.saturating_add(1))
        };
        let config = self.dir.join("config.json");
        let field = |field: &str, want: usize, found: usize, what: &str| MegatronError::Config {
            path: config.clone(),
            field: field.into(),
            message: format!(
                "says {want}, but the weights in {} hold {found} {what}",
                self.dir.display()
            ),
        };
        let layers = count("model.layers.");
        if cfg.num_hidden_layers != layers {
            return Err(field(
                "num_hidden_layers",
                cfg.num_hidden_layers,
                layers,
                "layers",
            ));
        }
        if let Some(moe) = &cfg.moe {
            let experts = count(".mlp.experts.");
            if experts > 0 && moe.num_experts != experts {
                return Err(field("num_experts", moe.num_experts, experts, "experts"));
            }
        }
        Ok(())
    }

    /// Checks the checkpoint against the tensors `cfg` implies: every tensor present, none
    /// extra, every shape right. Errors name the tensor, both shapes and the file.
    pub fn verify(&self, cfg: &HfModelConfig) -> Result<(), MegatronError> {
        self.check_counts(cfg)?;
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

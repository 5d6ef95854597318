//! [`DataProto`]: the batch that travels between the single controller and its rank workers.
//!
//! It mirrors verl's `DataProto`: named batch-first tensors (`batch`), per-row non-tensor values
//! (`non_tensor_batch`, here JSON values) and a free-form `meta_info` map. Every row operation keeps
//! the three in step.

mod column;
mod io;

use std::collections::BTreeMap;

use burn::prelude::*;
use burn::tensor::{Bool, Int, TensorData};
use serde_json::{Map, Value};

use column::Rows;
pub use column::{Column, ColumnKind};

use crate::error::DataProtoError;

type Result<T> = std::result::Result<T, DataProtoError>;

/// `meta_info` key whose per-part values [`DataProto::concat`] gathers into lists.
pub const METRICS_KEY: &str = "metrics";

/// Columns of rank 3 or more that hold one entry per position of the sequence (as
/// `[batch, width]` columns hold one value), narrowed with the positions by
/// [`DataProto::narrow_columns`]; every other column of rank 3 or more is left as it is,
/// whatever its second dimension (mrope's `position_ids` `[batch, 3, width]` among them).
pub const PER_POSITION_COLUMNS: &[&str] = &["routed_experts"];

/// A batch of named tensors, per-row JSON values and meta information.
///
/// ```
/// use burn::backend::Flex;
/// use burn::tensor::{Int, Tensor};
/// use verl_core::DataProto;
///
/// let device = Default::default();
/// let mut batch = DataProto::<Flex>::new();
/// batch.insert_int("input_ids", Tensor::<Flex, 2, Int>::from_ints([[1, 2], [3, 4], [5, 6], [7, 8]], &device))?;
/// batch.insert_non_tensor("uid", vec!["a".into(), "b".into(), "c".into(), "d".into()])?;
/// let grouped = batch.repeat(2, true)?; // GRPO: every prompt twice, samples adjacent
/// assert_eq!(grouped.len(), 8);
/// let parts = grouped.chunk(2)?;
/// assert_eq!(DataProto::concat(parts)?.len(), 8);
/// # Ok::<(), verl_core::error::DataProtoError>(())
/// ```
#[derive(Debug, Clone)]
pub struct DataProto<B: Backend> {
    batch: BTreeMap<String, Column<B>>,
    non_tensor: BTreeMap<String, Vec<Value>>,
    /// Free-form information that travels with the batch (temperature, global steps, ...).
    pub meta_info: Map<String, Value>,
}

impl<B: Backend> Default for DataProto<B> {
    fn default() -> Self {
        Self::new()
    }
}

fn joined<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    keys.map(String::as_str).collect::<Vec<_>>().join(", ")
}

impl<B: Backend> DataProto<B> {
    /// An empty batch.
    pub fn new() -> Self {
        Self {
            batch: BTreeMap::new(),
            non_tensor: BTreeMap::new(),
            meta_info: Map::new(),
        }
    }

    /// Number of rows; 0 for a batch with no columns.
    pub fn len(&self) -> usize {
        if let Some(c) = self.batch.values().next() {
            c.len()
        } else {
            self.non_tensor.values().next().map_or(0, Vec::len)
        }
    }

    /// True when the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn has_columns(&self) -> bool {
        !self.batch.is_empty() || !self.non_tensor.is_empty()
    }

    fn check_len(&self, key: &str, found: usize) -> Result<()> {
        if self.has_columns() && found != self.len() {
            return Err(DataProtoError::LengthMismatch {
                key: key.to_string(),
                expected: self.len(),
                found,
            });
        }
        Ok(())
    }

    fn insert_column(&mut self, key: &str, column: Column<B>) -> Result<()> {
        // Replacing a column with itself must not count the old one against the new length.
        let old = self.batch.remove(key);
        if let Err(e) = self.check_len(key, column.len()) {
            if let Some(old) = old {
                self.batch.insert(key.to_string(), old);
            }
            return Err(e);
        }
        self.batch.insert(key.to_string(), column);
        Ok(())
    }

    /// Adds (or replaces) a float tensor; its first dimension is the batch.
    pub fn insert_float<const D: usize>(&mut self, key: &str, tensor: Tensor<B, D>) -> Result<()> {
        self.insert_column(key, Column::float(key, tensor)?)
    }

    /// Adds (or replaces) an integer tensor; its first dimension is the batch.
    pub fn insert_int<const D: usize>(
        &mut self,
        key: &str,
        tensor: Tensor<B, D, Int>,
    ) -> Result<()> {
        self.insert_column(key, Column::int(key, tensor)?)
    }

    /// Adds (or replaces) a boolean tensor; its first dimension is the batch.
    pub fn insert_bool<const D: usize>(
        &mut self,
        key: &str,
        tensor: Tensor<B, D, Bool>,
    ) -> Result<()> {
        self.insert_column(key, Column::bool(key, tensor)?)
    }

    /// Adds (or replaces) a per-row non-tensor column (strings, numbers, JSON objects).
    pub fn insert_non_tensor(&mut self, key: &str, values: Vec<Value>) -> Result<()> {
        let old = self.non_tensor.remove(key);
        if let Err(e) = self.check_len(key, values.len()) {
            if let Some(old) = old {
                self.non_tensor.insert(key.to_string(), old);
            }
            return Err(e);
        }
        self.non_tensor.insert(key.to_string(), values);
        Ok(())
    }

    fn missing(&self, key: &str) -> DataProtoError {
        DataProtoError::MissingKey {
            key: key.to_string(),
            available: joined(self.batch.keys().chain(self.non_tensor.keys())),
        }
    }

    /// The column `key`, whatever its kind.
    pub fn column(&self, key: &str) -> Result<&Column<B>> {
        self.batch.get(key).ok_or_else(|| self.missing(key))
    }

    /// The float tensor `key` with its full shape (rank `D`).
    pub fn float<const D: usize>(&self, key: &str) -> Result<Tensor<B, D>> {
        self.column(key)?.reshape_float(key)
    }

    /// The integer tensor `key` with its full shape (rank `D`).
    pub fn int<const D: usize>(&self, key: &str) -> Result<Tensor<B, D, Int>> {
        self.column(key)?.reshape_int(key)
    }

    /// The boolean tensor `key` with its full shape (rank `D`).
    pub fn bool<const D: usize>(&self, key: &str) -> Result<Tensor<B, D, Bool>> {
        self.column(key)?.reshape_bool(key)
    }

    /// The per-row values of non-tensor column `key`.
    pub fn non_tensor(&self, key: &str) -> Result<&[Value]> {
        self.non_tensor
            .get(key)
            .map(Vec::as_slice)
            .ok_or_else(|| self.missing(key))
    }

    /// Names of the tensor columns, sorted.
    pub fn batch_keys(&self) -> impl Iterator<Item = &str> {
        self.batch.keys().map(String::as_str)
    }

    /// Names of the non-tensor columns, sorted.
    pub fn non_tensor_keys(&self) -> impl Iterator<Item = &str> {
        self.non_tensor.keys().map(String::as_str)
    }

    /// True if a tensor or non-tensor column named `key` exists.
    pub fn contains(&self, key: &str) -> bool {
        self.batch.contains_key(key) || self.non_tensor.contains_key(key)
    }

    /// A new batch with only the named columns and meta keys (`None` keeps all of that part).
    pub fn select(
        &self,
        batch_keys: Option<&[&str]>,
        non_tensor_keys: Option<&[&str]>,
        meta_keys: Option<&[&str]>,
    ) -> Result<Self> {
        let batch = match batch_keys {
            None => self.batch.clone(),
            Some(keys) => keys
                .iter()
                .map(|k| {
                    self.batch
                        .get(*k)
                        .map(|c| (k.to_string(), c.clone()))
                        .ok_or_else(|| self.missing(k))
                })
                .collect::<Result<_>>()?,
        };
        let non_tensor = match non_tensor_keys {
            None => self.non_tensor.clone(),
            Some(keys) => keys
                .iter()
                .map(|k| {
                    self.non_tensor
                        .get(*k)
                        .map(|c| (k.to_string(), c.clone()))
                        .ok_or_else(|| self.missing(k))
                })
                .collect::<Result<_>>()?,
        };
        let meta_info = match meta_keys {
            None => self.meta_info.clone(),
            Some(keys) => keys
                .iter()
                .filter_map(|k| self.meta_info.get(*k).map(|v| (k.to_string(), v.clone())))
                .collect(),
        };
        Ok(Self {
            batch,
            non_tensor,
            meta_info,
        })
    }

    /// Removes the named columns and meta keys and returns them as a new batch.
    /// Fails without changing `self` if a tensor or non-tensor key is missing.
    pub fn pop(
        &mut self,
        batch_keys: &[&str],
        non_tensor_keys: &[&str],
        meta_keys: &[&str],
    ) -> Result<Self> {
        let popped = self.select(Some(batch_keys), Some(non_tensor_keys), Some(meta_keys))?;
        for k in batch_keys {
            self.batch.remove(*k);
        }
        for k in non_tensor_keys {
            self.non_tensor.remove(*k);
        }
        for k in meta_keys {
            self.meta_info.remove(*k);
        }
        Ok(popped)
    }

    /// Merges `other` into `self`. A key present on both sides must hold equal values.
    pub fn union(mut self, other: Self) -> Result<Self> {
        if self.has_columns() && other.has_columns() && self.len() != other.len() {
            return Err(DataProtoError::UnionLength {
                left: self.len(),
                right: other.len(),
            });
        }
        for (k, c) in other.batch {
            match self.batch.get(&k) {
                Some(mine) if !mine.same_values(&c) => {
                    return Err(DataProtoError::UnionConflict { key: k })
                }
                Some(_) => {}
                None => {
                    self.batch.insert(k, c);
                }
            }
        }
        for (k, v) in other.non_tensor {
            match self.non_tensor.get(&k) {
                Some(mine) if *mine != v => return Err(DataProtoError::UnionConflict { key: k }),
                Some(_) => {}
                None => {
                    self.non_tensor.insert(k, v);
                }
            }
        }
        for (k, v) in other.meta_info {
            match self.meta_info.get(&k) {
                Some(mine) if *mine != v => return Err(DataProtoError::UnionConflict { key: k }),
                Some(_) => {}
                None => {
                    self.meta_info.insert(k, v);
                }
            }
        }
        Ok(self)
    }

    fn map_columns(
        &self,
        f: impl Fn(&Column<B>) -> Column<B>,
        g: impl Fn(&[Value]) -> Vec<Value>,
    ) -> Self {
        Self {
            batch: self.batch.iter().map(|(k, c)| (k.clone(), f(c))).collect(),
            non_tensor: self
                .non_tensor
                .iter()
                .map(|(k, v)| (k.clone(), g(v)))
                .collect(),
            meta_info: self.meta_info.clone(),
        }
    }

    fn device(&self) -> Option<B::Device> {
        self.batch.values().next().map(|c| match &c.rows {
            Rows::Float(t) => t.device(),
            Rows::Int(t) => t.device(),
            Rows::Bool(t) => t.device(),
        })
    }

    /// Rows at `indices`, in that order; indices may repeat.
    pub fn select_rows(&self, indices: &[usize]) -> Result<Self> {
        let len = self.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(DataProtoError::RowOutOfRange { index, len });
        }
        let idx = self.device().map(|d| {
            let v: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [indices.len()]), &d)
        });
        Ok(self.map_columns(
            |c| c.take_rows(idx.as_ref().expect("a tensor column implies a device")),
            |v| indices.iter().map(|&i| v[i].clone()).collect(),
        ))
    }

    /// Positions `start..start + len` of every tensor column `width` positions wide:
    /// `[batch, width]` ones, and those of [`PER_POSITION_COLUMNS`] (`[batch, width, ...]`, an
    /// entry of any shape per position, such as each token's routed experts); other columns
    /// as they are. How a micro-batch drops the padding columns none of its rows uses
    /// (`len ≥ 1`).
    ///
    /// ```
    /// use burn::tensor::{Int, Tensor};
    /// use verl_core::backend::CpuBackend as B;
    /// use verl_core::DataProto;
    /// let d = Default::default();
    /// let mut data = DataProto::<B>::new();
    /// data.insert_int("input_ids", Tensor::<B, 2, Int>::from_ints([[0, 5, 6, 0], [7, 8, 9, 0]], &d))?;
    /// data.insert_int("responses", Tensor::<B, 2, Int>::from_ints([[6, 0], [9, 0]], &d))?;
    /// // Per position of input_ids, two values (say, each token's two experts).
    /// let experts: Vec<i64> = (0..16).collect();
    /// data.insert_int(
    ///     "routed_experts", // one of PER_POSITION_COLUMNS
    ///     Tensor::<B, 3, Int>::from_data(burn::tensor::TensorData::new(experts, [2, 4, 2]), &d),
    /// )?;
    /// let trimmed = data.narrow_columns(4, 0, 3).narrow_columns(2, 0, 1);
    /// assert_eq!(trimmed.int::<2>("input_ids")?.dims(), [2, 3]);
    /// assert_eq!(trimmed.int::<2>("responses")?.dims(), [2, 1]);
    /// let kept = trimmed.int::<3>("routed_experts")?;
    /// assert_eq!(kept.dims(), [2, 3, 2]);
    /// let values: Vec<i64> = kept.into_data().convert::<i64>().to_vec().unwrap();
    /// assert_eq!(values, [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]);
    /// # Ok::<(), verl_core::error::DataProtoError>(())
    /// ```
    pub fn narrow_columns(&self, width: usize, start: usize, len: usize) -> Self {
        Self {
            batch: self
                .batch
                .iter()
                .map(|(k, c)| {
                    let entries = PER_POSITION_COLUMNS.contains(&k.as_str());
                    (k.clone(), c.narrow_width(width, start, len, entries))
                })
                .collect(),
            non_tensor: self.non_tensor.clone(),
            meta_info: self.meta_info.clone(),
        }
    }

    /// Rows `start..end`.
    pub fn slice(&self, start: usize, end: usize) -> Result<Self> {
        let len = self.len();
        if start > end || end > len {
            return Err(DataProtoError::RowOutOfRange {
                index: end.max(start),
                len,
            });
        }
        Ok(self.map_columns(|c| c.slice_rows(start, end), |v| v[start..end].to_vec()))
    }

    /// Permutes the rows in place: row `i` of the result is row `order[i]` of the input.
    pub fn reorder(&mut self, order: &[usize]) -> Result<()> {
        let len = self.len();
        if order.len() != len {
            return Err(DataProtoError::NotAPermutation {
                len,
                detail: format!("got {} indices", order.len()),
            });
        }
        let mut seen = vec![false; len];
        for &i in order {
            if i >= len || std::mem::replace(&mut seen[i], true) {
                return Err(DataProtoError::NotAPermutation {
                    len,
                    detail: format!("index {i} is out of range or repeated"),
                });
            }
        }
        *self = self.select_rows(order)?;
        Ok(())
    }

    /// Splits into `chunks` equal parts, in order. Fails if the length is not divisible.
    pub fn chunk(&self, chunks: usize) -> Result<Vec<Self>> {
        if chunks == 0 {
            return Err(DataProtoError::Zero { what: "chunks" });
        }
        let len = self.len();
        if !len.is_multiple_of(chunks) {
            return Err(DataProtoError::NotDivisible { len, chunks });
        }
        self.split(&vec![len / chunks; chunks])
    }

    /// Splits into consecutive parts of the given sizes, which must add up to the length.
    pub fn split(&self, sizes: &[usize]) -> Result<Vec<Self>> {
        let sum: usize = sizes.iter().sum();
        if sum != self.len() {
            return Err(DataProtoError::SplitSizes {
                sizes: sizes.to_vec(),
                sum,
                len: self.len(),
            });
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&n| {
                let part = self.slice(start, start + n);
                start += n;
                part
            })
            .collect()
    }

    /// Concatenates batches along rows. All parts need the same keys and kinds; meta_info is
    /// merged and a key with differing values is refused, except `metrics` (an object of
    /// metric → value or list), whose values are gathered into one list per metric.
    pub fn concat(parts: Vec<Self>) -> Result<Self> {
        let first = parts.first().ok_or(DataProtoError::ConcatEmpty)?;
        let keys = |p: &Self| joined(p.batch.keys().chain(p.non_tensor.keys()));
        let expected = keys(first);
        for (index, p) in parts.iter().enumerate().skip(1) {
            let found = keys(p);
            let same = p.batch.keys().eq(first.batch.keys())
                && p.non_tensor.keys().eq(first.non_tensor.keys());
            if !same {
                return Err(DataProtoError::ConcatKeys {
                    index,
                    expected,
                    found,
                });
            }
        }
        let mut out = Self::new();
        for key in first.batch.keys() {
            let cols: Vec<&Column<B>> = parts.iter().map(|p| &p.batch[key]).collect();
            out.batch.insert(key.clone(), Column::concat(key, cols)?);
        }
        for key in first.non_tensor.keys() {
            out.non_tensor.insert(
                key.clone(),
                parts
                    .iter()
                    .flat_map(|p| p.non_tensor[key].iter().cloned())
                    .collect(),
            );
        }
        for p in &parts {
            for (k, v) in &p.meta_info {
                // Each part's metrics are its own (ranks report different losses): gather them
                // into one list per metric, as verl does, instead of requiring them to agree.
                if let (METRICS_KEY, Value::Object(metrics)) = (k.as_str(), v) {
                    let merged = out
                        .meta_info
                        .entry(METRICS_KEY)
                        .or_insert_with(|| Value::Object(Map::new()));
                    if let Value::Object(merged) = merged {
                        for (name, value) in metrics {
                            let Value::Array(list) = merged
                                .entry(name.clone())
                                .or_insert_with(|| Value::Array(Vec::new()))
                            else {
                                continue;
                            };
                            match value {
                                Value::Array(values) => list.extend(values.iter().cloned()),
                                other => list.push(other.clone()),
                            }
                        }
                        continue;
                    }
                }
                match out.meta_info.get(k) {
                    Some(mine) if mine != v => {
                        return Err(DataProtoError::ConcatMeta { key: k.clone() })
                    }
                    Some(_) => {}
                    None => {
                        out.meta_info.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        Ok(out)
    }

    /// Repeats every row `times` times. With `interleave`, copies of a row are adjacent
    /// (`a a b b`, GRPO's group layout); otherwise the whole batch is tiled (`a b a b`).
    pub fn repeat(&self, times: usize, interleave: bool) -> Result<Self> {
        if times == 0 {
            return Err(DataProtoError::Zero {
                what: "repeat times",
            });
        }
        let len = self.len();
        let order: Vec<usize> = if interleave {
            (0..len)
                .flat_map(|i| std::iter::repeat_n(i, times))
                .collect()
        } else {
            (0..times).flat_map(|_| 0..len).collect()
        };
        self.select_rows(&order)
    }

    /// Pads by repeating rows from the start until the length divides `divisor`.
    /// Returns the padded batch and the number of rows added (give it to [`Self::unpad`]).
    pub fn pad_to_divisor(&self, divisor: usize) -> Result<(Self, usize)> {
        if divisor == 0 {
            return Err(DataProtoError::Zero { what: "divisor" });
        }
        let len = self.len();
        let pad = (divisor - len % divisor) % divisor;
        if pad == 0 {
            return Ok((self.clone(), 0));
        }
        if len == 0 {
            return Err(DataProtoError::Unpad { pad, len });
        }
        let order: Vec<usize> = (0..len).chain((0..pad).map(|i| i % len)).collect();
        Ok((self.select_rows(&order)?, pad))
    }

    /// Removes the last `pad` rows added by [`Self::pad_to_divisor`].
    pub fn unpad(&self, pad: usize) -> Result<Self> {
        let len = self.len();
        if pad > len {
            return Err(DataProtoError::Unpad { pad, len });
        }
        self.slice(0, len - pad)
    }

    /// A copy with every tensor on `device`.
    pub fn to_device(&self, device: &B::Device) -> Self {
        self.map_columns(|c| c.to_device(device), <[Value]>::to_vec)
    }

    /// Host copy of a column with its full shape.
    pub fn to_data(&self, key: &str) -> Result<TensorData> {
        Ok(self.column(key)?.to_data())
    }

    pub(crate) fn columns(&self) -> &BTreeMap<String, Column<B>> {
        &self.batch
    }

    pub(crate) fn non_tensor_columns(&self) -> &BTreeMap<String, Vec<Value>> {
        &self.non_tensor
    }

    pub(crate) fn from_parts(
        batch: BTreeMap<String, Column<B>>,
        non_tensor: BTreeMap<String, Vec<Value>>,
        meta_info: Map<String, Value>,
    ) -> Self {
        Self {
            batch,
            non_tensor,
            meta_info,
        }
    }
}

//! A batch-first tensor of any rank, stored as `[batch, rest]` so that row operations
//! (select, slice, concat) are the same for every rank and kind.

use burn::prelude::*;
use burn::tensor::{Bool, Int, TensorData};

use crate::error::DataProtoError;

/// Element kind of a [`Column`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ColumnKind {
    Float,
    Int,
    Bool,
}

impl ColumnKind {
    pub fn name(self) -> &'static str {
        match self {
            ColumnKind::Float => "float",
            ColumnKind::Int => "int",
            ColumnKind::Bool => "bool",
        }
    }
}

/// The tensor of a column, viewed as `[batch, product of the other dims]`.
#[derive(Debug, Clone)]
pub(crate) enum Rows<B: Backend> {
    Float(Tensor<B, 2>),
    Int(Tensor<B, 2, Int>),
    Bool(Tensor<B, 2, Bool>),
}

/// Applies the same row operation to whichever kind a [`Rows`] holds.
macro_rules! map_rows {
    ($rows:expr, $t:ident => $body:expr) => {
        match $rows {
            Rows::Float($t) => Rows::Float($body),
            Rows::Int($t) => Rows::Int($body),
            Rows::Bool($t) => Rows::Bool($body),
        }
    };
}

/// One named batch-first tensor of a [`crate::DataProto`]: its rows and its full shape.
#[derive(Debug, Clone)]
pub struct Column<B: Backend> {
    pub(crate) rows: Rows<B>,
    pub(crate) shape: Vec<usize>,
}

fn row_view(key: &str, dims: &[usize]) -> Result<[usize; 2], DataProtoError> {
    match dims.split_first() {
        None => Err(DataProtoError::ScalarColumn {
            key: key.to_string(),
        }),
        // Checked: a shape from outside (the wire, a saved file) may name absurd sizes.
        Some((batch, rest)) => rest
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .map(|per_row| [*batch, per_row])
            .ok_or_else(|| DataProtoError::ShapeOverflow {
                key: key.to_string(),
                shape: dims.to_vec(),
            }),
    }
}

impl<B: Backend> Column<B> {
    pub(crate) fn float<const D: usize>(
        key: &str,
        t: Tensor<B, D>,
    ) -> Result<Self, DataProtoError> {
        let shape = t.dims().to_vec();
        Ok(Self {
            rows: Rows::Float(t.reshape(row_view(key, &shape)?)),
            shape,
        })
    }
    pub(crate) fn int<const D: usize>(
        key: &str,
        t: Tensor<B, D, Int>,
    ) -> Result<Self, DataProtoError> {
        let shape = t.dims().to_vec();
        Ok(Self {
            rows: Rows::Int(t.reshape(row_view(key, &shape)?)),
            shape,
        })
    }
    pub(crate) fn bool<const D: usize>(
        key: &str,
        t: Tensor<B, D, Bool>,
    ) -> Result<Self, DataProtoError> {
        let shape = t.dims().to_vec();
        Ok(Self {
            rows: Rows::Bool(t.reshape(row_view(key, &shape)?)),
            shape,
        })
    }

    /// Rebuilds a column from host data with the given full shape.
    pub(crate) fn from_data(
        key: &str,
        kind: ColumnKind,
        data: TensorData,
        device: &B::Device,
    ) -> Result<Self, DataProtoError> {
        let shape = data.shape.to_vec();
        let view = row_view(key, &shape)?;
        let data = TensorData {
            shape: view.to_vec().into(),
            ..data
        };
        let rows = match kind {
            ColumnKind::Float => Rows::Float(Tensor::from_data(data.convert::<f32>(), device)),
            ColumnKind::Int => Rows::Int(Tensor::from_data(data.convert::<i64>(), device)),
            ColumnKind::Bool => Rows::Bool(Tensor::from_data(data, device)),
        };
        Ok(Self { rows, shape })
    }

    /// Number of rows (the batch dimension).
    pub fn len(&self) -> usize {
        self.shape[0]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Full shape, batch first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn kind(&self) -> ColumnKind {
        match self.rows {
            Rows::Float(_) => ColumnKind::Float,
            Rows::Int(_) => ColumnKind::Int,
            Rows::Bool(_) => ColumnKind::Bool,
        }
    }

    pub(crate) fn with_rows(&self, rows: Rows<B>) -> Self {
        let mut shape = self.shape.clone();
        shape[0] = match &rows {
            Rows::Float(t) => t.dims()[0],
            Rows::Int(t) => t.dims()[0],
            Rows::Bool(t) => t.dims()[0],
        };
        Self { rows, shape }
    }

    /// Rows at `indices`, in that order (indices may repeat).
    pub(crate) fn take_rows(&self, indices: &Tensor<B, 1, Int>) -> Self {
        let idx = indices.clone();
        self.with_rows(map_rows!(self.rows.clone(), t => t.select(0, idx)))
    }

    /// Rows `start..end`.
    pub(crate) fn slice_rows(&self, start: usize, end: usize) -> Self {
        if start == 0 && end == self.len() {
            return self.clone();
        }
        self.with_rows(map_rows!(self.rows.clone(), t => t.slice(start..end)))
    }

    /// Of a `[batch, width]` column, or a `[batch, width, ...]` one when `entries` says it
    /// holds an entry per position, positions `start..start + len`; any other column as it
    /// is (a rank-3 column whose second dimension only happens to equal the width included).
    pub(crate) fn narrow_width(
        &self,
        width: usize,
        start: usize,
        len: usize,
        entries: bool,
    ) -> Self {
        let per_position = self.shape.len() == 2 || (entries && self.shape.len() > 2);
        if !per_position || self.shape[1] != width || (start == 0 && len == width) {
            return self.clone();
        }
        let mut shape = self.shape.clone();
        shape[1] = len;
        // Rows are stored `[batch, rest]`: a position's entry is `inner` consecutive values.
        let inner: usize = self.shape[2..].iter().product();
        let batch = self.shape[0];
        Self {
            rows: map_rows!(self.rows.clone(), t => match inner {
                1 => t.narrow(1, start, len),
                _ => t
                    .reshape([batch, width, inner])
                    .narrow(1, start, len)
                    .reshape([batch, len * inner]),
            }),
            shape,
        }
    }

    pub(crate) fn to_device(&self, device: &B::Device) -> Self {
        self.with_rows(map_rows!(self.rows.clone(), t => t.to_device(device)))
    }

    /// Host copy of the values with the full shape.
    pub fn to_data(&self) -> TensorData {
        match &self.rows {
            Rows::Float(t) => TensorData {
                shape: self.shape.clone().into(),
                ..t.to_data()
            },
            Rows::Int(t) => TensorData {
                shape: self.shape.clone().into(),
                ..t.to_data()
            },
            // Backends may store booleans as u8 or u32 after some ops; hand out native bools.
            Rows::Bool(t) => {
                let values: Vec<bool> = t.to_data().iter::<u32>().map(|b| b != 0).collect();
                TensorData::new(values, self.shape.clone())
            }
        }
    }

    /// Exact equality of kind, shape and values (used by `union` to accept shared keys).
    pub(crate) fn same_values(&self, other: &Self) -> bool {
        self.kind() == other.kind()
            && self.shape == other.shape
            && self.to_data() == other.to_data()
    }

    pub(crate) fn reshape_float<const D: usize>(
        &self,
        key: &str,
    ) -> Result<Tensor<B, D>, DataProtoError> {
        self.check_rank::<D>(key)?;
        match &self.rows {
            Rows::Float(t) => Ok(t.clone().reshape(self.dims_array::<D>())),
            _ => Err(self.kind_error(key, ColumnKind::Float)),
        }
    }
    pub(crate) fn reshape_int<const D: usize>(
        &self,
        key: &str,
    ) -> Result<Tensor<B, D, Int>, DataProtoError> {
        self.check_rank::<D>(key)?;
        match &self.rows {
            Rows::Int(t) => Ok(t.clone().reshape(self.dims_array::<D>())),
            _ => Err(self.kind_error(key, ColumnKind::Int)),
        }
    }
    pub(crate) fn reshape_bool<const D: usize>(
        &self,
        key: &str,
    ) -> Result<Tensor<B, D, Bool>, DataProtoError> {
        self.check_rank::<D>(key)?;
        match &self.rows {
            Rows::Bool(t) => Ok(t.clone().reshape(self.dims_array::<D>())),
            _ => Err(self.kind_error(key, ColumnKind::Bool)),
        }
    }

    fn check_rank<const D: usize>(&self, key: &str) -> Result<(), DataProtoError> {
        if self.shape.len() != D {
            return Err(DataProtoError::RankMismatch {
                key: key.to_string(),
                shape: self.shape.clone(),
                expected: D,
                found: self.shape.len(),
            });
        }
        Ok(())
    }

    fn dims_array<const D: usize>(&self) -> [usize; D] {
        let mut dims = [0; D];
        dims.copy_from_slice(&self.shape);
        dims
    }

    fn kind_error(&self, key: &str, expected: ColumnKind) -> DataProtoError {
        DataProtoError::KindMismatch {
            key: key.to_string(),
            expected: expected.name(),
            found: self.kind().name(),
        }
    }

    /// Concatenates columns of one kind along the batch dimension.
    pub(crate) fn concat(key: &str, parts: Vec<&Self>) -> Result<Self, DataProtoError> {
        let first = parts[0];
        for p in &parts[1..] {
            if p.kind() != first.kind() || p.shape[1..] != first.shape[1..] {
                return Err(DataProtoError::ConcatKeys {
                    index: 0,
                    expected: format!("{key}: {} {:?}", first.kind().name(), &first.shape[1..]),
                    found: format!("{key}: {} {:?}", p.kind().name(), &p.shape[1..]),
                });
            }
        }
        let rows = match &first.rows {
            Rows::Float(_) => Rows::Float(Tensor::cat(
                parts
                    .iter()
                    .map(|p| match &p.rows {
                        Rows::Float(t) => t.clone(),
                        _ => unreachable!("kinds checked above"),
                    })
                    .collect(),
                0,
            )),
            Rows::Int(_) => Rows::Int(Tensor::cat(
                parts
                    .iter()
                    .map(|p| match &p.rows {
                        Rows::Int(t) => t.clone(),
                        _ => unreachable!("kinds checked above"),
                    })
                    .collect(),
                0,
            )),
            Rows::Bool(_) => Rows::Bool(Tensor::cat(
                parts
                    .iter()
                    .map(|p| match &p.rows {
                        Rows::Bool(t) => t.clone(),
                        _ => unreachable!("kinds checked above"),
                    })
                    .collect(),
                0,
            )),
        };
        Ok(first.with_rows(rows))
    }
}

//! [`NamedTensor`]: one parameter (or optimizer state) tensor of any rank with its name, the unit
//! of per-tensor weight streaming (actor → rollout) and of checkpoints.

use burn::prelude::*;
use futures::stream::LocalBoxStream;

use crate::error::{DataProtoError, Result};

/// A named tensor of any rank, stored flat with its shape.
///
/// ```
/// use burn::backend::Flex;
/// use burn::tensor::Tensor;
/// use verl_core::NamedTensor;
/// let t = Tensor::<Flex, 2>::from_floats([[1., 2.], [3., 4.]], &Default::default());
/// let named = NamedTensor::new("model.embed_tokens.weight", t);
/// assert_eq!(named.shape, vec![2, 2]);
/// let back: Tensor<Flex, 2> = named.to_tensor()?;
/// # Ok::<(), verl_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct NamedTensor<B: Backend> {
    pub name: String,
    pub shape: Vec<usize>,
    /// The values, flattened in row-major order.
    pub values: Tensor<B, 1>,
}

impl<B: Backend> NamedTensor<B> {
    /// Wraps a tensor of rank `D`.
    pub fn new<const D: usize>(name: impl Into<String>, tensor: Tensor<B, D>) -> Self {
        let shape = tensor.dims().to_vec();
        let n: usize = shape.iter().product();
        Self {
            name: name.into(),
            shape,
            values: tensor.reshape([n]),
        }
    }

    /// The tensor with its shape, as rank `D`.
    pub fn to_tensor<const D: usize>(&self) -> Result<Tensor<B, D>> {
        if self.shape.len() != D {
            return Err(DataProtoError::RankMismatch {
                key: self.name.clone(),
                shape: self.shape.clone(),
                expected: D,
                found: self.shape.len(),
            }
            .into());
        }
        let mut dims = [0; D];
        dims.copy_from_slice(&self.shape);
        Ok(self.values.clone().reshape(dims))
    }

    /// The same tensor on `device` (a no-op when it is there already).
    pub fn to_device(self, device: &B::Device) -> Self {
        Self {
            values: self.values.to_device(device),
            ..self
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A stream of weights, one tensor at a time, so that no full copy of the model is ever held.
pub type WeightStream<'a, B> = LocalBoxStream<'a, Result<NamedTensor<B>>>;

/// Where one rank's shard of a tensor sits in the full tensor, as Megatron's sharded state
/// dicts record it: the full shape, the dimension split across ranks (`None`: the shard is the
/// whole tensor) and the shard's real extent `start..start + len` along it. A shard may carry
/// padding after its real part (a vocabulary padded to a multiple of the tensor-parallel size):
/// its own extent along `dim` can exceed `len`.
///
/// ```
/// use verl_core::weights::ShardSlice;
/// // Rows 2..4 of a [4, 2] tensor, the shard padded to 3 rows.
/// let slice = ShardSlice { global_shape: vec![4, 2], dim: Some(0), start: 2, len: 2 };
/// let full: Vec<f32> = (0..8).map(|x| x as f32).collect();
/// let shard = slice.cut(&full, &[3, 2]);
/// assert_eq!(shard, vec![4., 5., 6., 7., 0., 0.]);
/// let mut back = vec![0.0; 8];
/// slice.place(&shard, &[3, 2], &mut back);
/// assert_eq!(&back[4..], &full[4..]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardSlice {
    pub global_shape: Vec<usize>,
    pub dim: Option<usize>,
    pub start: usize,
    pub len: usize,
}

impl ShardSlice {
    /// A shard that is the whole tensor.
    pub fn whole(shape: &[usize]) -> Self {
        Self {
            global_shape: shape.to_vec(),
            dim: None,
            start: 0,
            len: shape.first().copied().unwrap_or(1),
        }
    }

    /// `(outer, extent, inner)`: the row-major view of a tensor of `shape` around `dim` (the
    /// elements before it, its extent, the elements after it).
    fn around(shape: &[usize], dim: usize) -> (usize, usize, usize) {
        let outer = shape[..dim].iter().product();
        let inner = shape[dim + 1..].iter().product();
        (outer, shape[dim], inner)
    }

    /// This shard, `shard_shape` with zero padding after the real part, cut from the full
    /// tensor's row-major values.
    pub fn cut(&self, full: &[f32], shard_shape: &[usize]) -> Vec<f32> {
        let Some(dim) = self.dim else {
            return full.to_vec();
        };
        let (outer, full_extent, inner) = Self::around(&self.global_shape, dim);
        let (_, shard_extent, _) = Self::around(shard_shape, dim);
        let mut out = vec![0.0; outer * shard_extent * inner];
        for o in 0..outer {
            let from = (o * full_extent + self.start) * inner;
            let to = o * shard_extent * inner;
            out[to..to + self.len * inner].copy_from_slice(&full[from..from + self.len * inner]);
        }
        out
    }

    /// Writes this shard's real part (`shard` of `shard_shape`) into the full tensor's
    /// row-major values.
    pub fn place(&self, shard: &[f32], shard_shape: &[usize], full: &mut [f32]) {
        let Some(dim) = self.dim else {
            full.copy_from_slice(shard);
            return;
        };
        let (outer, full_extent, inner) = Self::around(&self.global_shape, dim);
        let (_, shard_extent, _) = Self::around(shard_shape, dim);
        for o in 0..outer {
            let to = (o * full_extent + self.start) * inner;
            let from = o * shard_extent * inner;
            full[to..to + self.len * inner].copy_from_slice(&shard[from..from + self.len * inner]);
        }
    }
}

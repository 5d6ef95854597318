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

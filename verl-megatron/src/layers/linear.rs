use burn::module::{Module, Param};
use burn::prelude::*;

/// A layer's place in its tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub size: usize,
}

impl TpShard {
    /// No tensor parallelism.
    pub const NONE: Self = Self { rank: 0, size: 1 };
}

/// `y = x·Wᵀ + b` with W's output rows split over tp ranks (HF layout `[out, in]`).
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// This rank's rows of the weight, `[out / tp, in]`.
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

/// `y = x·Wᵀ + b` with W's input columns split over tp ranks; the partial outputs are summed
/// across the group (and the bias added once).
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// This rank's columns of the weight, `[out, in / tp]`.
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

fn affine<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: &Tensor<B, 2>,
    bias: Option<&Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let in_features = dims[D - 1];
    let rows: usize = dims[..D - 1].iter().product();
    let [out_features, _] = weight.dims();
    let mut y = x
        .reshape([rows, in_features])
        .matmul(weight.clone().transpose());
    if let Some(b) = bias {
        y = y + b.clone().unsqueeze_dim(0);
    }
    let mut out = dims;
    out[D - 1] = out_features;
    y.reshape(out)
}

impl<B: Backend> ColumnParallelLinear<B> {
    /// From the full HF weight `[out, in]` (and bias `[out]`), keeping this rank's rows.
    pub fn from_full(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>, tp: TpShard) -> Self {
        let [out, _] = weight.dims();
        let (per, start) = (out / tp.size, out / tp.size * tp.rank);
        Self {
            weight: Param::from_tensor(weight.narrow(0, start, per)),
            bias: bias.map(|b| Param::from_tensor(b.narrow(0, start, per))),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        affine(
            x,
            &self.weight.val(),
            self.bias.as_ref().map(|b| b.val()).as_ref(),
        )
    }
}

impl<B: Backend> RowParallelLinear<B> {
    /// From the full HF weight `[out, in]` (and bias `[out]`), keeping this rank's columns.
    pub fn from_full(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>, tp: TpShard) -> Self {
        let [_, inp] = weight.dims();
        let (per, start) = (inp / tp.size, inp / tp.size * tp.rank);
        Self {
            weight: Param::from_tensor(weight.narrow(1, start, per)),
            bias: bias.map(Param::from_tensor),
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        affine(
            x,
            &self.weight.val(),
            self.bias.as_ref().map(|b| b.val()).as_ref(),
        )
    }
}

use burn::module::{Module, Param};
use burn::prelude::*;

use crate::ops::FusedOps;
use crate::parallel::{ParallelBackend, TpGroup};

/// `y = x·Wᵀ + b` with W's output rows split over tp ranks (HF layout `[out, in]`).
///
/// The input must already be in the tensor-parallel region (replicated, entered through
/// [`TpGroup::enter`] by the block that owns the layer, once for all the projections that share
/// it); the output is this rank's slice of the features.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// This rank's rows of the weight, `[out / tp, in]`.
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

/// `y = x·Wᵀ + b` with W's input columns split over tp ranks; the partial outputs are summed
/// across the group (reduce-scattered along the sequence with sequence parallelism) and the
/// bias added once.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// This rank's columns of the weight, `[out, in / tp]`.
    pub weight: Param<Tensor<B, 2>>,
    /// Replicated, `[out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub tp: TpGroup,
}

fn affine<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    weight: &Tensor<B, 2>,
    bias: Option<&Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let in_features = dims[D - 1];
    let rows: usize = dims[..D - 1].iter().product();
    let [out_features, _] = weight.dims();
    let mut y = super::precision::linear(x.reshape([rows, in_features]), weight.clone());
    if let Some(b) = bias {
        y = B::add_bias(y, b.clone());
    }
    let mut out = dims;
    out[D - 1] = out_features;
    y.reshape(out)
}

impl<B: FusedOps> ColumnParallelLinear<B> {
    /// From this rank's rows `[out / tp, in]` (and bias `[out / tp]`).
    pub fn new(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
        }
    }

    /// From the full HF weight `[out, in]` (and bias `[out]`), keeping this rank's rows.
    pub fn from_full(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>, tp: &TpGroup) -> Self {
        let [out, _] = weight.dims();
        let (start, per) = tp.part(out);
        Self {
            weight: Param::from_tensor(weight.narrow(0, start, per)),
            bias: bias.map(|b| Param::from_tensor(b.narrow(0, start, per))),
        }
    }

    /// An unsharded layer (routers, value and score heads): every rank holds all of it.
    pub fn replicated(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Self {
        Self::from_full(weight, bias, &TpGroup::none())
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        affine(
            x,
            &self.weight.val(),
            self.bias.as_ref().map(|b| b.val()).as_ref(),
        )
    }
}

impl<B: ParallelBackend> RowParallelLinear<B> {
    /// From this rank's columns `[out, in / tp]` and the whole bias `[out]`.
    pub fn new(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>, tp: &TpGroup) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
            tp: tp.clone(),
        }
    }

    /// From the full HF weight `[out, in]` (and bias `[out]`), keeping this rank's columns.
    pub fn from_full(weight: Tensor<B, 2>, bias: Option<Tensor<B, 1>>, tp: &TpGroup) -> Self {
        let [_, inp] = weight.dims();
        let (start, per) = tp.part(inp);
        Self {
            weight: Param::from_tensor(weight.narrow(1, start, per)),
            bias: bias.map(Param::from_tensor),
            tp: tp.clone(),
        }
    }

    /// This rank's partial product, before the reduction and without the bias: for blocks
    /// that sum several row-parallel outputs (experts) and reduce once.
    pub fn forward_partial<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        affine(x, &self.weight.val(), None)
    }

    /// The full output: partial products reduced over the group, then the bias.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let y = self.tp.exit(self.forward_partial(x));
        match &self.bias {
            Some(b) => {
                let mut shape = [1; D];
                shape[D - 1] = b.dims()[0];
                y + b.val().reshape(shape)
            }
            None => y,
        }
    }
}

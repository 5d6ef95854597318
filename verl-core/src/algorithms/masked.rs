//! Masked reductions, as verl's `masked_sum` / `masked_mean` / `masked_var` / `masked_whiten`.

use burn::prelude::*;

/// Σ values·mask over all entries.
pub fn masked_sum<B: Backend, const D: usize>(
    values: Tensor<B, D>,
    mask: Tensor<B, D>,
) -> Tensor<B, 1> {
    (values * mask).sum()
}

/// Σ values·mask / (Σ mask + 1e-8) over all entries.
///
/// ```
/// use burn::tensor::Tensor;
/// use verl_core::algorithms::masked::masked_mean;
/// use verl_core::backend::CpuBackend as B;
/// let d = Default::default();
/// let v = Tensor::<B, 2>::from_floats([[1., 2., 100.]], &d);
/// let m = Tensor::<B, 2>::from_floats([[1., 1., 0.]], &d);
/// let mean = masked_mean(v, m).into_scalar();
/// assert!((mean - 1.5).abs() < 1e-6);
/// ```
pub fn masked_mean<B: Backend, const D: usize>(
    values: Tensor<B, D>,
    mask: Tensor<B, D>,
) -> Tensor<B, 1> {
    let n = mask.clone().sum();
    masked_sum(values, mask) / (n + 1e-8)
}

/// Masked mean along `dim` (kept with size 1).
pub fn masked_mean_dim<B: Backend, const D: usize>(
    values: Tensor<B, D>,
    mask: Tensor<B, D>,
    dim: usize,
) -> Tensor<B, D> {
    let n = mask.clone().sum_dim(dim);
    (values * mask).sum_dim(dim) / (n + 1e-8)
}

/// Masked variance over all entries; `unbiased` applies Bessel's correction n/(n−1).
/// With fewer than 2 unmasked entries the unbiased variance is undefined and returns NaN.
pub fn masked_var<B: Backend, const D: usize>(
    values: Tensor<B, D>,
    mask: Tensor<B, D>,
    unbiased: bool,
) -> Tensor<B, 1> {
    let mean = masked_mean(values.clone(), mask.clone());
    let centered = values - mean.reshape([1; D]);
    let var = masked_mean(centered.powf_scalar(2.0), mask.clone());
    if unbiased {
        let n = mask.sum();
        var * n.clone() / (n - 1.0)
    } else {
        var
    }
}

/// (values − mean) / sqrt(var + 1e-8) with masked, unbiased statistics; with `shift_mean =
/// false` the mean is added back.
pub fn masked_whiten<B: Backend, const D: usize>(
    values: Tensor<B, D>,
    mask: Tensor<B, D>,
    shift_mean: bool,
) -> Tensor<B, D> {
    let mean = masked_mean(values.clone(), mask.clone()).reshape([1; D]);
    let var = masked_var(values.clone(), mask, true).reshape([1; D]);
    let whitened = (values - mean.clone()) / (var + 1e-8).sqrt();
    if shift_mean {
        whitened
    } else {
        whitened + mean
    }
}

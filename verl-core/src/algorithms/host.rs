//! Moving small `[batch, len]` tensors to the host as f64 and back. Advantage estimators are
//! sequential scans and group statistics over a few kilobytes: computing them on the host in f64
//! is exact and cheaper than many tiny device kernels. Losses stay on the device (they need
//! gradients).

use burn::prelude::*;
use burn::tensor::TensorData;

/// Row-major host copy of a 2-D tensor.
#[derive(Clone)]
pub(crate) struct Host2 {
    pub data: Vec<f64>,
    pub rows: usize,
    pub cols: usize,
}

impl Host2 {
    pub(super) fn from_tensor<B: Backend>(t: &Tensor<B, 2>) -> Self {
        let [rows, cols] = t.dims();
        let data = t.to_data().iter::<f64>().collect();
        Self { data, rows, cols }
    }

    pub(super) fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    #[inline]
    pub(super) fn at(&self, r: usize, c: usize) -> f64 {
        self.data[r * self.cols + c]
    }

    #[inline]
    pub(super) fn set(&mut self, r: usize, c: usize, v: f64) {
        self.data[r * self.cols + c] = v;
    }

    pub(super) fn row_sum(&self, r: usize) -> f64 {
        self.data[r * self.cols..(r + 1) * self.cols].iter().sum()
    }

    /// As a tensor of the backend's float type (f64 stays f64 on an f64 backend).
    pub(super) fn to_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        let data = TensorData::new(self.data.clone(), [self.rows, self.cols]);
        Tensor::from_data(data.convert::<B::FloatElem>(), device)
    }

    /// verl's `masked_whiten`: (x − mean) / sqrt(var + 1e-8) over masked entries, with the
    /// unbiased (Bessel-corrected) variance.
    pub(super) fn whiten(&self, mask: &Host2) -> Result<Host2, String> {
        let n: f64 = mask.data.iter().sum();
        if n <= 1.0 {
            return Err(format!(
                "whitening needs at least 2 unmasked tokens, found {n}"
            ));
        }
        let mean = self
            .data
            .iter()
            .zip(&mask.data)
            .map(|(x, m)| x * m)
            .sum::<f64>()
            / (n + 1e-8);
        let var = self
            .data
            .iter()
            .zip(&mask.data)
            .map(|(x, m)| (x - mean).powi(2) * m)
            .sum::<f64>()
            / (n + 1e-8)
            * n
            / (n - 1.0);
        let scale = 1.0 / (var + 1e-8).sqrt();
        Ok(Host2 {
            data: self.data.iter().map(|x| (x - mean) * scale).collect(),
            rows: self.rows,
            cols: self.cols,
        })
    }

    pub(super) fn mul_mask(mut self, mask: &Host2) -> Host2 {
        for (x, m) in self.data.iter_mut().zip(&mask.data) {
            *x *= m;
        }
        self
    }
}

/// A scalar tensor (any shape with one element) as f64.
pub(crate) fn scalar<B: Backend, const D: usize>(t: Tensor<B, D>) -> f64 {
    t.into_data().iter::<f64>().next().unwrap_or(f64::NAN)
}

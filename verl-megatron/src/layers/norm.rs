use burn::module::{Module, Param};
use burn::prelude::*;

/// RMSNorm over the last dimension: x / sqrt(mean(x²) + ε) · w.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn new(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            eps,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        // On burn-cuda, one fused kernel each way (crate::cuda::kernels::norm).
        #[cfg(feature = "cuda")]
        let x = match crate::cuda::kernels::norm::try_rms_norm(x, self.weight.val(), self.eps) {
            Ok(y) => return y,
            Err((x, _)) => x,
        };
        let ms = x.clone().powf_scalar(2.0).mean_dim(D - 1);
        let normed = x / (ms + self.eps).sqrt();
        let mut shape = [1; D];
        shape[D - 1] = self.weight.dims()[0];
        normed * self.weight.val().reshape(shape)
    }
}

use burn::prelude::*;
use burn::tensor::{Int, TensorData};

use crate::hf::RopeScaling;

/// Rotary position embedding in the "rotate half" layout HF uses, with optional Llama-3 scaling
/// of the inverse frequencies.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f64>,
}

impl RotaryEmbedding {
    pub fn new(head_dim: usize, theta: f64, scaling: RopeScaling) -> Self {
        let mut inv_freq: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = scaling
        {
            let old = original_max_position_embeddings as f64;
            let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
            for f in &mut inv_freq {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= factor;
                } else if wavelen >= high_wavelen {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
        Self { inv_freq }
    }

    /// cos and sin tables `[batch, 1, seq, head_dim]` for the given positions `[batch, seq]`.
    pub fn tables<B: Backend>(
        &self,
        positions: &Tensor<B, 2, Int>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        // On burn-cuda the angles are computed on the device (reading the positions back would
        // wait for the GPU once per forward): the same f32 products, CUDA's full-precision
        // cos and sin.
        #[cfg(feature = "cuda")]
        if crate::cuda::kernels::is_cuda_or_autodiff::<B>() {
            let [b, t] = positions.dims();
            let half = self.inv_freq.len();
            let device = positions.device();
            let freqs: Vec<f32> = (0..2)
                .flat_map(|_| self.inv_freq.iter().map(|f| *f as f32))
                .collect();
            let freqs = Tensor::<B, 1>::from_data(TensorData::new(freqs, [half * 2]), &device)
                .reshape([1, 1, 1, half * 2]);
            let angles = positions.clone().float().reshape([b, 1, t, 1]) * freqs;
            return (angles.clone().cos(), angles.sin());
        }
        self.tables_on_host(positions)
    }

    /// [`Self::tables`] computed on the host from the positions read back (the path of every
    /// backend but burn-cuda; public so the GPU path can be checked against it).
    pub fn tables_on_host<B: Backend>(
        &self,
        positions: &Tensor<B, 2, Int>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [b, t] = positions.dims();
        let half = self.inv_freq.len();
        crate::host_reads::note(1);
        let pos: Vec<f64> = positions.to_data().iter::<f64>().collect();
        let mut cos = Vec::with_capacity(b * t * half * 2);
        let mut sin = Vec::with_capacity(b * t * half * 2);
        for p in pos {
            for _ in 0..2 {
                for f in &self.inv_freq {
                    // Angles in f32, as HF computes them.
                    let angle = (p as f32) * (*f as f32);
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let device = positions.device();
        let shape = [b, 1, t, half * 2];
        (
            Tensor::from_data(TensorData::new(cos, shape), &device),
            Tensor::from_data(TensorData::new(sin, shape), &device),
        )
    }

    /// Applies the rotation to `x` `[..., head_dim]`, the tables broadcast over it:
    /// `[batch, heads, seq, head_dim]` with [`Self::tables`]' `[batch, 1, seq, head_dim]`, or
    /// `[batch, seq, heads, head_dim]` with the tables reshaped to `[batch, seq, 1, head_dim]`.
    pub fn apply<B: Backend>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        // On burn-cuda, x [batch, seq, heads, dim] with tables [batch, seq, 1, dim] (the fused
        // attention's layout) takes one kernel each way (crate::cuda::kernels::rope).
        #[cfg(feature = "cuda")]
        let x = match crate::cuda::kernels::rope::try_rope(x, cos, sin) {
            Ok(y) => return y,
            Err(x) => x,
        };
        let d = x.dims()[3];
        let x1 = x.clone().narrow(3, 0, d / 2);
        let x2 = x.clone().narrow(3, d / 2, d / 2);
        let rotated = Tensor::cat(vec![-x2, x1], 3);
        x * cos.clone() + rotated * sin.clone()
    }
}

use burn::prelude::*;
use burn::tensor::Int;

use crate::hf::RopeScaling;
use crate::ops::FusedOps;

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
    /// The backend's [`FusedOps::rotary_tables`]: on burn-cuda the angles are computed on the
    /// device (reading the positions back would wait for the GPU once per forward).
    pub fn tables<B: FusedOps>(
        &self,
        positions: &Tensor<B, 2, Int>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        B::rotary_tables(&self.inv_freq, positions)
    }

    /// [`Self::tables`] computed on the host from the positions read back (the path of every
    /// backend but burn-cuda; public so the GPU path can be checked against it).
    pub fn tables_on_host<B: Backend>(
        &self,
        positions: &Tensor<B, 2, Int>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        crate::ops::reference::rotary_tables(&self.inv_freq, positions)
    }

    /// Applies the rotation to `x` `[..., head_dim]`, the tables broadcast over it:
    /// `[batch, heads, seq, head_dim]` with [`Self::tables`]' `[batch, 1, seq, head_dim]`, or
    /// `[batch, seq, heads, head_dim]` with the tables reshaped to `[batch, seq, 1, head_dim]`.
    pub fn apply<B: FusedOps>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 4>,
        sin: &Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        // On burn-cuda, x [batch, seq, heads, dim] with tables [batch, seq, 1, dim] (the fused
        // attention's layout) takes one kernel each way.
        B::rotary(x, cos, sin)
    }
}

use burn::prelude::*;
use burn::tensor::Int;

use crate::hf::RopeScaling;
use crate::ops::FusedOps;

/// Rotary position embedding in the "rotate half" layout HF uses, with the inverse frequencies
/// scaled as the config's [`RopeScaling`] says (linear, Llama 3, YaRN), and YaRN's attention
/// factor applied to the cos and sin tables, as transformers applies it.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f64>,
    /// Multiplies cos and sin (YaRN's; 1 otherwise), so attention scores by its square.
    attention_factor: f64,
}

/// A forward's rope tables ([`RotaryEmbedding::tables`]): the model's, and where sliding
/// layers have a rope of their own (Gemma 3), theirs.
#[derive(Clone, Debug)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 4>,
    pub sin: Tensor<B, 4>,
    pub local: Option<(Tensor<B, 4>, Tensor<B, 4>)>,
}

impl<B: Backend> RopeTables<B> {
    /// The tables of a layer that slides (`sliding`) or not.
    pub fn for_layer(&self, sliding: bool) -> (&Tensor<B, 4>, &Tensor<B, 4>) {
        match (&self.local, sliding) {
            (Some((cos, sin)), true) => (cos, sin),
            _ => (&self.cos, &self.sin),
        }
    }
}

impl RotaryEmbedding {
    pub fn new(head_dim: usize, theta: f64, scaling: RopeScaling) -> Self {
        let mut inv_freq: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        let mut attention_factor = 1.0;
        if let RopeScaling::Linear { factor } = scaling {
            for f in &mut inv_freq {
                *f /= factor;
            }
        }
        if let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor: scale,
            truncate,
        } = scaling
        {
            attention_factor = scale;
            inv_freq = yarn_inv_freq(
                head_dim,
                theta,
                factor,
                original_max_position_embeddings as f64,
                (beta_fast, beta_slow),
                truncate,
            );
        }
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
        Self {
            inv_freq,
            attention_factor,
        }
    }

    /// The tables scaled by the attention factor (unchanged when it is 1).
    fn scaled<B: Backend>(
        &self,
        (cos, sin): (Tensor<B, 4>, Tensor<B, 4>),
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        if self.attention_factor == 1.0 {
            return (cos, sin);
        }
        let a = self.attention_factor as f32;
        (cos.mul_scalar(a), sin.mul_scalar(a))
    }

    /// [`Self::tables`] for every layer: with `local`, the sliding layers' own tables.
    pub fn layer_tables<B: FusedOps>(
        &self,
        local: Option<&RotaryEmbedding>,
        positions: &Tensor<B, 2, Int>,
    ) -> RopeTables<B> {
        let (cos, sin) = self.tables(positions);
        RopeTables {
            cos,
            sin,
            local: local.map(|r| r.tables(positions)),
        }
    }

    /// cos and sin tables `[batch, 1, seq, head_dim]` for the given positions `[batch, seq]`.
    /// The backend's [`FusedOps::rotary_tables`]: on burn-cuda the angles are computed on the
    /// device (reading the positions back would wait for the GPU once per forward).
    pub fn tables<B: FusedOps>(
        &self,
        positions: &Tensor<B, 2, Int>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        self.scaled(B::rotary_tables(&self.inv_freq, positions))
    }

    /// [`Self::tables`] computed on the host from the positions read back (the path of every
    /// backend but burn-cuda; public so the GPU path can be checked against it).
    pub fn tables_on_host<B: Backend>(
        &self,
        positions: &Tensor<B, 2, Int>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        self.scaled(crate::ops::reference::rotary_tables(
            &self.inv_freq,
            positions,
        ))
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

/// YaRN's inverse frequencies (transformers' `_compute_yarn_parameters`): a dimension pair keeps
/// its frequency where it makes more than `beta_fast` rotations over the original context, is
/// interpolated (`/ factor`) below `beta_slow` rotations, and blends linearly between, over the
/// dimension range the two rotation counts bound.
fn yarn_inv_freq(
    head_dim: usize,
    theta: f64,
    factor: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f64> {
    let dim = head_dim as f64;
    // The dimension at which a frequency makes `rotations` turns over the original context.
    let at = |rotations: f64| {
        dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (at(beta_fast), at(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    (0..head_dim / 2)
        .map(|i| {
            let extrapolated = 1.0 / theta.powf((2 * i) as f64 / dim);
            let interpolated = extrapolated / factor;
            // 0 up to `low` (the original frequency), 1 from `high` on (interpolated).
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            interpolated * ramp + extrapolated * (1.0 - ramp)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let plain = RotaryEmbedding::new(16, 10_000.0, RopeScaling::Default);
        let linear = RotaryEmbedding::new(16, 10_000.0, RopeScaling::Linear { factor: 4.0 });
        for (a, b) in plain.inv_freq.iter().zip(&linear.inv_freq) {
            assert!((a / 4.0 - b).abs() < 1e-15);
        }
        assert_eq!(linear.attention_factor, 1.0);
    }

    #[test]
    fn yarn_keeps_fast_pairs_interpolates_slow_ones_and_ramps_between() {
        // Head 16, theta 10 000, original context 64, factor 4 (the qwen3_yarn fixture): 32
        // rotations over 64 positions fall below dimension 0 and 1 rotation at dimension 2.02,
        // so truncated, low = 0 and high = 3: pair 0 keeps its frequency, pairs from 3 on are
        // divided by 4, pairs 1 and 2 blend at 1/3 and 2/3.
        let plain = RotaryEmbedding::new(16, 10_000.0, RopeScaling::Default).inv_freq;
        let yarn = yarn_inv_freq(16, 10_000.0, 4.0, 64.0, (32.0, 1.0), true);
        assert!((yarn[0] - plain[0]).abs() < 1e-15);
        for i in 3..8 {
            assert!((yarn[i] - plain[i] / 4.0).abs() < 1e-15, "{i}");
        }
        for (i, w) in [(1, 1.0 / 3.0), (2, 2.0 / 3.0)] {
            let expected = plain[i] / 4.0 * w + plain[i] * (1.0 - w);
            assert!((yarn[i] - expected).abs() < 1e-15, "{i}");
        }
        // The attention factor is carried to the tables: 0.1 ln 4 + 1.
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
            truncate: true,
        };
        let rope = RotaryEmbedding::new(16, 10_000.0, scaling);
        let positions = Tensor::<verl_core::backend::CpuBackend, 2, Int>::from_ints(
            [[0, 5]],
            &Default::default(),
        );
        let (cos, _) = rope.tables_on_host(&positions);
        let first: f32 = cos.narrow(2, 0, 1).narrow(3, 0, 1).into_scalar();
        assert!((first as f64 - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-6);
    }
}

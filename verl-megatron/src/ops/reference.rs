//! The plain chains of burn operations behind [`super::FusedOps`]' defaults: what every backend
//! without a kernel runs, what a kernel falls back to where it does not apply, and what
//! `verl bench kernels` checks each kernel against.

use burn::prelude::*;
use burn::tensor::activation::silu;
use burn::tensor::{FloatDType, Int, TensorData};

use super::{AdamWStep, FusedOps, RowSampling, ShardDraw};

/// `x / sqrt(mean(x², last dim) + eps) · weight`.
pub fn rms_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    let ms = x.clone().powf_scalar(2.0).mean_dim(D - 1);
    let normed = x / (ms + eps).sqrt();
    let mut shape = [1; D];
    shape[D - 1] = weight.dims()[0];
    normed * weight.reshape(shape)
}

/// The rotary tables `[batch, 1, seq, 2 · inv_freq.len()]` computed on the host from the
/// positions `[batch, seq]` read back (angles in f32, as HF computes them).
pub fn rotary_tables<B: Backend>(
    inv_freq: &[f64],
    positions: &Tensor<B, 2, Int>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, t] = positions.dims();
    let half = inv_freq.len();
    crate::host_reads::note(1);
    let pos: Vec<f64> = positions.to_data().iter::<f64>().collect();
    let mut cos = Vec::with_capacity(b * t * half * 2);
    let mut sin = Vec::with_capacity(b * t * half * 2);
    for p in pos {
        for _ in 0..2 {
            for f in inv_freq {
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

/// The rotary tables computed on the device from the positions (no read back): the same f32
/// products, the device's own cos and sin.
pub fn rotary_tables_on_device<B: Backend>(
    inv_freq: &[f64],
    positions: &Tensor<B, 2, Int>,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let [b, t] = positions.dims();
    let half = inv_freq.len();
    let device = positions.device();
    let freqs: Vec<f32> = (0..2)
        .flat_map(|_| inv_freq.iter().map(|f| *f as f32))
        .collect();
    let freqs = Tensor::<B, 1>::from_data(TensorData::new(freqs, [half * 2]), &device).reshape([
        1,
        1,
        1,
        half * 2,
    ]);
    let angles = positions.clone().float().reshape([b, 1, t, 1]) * freqs;
    (angles.clone().cos(), angles.sin())
}

/// `x · cos + rotate_half(x) · sin` over the last dimension of `x`, the tables broadcast.
pub fn rotary<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 4>, sin: &Tensor<B, 4>) -> Tensor<B, 4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d / 2);
    let rotated = Tensor::cat(vec![-x2, x1], 3);
    x * cos.clone() + rotated * sin.clone()
}

/// `silu(gate) · up`.
pub fn swiglu<B: Backend, const D: usize>(gate: Tensor<B, D>, up: Tensor<B, D>) -> Tensor<B, D> {
    silu(gate) * up
}

/// `y + b` on every row.
pub fn add_bias<B: Backend>(y: Tensor<B, 2>, b: Tensor<B, 1>) -> Tensor<B, 2> {
    y + b.unsqueeze_dim(0)
}

/// The residual sum, then the norm through `B`'s own [`FusedOps::rms_norm`], rounded to bf16.
pub fn add_rms_norm_bf16<B: FusedOps>(
    h: Tensor<B, 2>,
    delta: Option<Tensor<B, 2>>,
    weight: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let s = match delta {
        Some(d) => h + d,
        None => h,
    };
    let y = B::rms_norm(s.clone(), weight, eps).cast(FloatDType::BF16);
    (s, y)
}

/// The halves of `gu` through `B`'s own [`FusedOps::swiglu`], rounded to bf16.
pub fn swiglu_packed_bf16<B: FusedOps>(gu: Tensor<B, 2>) -> Tensor<B, 2> {
    let [_, width] = gu.dims();
    let inter = width / 2;
    let gate = gu.clone().narrow(1, 0, inter);
    let up = gu.narrow(1, inter, inter);
    B::swiglu(gate, up).cast(FloatDType::BF16)
}

/// A decode step's positions (one per slot) as the u32 words the decode-attention kernel
/// reads (bit patterns in an f32 tensor), uploaded once per step for every layer.
pub fn step_positions<B: Backend>(positions: &[usize], device: &B::Device) -> Tensor<B, 1> {
    let bits: Vec<f32> = positions
        .iter()
        .map(|&p| f32::from_bits(p as u32))
        .collect();
    let n = bits.len();
    Tensor::from_data(TensorData::new(bits, [n]), device)
}

/// One AdamW update as burn-optim's chain of operations computes it (the same scalars).
#[allow(clippy::type_complexity)]
pub fn adamw_step<B: Backend>(
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    moments: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
    s: &AdamWStep,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let grad = if s.grad_scale != 1.0 {
        grad.mul_scalar(s.grad_scale)
    } else {
        grad
    };
    let (factor_1, factor_2) = (1.0 - s.beta_1, 1.0 - s.beta_2);
    let (exp_avg, exp_avg_sq) = match moments {
        Some((m1, m2)) => (
            m1.mul_scalar(s.beta_1)
                .add(grad.clone().mul_scalar(factor_1)),
            m2.mul_scalar(s.beta_2)
                .add(grad.square().mul_scalar(factor_2)),
        ),
        None => (
            grad.clone().mul_scalar(factor_1),
            grad.square().mul_scalar(factor_2),
        ),
    };
    let m = exp_avg.clone().div_scalar(s.bias_correction_1);
    let v = exp_avg_sq.clone().div_scalar(s.bias_correction_2);
    let delta = m.div(v.sqrt().add_scalar(s.epsilon));
    let decayed = if s.decay_rate == 0.0 {
        param
    } else {
        param.mul_scalar(1.0 - s.decay_rate)
    };
    (decayed - delta.mul_scalar(s.lr), exp_avg, exp_avg_sq)
}

/// [`FusedOps::row_max`] as burn operations (`-inf` for every row when `valid` is 0).
pub fn row_max<B: Backend>(logits: Tensor<B, 2>, valid: usize) -> Tensor<B, 1> {
    let [n, _] = logits.dims();
    match valid {
        0 => Tensor::full([n], f32::NEG_INFINITY, &logits.device()),
        _ => logits.narrow(1, 0, valid).max_dim(1).reshape([n]),
    }
}

/// [`FusedOps::sample_shard`] on the host: the shard and the row maxima read back, each row
/// drawn by [`crate::sampling::reference_shard_draw`].
pub fn sample_shard<B: Backend>(
    logits: Tensor<B, 2>,
    row_max: Tensor<B, 1>,
    rows: &[RowSampling],
    (vocab_start, valid): (usize, usize),
) -> Tensor<B, 2> {
    let [n, width] = logits.dims();
    let device = logits.device();
    let x: Vec<f32> = logits
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 after convert");
    let m: Vec<f32> = row_max
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 after convert");
    let words: Vec<f32> = (0..n)
        .flat_map(|r| {
            let shard = &x[r * width..r * width + valid.min(width)];
            crate::sampling::reference_shard_draw(shard, vocab_start as u32, m[r], &rows[r])
                .to_words()
        })
        .collect();
    Tensor::from_data(TensorData::new(words, [n, ShardDraw::WORDS]), &device)
}

/// Each tensor's sum of squares, kept on the device until one read brings them all back.
pub fn sums_of_squares<B: Backend>(tensors: Vec<Tensor<B, 2>>) -> Vec<f64> {
    if tensors.is_empty() {
        return Vec::new();
    }
    let sums = tensors
        .into_iter()
        .map(|t| t.powi_scalar(2).sum())
        .collect();
    crate::host_reads::note(1);
    Tensor::cat(sums, 0)
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .expect("f64 data")
}

//! Mixed precision: parameters, gradients and optimizer state stay f32 (the master weights);
//! matrix products run in a lower compute dtype, as PyTorch's autocast and Megatron's bf16
//! training do. Everything between the products (norms, rotary embeddings, softmax, residual
//! sums, log-probs and losses) stays f32, so no kernel ever sees two dtypes at once (burn-cuda
//! 0.21 does not check that, and would read one operand's bytes as the other's type).
//!
//! A model enters its compute dtype for the span of its forward pass ([`enter`]); the layers
//! multiply through [`linear`] and [`matmul`], which read it. The casts are ordinary autodiff
//! operations, so the backward pass runs in the same dtypes and returns f32 gradients to the
//! f32 weights, whatever the setting is when backward runs.
//!
//! ```
//! use burn::prelude::*;
//! use verl_core::backend::CpuBackend;
//! use verl_megatron::layers::precision::{self, ComputeDtype};
//!
//! let device = Default::default();
//! let x = Tensor::<CpuBackend, 2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device);
//! let w = Tensor::<CpuBackend, 2>::from_floats([[0.5, 0.25]], &device);
//! let exact = precision::linear(x.clone(), w.clone());
//! let _bf16 = precision::enter(ComputeDtype::Bf16);
//! let low = precision::linear(x, w);
//! // 1.0 and 2.5 are exact in bf16; the result comes back as f32.
//! assert_eq!(low.into_data().to_vec::<f32>().unwrap(), exact.into_data().to_vec::<f32>().unwrap());
//! ```

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

use burn::prelude::*;
use burn::tensor::FloatDType;
use verl_core::config::Dtype;

use crate::error::MegatronError;
use crate::ops::FusedOps;

/// The dtype matrix products run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    /// Full f32 products (the CPU default).
    #[default]
    F32,
    /// bf16 operands with f32 accumulation; the product is returned as f32.
    Bf16,
}

impl ComputeDtype {
    /// Parses a config value: `bfloat16`/`bf16`, `float32`/`fp32`/`f32`, or `auto` (returned as
    /// `None`: the caller picks by backend). `field` names the key in the error.
    pub fn parse(value: &str, field: &str) -> Result<Option<Self>, MegatronError> {
        let setting: Dtype = value.parse().map_err(|message| MegatronError::Setting {
            field: field.into(),
            message,
        })?;
        Ok(Self::from_setting(setting))
    }

    /// The dtype a config's setting names; `None` for `auto` (the caller picks by backend).
    pub fn from_setting(setting: Dtype) -> Option<Self> {
        match setting {
            Dtype::Auto => None,
            Dtype::Bfloat16 => Some(Self::Bf16),
            Dtype::Float32 => Some(Self::F32),
        }
    }
}

impl FromStr for ComputeDtype {
    type Err = MegatronError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::parse(s, "dtype")?.unwrap_or_default())
    }
}

impl fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
        })
    }
}

thread_local! {
    static COMPUTE: Cell<ComputeDtype> = const { Cell::new(ComputeDtype::F32) };
}

/// Restores the previous compute dtype when dropped.
#[must_use = "the compute dtype reverts when the scope is dropped"]
pub struct PrecisionScope {
    previous: ComputeDtype,
}

impl Drop for PrecisionScope {
    fn drop(&mut self) {
        COMPUTE.with(|c| c.set(self.previous));
    }
}

/// Runs this thread's matrix products in `dtype` until the returned scope is dropped.
pub fn enter(dtype: ComputeDtype) -> PrecisionScope {
    PrecisionScope {
        previous: COMPUTE.with(|c| c.replace(dtype)),
    }
}

/// This thread's compute dtype.
pub fn current() -> ComputeDtype {
    COMPUTE.with(|c| c.get())
}

fn low<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.cast(FloatDType::BF16)
}

/// `x` as the products of the current compute dtype read it: cast once when several products
/// share an input (q/k/v, gate/up), so [`linear`]'s own cast of it is a no-op.
pub fn operand<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    match current() {
        ComputeDtype::F32 => x,
        ComputeDtype::Bf16 => low(x),
    }
}

/// `a · b` in the current compute dtype, returned as f32. bf16 products go through the
/// backend's [`FusedOps::matmul_bf16`] (the GPU products' seam on burn-cuda), which casts the
/// operands itself: on burn-cuda one operation casts, multiplies and writes f32, with no cast
/// kernels around the product in the backward either.
pub fn matmul<B: FusedOps, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    match current() {
        ComputeDtype::F32 => a.matmul(b),
        ComputeDtype::Bf16 => B::matmul_bf16(a, b).cast(FloatDType::F32),
    }
}

/// `x · wᵀ` for `x` `[rows, in]` and a weight in the HF layout `[out, in]`, in the current
/// compute dtype, returned as f32 (the backend's [`FusedOps::linear_bf16`] casts, as in
/// [`matmul`]).
pub fn linear<B: FusedOps>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Tensor<B, 2> {
    match current() {
        ComputeDtype::F32 => x.matmul(w.transpose()),
        // The backend's seam: on burn-cuda our kernels, or cuBLASLt where switched on.
        ComputeDtype::Bf16 => B::linear_bf16(x, w).cast(FloatDType::F32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;
    use verl_core::backend::CpuAutodiff;

    type B = CpuAutodiff;

    #[test]
    fn scope_nests_and_restores() {
        assert_eq!(current(), ComputeDtype::F32);
        {
            let _a = enter(ComputeDtype::Bf16);
            assert_eq!(current(), ComputeDtype::Bf16);
            {
                let _b = enter(ComputeDtype::F32);
                assert_eq!(current(), ComputeDtype::F32);
            }
            assert_eq!(current(), ComputeDtype::Bf16);
        }
        assert_eq!(current(), ComputeDtype::F32);
    }

    #[test]
    fn parse_names_the_field() {
        assert_eq!(
            ComputeDtype::parse("bf16", "x").unwrap(),
            Some(ComputeDtype::Bf16)
        );
        assert_eq!(
            ComputeDtype::parse("Float32", "x").unwrap(),
            Some(ComputeDtype::F32)
        );
        assert_eq!(ComputeDtype::parse("auto", "x").unwrap(), None);
        let e = ComputeDtype::parse("float16", "actor.megatron.dtype").unwrap_err();
        assert!(e.to_string().contains("actor.megatron.dtype"), "{e}");
    }

    /// bf16 products: values and f32 gradients within bf16 rounding of the f32 ones (8 bits
    /// of mantissa: a relative error near 2⁻⁸ per operand, far less after f32 accumulation).
    #[test]
    fn bf16_product_and_gradients_are_f32_and_close() {
        let device = Default::default();
        let x = Tensor::<B, 2>::random([16, 64], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let w = Tensor::<B, 2>::random([32, 64], Distribution::Normal(0.0, 1.0), &device)
            .require_grad();
        let run = |dtype| {
            let _s = enter(dtype);
            let y = linear(x.clone(), w.clone());
            let loss = (y.clone() * y.clone()).sum();
            let g = loss.backward();
            (
                y.inner(),
                x.grad(&g).expect("x grad"),
                w.grad(&g).expect("w grad"),
            )
        };
        let (y32, gx32, gw32) = run(ComputeDtype::F32);
        let (y16, gx16, gw16) = run(ComputeDtype::Bf16);
        for (a, b) in [(y32, y16), (gx32, gx16), (gw32, gw16)] {
            assert_eq!(b.dtype(), burn::tensor::DType::F32);
            let a: Vec<f32> = a.into_data().to_vec().unwrap();
            let b: Vec<f32> = b.into_data().to_vec().unwrap();
            let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
            let den: f32 = a.iter().map(|x| x * x).sum();
            let rel = (num / den).sqrt();
            assert!(rel > 0.0 && rel < 2e-2, "relative error {rel}");
        }
    }
}

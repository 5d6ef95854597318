//! The burn backends verl-rs runs on.
//!
//! [`CpuBackend`] is the embedded default (no GPU, no downloads). burn 0.21 offers two CPU
//! backends, `flex` and `ndarray`; `docs/PERFORMANCE.md` records the measurement behind the
//! choice (`cargo bench --bench cpu_backends`). With the `cuda` feature, [`CudaBackend`] is burn-cuda,
//! which loads the CUDA driver and NVRTC at run time, so it builds on machines without CUDA.

use burn::backend::Autodiff;

/// The default CPU backend.
pub type CpuBackend = burn::backend::Flex;

/// [`CpuBackend`] with automatic differentiation, for training.
pub type CpuAutodiff = Autodiff<CpuBackend>;

/// burn-cuda with f32 floats (bf16 compute is chosen per tensor by the trainer).
#[cfg(feature = "cuda")]
pub type CudaBackend = burn::backend::Cuda<f32, i32>;

/// [`CudaBackend`] with automatic differentiation.
#[cfg(feature = "cuda")]
pub type CudaAutodiff = Autodiff<CudaBackend>;

/// The backend the `verl` binary runs on: burn-cuda when built with the `cuda` feature, else
/// the CPU default.
#[cfg(not(feature = "cuda"))]
pub type DefaultBackend = CpuBackend;

/// The backend the `verl` binary runs on: burn-cuda when built with the `cuda` feature, else
/// the CPU default.
#[cfg(feature = "cuda")]
pub type DefaultBackend = CudaBackend;

/// [`DefaultBackend`] with automatic differentiation.
pub type DefaultAutodiff = Autodiff<DefaultBackend>;

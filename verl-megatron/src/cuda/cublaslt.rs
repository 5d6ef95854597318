//! A prototype of routing matrix products to cuBLASLt on burn-cuda buffers: `y = x · wᵀ` for a
//! row-major `x` `[m, k]` and a weight in the HF layout `[n, k]`, in bf16 with f32
//! accumulation, the product every linear layer computes.
//!
//! burn-cuda 0.21's own bf16 product reaches about a quarter of cuBLAS's rate on an H100
//! (`verl bench gemm`; docs/PERFORMANCE.md); this measures what handing the hot products to
//! cuBLASLt gains, buffer to buffer, with no copies. It is not yet wired into the layers: that
//! needs a custom autodiff op for the two backward products, and a way to order cuBLASLt's
//! stream after burn's without a host wait per product (burn-cuda does not expose its stream).

use std::sync::Arc;

use burn::backend::cuda::CudaDevice;
use burn::prelude::*;
use burn::tensor::{bf16, DType};
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::{CudaContext, CudaStream};
use verl_core::backend::CudaBackend;

use super::buffer::DeviceBuffer;

/// A cuBLASLt handle (with its workspace) on one GPU's stream.
pub struct CublasLt {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    blas: CudaBlasLT,
}

impl CublasLt {
    pub fn new(device: CudaDevice) -> Result<Self, String> {
        let ctx = CudaContext::new(device.index).map_err(|e| format!("CUDA context: {e:?}"))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("CUDA stream: {e:?}"))?;
        let blas = CudaBlasLT::new(stream.clone()).map_err(|e| format!("cuBLASLt: {e:?}"))?;
        Ok(Self {
            device,
            stream,
            blas,
        })
    }

    /// `x · wᵀ` for bf16 `x` `[m, k]` and `w` `[n, k]`: `[m, n]` bf16. With `wait`, returns
    /// after the product is done (the buffer protocol); without, the product may still be
    /// running on cuBLASLt's stream (for timing back-to-back products, then [`Self::wait`]).
    pub fn linear_bf16(
        &self,
        x: Tensor<CudaBackend, 2>,
        w: Tensor<CudaBackend, 2>,
        wait: bool,
    ) -> Result<Tensor<CudaBackend, 2>, String> {
        let [m, k] = x.dims();
        let [n, kw] = w.dims();
        if k != kw {
            return Err(format!("x·wᵀ: x is [{m}, {k}] but w is [{n}, {kw}]"));
        }
        if x.dtype() != DType::BF16 || w.dtype() != DType::BF16 {
            return Err("cuBLASLt linear: x and w must be bf16".into());
        }
        let x = DeviceBuffer::of(x)?;
        let w = DeviceBuffer::of(w)?;
        let y = DeviceBuffer::empty(m * n, DType::BF16, &self.device)?;
        DeviceBuffer::sync_burn(&self.device)?;
        // Row-major y [m, n] is column-major yᵀ [n, m] = w · xᵀ, where the row-major w [n, k]
        // read column-major is wᵀ (so it is transposed back) and x [m, k] is xᵀ [k, m].
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            alpha: 1.0,
            lda: k as i64,
            ldb: k as i64,
            beta: 0.0,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        let (a, b) = (w.view::<bf16>(&self.stream), x.view::<bf16>(&self.stream));
        let mut c = y.view::<bf16>(&self.stream);
        // SAFETY: the three buffers are held, contiguous and of the sizes the layout names.
        unsafe { self.blas.matmul(cfg, &a, &b, &mut c, None, None) }
            .map_err(|e| format!("cuBLASLt matmul: {e:?}"))?;
        if wait {
            self.wait()?;
        }
        Ok(y.into_tensor().reshape([m, n]))
    }

    /// Waits for every product queued on this handle's stream.
    pub fn wait(&self) -> Result<(), String> {
        self.stream
            .synchronize()
            .map_err(|e| format!("cuBLASLt stream: {e:?}"))
    }
}

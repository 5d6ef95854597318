//! A prototype of routing matrix products to cuBLASLt on burn-cuda buffers: `y = x · wᵀ` for a
//! row-major `x` `[m, k]` and a weight in the HF layout `[n, k]`, in bf16 with f32
//! accumulation, the product every linear layer computes.
//!
//! burn-cuda 0.21's own bf16 product reaches about a quarter of cuBLAS's rate on an H100
//! (`verl bench gemm`; docs/PERFORMANCE.md); this measures what handing the hot products to
//! cuBLASLt gains, buffer to buffer, with no copies. [`super::linear`] routes the linear layers'
//! bf16 products here when switched on; each product still waits on the host for burn's stream
//! and for its own (burn-cuda does not expose its stream to order them on the device).

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
        self.gemm_bf16(x, false, w, true, wait)
    }

    /// `op(a) · op(b)` for row-major bf16 matrices, `op` transposing where `ta` / `tb` say:
    /// the three products of a linear layer (`x·wᵀ`, `dy·w`, `dyᵀ·x`) with no copies.
    pub fn gemm_bf16(
        &self,
        a: Tensor<CudaBackend, 2>,
        ta: bool,
        b: Tensor<CudaBackend, 2>,
        tb: bool,
        wait: bool,
    ) -> Result<Tensor<CudaBackend, 2>, String> {
        let ([ar, ac], [br, bc]) = (a.dims(), b.dims());
        let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
        let (kb, n) = if tb { (bc, br) } else { (br, bc) };
        if k != kb {
            return Err(format!(
                "cuBLASLt product: op(a) is [{m}, {k}] but op(b) is [{kb}, {n}]"
            ));
        }
        if a.dtype() != DType::BF16 || b.dtype() != DType::BF16 {
            return Err("cuBLASLt product: both operands must be bf16".into());
        }
        let a = DeviceBuffer::of(a)?;
        let b = DeviceBuffer::of(b)?;
        let c = DeviceBuffer::empty(m * n, DType::BF16, &self.device)?;
        DeviceBuffer::sync_burn(&self.device)?;
        // cuBLASLt is column-major: row-major C [m, n] is column-major Cᵀ [n, m] = op(b)ᵀ · op(a)ᵀ.
        // A row-major buffer read column-major is its transpose, so op(b)ᵀ is b's buffer as is
        // when b is not transposed (leading dimension n) and transposed when it is (leading
        // dimension k); likewise for a with m.
        let cfg = MatmulConfig {
            transa: tb,
            transb: ta,
            transc: false,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            alpha: 1.0,
            lda: if tb { k } else { n } as i64,
            ldb: if ta { m } else { k } as i64,
            beta: 0.0,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        let (first, second) = (b.view::<bf16>(&self.stream), a.view::<bf16>(&self.stream));
        let mut out = c.view::<bf16>(&self.stream);
        // SAFETY: the three buffers are held, contiguous and of the sizes the layout names.
        unsafe { self.blas.matmul(cfg, &first, &second, &mut out, None, None) }
            .map_err(|e| format!("cuBLASLt matmul: {e:?}"))?;
        if wait {
            self.wait()?;
        }
        Ok(c.into_tensor().reshape([m, n]))
    }

    /// Waits for every product queued on this handle's stream.
    pub fn wait(&self) -> Result<(), String> {
        self.stream
            .synchronize()
            .map_err(|e| format!("cuBLASLt stream: {e:?}"))
    }
}

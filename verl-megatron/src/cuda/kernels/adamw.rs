//! Fused AdamW: one kernel per parameter tensor reads the parameter, its gradient and both
//! moments once and writes the parameter and the moments in place. burn's optimizer runs about
//! fifteen element-wise kernels per tensor for the same update, each a full pass over memory.
//!
//! The fallback is `crate::ops::reference::adamw_step`'s chain of burn operations (the same formula);
//! results differ from it only by rounding (the kernel may contract a multiply and an add into
//! one fused multiply-add), which `verl bench kernels` measures on a GPU.

use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use cubecl::calculate_cube_count_elemwise;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::CubeDim;
use verl_core::backend::CudaBackend;

use super::{CudaPrimitive, KernelSwitch};
use crate::ops::AdamWStep;

/// Whether the fused kernel is used: on unless `VERL_ADAMW=decomposed` in the environment, or
/// `SWITCH.set(false)` (to compare it with burn's chain inside a whole job).
pub static SWITCH: KernelSwitch = KernelSwitch::new("VERL_ADAMW");

/// What [`step`] hands back when it does not apply: the parameter, the gradient and the
/// moments, unchanged.
pub type NotApplied<B> = (
    Tensor<B, 1>,
    Tensor<B, 1>,
    Option<(Tensor<B, 1>, Tensor<B, 1>)>,
);

/// The updated parameter and moments.
pub type Updated<B> = (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>);

mod kernel {
    use cubecl::prelude::*;

    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    pub(super) fn adamw_kernel(
        param: &mut Array<f32>,
        grad: &Array<f32>,
        exp_avg: &mut Array<f32>,
        exp_avg_sq: &mut Array<f32>,
        grad_scale: f32,
        beta_1: f32,
        beta_2: f32,
        bias_correction_1: f32,
        bias_correction_2: f32,
        epsilon: f32,
        decay: f32,
        lr: f32,
    ) {
        let i = ABSOLUTE_POS;
        if i < param.len() {
            let g = grad[i] * grad_scale;
            let m = exp_avg[i] * beta_1 + g * (1.0 - beta_1);
            let v = exp_avg_sq[i] * beta_2 + g * g * (1.0 - beta_2);
            exp_avg[i] = m;
            exp_avg_sq[i] = v;
            let denom = f32::sqrt(v / bias_correction_2) + epsilon;
            param[i] = param[i] * decay - (m / bias_correction_1) / denom * lr;
        }
    }
}
use kernel::adamw_kernel;

/// A contiguous primitive this kernel may write (a copy when the buffer is shared). A copy
/// costs a tensor-sized allocation, so each is a debug event of target
/// `verl_megatron::memory` naming the tensor (`what`) and its bytes.
fn writable(t: Tensor<CudaBackend, 1>, what: &'static str) -> CudaPrimitive {
    let p = into_contiguous(t.into_primitive().tensor());
    if p.can_mut() {
        p
    } else {
        tracing::debug!(
            target: "verl_megatron::memory",
            adamw_copy = what,
            bytes = p.meta.shape().num_elements() * 4,
        );
        p.copy()
    }
}

fn wrap(p: CudaPrimitive) -> Tensor<CudaBackend, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// One AdamW update of a flat f32 parameter by the fused kernel; `moments` is `None` before the
/// first update. Another dtype, or the switch off, gets its inputs back.
pub fn step(
    param: Tensor<CudaBackend, 1>,
    grad: Tensor<CudaBackend, 1>,
    moments: Option<(Tensor<CudaBackend, 1>, Tensor<CudaBackend, 1>)>,
    s: &AdamWStep,
) -> Result<Updated<CudaBackend>, NotApplied<CudaBackend>> {
    let all_f32 = SWITCH.enabled()
        && param.dtype() == DType::F32
        && grad.dtype() == DType::F32
        && moments
            .as_ref()
            .is_none_or(|(a, b)| a.dtype() == DType::F32 && b.dtype() == DType::F32);
    if !all_f32 {
        return Err((param, grad, moments));
    }
    let n = param.dims()[0];
    let device = param.device();
    let (exp_avg, exp_avg_sq) = match moments {
        Some(moments) => moments,
        None => (
            Tensor::<CudaBackend, 1>::zeros([n], &device),
            Tensor::<CudaBackend, 1>::zeros([n], &device),
        ),
    };
    let (p, m1, m2) = (
        writable(param, "param"),
        writable(exp_avg, "exp_avg"),
        writable(exp_avg_sq, "exp_avg_sq"),
    );
    let g = into_contiguous(grad.into_primitive().tensor());
    if n > 0 {
        let client = p.client.clone();
        let cube_dim = CubeDim::new_1d(256);
        let count = calculate_cube_count_elemwise(&client, n, cube_dim);
        // SAFETY: the four arrays have n elements each (flat tensors of one shape), and the
        // kernel indexes them only below param.len().
        unsafe {
            adamw_kernel::launch_unchecked::<CudaRuntime>(
                &client,
                count,
                cube_dim,
                p.clone().into_array_arg(),
                g.into_array_arg(),
                m1.clone().into_array_arg(),
                m2.clone().into_array_arg(),
                s.grad_scale as f32,
                s.beta_1,
                s.beta_2,
                s.bias_correction_1,
                s.bias_correction_2,
                s.epsilon,
                (1.0 - s.decay_rate) as f32,
                s.lr as f32,
            );
        }
    }
    Ok((wrap(p), wrap(m1), wrap(m2)))
}

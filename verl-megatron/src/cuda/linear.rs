//! The linear layers' bf16 products through cuBLASLt (a prototype, off by default): forward
//! `x · wᵀ` and, under autodiff, a custom backward whose two products (`dy · w`, `dyᵀ · x`) go
//! through cuBLASLt too.
//!
//! Switched on by `VERL_CUBLASLT=1` in the environment or [`set_enabled`]. It is burn-cuda's
//! `FusedOps::linear_bf16` (plain and under autodiff) when on; a failure of cuBLASLt (logged
//! once, after which it stays off) falls back to the products' seam.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU8, Ordering};

use burn::backend::Autodiff;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType, TensorPrimitive};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{binary, Backward, Ops};
use verl_core::backend::CudaBackend;

use super::kernels::record;
use super::CublasLt;

/// burn-cuda's float tensor, as autodiff stores it.
type Primitive = burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>;

/// 0: not read yet, 1: off, 2: on.
static ENABLED: AtomicU8 = AtomicU8::new(0);

/// Whether the linear layers' bf16 products go to cuBLASLt.
pub fn enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("VERL_CUBLASLT").is_ok_and(|v| v == "1" || v == "true");
            ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Switches the routing on or off for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

thread_local! {
    /// One handle per GPU and thread (a handle owns a stream and a workspace).
    static HANDLES: RefCell<HashMap<usize, Rc<CublasLt>>> = RefCell::new(HashMap::new());
}

fn handle(device: &burn::backend::cuda::CudaDevice) -> Result<Rc<CublasLt>, String> {
    HANDLES.with(|h| {
        if let Some(found) = h.borrow().get(&device.index) {
            return Ok(found.clone());
        }
        let made = Rc::new(CublasLt::new(device.clone())?);
        h.borrow_mut().insert(device.index, made.clone());
        Ok(made)
    })
}

/// `op(a) · op(b)` in bf16 through cuBLASLt (operands cast to bf16 if they are not).
fn gemm(
    a: Tensor<CudaBackend, 2>,
    ta: bool,
    b: Tensor<CudaBackend, 2>,
    tb: bool,
) -> Result<Tensor<CudaBackend, 2>, String> {
    let bf = |t: Tensor<CudaBackend, 2>| {
        if t.dtype() == DType::BF16 {
            t
        } else {
            t.cast(FloatDType::BF16)
        }
    };
    handle(&a.device())?.gemm_bf16(bf(a), ta, bf(b), tb, true)
}

fn give_up(e: String) {
    tracing::warn!("cuBLASLt linear switched off, burn's product takes over: {e}");
    set_enabled(false);
}

/// The operands handed back: burn's own product takes over.
type Operands<B> = (Tensor<B, 2>, Tensor<B, 2>);

/// `x · wᵀ` for bf16 `x` `[rows, in]` and `w` `[out, in]` through cuBLASLt (inference, the
/// rollout engine), or the operands back when it does not apply (switched off, or cuBLASLt
/// failed, which switches it off).
pub fn linear(
    x: Tensor<CudaBackend, 2>,
    w: Tensor<CudaBackend, 2>,
) -> Result<Tensor<CudaBackend, 2>, Operands<CudaBackend>> {
    routed(x, w, |x, w| gemm(x, false, w, true))
}

/// [`linear`] under autodiff (training), with the custom backward.
pub fn linear_tracked<C: CheckpointStrategy>(
    x: Tensor<Autodiff<CudaBackend, C>, 2>,
    w: Tensor<Autodiff<CudaBackend, C>, 2>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, 2>, Operands<Autodiff<CudaBackend, C>>> {
    routed(x, w, linear_autodiff)
}

/// `product(x, w)` when switched on; the operands back when not, or when the product failed
/// (which switches the routing off).
fn routed<B: Backend>(
    x: Tensor<B, 2>,
    w: Tensor<B, 2>,
    product: impl FnOnce(Tensor<B, 2>, Tensor<B, 2>) -> Result<Tensor<B, 2>, String>,
) -> Result<Tensor<B, 2>, Operands<B>> {
    if !enabled() {
        return Err((x, w));
    }
    product(x.clone(), w.clone()).map_err(|e| {
        give_up(e);
        (x, w)
    })
}

/// The backward step of `y = x · wᵀ`: `dx = dy · w`, `dw = dyᵀ · x`.
#[derive(Debug)]
struct LinearBackward;

impl Backward<CudaBackend, 2> for LinearBackward {
    /// The bf16 operands, and the dtypes of the operands as given (each gradient comes back in
    /// its operand's own).
    type State = (Primitive, Primitive, DType, DType);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, w, x_dtype, w_dtype) = ops.state;
        let wrap =
            |p: Primitive| Tensor::<CudaBackend, 2>::from_primitive(TensorPrimitive::Float(p));
        let unwrap = |t: Tensor<CudaBackend, 2>| t.into_primitive().tensor();
        // burn's Backward has no error path: a failure here after a forward that worked is a
        // broken device, so it panics with the reason.
        let run = |r: Result<Tensor<CudaBackend, 2>, String>| {
            r.unwrap_or_else(|e| panic!("cuBLASLt linear backward: {e}"))
        };
        binary::<CudaBackend, _, _>(
            ops.parents,
            ops.node,
            grads,
            |dy| unwrap(run(gemm(wrap(dy), false, wrap(w), false)).cast(x_dtype)),
            |dy| unwrap(run(gemm(wrap(dy), true, wrap(x), false)).cast(w_dtype)),
        );
    }
}

fn linear_autodiff<C: CheckpointStrategy>(
    x: Tensor<Autodiff<CudaBackend, C>, 2>,
    w: Tensor<Autodiff<CudaBackend, C>, 2>,
) -> Result<Tensor<Autodiff<CudaBackend, C>, 2>, String> {
    let x = x.into_primitive().tensor();
    let w = w.into_primitive().tensor();
    // Cast once here, so the backward's two products reuse the bf16 operands (the operands may
    // come in f32: the products' seam casts them itself).
    let low = |p: &Primitive| {
        Tensor::<CudaBackend, 2>::from_primitive(TensorPrimitive::Float(p.clone()))
            .cast(FloatDType::BF16)
    };
    let (x16, w16) = (low(&x.primitive), low(&w.primitive));
    let y = gemm(x16.clone(), false, w16.clone(), true)?
        .into_primitive()
        .tensor();
    let (x_dtype, w_dtype) = (x.primitive.dtype, w.primitive.dtype);
    let saved = (
        x16.into_primitive().tensor(),
        w16.into_primitive().tensor(),
        x_dtype,
        w_dtype,
    );
    Ok(record(LinearBackward, [&x, &w], saved, y))
}

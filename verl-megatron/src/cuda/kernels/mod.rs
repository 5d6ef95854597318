//! Kernels of our own on burn-cuda's stream (`#[cube]` kernels, and cubek's matmul with fixed
//! strategies), one module per family. Each is launched through the `CubeTensor`'s own client,
//! so it is ordered with burn's operations with no host synchronisation, and each has a
//! plain-burn fallback that runs where it does not apply (another backend, another dtype, a
//! launch that fails) and that `verl bench kernels` compares it against on a GPU.

pub mod adamw;
pub mod gemm;

use std::any::Any;

use verl_core::backend::CudaBackend;

/// burn-cuda's float tensor primitive.
pub type CudaPrimitive = burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>;

/// `a` as a `T` when that is its type, else `a` back.
pub(crate) fn downcast<A: 'static, T: 'static>(a: A) -> Result<T, A> {
    let boxed: Box<dyn Any> = Box::new(a);
    match boxed.downcast::<T>() {
        Ok(t) => Ok(*t),
        Err(back) => Err(*back
            .downcast::<A>()
            .expect("a box holds the type it was made from")),
    }
}

/// A value whose type is known to be `T` (checked by an earlier downcast).
pub(crate) fn same<A: 'static, T: 'static>(a: A) -> T {
    match downcast(a) {
        Ok(t) => t,
        Err(_) => unreachable!("the backend was checked"),
    }
}

/// Whether tensors of backend `B` are burn-cuda's plain (not autodiff) tensors.
pub(crate) fn is_cuda<B: 'static>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<CudaBackend>()
}

//! Device pointers of burn-cuda tensors, for libraries (NCCL, cuBLASLt) that work on raw CUDA
//! memory.
//!
//! burn-cuda runs each calling thread's kernels on a stream of its own that it does not expose,
//! so a foreign library cannot be ordered after them on the device. The protocol here orders
//! them on the host instead: resolve every pointer (inputs and freshly allocated outputs), wait
//! for burn's stream ([`DeviceBuffer::sync_burn`]), run the library on our own stream, and wait
//! for that stream before the tensors go back to burn. A buffer stays valid while its tensor is
//! held, which [`DeviceBuffer`] does.

use std::sync::Arc;

use burn::backend::cuda::CudaDevice;
use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use verl_core::backend::CudaBackend;

/// A contiguous burn-cuda tensor held with its device pointer.
pub struct DeviceBuffer {
    tensor: CubeTensor<CudaRuntime>,
    ptr: u64,
    /// Elements.
    len: usize,
}

impl DeviceBuffer {
    /// Holds `tensor` (made contiguous if it is a strided view) and resolves its pointer.
    pub fn of<const D: usize>(tensor: Tensor<CudaBackend, D>) -> Result<Self, String> {
        let tensor = burn_cubecl::kernel::into_contiguous(tensor.into_primitive().tensor());
        let len = tensor.meta.shape().num_elements();
        let resource = tensor
            .client
            .get_resource(tensor.handle.clone())
            .map_err(|e| format!("burn-cuda buffer: {e:?}"))?;
        let ptr = resource.resource().ptr;
        Ok(Self { tensor, ptr, len })
    }

    /// A new uninitialised buffer of `len` elements of `dtype` on `device`, for a library to
    /// write (only this buffer holds it).
    pub fn empty(len: usize, dtype: DType, device: &CudaDevice) -> Result<Self, String> {
        Self::of(Tensor::<CudaBackend, 1>::empty([len], (device, dtype)))
    }

    /// The device address of the first element.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.tensor.dtype
    }

    pub fn device(&self) -> CudaDevice {
        self.tensor.device.clone()
    }

    /// Waits for every kernel burn queued on this thread's stream for the device (and, through
    /// the pointer resolution above, those that wrote the held buffers on other streams).
    pub fn sync_burn(device: &CudaDevice) -> Result<(), String> {
        <CudaBackend as burn::tensor::backend::Backend>::sync(device)
            .map_err(|e| format!("burn-cuda sync: {e:?}"))
    }

    /// The tensor again, `[len]`, once the library's stream has been waited for.
    pub fn into_tensor(self) -> Tensor<CudaBackend, 1> {
        Tensor::from_primitive(TensorPrimitive::Float(self.tensor))
    }

    /// A view for cudarc's typed APIs on `stream`: no copy, no ownership (cudarc never frees
    /// it), no implicit waits (the protocol above orders the work).
    pub fn view<T>(&self, stream: &Arc<CudaStream>) -> RawSlice<T> {
        RawSlice {
            ptr: self.ptr,
            len: self.len,
            stream: stream.clone(),
            _elem: std::marker::PhantomData,
        }
    }
}

/// Borrowed device memory as cudarc's slice traits see it.
pub struct RawSlice<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: std::marker::PhantomData<T>,
}

impl<T> DeviceSlice<T> for RawSlice<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for RawSlice<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for RawSlice<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

//! The burn-cuda host store (feature `cuda`): persistent pinned buffers and asynchronous copies
//! on a stream of our own.
//!
//! burn-cuda's own round trip (`Transaction` out, `from_data` back) stages every reload through
//! memory cubecl pins and unpins per call, which ran at about 2 GB/s on an H100. Here each slot
//! owns one page-locked buffer, allocated the first time the slot goes out and reused for the
//! role's lifetime (host memory = one copy of the state, never two), and the copies are
//! `cuMemcpy*Async` between that buffer and the tensors' device memory at the link's rate.
//!
//! burn's CUDA stream is private, so our copies are ordered with its kernels on the host: before
//! a copy touches a tensor, burn's stream is drained (`Backend::sync`) — the tensor is written
//! (outward), or its freshly allocated memory is no longer read by kernels that used it before
//! (inward). Outward copies are waited for before the tensors are dropped. An inward copy
//! started by [`HostOffload::prefetch`] runs while burn's stream computes; the tensors reach
//! burn only in [`HostOffload::reload`], after our stream is waited for.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::cuda::CudaDevice;
use burn::prelude::*;
use burn::tensor::{DType, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use verl_core::backend::CudaBackend;
use verl_core::traits::{HostOffload, TransferReport};

use crate::OffloadError;

/// Tensors start at multiples of this in a slot's buffer (the DMA engines' favourite).
const ALIGN: usize = 256;

/// Page-locked host memory, freed on drop.
struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    /// Keeps the context alive as long as the memory.
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is owned by one store and only touched through `&mut self`; the pointer
// is plain host memory, valid from any thread of the process.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: a fresh allocation of `len` bytes (at least one), freed in `drop`.
        let ptr = unsafe { result::malloc_host(len.max(1), 0)? } as *mut u8;
        Ok(Self {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_host` in `new`, freed once; no copy is in flight (the
        // store waits for its stream before a buffer can be dropped).
        unsafe {
            let _ = result::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}

/// Where one tensor lives in its slot's buffer.
#[derive(Debug, Clone)]
struct Entry {
    offset: usize,
    bytes: usize,
    elems: usize,
    dtype: DType,
}

enum SlotState {
    /// The tensors are the caller's (the buffer holds stale bytes).
    OnDevice,
    /// The buffer holds the tensors.
    Held,
    /// Copies back to these tensors are queued on our stream.
    Coming(Vec<CubeTensor<CudaRuntime>>),
}

struct PinnedSlot {
    /// `None` for a slot that went out with no bytes.
    buffer: Option<PinnedBuffer>,
    entries: Vec<Entry>,
    state: SlotState,
    /// The buffer holds the values the tensors had when they last came back (or went out), so
    /// tensors that were only read since can go out without a copy.
    kept: bool,
}

/// A role's host store on burn-cuda: see the module documentation.
///
/// ```no_run
/// use burn::prelude::*;
/// use burn::backend::cuda::CudaDevice;
/// use verl_core::backend::CudaBackend as Cuda;
/// use verl_core::traits::HostOffload;
/// use verl_offload::PinnedOffload;
///
/// let device = CudaDevice::new(0);
/// let mut host = PinnedOffload::new("actor");
/// let w = Tensor::<Cuda, 1>::from_floats([1.0, 2.0, 3.0], &device);
/// host.offload("params", vec![w]).unwrap();
/// host.prefetch("params", &device).unwrap(); // the copy back overlaps what comes next
/// let (back, _) = host.reload("params", &device).unwrap();
/// assert_eq!(back[0].to_data().to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
/// ```
pub struct PinnedOffload {
    role: String,
    /// The context and copy stream of the device the slots belong to, made on first use.
    link: Option<(usize, Arc<CudaContext>, Arc<CudaStream>)>,
    slots: HashMap<String, PinnedSlot>,
    /// Keep this many bytes of the device free when deciding whether a prefetch fits.
    headroom: u64,
}

impl PinnedOffload {
    /// An empty store for `role` (named in errors).
    pub fn new(role: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            link: None,
            slots: HashMap::new(),
            headroom: 1 << 30,
        }
    }

    /// Prefetches only while the device keeps `bytes` free besides the slot (1 GiB unless
    /// set): the bound that keeps an early copy from pushing a phase out of memory.
    pub fn with_prefetch_headroom(mut self, bytes: u64) -> Self {
        self.headroom = bytes;
        self
    }

    fn error(&self, slot: &str, what: &str, e: impl std::fmt::Debug) -> verl_core::Error {
        OffloadError::Copy {
            role: self.role.clone(),
            slot: slot.into(),
            message: format!("{what}: {e:?}"),
        }
        .into()
    }

    /// The copy stream for `device`'s context, bound to this thread.
    fn link(&mut self, slot: &str, device: &CudaDevice) -> verl_core::Result<Arc<CudaStream>> {
        if !matches!(&self.link, Some((index, ..)) if *index == device.index) {
            if self.slots.values().any(|s| s.buffer.is_some()) {
                return Err(self.error(slot, "device", "a store serves one device"));
            }
            let ctx = CudaContext::new(device.index).map_err(|e| self.error(slot, "context", e))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| self.error(slot, "stream", e))?;
            self.link = Some((device.index, ctx, stream));
        }
        let (_, ctx, stream) = self.link.as_ref().expect("set above");
        ctx.bind_to_thread()
            .map_err(|e| self.error(slot, "bind", e))?;
        Ok(stream.clone())
    }

    /// Waits for our copies to finish.
    fn wait(&self, slot: &str, stream: &CudaStream) -> verl_core::Result<()> {
        stream
            .synchronize()
            .map_err(|e| self.error(slot, "copy stream", e))
    }

    /// Allocates `slot`'s tensors on `device`, and queues the copies into them.
    fn start_reload(
        &mut self,
        slot: &str,
        device: &CudaDevice,
    ) -> verl_core::Result<Vec<CubeTensor<CudaRuntime>>> {
        let stream = self.link(slot, device)?;
        let held = self.slots.get(slot);
        let Some(PinnedSlot {
            entries,
            state: SlotState::Held,
            ..
        }) = held
        else {
            return Err(OffloadError::NotOffloaded {
                role: self.role.clone(),
                slot: slot.into(),
            }
            .into());
        };
        let mut tensors = Vec::with_capacity(entries.len());
        let mut ptrs = Vec::with_capacity(entries.len());
        for e in entries {
            let t = Tensor::<CudaBackend, 1>::empty([e.elems], (device, e.dtype))
                .into_primitive()
                .tensor();
            ptrs.push(device_ptr(&t).map_err(|m| self.error(slot, "device pointer", m))?);
            tensors.push(t);
        }
        // The new tensors' memory may have been freed by kernels still queued on burn's stream.
        sync_burn(device).map_err(|m| self.error(slot, "burn's stream", m))?;
        let slot_ref = self.slots.get(slot).expect("checked above");
        for (e, ptr) in slot_ref.entries.iter().zip(ptrs) {
            let Some(buffer) = slot_ref.buffer.as_ref().filter(|_| e.bytes > 0) else {
                continue;
            };
            // SAFETY: the source lies inside the slot's pinned buffer (offsets were laid out
            // within its length); the destination is a live allocation of `e.bytes` bytes held
            // in `tensors` until our stream is waited for.
            let src = unsafe { std::slice::from_raw_parts(buffer.ptr.add(e.offset), e.bytes) };
            // SAFETY: as above.
            if let Err(err) = unsafe { result::memcpy_htod_async(ptr, src, stream.cu_stream()) } {
                // Copies queued before this one still write into `tensors`.
                let _ = stream.synchronize();
                return Err(self.error(slot, "host-to-device copy", err));
            }
        }
        Ok(tensors)
    }
}

/// A contiguous tensor's device address (its memory stays valid while the tensor is held).
fn device_ptr(t: &CubeTensor<CudaRuntime>) -> Result<sys::CUdeviceptr, String> {
    let resource = t
        .client
        .get_resource(t.handle.clone())
        .map_err(|e| format!("{e:?}"))?;
    Ok(resource.resource().ptr)
}

fn sync_burn(device: &CudaDevice) -> Result<(), String> {
    <CudaBackend as burn::tensor::backend::Backend>::sync(device).map_err(|e| format!("{e:?}"))
}

fn report(entries: &[Entry], start: Instant) -> TransferReport {
    TransferReport {
        tensors: entries.len(),
        bytes: entries.iter().map(|e| e.bytes as u64).sum(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

impl HostOffload<CudaBackend> for PinnedOffload {
    fn offload(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<CudaBackend, 1>>,
    ) -> verl_core::Result<TransferReport> {
        if self
            .slots
            .get(slot)
            .is_some_and(|s| !matches!(s.state, SlotState::OnDevice))
        {
            return Err(OffloadError::AlreadyOffloaded {
                role: self.role.clone(),
                slot: slot.into(),
            }
            .into());
        }
        let start = Instant::now();
        let tensors: Vec<CubeTensor<CudaRuntime>> = tensors
            .into_iter()
            .map(|t| burn_cubecl::kernel::into_contiguous(t.into_primitive().tensor()))
            .collect();
        let Some(device) = tensors.first().map(|t| t.device.clone()) else {
            // Nothing to move: an empty slot, kept so that it comes back (empty) in order.
            let buffer = self.slots.remove(slot).and_then(|s| s.buffer);
            let state = SlotState::Held;
            let entries = Vec::new();
            self.slots.insert(
                slot.into(),
                PinnedSlot {
                    buffer,
                    entries,
                    state,
                    kept: false,
                },
            );
            return Ok(TransferReport::default());
        };
        let stream = self.link(slot, &device)?;
        let mut entries = Vec::with_capacity(tensors.len());
        let mut offset = 0;
        for t in &tensors {
            let elems = t.meta.shape().num_elements();
            let bytes = elems * t.dtype.size();
            entries.push(Entry {
                offset,
                bytes,
                elems,
                dtype: t.dtype,
            });
            offset = (offset + bytes).next_multiple_of(ALIGN);
        }
        let needed = offset;
        // The slot's buffer, allocated once (again only if the slot grew).
        let buffer = match self.slots.remove(slot).and_then(|s| s.buffer) {
            Some(b) if b.len >= needed => b,
            _ => {
                let ctx = &self.link.as_ref().expect("set by link").1;
                PinnedBuffer::new(ctx, needed)
                    .map_err(|e| self.error(slot, "pinned allocation", e))?
            }
        };
        let ptrs = tensors
            .iter()
            .map(device_ptr)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|m| self.error(slot, "device pointer", m))?;
        // The tensors' last writes must be done before our stream reads them.
        sync_burn(&device).map_err(|m| self.error(slot, "burn's stream", m))?;
        for (e, ptr) in entries.iter().zip(ptrs) {
            if e.bytes == 0 {
                continue;
            }
            // SAFETY: the destination lies inside the buffer (laid out above within `needed`,
            // which the buffer holds); the source is a live allocation held in `tensors`.
            let dst = unsafe { std::slice::from_raw_parts_mut(buffer.ptr.add(e.offset), e.bytes) };
            // SAFETY: as above.
            if let Err(err) = unsafe { result::memcpy_dtoh_async(dst, ptr, stream.cu_stream()) } {
                // Copies queued before this one still write into `buffer`.
                let _ = stream.synchronize();
                return Err(self.error(slot, "device-to-host copy", err));
            }
        }
        self.wait(slot, &stream)?;
        drop(tensors);
        let out = report(&entries, start);
        self.slots.insert(
            slot.into(),
            PinnedSlot {
                buffer: Some(buffer),
                entries,
                state: SlotState::Held,
                kept: true,
            },
        );
        Ok(out)
    }

    fn prefetch(&mut self, slot: &str, device: &CudaDevice) -> verl_core::Result<bool> {
        let Some(s) = self.slots.get(slot) else {
            return Ok(false);
        };
        if !matches!(s.state, SlotState::Held) {
            return Ok(false);
        }
        let bytes: u64 = s.entries.iter().map(|e| e.bytes as u64).sum();
        self.link(slot, device)?;
        let free = result::mem_get_info()
            .map(|(free, _)| free as u64)
            .map_err(|e| self.error(slot, "device memory", e))?;
        // burn's pool may hold free pages this figure does not see; erring low only skips the
        // overlap, never the reload.
        if free < bytes + self.headroom {
            return Ok(false);
        }
        let tensors = self.start_reload(slot, device)?;
        self.slots.get_mut(slot).expect("started above").state = SlotState::Coming(tensors);
        Ok(true)
    }

    fn reload(
        &mut self,
        slot: &str,
        device: &CudaDevice,
    ) -> verl_core::Result<(Vec<Tensor<CudaBackend, 1>>, TransferReport)> {
        let start = Instant::now();
        let stream = self.link(slot, device)?;
        let coming = match self.slots.get_mut(slot).map(|s| &mut s.state) {
            Some(state @ SlotState::Coming(_)) => match std::mem::replace(state, SlotState::Held) {
                SlotState::Coming(t) => Some(t),
                _ => unreachable!("matched above"),
            },
            _ => None,
        };
        let tensors = match coming {
            Some(t) => t,
            None => self.start_reload(slot, device)?,
        };
        // Until the copies are done the slot stays in host memory (the buffer is intact), so
        // a failed wait leaves it reloadable.
        if let Err(e) = self.wait(slot, &stream) {
            let _ = stream.synchronize();
            drop(tensors);
            return Err(e);
        }
        let s = self.slots.get_mut(slot).expect("reloaded above");
        s.state = SlotState::OnDevice;
        let out = report(&s.entries, start);
        let tensors = tensors
            .into_iter()
            .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
            .collect();
        Ok((tensors, out))
    }

    /// Drops tensors that were only read since they came back: the slot's buffer still holds
    /// their values (checked: same tensors, sizes and types as the buffer's layout); otherwise
    /// a copy as `offload`.
    fn offload_unchanged(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<CudaBackend, 1>>,
    ) -> verl_core::Result<TransferReport> {
        let start = Instant::now();
        let fits = |s: &PinnedSlot| {
            s.kept
                && matches!(s.state, SlotState::OnDevice)
                && s.entries.len() == tensors.len()
                && s.entries
                    .iter()
                    .zip(&tensors)
                    .all(|(e, t)| e.elems == t.shape().num_elements() && e.dtype == t.dtype())
        };
        match self.slots.get_mut(slot) {
            Some(s) if fits(s) => {
                drop(tensors);
                s.state = SlotState::Held;
                Ok(TransferReport {
                    tensors: s.entries.len(),
                    bytes: 0,
                    seconds: start.elapsed().as_secs_f64(),
                })
            }
            _ => self.offload(slot, tensors),
        }
    }

    fn discard(&mut self, slot: &str) {
        if let Some(s) = self.slots.get_mut(slot) {
            s.kept = false;
            if let SlotState::Coming(_) = s.state {
                // The copies into the dropped tensors must finish before their memory is reused.
                if let Some((_, _, stream)) = &self.link {
                    let _ = stream.synchronize();
                }
            }
            s.state = SlotState::OnDevice;
        }
    }

    fn is_offloaded(&self, slot: &str) -> bool {
        self.slots
            .get(slot)
            .is_some_and(|s| !matches!(s.state, SlotState::OnDevice))
    }

    fn host_bytes(&self) -> u64 {
        self.slots
            .values()
            .filter_map(|s| s.buffer.as_ref())
            .map(|b| b.len as u64)
            .sum()
    }
}

impl Drop for PinnedOffload {
    fn drop(&mut self) {
        // No copy may still read or write a buffer that is about to be freed.
        if let Some((_, ctx, stream)) = &self.link {
            let _ = ctx.bind_to_thread();
            let _ = stream.synchronize();
        }
    }
}

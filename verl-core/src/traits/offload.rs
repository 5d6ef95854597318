use burn::prelude::*;
use serde::{Deserialize, Serialize};

use crate::config::MegatronConfig;
use crate::Result;

/// Which of a role's state waits in host memory while the role is idle (verl's
/// `*.megatron.param_offload`, `grad_offload`, `optimizer_offload`).
///
/// ```
/// use verl_core::config::MegatronConfig;
/// use verl_core::traits::OffloadSwitches;
/// let m = MegatronConfig { param_offload: true, ..Default::default() };
/// let s = OffloadSwitches::of(&m);
/// assert!(s.param && !s.optimizer && s.any());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadSwitches {
    /// Parameters leave the device after each phase that uses them.
    pub param: bool,
    /// Gradients leave the device after each update.
    pub grad: bool,
    /// The optimizer state (AdamW moments) is on the device only for the optimizer step.
    pub optimizer: bool,
}

impl OffloadSwitches {
    /// The switches of a role's `megatron` section.
    pub fn of(m: &MegatronConfig) -> Self {
        Self {
            param: m.param_offload,
            grad: m.grad_offload,
            optimizer: m.optimizer_offload,
        }
    }

    pub fn any(&self) -> bool {
        self.param || self.grad || self.optimizer
    }
}

/// What one move between the device and host memory did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferReport {
    pub tensors: usize,
    pub bytes: u64,
    pub seconds: f64,
}

/// Both moves' tensors, bytes and seconds added.
impl std::ops::Add for TransferReport {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            tensors: self.tensors + other.tensors,
            bytes: self.bytes + other.bytes,
            seconds: self.seconds + other.seconds,
        }
    }
}

/// Keeps groups of tensors ("slots": a model's parameters, an optimizer's moments) in host
/// memory while their role does not need them, and brings them back. Implemented by
/// `verl-offload`'s `OffloadManager` (any backend) and `PinnedOffload` (burn-cuda: persistent
/// pinned buffers, asynchronous copies); `verl_offload::OffloadBackend::host_store` picks the
/// one for a backend. The Megatron workers call it at verl's points (see the `verl-offload`
/// crate documentation).
///
/// A slot's tensors are flat (a parameter is reshaped to one dimension and back by the caller,
/// which knows its shape); they come back in the order they went out.
pub trait HostOffload<B: Backend> {
    /// Copies `tensors` to host memory as `slot` and drops the caller's handles, so their device
    /// memory is freed (once nothing else holds it). An offloaded slot must be reloaded before
    /// it is offloaded again.
    fn offload(&mut self, slot: &str, tensors: Vec<Tensor<B, 1>>) -> Result<TransferReport>;

    /// Puts `slot`'s tensors back on `device`, in the order they were offloaded; the slot is
    /// then no longer in host memory.
    fn reload(
        &mut self,
        slot: &str,
        device: &B::Device,
    ) -> Result<(Vec<Tensor<B, 1>>, TransferReport)>;

    /// Like [`offload`](Self::offload), for tensors that hold exactly the values the last
    /// [`reload`](Self::reload) of `slot` returned (the phase only read them). A store that kept
    /// that copy drops the tensors without copying (the report then counts no bytes); the
    /// others copy as `offload` does.
    fn offload_unchanged(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<B, 1>>,
    ) -> Result<TransferReport> {
        self.offload(slot, tensors)
    }

    /// Starts bringing `slot` back to `device` without waiting for it, so the copy overlaps
    /// the compute the caller queues next; the [`reload`](Self::reload) that follows finishes
    /// it. A store that cannot copy asynchronously, or that sees no room on the device for the
    /// slot, starts nothing and says `false` (the reload then does all the work). The slot
    /// counts as on the device from here on for memory purposes.
    fn prefetch(&mut self, _slot: &str, _device: &B::Device) -> Result<bool> {
        Ok(false)
    }

    /// Drops `slot`'s host copy without bringing it back (its tensors were replaced).
    fn discard(&mut self, slot: &str);

    /// Whether `slot` is in host memory now.
    fn is_offloaded(&self, slot: &str) -> bool;

    /// Bytes of host memory the store holds now (a store with persistent pinned buffers keeps
    /// them while its slots are on the device, and counts them).
    fn host_bytes(&self) -> u64;
}

//! verl-offload: a role's parameters, gradients and optimizer state in host memory while the
//! role is idle (verl's `*.megatron.param_offload`, `grad_offload`, `optimizer_offload`).
//!
//! Two stores implement `verl_core::traits::HostOffload`: [`OffloadManager`] for any backend,
//! and on burn-cuda (feature `cuda`) [`PinnedOffload`], with one persistent pinned buffer per
//! slot and asynchronous copies. [`OffloadBackend::host_store`] gives a backend its best one.
//! The Megatron workers of `verl-megatron` call them at verl's points:
//!
//! | role | on the device only inside |
//! |---|---|
//! | actor parameters | `generate_sequences` (streamed into the rollout, then offloaded before generation; back for the log-prob recompute), `compute_log_prob`, `update_actor` |
//! | actor optimizer state | `update_actor` (prefetched at its start, waited for at the first optimizer step) |
//! | reference parameters | `compute_ref_log_prob` |
//! | critic parameters | `compute_values`, `update_critic` |
//! | critic optimizer state | `update_critic` (as the actor's) |
//! | rollout KV cache | generation (freed after, rebuilt before the next: sleep / wake-up) |
//!
//! Gradients in verl-rs exist only between a mini-batch's first backward pass and its
//! optimizer step (there is no persistent gradient buffer as in Megatron's DDP), so outside an
//! update they take no device memory with or without `grad_offload`.

mod manager;
#[cfg(feature = "cuda")]
mod pinned;

pub use manager::OffloadManager;
#[cfg(feature = "cuda")]
pub use pinned::PinnedOffload;

use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use verl_core::traits::{HostOffload, TransferReport};

/// What can go wrong moving a slot.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    #[error("{role}: slot `{slot}` is already in host memory (reload it before offloading again)")]
    AlreadyOffloaded { role: String, slot: String },
    #[error("{role}: slot `{slot}` is not in host memory (nothing to reload)")]
    NotOffloaded { role: String, slot: String },
    #[error("{role}: reading slot `{slot}` from the device failed: {message}")]
    Read {
        role: String,
        slot: String,
        message: String,
    },
    #[error("{role}: slot `{slot}` changed on the device although it was put away as unchanged (a phase that writes its state must offload it with `offload`)")]
    Changed { role: String, slot: String },
    #[error(
        "{role}: copying slot `{slot}` between the device and pinned host memory failed: {message}"
    )]
    Copy {
        role: String,
        slot: String,
        message: String,
    },
}

impl From<OffloadError> for verl_core::Error {
    fn from(e: OffloadError) -> Self {
        verl_core::Error::backend("offload", e)
    }
}

/// A backend's host store: the fastest way it has to keep a role's state in host memory.
///
/// ```
/// use verl_core::backend::CpuAutodiff;
/// use verl_offload::OffloadBackend;
/// let store = CpuAutodiff::host_store("actor");
/// assert_eq!(store.host_bytes(), 0);
/// ```
pub trait OffloadBackend: Backend {
    fn host_store(role: &str) -> Box<dyn HostOffload<Self>>;
}

impl OffloadBackend for verl_core::backend::CpuBackend {
    fn host_store(role: &str) -> Box<dyn HostOffload<Self>> {
        Box::new(OffloadManager::new(role))
    }
}

#[cfg(feature = "cuda")]
impl OffloadBackend for verl_core::backend::CudaBackend {
    fn host_store(role: &str) -> Box<dyn HostOffload<Self>> {
        Box::new(PinnedOffload::new(role))
    }
}

impl<B: OffloadBackend, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    OffloadBackend for burn::backend::Autodiff<B, C>
{
    fn host_store(role: &str) -> Box<dyn HostOffload<Self>> {
        Box::new(InnerOffload::<Self>(B::host_store(role)))
    }
}

/// An autodiff backend's store: the inner backend's, on the tensors' values (what goes out
/// carries no graph; the caller marks parameters as trained again when they come back).
pub struct InnerOffload<B: AutodiffBackend>(pub Box<dyn HostOffload<B::InnerBackend>>);

impl<B: AutodiffBackend> HostOffload<B> for InnerOffload<B> {
    fn offload(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<B, 1>>,
    ) -> verl_core::Result<TransferReport> {
        self.0
            .offload(slot, tensors.into_iter().map(|t| t.inner()).collect())
    }

    fn reload(
        &mut self,
        slot: &str,
        device: &B::Device,
    ) -> verl_core::Result<(Vec<Tensor<B, 1>>, TransferReport)> {
        let (tensors, report) = self.0.reload(slot, device)?;
        Ok((
            tensors.into_iter().map(Tensor::from_inner).collect(),
            report,
        ))
    }

    fn offload_unchanged(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<B, 1>>,
    ) -> verl_core::Result<TransferReport> {
        self.0
            .offload_unchanged(slot, tensors.into_iter().map(|t| t.inner()).collect())
    }

    fn prefetch(&mut self, slot: &str, device: &B::Device) -> verl_core::Result<bool> {
        self.0.prefetch(slot, device)
    }

    fn discard(&mut self, slot: &str) {
        self.0.discard(slot)
    }

    fn is_offloaded(&self, slot: &str) -> bool {
        self.0.is_offloaded(slot)
    }

    fn host_bytes(&self) -> u64 {
        self.0.host_bytes()
    }
}

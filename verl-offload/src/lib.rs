//! verl-offload: a role's parameters, gradients and optimizer state in host memory while the
//! role is idle (verl's `*.megatron.param_offload`, `grad_offload`, `optimizer_offload`).
//!
//! [`OffloadManager`] implements `verl_core::traits::HostOffload`; the Megatron workers of
//! `verl-megatron` call it at verl's points:
//!
//! | role | on the device only inside |
//! |---|---|
//! | actor parameters | `generate_sequences` (streamed into the rollout, then offloaded before generation; back for the log-prob recompute), `compute_log_prob`, `update_actor` |
//! | actor optimizer state | `update_actor` |
//! | reference parameters | `compute_ref_log_prob` |
//! | critic parameters | `compute_values`, `update_critic` |
//! | critic optimizer state | `update_critic` |
//! | rollout KV cache | generation (freed after, rebuilt before the next: sleep / wake-up) |
//!
//! Gradients in verl-rs exist only between a mini-batch's first backward pass and its
//! optimizer step (there is no persistent gradient buffer as in Megatron's DDP), so outside an
//! update they take no device memory with or without `grad_offload`.
//!
//! A slot goes out in one transfer (burn's `Transaction`: one device-to-host read for all its
//! tensors). On burn-cuda that read lands in cubecl's pinned host pool, which allocates pinned
//! pages once and hands the same pages back round after round; a reload copies from those
//! pinned pages straight to the device without a host wait and returns them to the pool.
//! On the CPU backend the host copy is the tensor's data moved out of the tensor.
//!
//! ```
//! use burn::prelude::*;
//! use verl_core::backend::CpuBackend as Cpu;
//! use verl_core::traits::HostOffload;
//! use verl_offload::OffloadManager;
//!
//! let device = Default::default();
//! let mut host = OffloadManager::<Cpu>::new("actor");
//! let w = Tensor::<Cpu, 1>::from_floats([1.0, 2.0, 3.0], &device);
//! host.offload("params", vec![w]).unwrap();
//! assert_eq!(host.host_bytes(), 12);
//! let (back, _) = host.reload("params", &device).unwrap();
//! assert_eq!(back[0].to_data().to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
//! assert_eq!(host.host_bytes(), 0);
//! ```

use std::collections::HashMap;
use std::marker::PhantomData;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{TensorData, Transaction};
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
}

impl From<OffloadError> for verl_core::Error {
    fn from(e: OffloadError) -> Self {
        verl_core::Error::backend("offload", e)
    }
}

/// One slot's tensors in host memory.
struct HostSlot {
    data: Vec<TensorData>,
    bytes: u64,
}

/// A role's host-memory store: see the crate documentation.
pub struct OffloadManager<B: Backend> {
    role: String,
    slots: HashMap<String, HostSlot>,
    /// The most bytes held at once (the host memory offload costs).
    peak_bytes: u64,
    backend: PhantomData<fn(B)>,
}

impl<B: Backend> OffloadManager<B> {
    /// An empty store for `role` (named in errors).
    pub fn new(role: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            slots: HashMap::new(),
            peak_bytes: 0,
            backend: PhantomData,
        }
    }

    /// The most bytes this store has held at once.
    pub fn peak_host_bytes(&self) -> u64 {
        self.peak_bytes
    }
}

impl<B: Backend> HostOffload<B> for OffloadManager<B> {
    fn offload(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<B, 1>>,
    ) -> verl_core::Result<TransferReport> {
        if self.slots.contains_key(slot) {
            return Err(OffloadError::AlreadyOffloaded {
                role: self.role.clone(),
                slot: slot.into(),
            }
            .into());
        }
        let start = Instant::now();
        let count = tensors.len();
        // One read for the whole slot; the device handles are dropped with the transaction.
        let transaction = tensors
            .into_iter()
            .fold(Transaction::default(), |t, x| t.register(x));
        let data = transaction.try_execute().map_err(|e| OffloadError::Read {
            role: self.role.clone(),
            slot: slot.into(),
            message: format!("{e:?}"),
        })?;
        let bytes = data.iter().map(|d| d.bytes.len() as u64).sum();
        self.slots.insert(slot.into(), HostSlot { data, bytes });
        self.peak_bytes = self.peak_bytes.max(self.host_bytes());
        Ok(TransferReport {
            tensors: count,
            bytes,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    fn reload(
        &mut self,
        slot: &str,
        device: &B::Device,
    ) -> verl_core::Result<(Vec<Tensor<B, 1>>, TransferReport)> {
        let held = self
            .slots
            .remove(slot)
            .ok_or_else(|| OffloadError::NotOffloaded {
                role: self.role.clone(),
                slot: slot.into(),
            })?;
        let start = Instant::now();
        let count = held.data.len();
        // The host data moves into the copy (no second host buffer).
        let tensors = held
            .data
            .into_iter()
            .map(|d| Tensor::<B, 1>::from_data(d, device))
            .collect();
        let report = TransferReport {
            tensors: count,
            bytes: held.bytes,
            seconds: start.elapsed().as_secs_f64(),
        };
        Ok((tensors, report))
    }

    fn discard(&mut self, slot: &str) {
        self.slots.remove(slot);
    }

    fn is_offloaded(&self, slot: &str) -> bool {
        self.slots.contains_key(slot)
    }

    fn host_bytes(&self) -> u64 {
        self.slots.values().map(|s| s.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use verl_core::backend::CpuBackend as Cpu;

    fn tensor(values: &[f32]) -> Tensor<Cpu, 1> {
        Tensor::from_floats(values, &Default::default())
    }

    proptest! {
        /// Any tensors come back bit for bit, in order, and the store is empty after.
        #[test]
        fn a_round_trip_is_exact(parts in prop::collection::vec(
            prop::collection::vec(prop::num::f32::ANY, 1..40), 1..6)) {
            let mut host = OffloadManager::<Cpu>::new("test");
            let out = host.offload("s", parts.iter().map(|p| tensor(p)).collect()).unwrap();
            let bytes: usize = parts.iter().map(|p| p.len() * 4).sum();
            prop_assert_eq!(out.bytes, bytes as u64);
            prop_assert_eq!(out.tensors, parts.len());
            prop_assert_eq!(host.host_bytes(), bytes as u64);
            prop_assert!(host.is_offloaded("s"));
            let (back, report) = host.reload("s", &Default::default()).unwrap();
            prop_assert_eq!(report.bytes, bytes as u64);
            prop_assert_eq!(host.host_bytes(), 0);
            prop_assert!(!host.is_offloaded("s"));
            for (t, p) in back.into_iter().zip(&parts) {
                let got: Vec<u32> = t.into_data().to_vec::<f32>().unwrap()
                    .iter().map(|v| v.to_bits()).collect();
                let want: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn slots_are_kept_apart_and_misuse_is_named() {
        let mut host = OffloadManager::<Cpu>::new("critic");
        host.offload("params", vec![tensor(&[1.0, 2.0])]).unwrap();
        host.offload("optimizer", vec![tensor(&[3.0]), tensor(&[4.0])])
            .unwrap();
        assert_eq!(host.host_bytes(), 16);
        assert_eq!(host.peak_host_bytes(), 16);
        let again = host.offload("params", vec![tensor(&[0.0])]).unwrap_err();
        assert!(again
            .to_string()
            .contains("critic: slot `params` is already in host memory"));
        let (opt, _) = host.reload("optimizer", &Default::default()).unwrap();
        assert_eq!(opt.len(), 2);
        assert_eq!(opt[1].clone().into_scalar(), 4.0);
        assert_eq!(host.host_bytes(), 8);
        let missing = host.reload("optimizer", &Default::default()).unwrap_err();
        assert!(missing
            .to_string()
            .contains("slot `optimizer` is not in host memory"));
        // The peak stays what it was.
        assert_eq!(host.peak_host_bytes(), 16);
    }
}

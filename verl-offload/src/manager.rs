//! The portable host store: any backend, the host copy kept as burn `TensorData`.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{TensorData, Transaction};
use verl_core::traits::{HostOffload, TransferReport};

use crate::OffloadError;

/// One slot's tensors in host memory.
struct HostSlot {
    data: Vec<TensorData>,
    bytes: u64,
}

/// A role's host-memory store for any backend: a slot goes out in one burn `Transaction` (one
/// device-to-host read for all its tensors) and comes back by `from_data`. On the CPU backend
/// the host copy is the tensors' data moved out of them. On burn-cuda each round trip goes
/// through cubecl's staging memory; [`crate::PinnedOffload`] is the fast path there.
///
/// ```
/// use burn::prelude::*;
/// use verl_core::backend::CpuBackend as Cpu;
/// use verl_core::traits::HostOffload;
/// use verl_offload::OffloadManager;
///
/// let device = Default::default();
/// let mut host = OffloadManager::<Cpu>::new("actor");
/// let w = Tensor::<Cpu, 1>::from_floats([1.0, 2.0, 3.0], &device);
/// host.offload("params", vec![w]).unwrap();
/// assert_eq!(host.host_bytes(), 12);
/// let (back, _) = host.reload("params", &device).unwrap();
/// assert_eq!(back[0].to_data().to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
/// assert_eq!(host.host_bytes(), 0);
/// ```
pub struct OffloadManager<B: Backend> {
    role: String,
    slots: HashMap<String, HostSlot>,
    /// Debug builds: each slot's data as its last reload returned it, to check the callers of
    /// `offload_unchanged` (a claim that the tensors did not change is compared bit for bit).
    reloaded: HashMap<String, Vec<TensorData>>,
    /// Slots a prefetch has put back on the device, waiting for their reload.
    arrived: HashMap<String, (Vec<Tensor<B, 1>>, TransferReport)>,
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
            arrived: HashMap::new(),
            reloaded: HashMap::new(),
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
        if self.is_offloaded(slot) {
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
        if let Some(arrived) = self.arrived.remove(slot) {
            return Ok(arrived);
        }
        let held = self
            .slots
            .remove(slot)
            .ok_or_else(|| OffloadError::NotOffloaded {
                role: self.role.clone(),
                slot: slot.into(),
            })?;
        let start = Instant::now();
        let count = held.data.len();
        if cfg!(debug_assertions) {
            self.reloaded.insert(slot.into(), held.data.clone());
        }
        // The host data moves into the copy (no second host buffer).
        let tensors = held
            .data
            .into_iter()
            // In its own dtype (a bf16 reference stays bf16; `from_data` alone converts to
            // the device's default float).
            .map(|d| {
                let dtype = d.dtype;
                Tensor::<B, 1>::from_data(d, (device, dtype))
            })
            .collect();
        let report = TransferReport {
            tensors: count,
            bytes: held.bytes,
            seconds: start.elapsed().as_secs_f64(),
        };
        Ok((tensors, report))
    }

    /// Brings the slot back now (`from_data` queues the copies on the device's stream, so on
    /// a GPU they overlap what the caller queues next); the reload hands the tensors over.
    fn prefetch(&mut self, slot: &str, device: &B::Device) -> verl_core::Result<bool> {
        if !self.slots.contains_key(slot) {
            return Ok(false);
        }
        let back = self.reload(slot, device)?;
        self.arrived.insert(slot.into(), back);
        Ok(true)
    }

    /// Copies as `offload` does (this store keeps no copy on the device's side); debug builds
    /// check the claim against what the last reload returned.
    fn offload_unchanged(
        &mut self,
        slot: &str,
        tensors: Vec<Tensor<B, 1>>,
    ) -> verl_core::Result<TransferReport> {
        let before = self.reloaded.remove(slot);
        let report = self.offload(slot, tensors)?;
        if let (Some(before), Some(now)) = (before, self.slots.get(slot)) {
            let same = before.len() == now.data.len()
                && before
                    .iter()
                    .zip(&now.data)
                    .all(|(a, b)| a.bytes[..] == b.bytes[..]);
            if !same {
                return Err(OffloadError::Changed {
                    role: self.role.clone(),
                    slot: slot.into(),
                }
                .into());
            }
        }
        Ok(report)
    }

    fn discard(&mut self, slot: &str) {
        self.slots.remove(slot);
        self.arrived.remove(slot);
        self.reloaded.remove(slot);
    }

    fn is_offloaded(&self, slot: &str) -> bool {
        self.slots.contains_key(slot) || self.arrived.contains_key(slot)
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
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

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

    /// A bf16 tensor (the bf16 reference's matrices) comes back bf16, bit for bit.
    #[test]
    fn a_tensor_comes_back_in_its_own_dtype() {
        let mut host = OffloadManager::<Cpu>::new("reference");
        let device = Default::default();
        let low = tensor(&[1.5, -2.25, 3.0]).cast(burn::tensor::FloatDType::BF16);
        let want = low.clone().into_data();
        host.offload("params", vec![low]).unwrap();
        let (back, report) = host.reload("params", &device).unwrap();
        assert_eq!(report.bytes, 6);
        assert_eq!(back[0].dtype(), burn::tensor::DType::BF16);
        assert_eq!(back[0].clone().into_data(), want);
    }

    #[test]
    fn a_prefetched_slot_comes_back_through_its_reload() {
        let mut host = OffloadManager::<Cpu>::new("actor");
        let device = Default::default();
        host.offload("optimizer", vec![tensor(&[1.5, -2.0])])
            .unwrap();
        assert!(host.prefetch("optimizer", &device).unwrap());
        // Still waiting for its reload: not offloaded again, not prefetched twice.
        assert!(host.is_offloaded("optimizer"));
        assert_eq!(host.host_bytes(), 0);
        assert!(host.offload("optimizer", vec![tensor(&[0.0])]).is_err());
        let (back, report) = host.reload("optimizer", &device).unwrap();
        assert_eq!(report.bytes, 8);
        assert_eq!(back[0].to_data().to_vec::<f32>().unwrap(), vec![1.5, -2.0]);
        assert!(!host.is_offloaded("optimizer"));
        // Nothing held: nothing to prefetch.
        assert!(!host.prefetch("optimizer", &device).unwrap());
    }

    #[test]
    fn a_false_claim_of_unchanged_tensors_is_caught() {
        let mut host = OffloadManager::<Cpu>::new("reference");
        let device = Default::default();
        host.offload("params", vec![tensor(&[1.0, 2.0])]).unwrap();
        let (back, _) = host.reload("params", &device).unwrap();
        // Read only: fine.
        host.offload_unchanged("params", back).unwrap();
        let (back, _) = host.reload("params", &device).unwrap();
        let changed = vec![back[0].clone().add_scalar(1.0)];
        let err = host.offload_unchanged("params", changed).unwrap_err();
        assert!(
            err.to_string().contains("reference: slot `params` changed"),
            "{err}"
        );
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

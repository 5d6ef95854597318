//! A role's state in host memory between its phases, through a `HostOffload` store (the
//! `verl-offload` crate's `OffloadManager`): a model's parameters ([`ParamOffload`]), its
//! optimizers' AdamW moments ([`MomentOffload`]), both for a trained role
//! ([`TrainingOffload`]). Which phase needs what is the workers' business (see
//! `verl-offload`'s table); this module only moves things and counts what it moved.

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::prelude::*;
use verl_core::memory::{gib, MemoryUsage};
use verl_core::traits::{HostOffload, OffloadSwitches, TransferReport};
use verl_core::{Metrics, Result};

use super::adamw::{AdamW, Moments};
use crate::parallel::{sample_memory, ParallelAutodiffBackend, ParallelBackend};

/// What moved in each direction: out to host memory, and back to the device (the reload's
/// copy is queued on the device's stream, so its seconds are the host's part of it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Moved {
    pub out: TransferReport,
    pub back: TransferReport,
}

impl std::ops::Add for Moved {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            out: self.out + other.out,
            back: self.back + other.back,
        }
    }
}

/// The slot a model's parameters go to.
const PARAMS: &str = "params";
/// The slot an optimizer's moments go to.
const OPTIMIZER: &str = "optimizer";

/// A parameter as it was before it left: its shape and whether it is trained.
type ParamLayout = (Vec<usize>, bool);

/// A model's parameters in host memory while its role is idle. The model keeps its structure
/// (each parameter replaced by a one-element placeholder), so it goes back as it was.
pub struct ParamOffload<B: ParallelBackend> {
    host: Box<dyn HostOffload<B>>,
    /// While offloaded: every parameter's layout, in the model's order.
    layouts: Option<Vec<ParamLayout>>,
    device: Option<B::Device>,
    moved: Moved,
}

impl<B: ParallelBackend> ParamOffload<B> {
    pub fn new(host: Box<dyn HostOffload<B>>) -> Self {
        Self {
            host,
            layouts: None,
            device: None,
            moved: Moved::default(),
        }
    }

    pub fn is_offloaded(&self) -> bool {
        self.layouts.is_some()
    }

    /// Moves the parameters of the model in `slot` to host memory (nothing if they are there).
    pub fn offload<M: Module<B>>(&mut self, slot: &mut Option<M>) -> Result<()> {
        self.offload_as(slot, false)
    }

    /// [`Self::offload`] after a phase that only read the parameters since their reload: a
    /// store that kept their host copy drops them without copying.
    pub fn offload_unchanged<M: Module<B>>(&mut self, slot: &mut Option<M>) -> Result<()> {
        self.offload_as(slot, true)
    }

    pub(crate) fn offload_as<M: Module<B>>(
        &mut self,
        slot: &mut Option<M>,
        unchanged: bool,
    ) -> Result<()> {
        if self.layouts.is_some() {
            return Ok(());
        }
        let Some(model) = slot.take() else {
            return Ok(());
        };
        let mut take = TakeParams::<B> {
            tensors: Vec::new(),
            layouts: Vec::new(),
            device: None,
        };
        *slot = Some(model.map(&mut take));
        if take.device.is_some() {
            self.device = take.device;
        }
        let report = if unchanged {
            self.host.offload_unchanged(PARAMS, take.tensors)
        } else {
            self.host.offload(PARAMS, take.tensors)
        };
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                // The model holds placeholders and its parameters are gone with the failed
                // copy: no later phase may run on it.
                *slot = None;
                return Err(e);
            }
        };
        self.moved.out = self.moved.out + report;
        self.layouts = Some(take.layouts);
        Ok(())
    }

    /// Brings the parameters back into the model in `slot` (nothing if they are on the device).
    pub fn reload<M: Module<B>>(&mut self, slot: &mut Option<M>) -> Result<()> {
        let (Some(layouts), Some(device)) = (self.layouts.as_ref(), self.device.as_ref()) else {
            return Ok(());
        };
        let Some(model) = slot.take() else {
            return Ok(());
        };
        let (tensors, report) = match self.host.reload(PARAMS, device) {
            Ok(r) => r,
            Err(e) => {
                *slot = Some(model);
                return Err(e);
            }
        };
        let mut put = PutParams {
            values: tensors.into_iter().zip(layouts.iter().cloned()),
        };
        *slot = Some(model.map(&mut put));
        self.layouts = None;
        self.moved.back = self.moved.back + report;
        sample_memory::<B>(device);
        Ok(())
    }

    /// Forgets the host copy: the model it belonged to was replaced by one whose parameters
    /// are on the device.
    pub fn forget(&mut self) {
        if self.layouts.take().is_some() {
            self.host.discard(PARAMS);
        }
    }

    /// What moved since the last call.
    pub fn take_moved(&mut self) -> Moved {
        std::mem::take(&mut self.moved)
    }

    pub fn host_bytes(&self) -> u64 {
        self.host.host_bytes()
    }
}

/// Takes every float parameter out of a module, leaving one-element placeholders.
struct TakeParams<B: Backend> {
    tensors: Vec<Tensor<B, 1>>,
    layouts: Vec<ParamLayout>,
    device: Option<B::Device>,
}

impl<B: Backend> ModuleMapper<B> for TakeParams<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims();
        let trained = tensor.is_require_grad();
        let device = tensor.device();
        let placeholder = Tensor::<B, D>::zeros([1; D], &device);
        self.device.get_or_insert(device);
        let n = dims.iter().product::<usize>();
        self.tensors
            .push(tensor.set_require_grad(false).reshape([n]));
        self.layouts.push((dims.to_vec(), trained));
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts parameters back in the order [`TakeParams`] took them.
struct PutParams<I: Iterator> {
    values: I,
}

impl<B: Backend, I: Iterator<Item = (Tensor<B, 1>, ParamLayout)>> ModuleMapper<B> for PutParams<I> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, _placeholder, mapper) = param.consume();
        let (flat, (dims, trained)) = self
            .values
            .next()
            .expect("a model gets back the parameters it gave");
        let dims: [usize; D] = dims
            .try_into()
            .expect("a parameter keeps its number of dimensions");
        let tensor = flat.reshape(dims);
        let tensor = if trained {
            tensor.require_grad()
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// A parameter's moments as they wait in host memory: its id, update count and shape.
type MomentKey = (ParamId, usize, Vec<usize>);

/// Optimizers' AdamW moments in host memory outside the optimizer step.
pub struct MomentOffload<I: ParallelBackend> {
    host: Box<dyn HostOffload<I>>,
    /// While offloaded: each optimizer's keys, in the order their tensors went out.
    keys: Option<Vec<Vec<MomentKey>>>,
    device: Option<I::Device>,
    /// A prefetch is under way (its tensors wait in the store for the reload).
    prefetched: bool,
    moved: Moved,
}

impl<I: ParallelBackend> MomentOffload<I> {
    pub fn new(host: Box<dyn HostOffload<I>>) -> Self {
        Self {
            host,
            keys: None,
            device: None,
            prefetched: false,
            moved: Moved::default(),
        }
    }

    pub fn is_offloaded(&self) -> bool {
        self.keys.is_some()
    }

    /// Moves every optimizer's moments to host memory (nothing if they are there).
    pub fn offload(&mut self, optims: &mut [&mut AdamW<I>]) -> Result<()> {
        if self.keys.is_some() {
            if self.prefetched {
                // A phase prefetched the moments but took no optimizer step: the prefetched
                // copies must not stay on the device. They are unchanged, so where the store
                // kept its host copy this frees them without copying.
                self.prefetched = false;
                if let Some(device) = self.device.clone() {
                    let (tensors, _) = self.host.reload(OPTIMIZER, &device)?;
                    self.host.offload_unchanged(OPTIMIZER, tensors)?;
                }
            }
            return Ok(());
        }
        let mut tensors = Vec::new();
        let mut keys = Vec::with_capacity(optims.len());
        for adamw in optims.iter_mut() {
            let mut these = Vec::new();
            for (id, m) in adamw.take_moments() {
                self.device.get_or_insert_with(|| m.exp_avg.device());
                tensors.push(m.exp_avg);
                tensors.push(m.exp_avg_sq);
                these.push((id, m.time, m.shape));
            }
            keys.push(these);
        }
        if !tensors.is_empty() {
            let report = self.host.offload(OPTIMIZER, tensors)?;
            self.moved.out = self.moved.out + report;
        }
        self.keys = Some(keys);
        Ok(())
    }

    /// Starts bringing the moments back without waiting (the store copies them while the
    /// caller computes); [`Self::reload`] finishes. Whether a copy started.
    pub fn prefetch(&mut self) -> Result<bool> {
        match (&self.keys, &self.device) {
            (Some(_), Some(device)) if self.host.is_offloaded(OPTIMIZER) => {
                self.prefetched = self.host.prefetch(OPTIMIZER, device)?;
                Ok(self.prefetched)
            }
            _ => Ok(false),
        }
    }

    /// Brings the moments back into the same optimizers (nothing if they are on the device),
    /// finishing a [`Self::prefetch`].
    pub fn reload(&mut self, optims: &mut [&mut AdamW<I>]) -> Result<()> {
        if self.keys.is_none() {
            return Ok(());
        }
        self.prefetched = false;
        let mut tensors = match (self.host.is_offloaded(OPTIMIZER), self.device.as_ref()) {
            (true, Some(device)) => {
                let (tensors, report) = self.host.reload(OPTIMIZER, device)?;
                self.moved.back = self.moved.back + report;
                sample_memory::<I>(device);
                tensors.into_iter()
            }
            _ => Vec::new().into_iter(),
        };
        let keys = self.keys.take().unwrap_or_default();
        for (adamw, these) in optims.iter_mut().zip(keys) {
            let moments = these
                .into_iter()
                .map(|(id, time, shape)| {
                    let (Some(exp_avg), Some(exp_avg_sq)) = (tensors.next(), tensors.next()) else {
                        unreachable!("the moments come back as they went")
                    };
                    let m = Moments {
                        time,
                        shape,
                        exp_avg,
                        exp_avg_sq,
                    };
                    (id, m)
                })
                .collect();
            adamw.set_moments(moments);
        }
        Ok(())
    }

    /// What moved since the last call.
    pub fn take_moved(&mut self) -> Moved {
        std::mem::take(&mut self.moved)
    }

    pub fn host_bytes(&self) -> u64 {
        self.host.host_bytes()
    }
}

/// A trained role's offload (actor, critic): its parameters and its optimizers' moments, each
/// moved when its switch is on.
pub struct TrainingOffload<B: ParallelAutodiffBackend> {
    pub switches: OffloadSwitches,
    pub params: ParamOffload<B>,
    pub moments: MomentOffload<B::InnerBackend>,
}

impl<B: ParallelAutodiffBackend> TrainingOffload<B> {
    pub fn new(
        switches: OffloadSwitches,
        params: Box<dyn HostOffload<B>>,
        moments: Box<dyn HostOffload<B::InnerBackend>>,
    ) -> Self {
        Self {
            switches,
            params: ParamOffload::new(params),
            moments: MomentOffload::new(moments),
        }
    }

    /// Brings back the parameters, and with `optimizer` the optimizer state, for a phase.
    pub fn bring_in<M: Module<B>>(
        &mut self,
        model: &mut Option<M>,
        optims: &mut [&mut AdamW<B::InnerBackend>],
        optimizer: bool,
    ) -> Result<()> {
        let _span = tracing::info_span!("offload_reload").entered();
        self.params.reload(model)?;
        if optimizer {
            self.moments.reload(optims)?;
        }
        Ok(())
    }

    /// Brings back the parameters for an update and starts the optimizer state's copy, which
    /// overlaps the first mini-batch's forward and backward passes; [`Self::ready_optimizer`]
    /// waits for it before the first optimizer step.
    pub fn bring_in_for_update<M: Module<B>>(&mut self, model: &mut Option<M>) -> Result<()> {
        let _span = tracing::info_span!("offload_reload").entered();
        self.params.reload(model)?;
        self.moments.prefetch()?;
        Ok(())
    }

    /// Makes sure the optimizer state is on the device (nothing when it already is).
    pub fn ready_optimizer(&mut self, optims: &mut [&mut AdamW<B::InnerBackend>]) -> Result<()> {
        self.moments.reload(optims)
    }

    /// Sends away what the switches say once a phase is over.
    pub fn put_away<M: Module<B>>(
        &mut self,
        model: &mut Option<M>,
        optims: &mut [&mut AdamW<B::InnerBackend>],
    ) -> Result<()> {
        self.put_away_as(model, optims, false)
    }

    /// [`Self::put_away`] after a phase that only read the state (a log-prob pass, streaming
    /// the weights into the rollout): unchanged parameters need no copy where the store kept
    /// one.
    pub fn put_away_read_only<M: Module<B>>(
        &mut self,
        model: &mut Option<M>,
        optims: &mut [&mut AdamW<B::InnerBackend>],
    ) -> Result<()> {
        self.put_away_as(model, optims, true)
    }

    fn put_away_as<M: Module<B>>(
        &mut self,
        model: &mut Option<M>,
        optims: &mut [&mut AdamW<B::InnerBackend>],
        unchanged: bool,
    ) -> Result<()> {
        let _span = tracing::info_span!("offload").entered();
        if self.switches.param {
            self.params.offload_as(model, unchanged)?;
        }
        if self.switches.optimizer {
            self.moments.offload(optims)?;
        }
        Ok(())
    }

    /// What moved since the last call, both ways, and the bytes in host memory now.
    pub fn take_moved(&mut self) -> (Moved, u64) {
        let moved = self.params.take_moved() + self.moments.take_moved();
        (moved, self.params.host_bytes() + self.moments.host_bytes())
    }
}

/// Pushes a phase's memory and offload figures: verl's `perf/max_memory_allocated_gb` and
/// `perf/max_memory_reserved_gb` (reduced by their maximum over phases and ranks), on a GPU
/// `perf/max_memory_device_used_gb` (the whole card as the driver counts it), and the same per
/// phase (`…/<phase>`); when something moved, `timing_s/offload/<phase>` (seconds moving
/// state out and in, both ways; `timing_s/offload_out/<phase>` the outward part) and
/// `perf/offload_gb/<phase>` (GiB moved, both ways).
pub fn push_phase_metrics(
    metrics: &mut Metrics,
    phase: &str,
    peak: Option<MemoryUsage>,
    moved: Moved,
) {
    if let Some(peak) = peak {
        for (key, bytes) in [
            ("perf/max_memory_allocated_gb", peak.allocated),
            ("perf/max_memory_reserved_gb", peak.reserved),
            ("perf/max_memory_device_used_gb", peak.device_used),
        ] {
            if key.ends_with("device_used_gb") && bytes == 0 {
                continue; // the backend cannot tell (the CPU default)
            }
            metrics.push(key, gib(bytes));
            metrics.push(format!("{key}/{phase}"), gib(bytes));
        }
    }
    let both = moved.out + moved.back;
    if both.tensors > 0 {
        metrics.push(format!("timing_s/offload/{phase}"), both.seconds);
        metrics.push(format!("timing_s/offload_out/{phase}"), moved.out.seconds);
        metrics.push(format!("perf/offload_gb/{phase}"), gib(both.bytes));
    }
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;
    use verl_core::backend::CpuBackend as Cpu;
    use verl_offload::OffloadManager;

    use super::*;
    use crate::workers::adamw::AdamWHyper;

    fn adamw_with_moments(values: &[f32]) -> AdamW<Cpu> {
        let device = Default::default();
        let mut adamw = AdamW::new(AdamWHyper {
            beta_1: 0.9,
            beta_2: 0.95,
            epsilon: 1e-8,
            weight_decay: 0.0,
        });
        let t = |v: &[f32]| Tensor::<Cpu, 1>::from_floats(v, &device);
        let doubled: Vec<f32> = values.iter().map(|v| v * 2.0).collect();
        let m = Moments {
            time: 3,
            shape: vec![values.len()],
            exp_avg: t(values),
            exp_avg_sq: t(&doubled),
        };
        adamw.set_moments([(ParamId::new(), m)].into_iter().collect());
        adamw
    }

    /// A phase that prefetched the moments but took no optimizer step (no rows, an error)
    /// leaves nothing on the device when it is put away, and the moments still come back
    /// exact.
    #[test]
    fn a_prefetch_without_an_optimizer_step_is_put_away_again() {
        let values = [0.5f32, -1.25, 3.0];
        let mut adamw = adamw_with_moments(&values);
        let mut moments = MomentOffload::<Cpu>::new(Box::new(OffloadManager::new("actor")));
        moments.offload(&mut [&mut adamw]).unwrap();
        assert_eq!(moments.host_bytes(), 24);
        assert_eq!(adamw.moments().count(), 0);
        assert!(moments.prefetch().unwrap());
        assert_eq!(
            moments.host_bytes(),
            0,
            "the prefetched copy is on the device"
        );
        moments.offload(&mut [&mut adamw]).unwrap();
        assert_eq!(moments.host_bytes(), 24, "put away again without a step");
        assert!(moments.is_offloaded());
        moments.reload(&mut [&mut adamw]).unwrap();
        let (_, m) = adamw.moments().next().expect("the moments came back");
        assert_eq!(m.time, 3);
        assert_eq!(m.exp_avg.to_data().to_vec::<f32>().unwrap(), values);
        assert_eq!(
            m.exp_avg_sq.to_data().to_vec::<f32>().unwrap(),
            vec![1.0, -2.5, 6.0]
        );
    }
}

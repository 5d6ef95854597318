//! AdamW with decoupled weight decay (Loshchilov & Hutter), one update per parameter tensor.
//!
//! The update is burn-optim's `AdamW` formula, written once so that the state (the two moments
//! and their update count) is ours. Each parameter goes through the backend's
//! [`FusedOps::adamw_step`]: on burn-cuda one fused kernel (in place, with the gradient-clipping
//! factor folded in), everywhere else the same chain of tensor operations burn's optimizer runs
//! ([`reference::adamw_step`]), so the CPU default's results are unchanged bit for bit (`tests`
//! below checks that against burn's own).
//!
//! ```
//! use burn::module::Param;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::GradientsParams;
//! use burn::prelude::*;
//! use verl_core::backend::CpuAutodiff;
//! use verl_megatron::workers::adamw::{AdamW, AdamWHyper};
//!
//! let device = Default::default();
//! let layer: Linear<CpuAutodiff> = LinearConfig::new(4, 2).init(&device);
//! let x = Tensor::<CpuAutodiff, 2>::ones([3, 4], &device);
//! let grads = GradientsParams::from_grads(layer.forward(x).sum().backward(), &layer);
//! let mut adamw = AdamW::new(AdamWHyper { beta_1: 0.9, beta_2: 0.999, epsilon: 1e-8, weight_decay: 0.01 });
//! let before = layer.weight.val().into_data();
//! let layer = adamw.step(1e-3, 1.0, layer, grads);
//! assert_ne!(layer.weight.val().into_data(), before);
//! assert_eq!(adamw.moments().count(), 2); // weight and bias
//! ```

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::ops::{reference, FusedOps};
pub use crate::ops::{AdamWHyper, AdamWStep};

/// One parameter's AdamW state, flattened in row-major order.
#[derive(Debug, Clone)]
pub struct Moments<B: Backend> {
    /// Updates applied so far (the bias corrections' exponent).
    pub time: usize,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// First moment (torch's `exp_avg`).
    pub exp_avg: Tensor<B, 1>,
    /// Second moment (torch's `exp_avg_sq`).
    pub exp_avg_sq: Tensor<B, 1>,
}

/// AdamW over one model's parameters: see the module documentation.
#[derive(Debug)]
pub struct AdamW<B: Backend> {
    pub hyper: AdamWHyper,
    moments: HashMap<ParamId, Moments<B>>,
    /// Whether parameters go through the backend's [`FusedOps::adamw_step`] (on by default);
    /// off, through the plain chain even where a kernel exists (to compare them).
    fused: bool,
}

impl<B: Backend> AdamW<B> {
    pub fn new(hyper: AdamWHyper) -> Self {
        Self {
            hyper,
            moments: HashMap::new(),
            fused: true,
        }
    }

    /// Uses burn's tensor operations even where the fused kernel applies (to compare them).
    pub fn with_fused(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// See [`Self::with_fused`].
    pub fn set_fused(&mut self, fused: bool) {
        self.fused = fused;
    }

    /// Every parameter's state, by parameter id.
    pub fn moments(&self) -> impl Iterator<Item = (&ParamId, &Moments<B>)> {
        self.moments.iter()
    }

    /// Takes the whole state out (to move it to host memory), leaving none.
    pub fn take_moments(&mut self) -> HashMap<ParamId, Moments<B>> {
        std::mem::take(&mut self.moments)
    }

    /// Keeps the state of the parameters `keep` says yes to.
    pub fn retain_moments(&mut self, keep: impl Fn(&ParamId) -> bool) {
        self.moments.retain(|id, _| keep(id));
    }

    /// Replaces the whole state (a checkpoint's).
    pub fn set_moments(&mut self, moments: HashMap<ParamId, Moments<B>>) {
        self.moments = moments;
    }
}

impl<B: FusedOps> AdamW<B> {
    /// Updates every parameter of `model` that has a gradient in `grads` (the others, and their
    /// state, stay as they are), with the gradients multiplied by `grad_scale` first.
    pub fn step<A, M>(
        &mut self,
        lr: f64,
        grad_scale: f64,
        model: M,
        mut grads: GradientsParams,
    ) -> M
    where
        A: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<A>,
    {
        let mut mapper = StepMapper {
            adamw: self,
            grads: &mut grads,
            lr,
            grad_scale,
        };
        model.map(&mut mapper)
    }

    /// Updates one flat parameter `id` with its flat gradient (its state kept here), returning
    /// the new value.
    pub fn step_tensor(
        &mut self,
        id: ParamId,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        lr: f64,
        grad_scale: f64,
    ) -> Tensor<B, 1> {
        let shape = param.dims().to_vec();
        let state = self.moments.remove(&id);
        let (param, moments) = self.update(param, grad, state, shape, lr, grad_scale);
        self.moments.insert(id, moments);
        param
    }

    /// One parameter's update: the new value and its state.
    fn update(
        &self,
        param: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        state: Option<Moments<B>>,
        shape: Vec<usize>,
        lr: f64,
        grad_scale: f64,
    ) -> (Tensor<B, 1>, Moments<B>) {
        let time = state.as_ref().map_or(0, |s| s.time) + 1;
        let step = AdamWStep::new(&self.hyper, lr, grad_scale, time);
        let moments = state.map(|s| (s.exp_avg, s.exp_avg_sq));
        let (param, exp_avg, exp_avg_sq) = if self.fused {
            B::adamw_step(param, grad, moments, &step)
        } else {
            reference::adamw_step(param, grad, moments, &step)
        };
        let moments = Moments {
            time,
            shape,
            exp_avg,
            exp_avg_sq,
        };
        (param, moments)
    }
}

struct StepMapper<'a, B: Backend> {
    adamw: &'a mut AdamW<B>,
    grads: &'a mut GradientsParams,
    lr: f64,
    grad_scale: f64,
}

impl<A: AutodiffBackend<InnerBackend: FusedOps>> ModuleMapper<A>
    for StepMapper<'_, A::InnerBackend>
{
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<A::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let value = tensor.inner();
        let shape = value.dims();
        let n = shape.iter().product::<usize>();
        let state = self.adamw.moments.remove(&id);
        let (value, moments) = self.adamw.update(
            value.reshape([n]),
            grad.reshape([n]),
            state,
            shape.to_vec(),
            self.lr,
            self.grad_scale,
        );
        self.adamw.moments.insert(id, moments);
        let mut tensor = Tensor::from_inner(value.reshape(shape));
        if require_grad {
            tensor = tensor.require_grad();
        }
        Param::from_mapped_value(id, tensor, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::optim::{AdamWConfig, Optimizer};
    use verl_core::backend::CpuAutodiff;

    type B = CpuAutodiff;

    /// A 7 → 3 linear layer with fixed, initialised weights (a lazily initialised `Param`
    /// draws new values in every clone, so clones of `LinearConfig::init`'s layer differ).
    fn layer() -> Linear<B> {
        let device = Default::default();
        let values = |n: u64, seed: u64| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7907 + seed * 6151) % 997) as f32 / 1994.0) - 0.25)
                .collect()
        };
        Linear {
            weight: Param::from_tensor(
                Tensor::<B, 1>::from_floats(values(21, 1).as_slice(), &device).reshape([7, 3]),
            ),
            bias: Some(Param::from_tensor(Tensor::from_floats(
                values(3, 2).as_slice(),
                &device,
            ))),
        }
    }

    /// Gradients of ‖layer(x)‖² for an input fixed by `seed` (computed, not drawn from the
    /// backend's global generator, which tests running in parallel share). The layer runs on
    /// fresh leaves: burn-autodiff can free a graph only spent parameters hold while another
    /// thread runs a backward (see `crate::parallel::with_fresh_leaves`).
    fn grads_of(layer: &Linear<B>, seed: u64) -> GradientsParams {
        let layer = &crate::parallel::with_fresh_leaves(layer.clone());
        let device = Default::default();
        let values: Vec<f32> = (0..35u64)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x = Tensor::<B, 1>::from_floats(values.as_slice(), &device).reshape([5, 7]);
        let y = layer.forward(x);
        GradientsParams::from_grads((y.clone() * y).sum().backward(), layer)
    }

    /// Three steps of ours and of burn-optim's AdamW from the same weights and gradients give
    /// the same weights to the bit (the CPU default must not change).
    #[test]
    fn equals_burn_optim_bit_for_bit() {
        let hyper = AdamWHyper {
            beta_1: 0.9,
            beta_2: 0.95,
            epsilon: 1e-8,
            weight_decay: 0.1,
        };
        let start = layer();
        let mut ours = AdamW::new(hyper);
        let mut burns = AdamWConfig::new()
            .with_beta_1(hyper.beta_1)
            .with_beta_2(hyper.beta_2)
            .with_epsilon(hyper.epsilon)
            .with_weight_decay(hyper.weight_decay)
            .init::<B, Linear<B>>();
        let (mut a, mut b) = (start.clone(), start);
        for step in 0..3u64 {
            let lr = 1e-2 * (step + 1) as f64;
            a = ours.step(lr, 1.0, a.clone(), grads_of(&a, step));
            b = burns.step(lr, b.clone(), grads_of(&b, step));
        }
        assert_eq!(a.weight.val().into_data(), b.weight.val().into_data());
        let (ab, bb) = (a.bias.unwrap(), b.bias.unwrap());
        assert_eq!(ab.val().into_data(), bb.val().into_data());
        assert!(ours.moments().all(|(_, m)| m.time == 3));
    }

    /// A gradient scale is the same as scaling the gradients beforehand.
    #[test]
    fn grad_scale_equals_scaled_gradients() {
        let hyper = AdamWHyper {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-6,
            weight_decay: 0.0,
        };
        let start = layer();
        let grads = grads_of(&start, 1);
        let w_grad = grads.get::<CpuBackendInner, 2>(start.weight.id).unwrap();
        let mut scaled = GradientsParams::new();
        scaled.register(start.weight.id, w_grad * 0.25);
        let mut only_w = GradientsParams::new();
        only_w.register(
            start.weight.id,
            grads.get::<CpuBackendInner, 2>(start.weight.id).unwrap(),
        );
        let a = AdamW::new(hyper).step(1e-2, 0.25, start.clone(), only_w);
        let b = AdamW::new(hyper).step(1e-2, 1.0, start.clone(), scaled);
        assert_eq!(a.weight.val().into_data(), b.weight.val().into_data());
        // The bias had no gradient: untouched.
        assert_eq!(
            a.bias.unwrap().val().into_data(),
            start.bias.unwrap().val().into_data()
        );
    }

    type CpuBackendInner = <B as AutodiffBackend>::InnerBackend;

    /// The first update on a hand-checked example: with m = (1-β₁)g, v = (1-β₂)g², the bias
    /// corrections make the step lr·g/(|g|+ε) = lr·sign(g) (ε small), after decay.
    #[test]
    fn first_step_is_lr_times_sign() {
        let device = Default::default();
        let hyper = AdamWHyper {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-12,
            weight_decay: 0.5,
        };
        let adamw = AdamW::<CpuBackendInner>::new(hyper);
        let p = Tensor::<CpuBackendInner, 1>::from_floats([1.0, -2.0, 0.5], &device);
        let g = Tensor::<CpuBackendInner, 1>::from_floats([3.0, -0.25, 0.0], &device);
        let (p, m) = adamw.update(p, g, None, vec![3], 0.1, 1.0);
        let p: Vec<f32> = p.into_data().to_vec().unwrap();
        // decay 1 - 0.1·0.5 = 0.95; step 0.1·sign(g) (0 for g = 0).
        let want = [0.95 - 0.1, -1.9 + 0.1, 0.475];
        for (got, want) in p.iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        assert_eq!(m.time, 1);
        let m1: Vec<f32> = m.exp_avg.into_data().to_vec().unwrap();
        assert!((m1[0] - 0.3).abs() < 1e-6 && (m1[1] + 0.025).abs() < 1e-6);
    }
}

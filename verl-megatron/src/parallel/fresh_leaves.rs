//! [`with_fresh_leaves`]: a model's parameters as new autodiff leaves, so that ranks running as
//! threads of one process can train without losing gradients to burn's autodiff.
//!
//! Why: burn 0.21's autodiff keeps one process-wide registry of graphs, and every `backward()`
//! ends by sweeping the graphs of *all* threads, freeing the steps of any graph none of whose
//! nodes is held by a live tensor (tracel-ai/burn#5573). A parameter that has already been
//! through a backward (the second micro-batch of a step, say) is no longer in that registry, so
//! its next use opens a new graph whose first steps (a weight's transpose, an embedding lookup)
//! no live tensor holds. Whenever an operation has consumed that graph's only live tensor (a
//! `cat` copying the logits into their vocabulary padding does), another thread's sweep can free
//! those first steps, and the backward then gives the weight no gradient, or part of one. A
//! fresh leaf is registered in the graph it feeds and held by its `Param`, which keeps the graph
//! alive: re-leafing the parameters before each micro-batch closes the window.

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// Replaces every trainable parameter of `module` by a new leaf over the same values (no copy)
/// with the same [`burn::module::ParamId`]; frozen parameters stay as they are. Gradients of a
/// forward run with the returned module are read with that module
/// (`GradientsParams::from_grads(grads, &fresh)`); they are keyed by the unchanged ids.
///
/// ```
/// use burn::module::{Module, Param};
/// use burn::optim::GradientsParams;
/// use burn::prelude::*;
/// use verl_megatron::parallel::with_fresh_leaves;
/// type B = verl_core::backend::CpuAutodiff;
///
/// #[derive(Module, Debug)]
/// struct Scale<B: Backend> {
///     w: Param<Tensor<B, 1>>,
/// }
///
/// let device = Default::default();
/// let model = Scale::<B> { w: Param::from_tensor(Tensor::from_floats([2.0, 3.0], &device)) };
/// let x = Tensor::<B, 1>::from_floats([1.0, 10.0], &device);
/// let _ = (model.w.val() * x.clone()).sum().backward(); // the leaves are now spent
/// let fresh = with_fresh_leaves(model.clone());
/// let grads = GradientsParams::from_grads((fresh.w.val() * x).sum().backward(), &fresh);
/// let g = grads.get::<verl_core::backend::CpuBackend, 1>(model.w.id).unwrap();
/// assert_eq!(g.into_data().to_vec::<f32>().unwrap(), vec![1.0, 10.0]);
/// ```
pub fn with_fresh_leaves<B: AutodiffBackend, M: AutodiffModule<B>>(module: M) -> M {
    module.map(&mut FreshLeaves)
}

struct FreshLeaves;

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, value, mapper) = param.consume();
        let value = if value.is_require_grad() {
            Tensor::from_inner(value.inner()).require_grad()
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

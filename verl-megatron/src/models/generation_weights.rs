//! The fused weights a generation-only model keeps (see [`crate::models::generation`], which
//! builds them and runs the decode step with them).

use std::any::Any;
use std::sync::Arc;

use burn::prelude::*;

/// One dense decoder layer's stacked matrices (bf16).
#[derive(Debug, Clone)]
pub struct FusedLayer<B: Backend> {
    /// `[q_out + 2 · kv_out, hidden]`: this rank's q, k and v rows, in that order.
    pub qkv: Tensor<B, 2>,
    /// q, k and v biases side by side (Qwen2), `None` for layers without.
    pub qkv_bias: Option<Tensor<B, 1>>,
    /// `[2 · intermediate, hidden]`: gate rows, then up rows.
    pub gate_up: Tensor<B, 2>,
}

/// The fused weights of a generation-only model (see the module docs).
#[derive(Debug, Clone)]
pub struct GenerationWeights<B: Backend> {
    pub layers: Vec<FusedLayer<B>>,
    /// The tied embedding in bf16, read by the LM head (`None` with an untied head, whose own
    /// matrix is already bf16).
    pub tied_head: Option<Tensor<B, 2>>,
}

/// Where [`CausalLm`] keeps its [`GenerationWeights`]: type-erased, because burn's `Module`
/// derive treats any field that names the backend as a module, skipped or not.
#[derive(Clone, Default)]
pub(crate) struct FusedWeights(Option<Arc<dyn Any + Send + Sync>>);

impl FusedWeights {
    pub(crate) fn of<B: Backend>(weights: Option<GenerationWeights<B>>) -> Self {
        Self(weights.map(|w| Arc::new(w) as Arc<dyn Any + Send + Sync>))
    }

    pub(crate) fn get<B: Backend>(&self) -> Option<&GenerationWeights<B>> {
        self.0.as_ref()?.downcast_ref()
    }
}

impl std::fmt::Debug for FusedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "FusedWeights(built)"
        } else {
            "FusedWeights(none)"
        })
    }
}

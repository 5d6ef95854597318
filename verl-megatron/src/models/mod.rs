//! Decoder-only language models on burn, built from the parallel-aware [`crate::layers`].
//!
//! Qwen2, Llama, Qwen3, Mistral, Qwen2-MoE, Qwen3-MoE and Mixtral share one decoder
//! ([`CausalLm`]); what differs is set by the config: q/k/v (and o) biases, Qwen3's per-head
//! q/k RMSNorm, rope scaling (linear, Llama 3, YaRN), tied embeddings, and the expert blocks
//! ([`sparse_moe::SparseMoe`], with Qwen2-MoE's shared expert or without, as in Qwen3-MoE and
//! Mixtral).

pub mod attention;
pub mod causal_lm;
pub mod feed_forward;
pub mod fused_log_probs;
pub mod generate;
pub mod generation;
pub mod generation_weights;
pub mod kv_cache;
pub mod latent_attention;
pub mod mlp;
pub mod packing;
pub mod router_replay;
pub mod sparse_moe;
pub mod vocab_parallel;

pub use causal_lm::{tp_split_dim, CausalLm, Recompute, RecomputeMethod, WeightBucket};
pub use generate::{generate, GenerateOptions};
pub use generation_weights::GenerationWeights;
pub use kv_cache::{ChunkLayout, KvCache, LayerKv, SlotKvCache};
pub use vocab_parallel::vocab_parallel_log_probs;

/// `values` as an index tensor (for `select` / `gather`) on `device`.
pub(crate) fn index_tensor<B: burn::prelude::Backend>(
    values: &[usize],
    device: &B::Device,
) -> burn::prelude::Tensor<B, 1, burn::tensor::Int> {
    let v: Vec<i64> = values.iter().map(|&i| i as i64).collect();
    let n = v.len();
    burn::prelude::Tensor::from_data(burn::tensor::TensorData::new(v, [n]), device)
}

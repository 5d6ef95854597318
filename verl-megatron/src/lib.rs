//! verl-megatron: the Megatron-parallel implementations of the core traits on burn.
//!
//! - [`hf`]: the Hugging Face bridge — `config.json` in the transformers 4 or 5 dialect, a
//!   memory-mapped safetensors reader (single file or shards), the per-architecture tensor table
//!   shared by load / save / export, saving back in HF layout, the tokenizer and chat template.
//! - [`layers`]: column / row-parallel linear, vocab-parallel embedding, RMSNorm and rotary
//!   layers.
//! - [`models`]: the decoder for Qwen2, Llama, Qwen3, Mistral, Qwen2-MoE, Qwen3-MoE and
//!   Mixtral (linear, Llama-3 and YaRN rope scaling) with LM, value and score heads; KV caches (a growing one and the rollout
//!   engine's slot cache); random init; weights replaced one tensor at a time by HF name; a
//!   plain generation loop.
//!
//! - [`workers`]: verl's role workers — the actor (PPO update, log-probs), the critic, the
//!   hybrid actor-rollout-reference worker, the reward-model worker — with AdamW and Megatron's
//!   learning-rate schedule, checkpointing through [`checkpoint`].
//! - [`checkpoint`]: sharded checkpoints with optimizer state for exact resume, and HF-format
//!   model checkpoints, behind `CheckpointBackend`.
//!
//! - [`parallel`]: the in-process `LocalCommunicator` (ranks as threads), the process groups
//!   of a topology, the tensor / sequence-parallel region operators (custom autodiff
//!   operations running the conjugate collective backward), context parallel's load-balanced
//!   sequence split ([`parallel::ContextSplit`]), the expert-parallel all-to-all, and the
//!   pipeline stage split and 1F1B schedule. The MoE token dispatch lives with its block
//!   ([`models::sparse_moe`]).

pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device_faults;
pub mod error;
pub mod hf;
pub mod host_reads;
pub mod layers;
pub mod models;
pub mod ops;
pub mod parallel;
pub mod sampling;
pub mod workers;

pub use error::MegatronError;

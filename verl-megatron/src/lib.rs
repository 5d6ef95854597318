//! verl-megatron: the Megatron-parallel implementations of the core traits on burn.
//!
//! Landed so far: [`hf::config`], which reads a Hugging Face `config.json` in either the
//! transformers 4 or 5 dialect. Planned here (see the issue tracker): decoder models (Qwen2,
//! Llama, Qwen3, Qwen2-MoE) built from parallel-aware layers, weight loading and saving,
//! tensor / sequence / data / pipeline / context / expert parallelism over a `Communicator`, and
//! the actor, critic, reference and reward workers.

pub mod error;
pub mod hf;
pub mod layers;
pub mod models;

pub use error::MegatronError;

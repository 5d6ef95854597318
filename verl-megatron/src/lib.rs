//! verl-megatron: the Megatron-parallel implementations of the core traits on burn.
//!
//! Planned here (see the issue tracker): decoder models (Qwen2, Llama, Qwen3, Qwen2-MoE) built
//! from parallel-aware layers, the Hugging Face bridge, tensor / sequence / data / pipeline /
//! context / expert parallelism over a `Communicator`, and the actor, critic, reference and
//! reward workers. Nothing is implemented yet; the crate exists so the workspace layout is final.

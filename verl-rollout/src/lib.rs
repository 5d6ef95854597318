//! verl-rollout: the native rollout engine behind the core `RolloutEngine` trait.
//!
//! Planned here (see the issue tracker): batched prefill and decode with a budgeted KV cache,
//! continuous batching, sampling controls and per-tensor weight updates. Nothing is implemented
//! yet; the crate exists so the workspace layout is final.

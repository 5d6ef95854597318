//! verl-rollout: the native rollout engine behind the core `RolloutEngine` trait.
//!
//! Landed so far: [`sampling`], the token sampler (greedy, temperature, top-k, top-p, seeded per
//! request). Planned (see the issue tracker): batched prefill and decode over the model's KV
//! cache with a memory budget, continuous batching, verl's output layout, per-tensor weight
//! updates and sleep / wake-up.

pub mod sampling;

pub use sampling::{Sampler, SamplingError, SamplingParams};

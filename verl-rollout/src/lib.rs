//! verl-rollout: the native rollout engine behind the core `RolloutEngine` trait.
//!
//! - [`sampling`]: the token sampler (greedy, temperature, top-k, top-p), seeded per request.
//! - [`config`]: the engine's settings ([`EngineConfig`]) and KV budget, from verl's config.
//! - [`engine`]: [`NativeRollout`], batched prefill and decode over a preallocated slot KV
//!   cache with continuous batching.
//! - [`prefix_cache`]: what the cache's slots keep from finished requests, for later
//!   requests that start with the same tokens.
//! - [`stop`]: stop strings, matched on the response's text through a [`Detokenizer`].
//! - [`layout`]: verl's rollout batch layout in and out of a `DataProto`.
//! - [`rollout_engine`]: the `RolloutEngine` trait: generation, per-tensor weight updates,
//!   sleep / wake-up.

pub mod agent;
pub mod config;
pub mod engine;
pub mod error;
pub mod layout;
pub mod prefix_cache;
pub mod rollout_engine;
pub mod routing;
pub mod sampling;
pub mod stop;

pub use config::{EngineConfig, KvBudget, MemoryBase};
pub use engine::{Completion, FinishReason, GenerationStats, NativeRollout, Request};
pub use error::RolloutError;
pub use rollout_engine::{PROMPT_INDEX_KEY, TOOL_EXTRA_FIELDS_KEY};
pub use sampling::{Sampler, SamplingError, SamplingParams};
pub use stop::{Detokenizer, StopStrings};

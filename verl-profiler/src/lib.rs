//! verl-profiler: implementations of the core `Profiler` trait, configured as verl's
//! `global_profiler` and per-role `profiler` blocks (tool, steps, ranks, discrete).
//!
//! Nothing is implemented yet; the configuration lives in `verl_core::config`, and the crate
//! exists so the workspace layout is final.

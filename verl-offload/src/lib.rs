//! verl-offload: moving parameters, gradients and optimizer state between device and host memory
//! (verl's `param_offload`, `grad_offload`, `optimizer_offload`).
//!
//! Nothing is implemented yet; the crate exists so the workspace layout is final.

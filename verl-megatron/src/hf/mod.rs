//! The Hugging Face bridge: reading HF model directories directly, with no offline conversion
//! (what mbridge gives verl).

pub mod config;

pub use config::{Architecture, HfModelConfig, RopeScaling, WeightDtype};

//! The Hugging Face bridge: reading HF model directories directly, with no offline conversion
//! (what mbridge gives verl).

pub mod byte_runs;
pub mod checkpoint;
pub mod config;
pub mod hub;
pub mod latent_attention;
pub mod layer_variants;
pub mod names;
pub mod save;
pub mod tensor_map;
pub mod tokenizer;

pub use checkpoint::{HfCheckpoint, LoadStats};
pub use config::{
    Architecture, HeadKind, HfModelConfig, MoeConfig, MoeRouting, Qwen2Dims, RopeScaling,
    WeightDtype,
};
pub use hub::resolve_model_dir;
pub use latent_attention::LatentAttentionConfig;
pub use layer_variants::{Activation, LayerVariants};
pub use save::{read_config_json, save_pretrained, SaveOptions};
pub use tensor_map::{hf_tensor_specs, TensorSpec};
pub use tokenizer::{ChatMessage, HfTokenizer};

//! Hugging Face tensor names that differ from the decoder's. The decoder names every MoE block
//! as Qwen-MoE does (`mlp.gate`, `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`);
//! Mixtral stores the same tensors as `block_sparse_moe.gate` and
//! `block_sparse_moe.experts.{e}.w1` / `w3` / `w2`. [`HfCheckpoint`](super::HfCheckpoint)
//! renames what it reads with [`to_decoder_name`], and [`save_pretrained`](super::save_pretrained)
//! writes a Mixtral's tensors back with [`to_stored_name`], so a Mixtral checkpoint loads and
//! saves with no conversion.
//!
//! ```
//! use verl_megatron::hf::names::{to_decoder_name, to_stored_name};
//! use verl_megatron::hf::Architecture;
//! let stored = "model.layers.3.block_sparse_moe.experts.7.w3.weight";
//! let ours = to_decoder_name(stored);
//! assert_eq!(ours, "model.layers.3.mlp.experts.7.up_proj.weight");
//! assert_eq!(to_stored_name(Architecture::Mixtral, &ours), stored);
//! // Other architectures keep the decoder's names.
//! assert_eq!(to_stored_name(Architecture::Qwen3Moe, &ours), ours);
//! ```

use std::borrow::Cow;

use super::Architecture;

/// Mixtral's expert projections against the decoder's.
const MIXTRAL_PROJECTIONS: [(&str, &str); 3] =
    [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")];

/// `name` with its layer's block `from` renamed `to` and an expert's projection renamed by
/// `projection` (a pair of the table: from, to); `None` when `name` is not in block `from`.
fn rename_block(
    name: &str,
    (from, to): (&str, &str),
    projection: impl Fn(&(&'static str, &'static str)) -> (&'static str, &'static str),
) -> Option<String> {
    let (layer, rest) = name.split_once(&format!(".{from}."))?;
    let rest = match rest
        .strip_prefix("experts.")
        .and_then(|r| r.split_once('.'))
    {
        Some((expert, tail)) => {
            let tail = MIXTRAL_PROJECTIONS
                .iter()
                .map(&projection)
                .find_map(|(theirs, ours)| {
                    tail.strip_prefix(theirs)
                        .filter(|t| t.starts_with('.'))
                        .map(|t| format!("{ours}{t}"))
                })
                .unwrap_or_else(|| tail.to_string());
            format!("experts.{expert}.{tail}")
        }
        None => rest.to_string(),
    };
    Some(format!("{layer}.{to}.{rest}"))
}

/// DeepSeek's shared experts (one MLP) against the decoder's shared expert.
const DEEPSEEK_SHARED: (&str, &str) = (".mlp.shared_experts.", ".mlp.shared_expert.");

/// The decoder's name for a stored tensor: Mixtral's `block_sparse_moe.*` and DeepSeek's
/// `shared_experts` renamed, any other name as it is.
pub fn to_decoder_name(stored: &str) -> Cow<'_, str> {
    if stored.contains(DEEPSEEK_SHARED.0) {
        return Cow::Owned(stored.replacen(DEEPSEEK_SHARED.0, DEEPSEEK_SHARED.1, 1));
    }
    match rename_block(stored, ("block_sparse_moe", "mlp"), |&p| p) {
        Some(name) => Cow::Owned(name),
        None => Cow::Borrowed(stored),
    }
}

/// How `architecture` stores the decoder's tensor `name` (the inverse of [`to_decoder_name`]).
pub fn to_stored_name(architecture: Architecture, name: &str) -> Cow<'_, str> {
    if architecture == Architecture::DeepseekV3 && name.contains(DEEPSEEK_SHARED.1) {
        return Cow::Owned(name.replacen(DEEPSEEK_SHARED.1, DEEPSEEK_SHARED.0, 1));
    }
    if architecture != Architecture::Mixtral {
        return Cow::Borrowed(name);
    }
    // Only the expert block's tensors move (a Mixtral has no dense MLP).
    match rename_block(name, ("mlp", "block_sparse_moe"), |&(theirs, ours)| {
        (ours, theirs)
    }) {
        Some(stored) => Cow::Owned(stored),
        None => Cow::Borrowed(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixtral_names_map_both_ways_and_others_stay() {
        for (stored, ours) in [
            (
                "model.layers.0.block_sparse_moe.gate.weight",
                "model.layers.0.mlp.gate.weight",
            ),
            (
                "model.layers.11.block_sparse_moe.experts.3.w1.weight",
                "model.layers.11.mlp.experts.3.gate_proj.weight",
            ),
            (
                "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                "model.layers.1.mlp.experts.0.down_proj.weight",
            ),
        ] {
            assert_eq!(to_decoder_name(stored), ours);
            assert_eq!(to_stored_name(Architecture::Mixtral, ours), stored);
        }
        for same in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.0.mlp.experts.1.up_proj.weight",
        ] {
            assert_eq!(to_decoder_name(same), same);
        }
        assert_eq!(
            to_stored_name(Architecture::Mixtral, "model.norm.weight"),
            "model.norm.weight"
        );
        assert_eq!(
            to_stored_name(Architecture::Qwen2Moe, "model.layers.0.mlp.gate.weight"),
            "model.layers.0.mlp.gate.weight"
        );
    }

    #[test]
    fn deepseeks_shared_experts_map_both_ways() {
        let stored = "model.layers.3.mlp.shared_experts.down_proj.weight";
        let ours = to_decoder_name(stored);
        assert_eq!(ours, "model.layers.3.mlp.shared_expert.down_proj.weight");
        assert_eq!(to_stored_name(Architecture::DeepseekV3, &ours), stored);
        assert_eq!(to_stored_name(Architecture::Qwen2Moe, &ours), ours);
    }
}

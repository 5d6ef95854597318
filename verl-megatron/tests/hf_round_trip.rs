//! load → save → load is bit-exact, sharded or not, and half-precision saves convert as stated.

mod common;
use common::fixture;

use std::path::Path;

use burn::tensor::{Int, Tensor};
use verl_core::backend::CpuBackend as B;
use verl_megatron::hf::{
    read_config_json, save_pretrained, HfCheckpoint, HfModelConfig, SaveOptions, WeightDtype,
};
use verl_megatron::models::CausalLm;

fn load(dir: &Path) -> (HfModelConfig, HfCheckpoint, CausalLm<B>) {
    let cfg = HfModelConfig::from_dir(dir).unwrap();
    let ckpt = HfCheckpoint::open(dir).unwrap();
    let model = CausalLm::from_checkpoint(&cfg, &ckpt, &Default::default()).unwrap();
    (cfg, ckpt, model)
}

/// `model` saved in f32 to `out` under `src`'s config.json, in shards of `shard` bytes.
fn save_f32(model: &CausalLm<B>, src: &Path, out: &Path, shard: usize) {
    save_pretrained(
        &model.export_weights(),
        &read_config_json(src).unwrap(),
        out,
        SaveOptions {
            dtype: WeightDtype::F32,
            max_shard_bytes: shard,
        },
    )
    .unwrap();
}

#[test]
fn every_architecture_round_trips_bit_exactly() {
    for name in [
        "qwen2",
        "qwen2_sharded_tf4",
        "llama3",
        "qwen3",
        "qwen2_moe",
        "qwen3_moe",
        "mixtral",
        "mistral",
        "qwen3_yarn",
    ] {
        let src = fixture(name);
        let (cfg, original, model) = load(&src);
        for shard in [usize::MAX, 20_000] {
            let out = tempfile::tempdir().unwrap();
            save_f32(&model, &src, out.path(), shard);
            assert_eq!(
                out.path().join("model.safetensors.index.json").exists(),
                shard != usize::MAX,
                "{name}"
            );
            let (cfg2, saved, model2) = load(out.path());
            assert_eq!(cfg2, cfg, "{name}: config survives");
            let names: Vec<&str> = original.names().collect();
            assert_eq!(
                saved.names().collect::<Vec<_>>(),
                names,
                "{name}: same tensors"
            );
            for t in names {
                assert_eq!(
                    original.read_f32(t).unwrap(),
                    saved.read_f32(t).unwrap(),
                    "{name}: {t}"
                );
            }
            let ids = Tensor::<B, 2, Int>::from_ints([[1, 7, 30, 2]], &Default::default());
            let a: Vec<f32> = model
                .forward(ids.clone(), None, None)
                .to_data()
                .to_vec()
                .unwrap();
            let b: Vec<f32> = model2.forward(ids, None, None).to_data().to_vec().unwrap();
            assert_eq!(a, b, "{name}: same logits after the round trip");
        }
    }
}

#[test]
fn bf16_saves_round_to_bf16_and_record_the_dtype() {
    let src = fixture("qwen2");
    let (_, original, model) = load(&src);
    let out = tempfile::tempdir().unwrap();
    save_pretrained(
        &model.export_weights(),
        &read_config_json(&src).unwrap(),
        out.path(),
        SaveOptions {
            dtype: WeightDtype::BF16,
            ..Default::default()
        },
    )
    .unwrap();
    let cfg = HfModelConfig::from_dir(out.path()).unwrap();
    assert_eq!(cfg.dtype, WeightDtype::BF16);
    let saved = HfCheckpoint::open(out.path()).unwrap();
    let (a, _) = original.read_f32("model.norm.weight").unwrap();
    let (b, _) = saved.read_f32("model.norm.weight").unwrap();
    assert_eq!(
        b,
        a.iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect::<Vec<_>>()
    );
    // The transformers-4 dialect is kept on save.
    let out4 = tempfile::tempdir().unwrap();
    let src4 = fixture("qwen2_sharded_tf4");
    save_pretrained(
        &load(&src4).2.export_weights(),
        &read_config_json(&src4).unwrap(),
        out4.path(),
        SaveOptions::default(),
    )
    .unwrap();
    let raw = read_config_json(out4.path()).unwrap();
    assert_eq!(raw["torch_dtype"], "float32");
    assert!(raw.get("dtype").is_none());
}

/// A Mixtral is read under the decoder's names and written back under its own
/// (`block_sparse_moe.experts.{e}.w1/w3/w2`): the saved file names exactly the tensors
/// transformers wrote.
#[test]
fn a_mixtral_saves_under_its_own_tensor_names() {
    let src = fixture("mixtral");
    let (_, _, model) = load(&src);
    let out = tempfile::tempdir().unwrap();
    save_f32(&model, &src, out.path(), usize::MAX);
    let stored_names = |path: &Path| {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        names
    };
    let saved = stored_names(&out.path().join("model.safetensors"));
    assert!(saved
        .iter()
        .any(|n| n.ends_with("block_sparse_moe.experts.3.w2.weight")));
    assert_eq!(saved, stored_names(&src.join("model.safetensors")));
    // Sharded, the index maps the same stored names to their files.
    let sharded = tempfile::tempdir().unwrap();
    save_f32(&model, &src, sharded.path(), 20_000);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(sharded.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut indexed: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    indexed.sort();
    assert_eq!(indexed, saved);
}

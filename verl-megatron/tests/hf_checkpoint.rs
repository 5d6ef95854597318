//! Reading safetensors checkpoints: every fixture matches its architecture's tensor table,
//! shards read the same as the single file, dtypes convert, and bad checkpoints are named.

mod common;
use common::fixture;

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};
use verl_core::backend::CpuBackend as B;
use verl_megatron::hf::{hf_tensor_specs, HfCheckpoint, HfModelConfig};
use verl_megatron::MegatronError;

#[test]
fn every_fixture_matches_its_tensor_table() {
    for name in ["qwen2", "qwen2_sharded_tf4", "llama3", "qwen3", "qwen2_moe"] {
        let cfg = HfModelConfig::from_dir(fixture(name)).unwrap();
        let ckpt = HfCheckpoint::open(fixture(name)).unwrap();
        ckpt.verify(&cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let required = hf_tensor_specs(&cfg).iter().filter(|s| !s.optional).count();
        assert!(ckpt.names().count() >= required, "{name}");
    }
}

#[test]
fn shards_read_exactly_like_the_single_file() {
    let single = HfCheckpoint::open(fixture("qwen2")).unwrap();
    let sharded = HfCheckpoint::open(fixture("qwen2_sharded_tf4")).unwrap();
    let files: std::collections::BTreeSet<_> = sharded
        .names()
        .map(|n| sharded.file_of(n).unwrap().to_path_buf())
        .collect();
    assert_eq!(files.len(), 3, "the fixture is split over 3 shards");
    assert_eq!(
        single.names().collect::<Vec<_>>(),
        sharded.names().collect::<Vec<_>>()
    );
    for name in single.names() {
        assert_eq!(
            single.read_f32(name).unwrap(),
            sharded.read_f32(name).unwrap(),
            "{name}"
        );
    }
    let t: Tensor<B, 2> = single
        .load("model.embed_tokens.weight", &Default::default())
        .unwrap();
    assert_eq!(t.dims(), [320, 32]);
    assert!(single
        .load::<B, 1>("model.embed_tokens.weight", &Default::default())
        .is_err());
}

/// Writes `model.safetensors` with the given f32 tensors (and the qwen2 fixture's config).
fn write_checkpoint(dir: &Path, tensors: Vec<(String, Vec<usize>, Vec<f32>)>) {
    std::fs::copy(
        fixture("qwen2").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None::<HashMap<String, String>>).unwrap(),
    )
    .unwrap();
}

fn fixture_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let ckpt = HfCheckpoint::open(fixture("qwen2")).unwrap();
    ckpt.names()
        .map(|n| {
            let (v, s) = ckpt.read_f32(n).unwrap();
            (n.to_string(), s, v)
        })
        .collect()
}

#[test]
fn missing_unexpected_and_misshaped_tensors_are_named() {
    let cfg = HfModelConfig::from_dir(fixture("qwen2")).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let mut t = fixture_tensors();
    t.retain(|(n, _, _)| n != "model.layers.1.self_attn.k_proj.bias");
    write_checkpoint(dir.path(), t);
    let e = HfCheckpoint::open(dir.path())
        .unwrap()
        .verify(&cfg)
        .unwrap_err();
    assert!(
        matches!(e, MegatronError::MissingTensor { ref name, .. } if name == "model.layers.1.self_attn.k_proj.bias"),
        "{e}"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut t = fixture_tensors();
    t.push((
        "model.layers.0.mlp.extra.weight".into(),
        vec![2],
        vec![0.0, 1.0],
    ));
    write_checkpoint(dir.path(), t);
    let e = HfCheckpoint::open(dir.path())
        .unwrap()
        .verify(&cfg)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.layers.0.mlp.extra.weight") && e.contains("model.safetensors"),
        "{e}"
    );

    let dir = tempfile::tempdir().unwrap();
    let mut t = fixture_tensors();
    for (n, s, v) in t.iter_mut() {
        if n == "model.layers.0.self_attn.q_proj.weight" {
            *s = vec![16, 64];
            v.truncate(16 * 64);
        }
    }
    write_checkpoint(dir.path(), t);
    let e = HfCheckpoint::open(dir.path())
        .unwrap()
        .verify(&cfg)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("q_proj.weight") && e.contains("[16, 64]") && e.contains("[32, 32]"),
        "{e}"
    );

    assert!(matches!(
        HfCheckpoint::open(fixture("nope")),
        Err(MegatronError::Io { .. })
    ));
}

#[test]
fn half_precision_tensors_convert_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [1.5f32, -2.25, 0.1];
    let bf: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let f16: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let views = vec![
        (
            "a".to_string(),
            TensorView::new(Dtype::BF16, vec![3], &bf).unwrap(),
        ),
        (
            "b".to_string(),
            TensorView::new(Dtype::F16, vec![3], &f16).unwrap(),
        ),
    ];
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors::serialize(views, None::<HashMap<String, String>>).unwrap(),
    )
    .unwrap();
    let ckpt = HfCheckpoint::open(dir.path()).unwrap();
    let (a, _) = ckpt.read_f32("a").unwrap();
    let (b, _) = ckpt.read_f32("b").unwrap();
    assert_eq!(
        a,
        vals.iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect::<Vec<_>>()
    );
    assert_eq!(
        b,
        vals.iter()
            .map(|v| half::f16::from_f32(*v).to_f32())
            .collect::<Vec<_>>()
    );
    assert_eq!(a[0], 1.5);
}

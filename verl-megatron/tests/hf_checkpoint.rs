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

/// Half-precision weights widened on the device (the loading path of any backend holding bf16)
/// equal the host's widening, whole and in tensor-parallel parts along either dimension; the
/// raw part bytes equal a naive slice. The tensor is over the 32 MiB above which the part's
/// bytes are gathered by several threads, with runs that straddle the threads' slices.
#[test]
fn half_precision_parts_widen_on_the_device_as_on_the_host() {
    let (rows, cols) = (4099usize, 4133usize);
    let bf: Vec<u8> = (0..rows * cols)
        .flat_map(|i| half::bf16::from_f32((i as f32 * 0.37).sin() * 3.0).to_le_bytes())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let views = vec![(
        "w".to_string(),
        TensorView::new(Dtype::BF16, vec![rows, cols], &bf).unwrap(),
    )];
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors::serialize(views, None::<HashMap<String, String>>).unwrap(),
    )
    .unwrap();
    let device = Default::default();
    let on_device = HfCheckpoint::open(dir.path()).unwrap();
    let on_host = HfCheckpoint::open(dir.path())
        .unwrap()
        .with_widening_on_host(true);
    for (dim, part) in [
        (0, None),
        (0, Some((1021, 2047))),
        (1, Some((0, 2066))),
        (1, Some((2067, 2066))),
    ] {
        let a: Tensor<B, 2> = on_device.load_part("w", dim, part, &device).unwrap();
        let b: Tensor<B, 2> = on_host.load_part("w", dim, part, &device).unwrap();
        assert_eq!(a.dims(), b.dims(), "dim {dim} part {part:?}");
        let (a, b) = (
            a.into_data().to_vec::<f32>().unwrap(),
            b.into_data().to_vec::<f32>().unwrap(),
        );
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "dim {dim} part {part:?}"
        );
        let (bytes, shape, dtype) = on_device.read_part_bytes("w", dim, part).unwrap();
        assert_eq!(dtype, Dtype::BF16);
        let (start, len) = part.unwrap_or((0, rows));
        let naive: Vec<u8> = match dim {
            0 => bf[start * cols * 2..(start + len) * cols * 2].to_vec(),
            _ => (0..rows)
                .flat_map(|r| &bf[(r * cols + start) * 2..(r * cols + start + len) * 2])
                .copied()
                .collect(),
        };
        assert_eq!(
            shape,
            if dim == 0 {
                vec![len, cols]
            } else {
                vec![rows, len]
            }
        );
        assert!(bytes == naive, "dim {dim} part {part:?}: bytes differ");
    }
    // Every loaded byte is counted once, on each checkpoint.
    let loaded = 2 * (rows * cols + 2047 * cols + 2 * rows * 2066);
    assert_eq!(on_device.load_stats().bytes as usize, loaded);
    assert_eq!(on_host.load_stats().bytes as usize, loaded);
    // The first row, by hand: element i is bf16(sin(0.37 i) * 3).
    let (row, _) = on_host.read_part_f32("w", 0, Some((0, 1))).unwrap();
    assert_eq!(row[0], 0.0);
    assert_eq!(row[1], half::bf16::from_f32(0.37f32.sin() * 3.0).to_f32());
}

/// A copy of fixture `name`'s files in a temporary directory.
fn fixture_copy(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

/// Rewrites the JSON file `path` with `edit` applied.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// The error of opening `dir`, which must be refused.
fn open_err(dir: &Path) -> String {
    match HfCheckpoint::open(dir) {
        Ok(_) => panic!("{} opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A `num_hidden_layers` (or `num_experts`) larger than the weights on disk hold is refused
/// naming the field before anything is sized by it: 10¹² layers must not allocate.
#[test]
fn counts_beyond_the_weights_on_disk_are_refused_by_field() {
    use verl_megatron::models::CausalLm;
    // Beyond any model: refused as config.json is read.
    for field in ["num_hidden_layers", "num_experts"] {
        let dir = fixture_copy(if field == "num_experts" {
            "qwen2_moe"
        } else {
            "qwen2"
        });
        edit_json(&dir.path().join("config.json"), |c| {
            c[field] = 1_000_000_000_000u64.into();
        });
        let e = HfModelConfig::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(&e, MegatronError::Config { field: f, .. } if f == field),
            "{e}"
        );
    }
    // Within bounds but more than the weights hold: refused against them, before a list of
    // that length exists (2^24 layers' tensor table would take gigabytes).
    for layers in [1u64 << 24, 3] {
        let dir = fixture_copy("qwen2");
        edit_json(&dir.path().join("config.json"), |c| {
            c["num_hidden_layers"] = layers.into();
        });
        let cfg = HfModelConfig::from_dir(dir.path()).unwrap();
        assert_eq!(cfg.num_hidden_layers as u64, layers);
        let ckpt = HfCheckpoint::open(dir.path()).unwrap();
        let e = ckpt.verify(&cfg).unwrap_err();
        assert!(
            matches!(&e, MegatronError::Config { field, .. } if field == "num_hidden_layers"),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("says {layers}")) && msg.contains("hold 2 layers"),
            "{msg}"
        );
        assert!(msg.contains("config.json"), "names the file: {msg}");
        // Building the model checks first too.
        let Err(e) = CausalLm::<B>::from_checkpoint(&cfg, &ckpt, &Default::default()) else {
            panic!("a model of {layers} layers was built from weights that hold fewer");
        };
        let e = e.to_string();
        assert!(e.contains("`num_hidden_layers`"), "{e}");
    }

    let dir = fixture_copy("qwen2_moe");
    edit_json(&dir.path().join("config.json"), |c| {
        c["num_experts"] = (1u64 << 24).into();
    });
    let cfg = HfModelConfig::from_dir(dir.path()).unwrap();
    let e = HfCheckpoint::open(dir.path())
        .unwrap()
        .verify(&cfg)
        .unwrap_err();
    assert!(
        matches!(&e, MegatronError::Config { field, .. } if field == "num_experts"),
        "{e}"
    );
    assert!(e.to_string().contains("hold 4 experts"), "{e}");
}

/// A shard index may only name files inside the model directory: `..`, an absolute path or
/// an empty name is refused naming the shard and the index, before any file is opened.
#[test]
fn shard_names_leaving_the_model_directory_are_refused() {
    let shard = "model-00002-of-00003.safetensors";
    for evil in [
        "../../../../etc/passwd",
        "/etc/passwd",
        "sub/../../x.safetensors",
        "",
    ] {
        let dir = fixture_copy("qwen2_sharded_tf4");
        edit_json(&dir.path().join("model.safetensors.index.json"), |v| {
            for file in v["weight_map"].as_object_mut().unwrap().values_mut() {
                if *file == shard {
                    *file = evil.into();
                }
            }
        });
        let e = open_err(dir.path());
        assert!(
            e.contains(&format!("shard `{evil}`")) && e.contains("inside the model directory"),
            "{evil}: {e}"
        );
        assert!(e.contains("model.safetensors.index.json"), "{e}");
    }
    // A shard in a subfolder of the directory is inside it.
    let dir = fixture_copy("qwen2_sharded_tf4");
    std::fs::create_dir(dir.path().join("part")).unwrap();
    std::fs::rename(dir.path().join(shard), dir.path().join("part").join(shard)).unwrap();
    edit_json(&dir.path().join("model.safetensors.index.json"), |v| {
        for file in v["weight_map"].as_object_mut().unwrap().values_mut() {
            if *file == shard {
                *file = format!("part/{shard}").into();
            }
        }
    });
    let cfg = HfModelConfig::from_dir(dir.path()).unwrap();
    HfCheckpoint::open(dir.path())
        .unwrap()
        .verify(&cfg)
        .unwrap();
}

/// A weight file that is a symbolic link out of the model directory is refused naming it — a
/// shard of the index and the single `model.safetensors` alike — while links that stay inside,
/// a model directory that is itself a link, and the Hugging Face hub cache's layout (each file
/// of `snapshots/<revision>` a link to `../../blobs/<hash>`) load.
#[cfg(unix)]
#[test]
fn weight_files_linked_from_outside_the_directory_are_refused() {
    use std::os::unix::fs::symlink;
    let outside = tempfile::tempdir().unwrap();

    // A shard linked from outside.
    let shard = "model-00002-of-00003.safetensors";
    let dir = fixture_copy("qwen2_sharded_tf4");
    std::fs::rename(dir.path().join(shard), outside.path().join(shard)).unwrap();
    symlink(outside.path().join(shard), dir.path().join(shard)).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains(&format!("shard `{shard}`")) && e.contains("outside the model directory"),
        "{e}"
    );
    assert!(e.contains("model.safetensors.index.json"), "{e}");

    // The single model.safetensors linked from outside.
    let dir = fixture_copy("qwen2");
    let single = dir.path().join("model.safetensors");
    std::fs::rename(&single, outside.path().join("model.safetensors")).unwrap();
    symlink(outside.path().join("model.safetensors"), &single).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("`model.safetensors`") && e.contains("outside the model directory"),
        "{e}"
    );
    // ... also by a relative link.
    std::fs::remove_file(&single).unwrap();
    let up = format!(
        "../{}/model.safetensors",
        outside.path().file_name().unwrap().to_str().unwrap()
    );
    symlink(&up, &single).unwrap();
    assert!(single.exists(), "{up} resolves");
    let e = open_err(dir.path());
    assert!(e.contains("outside the model directory"), "{e}");

    // A link that stays inside the directory loads.
    let dir = fixture_copy("qwen2");
    let cfg = HfModelConfig::from_dir(dir.path()).unwrap();
    std::fs::create_dir(dir.path().join("real")).unwrap();
    std::fs::rename(
        dir.path().join("model.safetensors"),
        dir.path().join("real/model.safetensors"),
    )
    .unwrap();
    symlink(
        "real/model.safetensors",
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    HfCheckpoint::open(dir.path())
        .unwrap()
        .verify(&cfg)
        .unwrap();

    // A model directory that is itself a link loads.
    let links = tempfile::tempdir().unwrap();
    for name in ["qwen2", "qwen2_sharded_tf4"] {
        let linked = links.path().join(name);
        symlink(fixture(name), &linked).unwrap();
        let cfg = HfModelConfig::from_dir(&linked).unwrap();
        HfCheckpoint::open(&linked).unwrap().verify(&cfg).unwrap();
    }

    // The hub cache: every file of a snapshot links into its repository's blobs.
    let hub = tempfile::tempdir().unwrap();
    for name in ["qwen2", "qwen2_sharded_tf4"] {
        let repo = hub.path().join(format!("models--tiny--{name}"));
        let snapshot = repo.join("snapshots/0123456789abcdef");
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(&snapshot).unwrap();
        for (i, entry) in std::fs::read_dir(fixture(name)).unwrap().enumerate() {
            let entry = entry.unwrap();
            let blob = format!("blob{i:04}");
            std::fs::copy(entry.path(), repo.join("blobs").join(&blob)).unwrap();
            symlink(
                format!("../../blobs/{blob}"),
                snapshot.join(entry.file_name()),
            )
            .unwrap();
        }
        let cfg = HfModelConfig::from_dir(&snapshot).unwrap();
        HfCheckpoint::open(&snapshot)
            .unwrap_or_else(|e| panic!("{name} in the hub cache: {e}"))
            .verify(&cfg)
            .unwrap();
    }
    // ... but a snapshot's link into another repository's blobs leads outside.
    let repo = hub.path().join("models--tiny--qwen2");
    let snapshot = repo.join("snapshots/0123456789abcdef");
    std::fs::remove_file(snapshot.join("model.safetensors")).unwrap();
    std::fs::create_dir_all(hub.path().join("models--other--x/blobs")).unwrap();
    std::fs::copy(
        fixture("qwen2").join("model.safetensors"),
        hub.path().join("models--other--x/blobs/elsewhere"),
    )
    .unwrap();
    symlink(
        "../../../models--other--x/blobs/elsewhere",
        snapshot.join("model.safetensors"),
    )
    .unwrap();
    let e = open_err(&snapshot);
    assert!(e.contains("outside the model directory"), "{e}");
}

/// A safetensors file of hand-written `header` JSON and `data` (the safetensors crate will not
/// write an inconsistent one), as `dir/model.safetensors`.
fn write_raw(dir: &Path, header: serde_json::Value, data: &[u8]) {
    let mut h = header.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.extend_from_slice(data);
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

/// An F16 or BF16 tensor whose byte range disagrees with its shape, or runs past the file's
/// end, is refused naming the tensor and the file.
#[test]
fn half_precision_tensors_of_the_wrong_byte_length_are_named() {
    use serde_json::json;
    for dtype in ["F16", "BF16"] {
        // `a` is sound; `b` says 3 elements (6 bytes) but its range holds 4.
        let dir = tempfile::tempdir().unwrap();
        let header = json!({
            "a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 4]},
            "b": {"dtype": dtype, "shape": [3], "data_offsets": [4, 8]},
        });
        write_raw(dir.path(), header, &[0u8; 8]);
        let e = open_err(dir.path());
        assert!(
            e.contains("tensor `b`") && e.contains("needs 6 bytes") && e.contains("give 4"),
            "{dtype}: {e}"
        );
        assert!(e.contains("model.safetensors"), "names the file: {e}");

        // `b`'s range is right for its shape but the file ends before it does.
        let header = json!({
            "a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 4]},
            "b": {"dtype": dtype, "shape": [3], "data_offsets": [4, 10]},
        });
        write_raw(dir.path(), header, &[0u8; 8]);
        let e = open_err(dir.path());
        assert!(
            e.contains("tensor `b`") && e.contains("truncated"),
            "{dtype}: {e}"
        );

        // The same file with consistent ranges opens and reads.
        let header = json!({
            "a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 4]},
            "b": {"dtype": dtype, "shape": [2], "data_offsets": [4, 8]},
        });
        write_raw(dir.path(), header, &[0u8; 8]);
        let ckpt = HfCheckpoint::open(dir.path()).unwrap();
        assert_eq!(ckpt.read_f32("b").unwrap(), (vec![0.0, 0.0], vec![2]));
    }
}

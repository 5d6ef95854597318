//! The generation model's fused decode step (stacked q/k/v and gate/up, residual add fused with
//! the next norm; `models::generation`) computes what the layer-by-layer step computes, on the
//! CPU backend where every fused kernel takes its fallback.

mod common;
use common::{fixture, load_model};

use burn::tensor::{FloatDType, Tensor};
use verl_core::backend::CpuBackend as B;
use verl_core::NamedTensor;
use verl_megatron::layers::precision::ComputeDtype;
use verl_megatron::models::{CausalLm, SlotKvCache};

fn rows(t: Tensor<B, 2>) -> Vec<Vec<f32>> {
    let [_, v] = t.dims();
    let flat: Vec<f32> = t.into_data().convert::<f32>().to_vec().unwrap();
    flat.chunks(v).map(<[f32]>::to_vec).collect()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}

/// Prefills three prompts into a 4-slot cache stored as `dtype` (slot 2 idle), then decodes
/// `steps` greedy steps; returns every step's logits rows.
fn run_with(model: &CausalLm<B>, steps: usize, dtype: FloatDType) -> Vec<Vec<Vec<f32>>> {
    let cfg = &model.config;
    let mut cache = SlotKvCache::<B>::new_with_dtype(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        4,
        32,
        dtype,
        &Default::default(),
    );
    let prompts = vec![
        vec![1u32, 17, 33, 5, 90],
        vec![3, 200, 44],
        vec![9, 8, 7, 6, 5, 4, 3],
    ];
    let slots = [0usize, 1, 3];
    let first = rows(model.prefill_slots(&prompts, &slots, &mut cache));
    let mut tokens = vec![0u32; 4];
    let mut positions = vec![0usize; 4];
    for ((p, &s), row) in prompts.iter().zip(&slots).zip(&first) {
        tokens[s] = argmax(row);
        positions[s] = p.len();
    }
    let mut out = vec![first];
    for _ in 0..steps {
        let window = positions.iter().max().unwrap() + 1;
        let logits = rows(model.decode_slots(&tokens, &positions, window, &mut cache));
        for &s in &slots {
            tokens[s] = argmax(&logits[s]);
            positions[s] += 1;
        }
        out.push(slots.iter().map(|&s| logits[s].clone()).collect());
    }
    out
}

/// [`run_with`] on an f32 cache.
fn run(model: &CausalLm<B>, steps: usize) -> Vec<Vec<Vec<f32>>> {
    run_with(model, steps, FloatDType::F32)
}

/// With bf16 products a bf16 cache (what the rollout engine allocates) gives the f32 cache's
/// logits to the bit, layer by layer and in the fused step: the products round keys and values
/// to bf16 anyway. With f32 products the bf16 cache does change them (the control).
#[test]
fn a_bf16_cache_gives_the_f32_caches_logits_with_bf16_products() {
    for name in ["qwen2", "qwen3", "qwen2_moe"] {
        let (_, model) = load_model(&fixture(name));
        let plain = model.clone().with_compute_dtype(ComputeDtype::Bf16);
        let fused = plain.clone().with_generation_matrices();
        for m in [&plain, &fused] {
            assert_eq!(
                run_with(m, 6, FloatDType::BF16),
                run_with(m, 6, FloatDType::F32),
                "{name}"
            );
        }
        if name == "qwen2" {
            assert_ne!(run_with(&model, 2, FloatDType::BF16), run(&model, 2));
        }
    }
}

#[test]
fn fused_decode_steps_equal_the_layer_by_layer_steps() {
    for (name, fusable) in [
        ("qwen2", true),
        ("llama3", true),
        ("qwen3", false),
        ("qwen2_moe", false),
    ] {
        let (_, model) = load_model(&fixture(name));
        let plain = model.with_compute_dtype(ComputeDtype::Bf16);
        let fused = plain.clone().with_generation_matrices();
        assert_eq!(fused.generation().is_some(), fusable, "{name}");
        if !fusable {
            continue;
        }
        let (a, b) = (run(&plain, 6), run(&fused, 6));
        for (step, (ra, rb)) in a.iter().zip(&b).enumerate() {
            for (x, y) in ra.iter().zip(rb) {
                let worst = x
                    .iter()
                    .zip(y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= 1e-4,
                    "{name} step {step}: logits differ by {worst}"
                );
                assert_eq!(argmax(x), argmax(y), "{name} step {step}");
            }
        }
    }
}

#[test]
fn loading_a_weight_clears_the_fused_copies_and_preparing_restacks_them() {
    let (_, model) = load_model(&fixture("qwen2"));
    let mut fused = model
        .with_compute_dtype(ComputeDtype::Bf16)
        .with_generation_matrices();
    let name = "model.layers.0.mlp.up_proj.weight";
    let old = fused
        .export_shards()
        .into_iter()
        .find(|t| t.name == name)
        .unwrap();
    // The separate weight is a view of the stack: same values, still loadable by name.
    let stacked = fused.generation().unwrap().layers[0].gate_up.clone();
    let [rows, _] = old.to_tensor::<2>().unwrap().dims();
    let up_rows = stacked.clone().narrow(0, rows, rows);
    assert_eq!(
        up_rows
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap(),
        old.to_tensor::<2>()
            .unwrap()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap()
    );
    let doubled = old
        .to_tensor::<2>()
        .unwrap()
        .cast(burn::tensor::FloatDType::F32)
        * 2.0;
    fused
        .load_weight(NamedTensor::new(name, doubled.clone()))
        .unwrap();
    assert!(
        fused.generation().is_none(),
        "stale fused weights were kept"
    );
    fused.prepare_generation();
    let restacked = fused.generation().unwrap().layers[0].gate_up.clone();
    let expected: Vec<f32> = doubled
        .cast(burn::tensor::FloatDType::BF16)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap();
    assert_eq!(
        restacked
            .narrow(0, rows, rows)
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap(),
        expected
    );
}

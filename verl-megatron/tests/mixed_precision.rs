//! bf16 mixed precision on a whole model: f32 master weights and f32 gradients, bf16 products.
//! Its logits and one training step follow the f32 model's within bf16 rounding, and the
//! weights and their gradients never leave f32.

use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::{DType, Int};
use verl_core::algorithms::logits::log_probs_from_logits;
use verl_core::backend::CpuAutodiff;
use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
use verl_megatron::layers::precision::ComputeDtype;
use verl_megatron::models::CausalLm;

type B = CpuAutodiff;

fn config() -> HfModelConfig {
    HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 40,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 64,
    })
}

fn rel(a: Tensor<B, 1>, b: Tensor<B, 1>) -> f32 {
    let num = (a.clone() - b).powf_scalar(2.0).sum().into_scalar();
    let den = a.powf_scalar(2.0).sum().into_scalar();
    (num / den).sqrt()
}

/// Next-token loss of the model on fixed ids.
fn loss(model: &CausalLm<B>, ids: &Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [b, t] = ids.dims();
    let logits = model.forward_window(ids.clone(), None, None, 0, t - 1);
    log_probs_from_logits(logits, ids.clone().slice([0..b, 1..t]))
        .mean()
        .neg()
}

#[test]
fn bf16_model_follows_the_f32_model() {
    let device = Default::default();
    let ids: Vec<i64> = (0..4 * 12).map(|i| (i * 7 + 3) % 40).collect();
    let ids = Tensor::<B, 1, Int>::from_ints(ids.as_slice(), &device).reshape([4, 12]);
    let f32_model = CausalLm::<B>::init(&config(), 0.1, 7, &device);
    let bf16_model =
        CausalLm::<B>::init(&config(), 0.1, 7, &device).with_compute_dtype(ComputeDtype::Bf16);

    let logits = |m: &CausalLm<B>| m.forward(ids.clone(), None, None).flatten::<1>(0, 2);
    let (l32, l16) = (logits(&f32_model), logits(&bf16_model));
    assert_eq!(l16.dtype(), DType::F32, "bf16 products come back as f32");
    let r = rel(l32, l16);
    assert!(r > 0.0 && r < 2e-2, "logits differ by {r} (relative)");

    // One AdamW step each: the losses before and after agree within bf16 rounding, and every
    // parameter and gradient stays f32.
    let step = |m: CausalLm<B>| {
        let before = loss(&m, &ids);
        let grads = before.backward();
        let grads = GradientsParams::from_grads(grads, &m);
        let mut optim = AdamWConfig::new().init::<B, CausalLm<B>>();
        let m = optim.step(1e-3, m, grads);
        let after = loss(&m, &ids);
        (before.into_scalar(), after.into_scalar(), m)
    };
    let (b32, a32, m32) = step(f32_model);
    let (b16, a16, m16) = step(bf16_model);
    assert!((b32 - b16).abs() < 1e-2 * b32.abs(), "{b32} vs {b16}");
    assert!((a32 - a16).abs() < 1e-2 * a32.abs(), "{a32} vs {a16}");
    assert!(a16 < b16, "the bf16 step lowers the loss: {b16} -> {a16}");
    // Over all weights together: a single tensor can be all noise (the key bias's gradient is
    // zero in exact arithmetic, so AdamW's first step moves it by ±lr either way).
    let (mut diff, mut norm) = (0.0f32, 0.0f32);
    for (w32, w16) in m32.export_weights().into_iter().zip(m16.export_weights()) {
        assert_eq!(
            w16.values.dtype(),
            DType::F32,
            "{} is a master weight",
            w16.name
        );
        diff += (w32.values.clone() - w16.values)
            .powf_scalar(2.0)
            .sum()
            .into_scalar();
        norm += w32.values.powf_scalar(2.0).sum().into_scalar();
    }
    let r = (diff / norm).sqrt();
    assert!(r < 1e-2, "weights differ by {r} (relative)");
}

/// The frozen reference keeps its product matrices in bf16 (`with_bf16_products`): the logits
/// are the f32-matrix model's to the bit (every bf16 product casts its matrix anyway), and the
/// matrices take half the bytes.
#[test]
fn bf16_products_give_the_same_logits_to_the_bit() {
    type I = verl_core::backend::CpuBackend;
    let device = Default::default();
    let ids: Vec<i64> = (0..3 * 10).map(|i| (i * 11 + 5) % 40).collect();
    let ids = Tensor::<I, 1, Int>::from_ints(ids.as_slice(), &device).reshape([3, 10]);
    let model =
        CausalLm::<I>::init(&config(), 0.1, 9, &device).with_compute_dtype(ComputeDtype::Bf16);
    let low = model.clone().with_bf16_products();
    let logits = |m: &CausalLm<I>| m.forward(ids.clone(), None, None).into_data();
    assert_eq!(logits(&model), logits(&low));
    let bytes = |m: &CausalLm<I>| -> usize {
        m.export_shards()
            .iter()
            .map(|t| t.values.clone().into_data().bytes.len())
            .sum()
    };
    let (full, half) = (bytes(&model), bytes(&low));
    assert!(half < full * 3 / 4, "{half} of {full} bytes");
    // With f32 products nothing changes.
    let f32_model = CausalLm::<I>::init(&config(), 0.1, 9, &device).with_bf16_products();
    assert_eq!(bytes(&f32_model), full);
}

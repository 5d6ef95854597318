//! `verl bench moe`: Qwen2-MoE's expert block with token dispatch (each token through its k
//! experts) against the dense form (every expert on every token), forward and forward +
//! backward, on one device (peer: bench/peers/moe.py, transformers' per-expert loop).

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use verl::backend::{DefaultAutodiff, DefaultBackend};
use verl::megatron::hf::{Architecture, HfModelConfig, MoeConfig, Qwen2Dims};
use verl::megatron::layers::precision::{self, ComputeDtype};
use verl::megatron::models::feed_forward::FeedForward;
use verl::megatron::models::sparse_moe::SparseMoe;
use verl::megatron::models::CausalLm;
use verl::megatron::parallel::ParallelBackend;

use super::median;

/// The shape of one MoE block.
pub(crate) struct MoeShape {
    pub hidden: usize,
    pub moe_ffn: usize,
    pub shared_ffn: usize,
    pub top_k: usize,
    pub tokens: usize,
}

fn block<B: ParallelBackend>(shape: &MoeShape, experts: usize, device: &B::Device) -> SparseMoe<B> {
    let mut cfg = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 256,
        hidden_size: shape.hidden,
        intermediate_size: shape.shared_ffn,
        num_hidden_layers: 1,
        num_attention_heads: 16,
        num_key_value_heads: 4,
        max_position_embeddings: 4096,
    });
    cfg.architecture = Architecture::Qwen2Moe;
    cfg.moe = Some(MoeConfig {
        num_experts: experts,
        num_experts_per_tok: shape.top_k,
        moe_intermediate_size: shape.moe_ffn,
        shared_expert_intermediate_size: shape.shared_ffn,
        norm_topk_prob: false,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        routing: Default::default(),
    });
    let model = CausalLm::<B>::init(&cfg, 0.02, 0, device);
    match model.layers.into_iter().next().map(|l| l.mlp) {
        Some(FeedForward::Moe(m)) => m,
        _ => unreachable!("a one-layer Qwen2-MoE model has an expert block"),
    }
}

/// Median seconds of `repeat` synced runs of `f` after one warm-up.
fn time<B: Backend>(device: &B::Device, repeat: usize, mut f: impl FnMut()) -> f64 {
    f();
    let _ = B::sync(device);
    let times = (0..repeat)
        .map(|_| {
            let t = Instant::now();
            f();
            let _ = B::sync(device);
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(times)
}

fn backward<B: AutodiffBackend>(y: Tensor<B, 3>) {
    let _ = y.powi_scalar(2).mean().backward();
}

/// Times the block at each expert count: dispatch and dense, forward alone and with backward.
pub(crate) fn moe(
    experts: &[usize],
    shape: &MoeShape,
    dtype: &str,
    repeat: usize,
) -> Result<(), String> {
    let compute: ComputeDtype = dtype
        .parse()
        .map_err(|e: verl::megatron::MegatronError| e.to_string())?;
    let device = Default::default();
    println!(
        "MoE block: {} tokens, hidden {}, expert ffn {}, shared ffn {}, top-{}, {compute} products",
        shape.tokens, shape.hidden, shape.moe_ffn, shape.shared_ffn, shape.top_k
    );
    println!("experts | path     | forward ms | fwd+bwd ms | forward TFLOP/s (routed+shared)");
    for &e in experts {
        if shape.top_k > e {
            return Err(format!("--top-k {} exceeds --experts {e}", shape.top_k));
        }
        let _precision = precision::enter(compute);
        let x = Tensor::<DefaultBackend, 3>::random(
            [1, shape.tokens, shape.hidden],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let inference = block::<DefaultBackend>(shape, e, &device);
        let training = block::<DefaultAutodiff>(shape, e, &device);
        let xa = Tensor::<DefaultAutodiff, 3>::from_inner(x.clone());
        // Dispatch must give the dense form's output: checked before timing.
        let (d, full) = (
            inference.forward(x.clone()),
            inference.forward_dense(x.clone()),
        );
        let scale = full.clone().abs().max().into_scalar().elem::<f64>();
        let diff = (d - full).abs().max().into_scalar().elem::<f64>();
        println!(
            "{e:>7} | check    | max |dispatch − dense| = {diff:.3e} (output max {scale:.3e})"
        );
        // 2 flops per multiply-add, 3 matrices per expert.
        let per_token =
            |k: usize| 6.0 * shape.hidden as f64 * (k * shape.moe_ffn + shape.shared_ffn) as f64;
        for (path, k) in [("dispatch", shape.top_k), ("dense", e)] {
            let dense = path == "dense";
            let fwd = time::<DefaultBackend>(&device, repeat, || {
                let y = match dense {
                    true => inference.forward_dense(x.clone()),
                    false => inference.forward(x.clone()),
                };
                drop(y);
            });
            let both = time::<DefaultBackend>(&device, repeat, || {
                let y = match dense {
                    true => training.forward_dense(xa.clone()),
                    false => training.forward(xa.clone()),
                };
                backward(y);
            });
            let tflops = per_token(k) * shape.tokens as f64 / fwd / 1e12;
            println!(
                "{e:>7} | {path:<8} | {:>10.2} | {:>10.2} | {tflops:.1}",
                fwd * 1e3,
                both * 1e3
            );
        }
    }
    Ok(())
}

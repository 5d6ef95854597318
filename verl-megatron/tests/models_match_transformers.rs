//! Our decoders against transformers: logits on the committed fixtures (f32, max relative
//! error ≤ 1e-4) and greedy continuations token for token.

mod common;
use common::fixture;

use burn::tensor::{Int, Tensor, TensorData};
use verl_core::backend::CpuBackend as B;
use verl_megatron::hf::{HfCheckpoint, HfModelConfig};
use verl_megatron::models::CausalLm;

fn load(name: &str) -> CausalLm<B> {
    let cfg = HfModelConfig::from_dir(fixture(name)).unwrap();
    let ckpt = HfCheckpoint::open(fixture(name)).unwrap();
    CausalLm::from_checkpoint(&cfg, &ckpt, &Default::default()).unwrap()
}

fn reference(name: &str) -> (Tensor<B, 2, Int>, Vec<f32>, serde_json::Value) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let ids_v: Vec<i64> = ids
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids_v, ids.shape().to_vec()),
        &Default::default(),
    );
    let logits: Vec<f32> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    (ids, logits, json)
}

fn check_logits(name: &str) {
    let model = load(name);
    let (ids, expected, _) = reference(name);
    let got: Vec<f32> = model.forward(ids, None, None).to_data().to_vec().unwrap();
    assert_eq!(got.len(), expected.len());
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max_err = got
        .iter()
        .zip(&expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{name}: max relative logit error {:.2e}", max_err / scale);
    assert!(
        max_err / scale <= 1e-4,
        "{name}: max |Δ| {max_err} vs max |logit| {scale} (relative {})",
        max_err / scale
    );
}

fn check_greedy(name: &str) {
    let model = load(name);
    let (_, _, json) = reference(name);
    let prompt: Vec<i64> = json["greedy_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    let expected: Vec<i64> = json["greedy_output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    let mut seq = prompt.clone();
    while seq.len() < expected.len() {
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(seq.clone(), [1, seq.len()]),
            &Default::default(),
        );
        let logits = model.forward(ids, None, None);
        let [_, t, v] = logits.dims();
        let last: Vec<f32> = logits
            .narrow(1, t - 1, 1)
            .reshape([v])
            .to_data()
            .to_vec()
            .unwrap();
        let next = last
            .iter()
            .enumerate()
            .fold(
                (0, f32::MIN),
                |best, (i, &x)| if x > best.1 { (i, x) } else { best },
            )
            .0;
        seq.push(next as i64);
    }
    assert_eq!(
        seq, expected,
        "{name}: greedy continuation differs from transformers"
    );
}

#[test]
fn qwen2_matches_transformers() {
    check_logits("qwen2");
    check_greedy("qwen2");
}

#[test]
fn sharded_transformers_4_checkpoint_matches_too() {
    check_logits("qwen2_sharded_tf4");
}

#[test]
fn llama3_with_rope_scaling_matches_transformers() {
    check_logits("llama3");
    check_greedy("llama3");
}

#[test]
fn qwen3_matches_transformers() {
    check_logits("qwen3");
    check_greedy("qwen3");
}

#[test]
fn qwen2_moe_matches_transformers() {
    check_logits("qwen2_moe");
    check_greedy("qwen2_moe");
}

#[test]
fn padding_does_not_change_the_logits_of_real_tokens() {
    // Left padding with the attention mask and shifted positions gives the same logits as the
    // unpadded sequence.
    let model = load("qwen2");
    let d = Default::default();
    let plain = Tensor::<B, 2, Int>::from_ints([[5, 9, 14, 3]], &d);
    let padded = Tensor::<B, 2, Int>::from_ints([[0, 0, 5, 9, 14, 3]], &d);
    let mask = Tensor::<B, 2>::from_floats([[0., 0., 1., 1., 1., 1.]], &d);
    let pos = Tensor::<B, 2, Int>::from_ints([[0, 0, 0, 1, 2, 3]], &d);
    let a: Vec<f32> = model.forward(plain, None, None).to_data().to_vec().unwrap();
    let b: Vec<f32> = model
        .forward(padded, Some(mask), Some(pos))
        .narrow(1, 2, 4)
        .to_data()
        .to_vec()
        .unwrap();
    let err = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err < 1e-4, "{err}");
}

#[test]
fn qwen2_moe_with_renormalised_routing_matches_transformers() {
    check_logits("qwen2_moe_norm_topk");
    check_greedy("qwen2_moe_norm_topk");
    // The two MoE fixtures share weights: renormalising the routing must change the outputs.
    let (ids, a, _) = reference("qwen2_moe");
    let (_, b, _) = reference("qwen2_moe_norm_topk");
    assert_ne!(a, b);
    let _ = ids;
}

#[test]
fn qwen3_moe_matches_transformers() {
    // Qwen3's q/k norms, routed experts with renormalised weights and no shared expert, and a
    // dense MLP in layer 1 (mlp_only_layers); the config names the experts `num_local_experts`,
    // as transformers 5.17 writes it.
    let cfg = HfModelConfig::from_dir(fixture("qwen3_moe")).unwrap();
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(cfg.architecture, verl_megatron::hf::Architecture::Qwen3Moe);
    assert_eq!(
        (moe.num_experts, moe.shared_expert_intermediate_size),
        (4, 0)
    );
    assert!(moe.norm_topk_prob && moe.is_moe_layer(0) && !moe.is_moe_layer(1));
    check_logits("qwen3_moe");
    check_greedy("qwen3_moe");
}

#[test]
fn mixtral_matches_transformers() {
    // Llama's attention, 4 experts of intermediate_size in both layers, top-2 renormalised,
    // stored as block_sparse_moe.experts.{e}.w1/w3/w2 (renamed on load).
    let cfg = HfModelConfig::from_dir(fixture("mixtral")).unwrap();
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(cfg.architecture, verl_megatron::hf::Architecture::Mixtral);
    assert_eq!(
        (
            moe.num_experts,
            moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size
        ),
        (4, 64, 0)
    );
    assert!(moe.norm_topk_prob && moe.is_moe_layer(0) && moe.is_moe_layer(1));
    check_logits("mixtral");
    check_greedy("mixtral");
}

#[test]
fn mistral_matches_transformers() {
    // Llama's layers without biases, head_dim 16 against hidden / heads = 8 (as Mistral-Nemo),
    // no sliding window.
    let cfg = HfModelConfig::from_dir(fixture("mistral")).unwrap();
    assert_eq!(cfg.architecture, verl_megatron::hf::Architecture::Mistral);
    assert_eq!(cfg.head_dim, 16);
    check_logits("mistral");
    check_greedy("mistral");
}

#[test]
fn linear_and_yarn_rope_scaling_match_transformers() {
    use verl_megatron::hf::RopeScaling;
    let linear = HfModelConfig::from_dir(fixture("llama_rope_linear")).unwrap();
    assert_eq!(linear.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    check_logits("llama_rope_linear");
    check_greedy("llama_rope_linear");
    let yarn = HfModelConfig::from_dir(fixture("qwen3_yarn")).unwrap();
    match yarn.rope_scaling {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } => {
            assert_eq!((factor, original_max_position_embeddings), (4.0, 64));
            assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        }
        other => panic!("{other:?}"),
    }
    check_logits("qwen3_yarn");
    check_greedy("qwen3_yarn");
}

#[test]
fn sliding_window_attention_matches_transformers() {
    // A window of 4 keys, shorter than the test sequences: on every Mistral layer, and on
    // Qwen2's layers from max_window_layers (1) on.
    let mistral = HfModelConfig::from_dir(fixture("mistral_sliding")).unwrap();
    assert_eq!(mistral.variants.sliding_window, Some(4));
    assert_eq!(mistral.variants.sliding_layers, vec![true, true]);
    let qwen2 = HfModelConfig::from_dir(fixture("qwen2_sliding")).unwrap();
    assert_eq!(
        (
            qwen2.variants.sliding_window_of(0),
            qwen2.variants.sliding_window_of(1)
        ),
        (None, Some(4))
    );
    for name in ["mistral_sliding", "qwen2_sliding"] {
        check_logits(name);
        check_greedy(name);
    }
    // The window matters: without it the same weights give other logits.
    let mut full = mistral.clone();
    full.variants = Default::default();
    let ckpt = HfCheckpoint::open(fixture("mistral_sliding")).unwrap();
    let model = CausalLm::<B>::from_checkpoint(&full, &ckpt, &Default::default()).unwrap();
    let (ids, expected, _) = reference("mistral_sliding");
    let got: Vec<f32> = model.forward(ids, None, None).to_data().to_vec().unwrap();
    let worst = got
        .iter()
        .zip(&expected)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst > 1e-2, "the window changed nothing ({worst})");
}

#[test]
fn gemma2_matches_transformers() {
    // Local (window 4) and global layers alternating, Gemma's zero-centred norms around both
    // sublayers, embeddings × √hidden, GeGLU, scores scaled by query_pre_attn_scalar (12, not
    // head_dim 16) and soft-capped at 4, logits soft-capped at 6.
    use verl_megatron::hf::{Activation, Architecture};
    let cfg = HfModelConfig::from_dir(fixture("gemma2")).unwrap();
    assert_eq!(cfg.architecture, Architecture::Gemma2);
    let v = &cfg.variants;
    assert_eq!(v.sliding_layers, vec![true, false]);
    assert_eq!(v.activation, Activation::GeluTanh);
    assert_eq!(
        (
            v.query_pre_attn_scalar,
            v.attn_logit_softcapping,
            v.final_logit_softcapping
        ),
        (Some(12.0), Some(4.0), Some(6.0))
    );
    check_logits("gemma2");
    check_greedy("gemma2");
}

#[test]
fn gemma3_matches_transformers() {
    // Gemma 2's layers with q/k norms, no attention soft-cap, a global layer between two local
    // ones, and the local layers' own rope (θ 10⁴, plain) beside the global one (θ 10⁶, linear
    // × 8), read from transformers 5's `rope_parameters` keyed by layer type.
    use verl_megatron::hf::RopeScaling;
    let cfg = HfModelConfig::from_dir(fixture("gemma3")).unwrap();
    assert_eq!(cfg.variants.sliding_layers, vec![true, false, true]);
    assert_eq!(
        (cfg.rope_theta, cfg.rope_scaling),
        (1e6, RopeScaling::Linear { factor: 8.0 })
    );
    assert_eq!(cfg.variants.local_rope, Some((1e4, RopeScaling::Default)));
    assert_eq!(cfg.variants.attn_logit_softcapping, None);
    check_logits("gemma3");
    check_greedy("gemma3");
}

#[test]
fn new_architectures_save_a_config_that_reads_back_the_same() {
    for name in ["mistral_sliding", "qwen2_sliding", "gemma2", "gemma3"] {
        let cfg = HfModelConfig::from_dir(fixture(name)).unwrap();
        let json = cfg.to_config_json().to_string();
        let back = HfModelConfig::from_json(&json, std::path::Path::new("config.json")).unwrap();
        assert_eq!(back, cfg, "{name}");
    }
}

#[test]
fn deepseek_v3_matches_transformers() {
    // Multi-head latent attention (a query rank of 16, or one q_proj; keys/values compressed to
    // 16, a rope part of 8 shared by the heads, values of 12, interleaved rope, YaRN with its
    // softmax mscale), a dense first layer, then 8 experts in 4 groups: sigmoid scores, the
    // selection bias, the 2 best groups, top-2 renormalised × 2.5, and an ungated shared expert.
    use verl_megatron::hf::{Architecture, MoeRouting};
    let cfg = HfModelConfig::from_dir(fixture("deepseek_v3")).unwrap();
    assert_eq!(cfg.architecture, Architecture::DeepseekV3);
    let mla = cfg.mla.as_ref().unwrap();
    assert_eq!(
        (
            mla.q_lora_rank,
            mla.qk_head_dim(),
            mla.v_head_dim,
            cfg.head_dim
        ),
        (Some(16), 16, 12, 16)
    );
    let m = 0.1 * 4f64.ln() + 1.0;
    assert!((mla.softmax_scale - m * m / 4.0).abs() < 1e-12);
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        moe.routing,
        MoeRouting::SigmoidGroups {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5
        }
    );
    assert!(!moe.is_moe_layer(0) && moe.is_moe_layer(1) && !moe.shared_expert_gated());
    for name in ["deepseek_v3", "deepseek_v3_no_q_lora"] {
        check_logits(name);
        check_greedy(name);
    }
    let back = cfg.to_config_json().to_string();
    assert_eq!(
        HfModelConfig::from_json(&back, std::path::Path::new("config.json")).unwrap(),
        cfg
    );
}

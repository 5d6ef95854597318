//! The critic's value head and the reward model's score head against transformers'
//! `Qwen2ForTokenClassification` / `Qwen2ForSequenceClassification`.

mod common;
use common::{fixture, load_model as load};

use burn::tensor::{Int, Tensor, TensorData};
use verl_core::backend::CpuBackend as B;
use verl_megatron::hf::{read_config_json, save_pretrained, HeadKind, HfCheckpoint, SaveOptions};
use verl_megatron::models::CausalLm;

fn reference(name: &str) -> (Tensor<B, 2, Int>, Vec<f32>) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let v: Vec<i64> = ids
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let ids = Tensor::from_data(
        TensorData::new(v, ids.shape().to_vec()),
        &Default::default(),
    );
    let scores = st
        .tensor("scores")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (ids, scores)
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(err / scale <= 1e-4, "max |Δ| {err} vs scale {scale}");
}

#[test]
fn value_head_matches_token_classification() {
    let (cfg, model) = load(&fixture("qwen2_value"));
    assert_eq!(cfg.head, HeadKind::TokenClassification { num_labels: 1 });
    let (ids, expected) = reference("qwen2_value");
    let values = model.forward(ids, None, None);
    assert_eq!(values.dims(), [2, 8, 1]);
    close(&values.to_data().to_vec::<f32>().unwrap(), &expected);
}

#[test]
fn score_head_matches_sequence_classification_at_the_last_token() {
    let (cfg, model) = load(&fixture("qwen2_reward"));
    assert_eq!(cfg.head, HeadKind::SequenceClassification { num_labels: 1 });
    let (ids, expected) = reference("qwen2_reward");
    let pooled = CausalLm::last_token_scores(model.forward(ids, None, None), None);
    assert_eq!(pooled.dims(), [2, 1]);
    close(&pooled.to_data().to_vec::<f32>().unwrap(), &expected);

    // With right padding the score is read at the last real token.
    let d = Default::default();
    let scores = Tensor::<B, 3>::from_floats([[[1.0], [2.0], [3.0]], [[4.0], [5.0], [6.0]]], &d);
    let mask = Tensor::<B, 2>::from_floats([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], &d);
    assert_eq!(
        CausalLm::last_token_scores(scores, Some(mask))
            .to_data()
            .to_vec::<f32>()
            .unwrap(),
        vec![2.0, 6.0]
    );
}

#[test]
fn heads_round_trip_through_save() {
    for name in ["qwen2_value", "qwen2_reward"] {
        let src = fixture(name);
        let (cfg, model) = load(&src);
        let out = tempfile::tempdir().unwrap();
        save_pretrained(
            &model.export_weights(),
            &read_config_json(&src).unwrap(),
            out.path(),
            SaveOptions::default(),
        )
        .unwrap();
        let (cfg2, _) = load(out.path());
        assert_eq!(cfg2, cfg);
        let (a, b) = (
            HfCheckpoint::open(&src).unwrap(),
            HfCheckpoint::open(out.path()).unwrap(),
        );
        for t in a.names() {
            assert_eq!(
                a.read_f32(t).unwrap(),
                b.read_f32(t).unwrap(),
                "{name}: {t}"
            );
        }
    }
}

/// A critic from an LM path (verl's `critic.model.path`): the LM checkpoint's backbone, tensor
/// for tensor, under a new value head; the LM head is not read. A checkpoint that has a value
/// head already loads whole.
#[test]
fn a_value_model_starts_from_a_causal_lm_backbone() {
    use verl_megatron::hf::HfModelConfig;
    use verl_megatron::models::causal_lm::PipelineStageLayout;
    use verl_megatron::parallel::TpGroup;
    let device = Default::default();
    let dir = fixture("qwen2");
    let lm = HfModelConfig::from_dir(&dir).unwrap();
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let whole = PipelineStageLayout::whole(lm.num_hidden_layers);
    let value = CausalLm::<B>::value_model_from_checkpoint_stage(
        &lm,
        &ckpt,
        (0.02, 7),
        &device,
        &TpGroup::none(),
        &whole,
    )
    .unwrap();
    let weights = value.export_weights();
    let get = |name: &str| weights.iter().find(|w| w.name == name);
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ] {
        let mine: Vec<f32> = get(name)
            .unwrap()
            .values
            .clone()
            .into_data()
            .to_vec()
            .unwrap();
        let theirs: Vec<f32> = ckpt
            .load::<B, 1>(name, &device)
            .or_else(|_| ckpt.load::<B, 2>(name, &device).map(|t| t.flatten(0, 1)))
            .unwrap()
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(mine, theirs, "{name}");
    }
    let score = get("score.weight").expect("a value head");
    assert_eq!(score.shape, [1, lm.hidden_size]);
    assert!(get("lm_head.weight").is_none());
    let drawn: Vec<f32> = score.values.clone().into_data().to_vec().unwrap();
    assert!(drawn.iter().any(|v| *v != 0.0) && drawn.iter().all(|v| v.abs() < 0.2));

    // A saved critic (a token-classification checkpoint) keeps its own head.
    let dir = fixture("qwen2_value");
    let ckpt = HfCheckpoint::open(&dir).unwrap();
    let saved = HfModelConfig::from_dir(&dir).unwrap();
    let value = CausalLm::<B>::value_model_from_checkpoint_stage(
        &saved,
        &ckpt,
        (0.02, 7),
        &device,
        &TpGroup::none(),
        &PipelineStageLayout::whole(saved.num_hidden_layers),
    )
    .unwrap();
    let score = value
        .export_weights()
        .into_iter()
        .find(|w| w.name == "score.weight")
        .unwrap();
    let want: Vec<f32> = ckpt
        .load::<B, 2>("score.weight", &device)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(score.values.into_data().to_vec::<f32>().unwrap(), want);
}

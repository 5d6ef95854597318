//! A model's shard slices (what a layout-independent checkpoint records) place every tensor-
//! parallel shard exactly where it sits in the full tensor: cutting the full tensor by the slice
//! gives the shard, and placing both ranks' shards rebuilds the full tensor, vocabulary padding
//! included.

use std::collections::HashMap;
use std::sync::Arc;

use verl_core::traits::Communicator;
use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::{LocalCommunicator, TpGroup};

type B = verl_core::backend::CpuBackend;

fn values(t: &verl_core::NamedTensor<B>) -> Vec<f32> {
    t.values.to_data().convert::<f32>().to_vec::<f32>().unwrap()
}

#[test]
fn shards_cut_from_and_place_into_the_full_tensors() {
    let mut cfg = HfModelConfig::qwen2(Qwen2Dims {
        // 17 rows do not split evenly over 2 ranks: rank 1 holds 8 real rows and 1 of padding.
        vocab_size: 17,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 2,
        max_position_embeddings: 16,
    });
    cfg.tie_word_embeddings = false;
    let device = Default::default();
    let full: HashMap<String, Vec<f32>> = CausalLm::<B>::init(&cfg, 0.2, 5, &device)
        .export_shards()
        .iter()
        .map(|t| (t.name.clone(), values(t)))
        .collect();
    let whole = CausalLm::<B>::init(&cfg, 0.2, 5, &device).shard_slices();
    assert!(
        whole.values().all(|s| s.dim.is_none()),
        "tp=1 holds whole tensors"
    );
    let mut rebuilt: HashMap<String, Vec<f32>> = full
        .iter()
        .map(|(name, v)| (name.clone(), vec![f32::NAN; v.len()]))
        .collect();
    let mut split_dims = Vec::new();
    for comm in LocalCommunicator::group(2) {
        let comm: Arc<dyn Communicator<B>> = Arc::new(comm);
        let tp = TpGroup::new(comm, false);
        let model = CausalLm::<B>::init_sharded(&cfg, 0.2, 5, &device, &tp).unwrap();
        let slices = model.shard_slices();
        for t in model.export_shards() {
            let slice = &slices[&t.name];
            let shard = values(&t);
            assert_eq!(slice.cut(&full[&t.name], &t.shape), shard, "{}", t.name);
            slice.place(&shard, &t.shape, rebuilt.get_mut(&t.name).unwrap());
            split_dims.push((t.name.clone(), slice.dim));
        }
    }
    for (name, v) in &full {
        assert_eq!(&rebuilt[name], v, "{name} rebuilt from its shards");
    }
    let dim = |name: &str| split_dims.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(dim("model.embed_tokens.weight"), Some(0));
    assert_eq!(dim("lm_head.weight"), Some(0));
    assert_eq!(dim("model.layers.0.self_attn.o_proj.weight"), Some(1));
    assert_eq!(dim("model.layers.1.mlp.up_proj.weight"), Some(0));
    assert_eq!(dim("model.norm.weight"), None);
}

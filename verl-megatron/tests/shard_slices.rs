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

/// The weights and AdamW moments of a tp=2 × dp=2 run whose distributed optimizer split the
/// moments over the data-parallel pair, saved as a dist checkpoint, load on tp=1 and tp=4 as
/// exactly those layouts' own shards; a missing rank directory is named, not papered over.
#[test]
fn a_dist_checkpoint_loads_on_other_tensor_parallel_sizes() {
    use verl_core::traits::{CheckpointBackend, CheckpointContents, CheckpointState};
    use verl_core::NamedTensor;
    use verl_megatron::checkpoint::{DistCheckpoint, ShardedCheckpoint};

    let mut cfg = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 17,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        max_position_embeddings: 16,
    });
    cfg.tie_word_embeddings = false;
    let device = Default::default();
    let scaled = |t: &NamedTensor<B>, name: String, k: f32| NamedTensor {
        name,
        shape: t.shape.clone(),
        values: t.values.clone() * k,
    };
    let dir = tempfile::tempdir().unwrap();
    let models = |tp: usize| -> Vec<CausalLm<B>> {
        LocalCommunicator::group(tp)
            .into_iter()
            .map(|comm| {
                let comm: Arc<dyn Communicator<B>> = Arc::new(comm);
                let tp = TpGroup::new(comm, false);
                CausalLm::<B>::init_sharded(&cfg, 0.2, 5, &device, &tp).unwrap()
            })
            .collect()
    };
    let saved = models(2);
    futures::executor::block_on(async {
        for dp_rank in 0..2 {
            for (tp_rank, model) in saved.iter().enumerate() {
                let shards = model.export_shards();
                // The distributed optimizer: dp rank 0 owns the even tensors, dp rank 1 the odd.
                let owned: Vec<&NamedTensor<B>> = shards
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| i % 2 == dp_rank)
                    .map(|(_, t)| t)
                    .collect();
                let mut optimizer = Vec::new();
                let mut times = serde_json::Map::new();
                for t in &owned {
                    optimizer.push(scaled(t, format!("optim/{}.exp_avg", t.name), 2.0));
                    optimizer.push(scaled(t, format!("optim/{}.exp_avg_sq", t.name), 3.0));
                    times.insert(t.name.clone(), serde_json::json!(7));
                }
                let state = CheckpointState {
                    model: shards.clone(),
                    optimizer,
                    extra: serde_json::json!({
                        "counters": {"updates": 7},
                        "optimizers": {"optim": {"step": 7, "moment_updates": times, "sharded_over": 2}},
                        "shards": model.shard_slices(),
                        "layout": {"tp_rank": tp_rank, "tp_size": 2, "pp_stage": 0, "pp_stages": 1},
                    }),
                };
                DistCheckpoint::new(dp_rank * 2 + tp_rank)
                    .save(dir.path(), &state, CheckpointContents::ALL)
                    .await
                    .unwrap();
            }
        }
    });
    let ckpt = ShardedCheckpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.ranks(), 4);
    assert!(ckpt.is_indexed());
    for tp in [1, 4] {
        for (rank, model) in models(tp).iter().enumerate() {
            let state = ckpt
                .load_for::<B>(
                    rank,
                    &model.shard_targets(),
                    CheckpointContents::ALL,
                    &device,
                )
                .unwrap();
            let want = model.export_shards();
            assert_eq!(state.model.len(), want.len());
            let by_name: HashMap<&str, &NamedTensor<B>> =
                state.model.iter().map(|t| (t.name.as_str(), t)).collect();
            let optim: HashMap<&str, &NamedTensor<B>> = state
                .optimizer
                .iter()
                .map(|t| (t.name.as_str(), t))
                .collect();
            for t in &want {
                let got = by_name[t.name.as_str()];
                assert_eq!(got.shape, t.shape, "tp={tp} rank {rank} {}", t.name);
                assert_eq!(values(got), values(t), "tp={tp} rank {rank} {}", t.name);
                // Every moment, whichever data-parallel rank owned it.
                let m1 = optim[format!("optim/{}.exp_avg", t.name).as_str()];
                let m2 = optim[format!("optim/{}.exp_avg_sq", t.name).as_str()];
                assert_eq!(values(m1), values(&scaled(t, String::new(), 2.0)));
                assert_eq!(values(m2), values(&scaled(t, String::new(), 3.0)));
            }
            let merged = &state.extra["optimizers"]["optim"];
            assert_eq!(merged["step"], 7);
            assert_eq!(
                merged["moment_updates"].as_object().unwrap().len(),
                want.len()
            );
            assert_eq!(state.extra["counters"]["updates"], 7);
            assert!(state.extra.get("shards").is_none());
        }
    }
    // Without tp rank 1 of both dp ranks, half of every split tensor is nowhere.
    for r in [1, 3] {
        std::fs::remove_dir_all(dir.path().join(format!("rank_{r:05}"))).unwrap();
    }
    let ckpt = ShardedCheckpoint::open(dir.path()).unwrap();
    let one = &models(1)[0];
    let err = match ckpt.load_for::<B>(0, &one.shard_targets(), CheckpointContents::MODEL, &device)
    {
        Ok(_) => panic!("a missing rank is an error"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("rank_* directory missing"), "{err}");
}

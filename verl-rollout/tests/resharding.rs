//! The hybrid engine's weight sync into a tensor-parallel rollout, on simulated ranks: every
//! training layout (tp ∈ {1, 2, 4}, pp ∈ {1, 2}) synced into every rollout tp ∈ {1, 2, 4}
//! leaves each rollout rank holding exactly its shard of the single-rank model, and greedy
//! generation on every rollout group gives the single-rank engine's tokens. The sync's peak
//! extra memory, measured with the counting allocator, stays within a bucket per rank.

use burn::tensor::Tensor;
use verl_core::backend::{CpuAutodiff, CpuBackend as B};
use verl_core::config::OptimConfig;
use verl_core::memory::CountingAllocator;
use verl_core::topology::{GroupKind, ParallelConfig, Topology};
use verl_core::traits::{ShardingManager, WeightSyncPlan};
use verl_core::NamedTensor;
use verl_megatron::hf::{HfModelConfig, Qwen2Dims};
use verl_megatron::models::causal_lm::PipelineStageLayout;
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::pipeline::stage_layers;
use verl_megatron::parallel::{ProcessGroups, TpGroup};
use verl_megatron::workers::TrainingRole;
use verl_megatron::workers::{ActorSettings, HybridShardingManager, MegatronActor, ModelOptimizer};
use verl_rollout::{
    Completion, EngineConfig, KvBudget, NativeRollout, Request, Sampler, SamplingParams,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Simulated ranks of several layouts in one process: one layout at a time (see
/// verl-megatron's tests/model_parallel.rs on burn's autodiff locks).
static ONE_LAYOUT_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

const ACTOR_SEED: u64 = 3;

/// 17 ids (padded on every tp > 1), 4 query and 4 key/value heads, tied embeddings (held by
/// both pipeline ends).
fn model_config(hidden: usize, layers: usize) -> HfModelConfig {
    HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 17,
        hidden_size: hidden,
        intermediate_size: hidden * 3 / 2,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        max_position_embeddings: 64,
    })
}

fn settings() -> ActorSettings {
    ActorSettings {
        mini_batch_rows: 4,
        micro_batch_rows: 2,
        log_prob_micro_batch_rows: 2,
        ppo_epochs: 1,
        shuffle: false,
        seed: 0,
        policy_loss: "vanilla".into(),
        loss_params: Default::default(),
        loss_agg_mode: verl_core::algorithms::aggregation::LossAggMode::TokenMean,
        loss_scale_factor: None,
        entropy_coeff: 0.0,
        use_kl_loss: false,
        kl_loss_coef: 0.0,
        kl_loss_type: "low_var_kl".parse().unwrap(),
        temperature: 1.0,
        bypass: None,
    }
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 4,
        prompt_length: 8,
        response_length: 6,
        kv_budget: KvBudget::Tokens(1 << 12),
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn requests() -> Vec<Request> {
    let prompts: [&[u32]; 5] = [&[1, 2, 3], &[4], &[5, 6, 7, 8, 9], &[16, 0], &[2, 2, 2, 2]];
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.to_vec(),
            sampler: Sampler::new(greedy, i as u64).unwrap(),
            max_new_tokens: 6,
        })
        .collect()
}

fn values(t: &verl_core::NamedTensor<B>) -> Vec<f32> {
    t.values.to_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// What one rollout rank ended with: its shards, its layout's slices and its generations.
struct RankResult {
    shards: Vec<verl_core::NamedTensor<B>>,
    slices: std::collections::BTreeMap<String, verl_core::weights::ShardSlice>,
    completions: Vec<Completion>,
    extra_bytes: u64,
    synced_bytes: usize,
}

/// Every rank of the layout: an actor stage of (tp, pp) initialised with `ACTOR_SEED`, a
/// rollout engine of tp `rollout_tp` initialised otherwise; sync, then generate greedily.
fn sync_and_generate(
    cfg: &HfModelConfig,
    (tp, pp, rollout_tp): (usize, usize, usize),
    bucket_bytes: usize,
    measure: bool,
) -> Vec<RankResult> {
    let world = num_integer_lcm(tp * pp, rollout_tp);
    let topo = Topology::new(
        ParallelConfig {
            tp,
            pp,
            ..Default::default()
        },
        world,
    )
    .unwrap()
    .with_rollout_tp(rollout_tp)
    .unwrap();
    let split = stage_layers(cfg.num_hidden_layers, pp, None, None).unwrap();
    let groups = ProcessGroups::<B>::local(&topo);
    let barrier = std::sync::Barrier::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                let coords = topo.coords(rank).unwrap();
                let split = split.clone();
                let barrier = &barrier;
                s.spawn(move || {
                    let device = Default::default();
                    let actor_tp = TpGroup::new(g.tp().clone(), false);
                    let stage = PipelineStageLayout::of(coords.pp_rank, split);
                    let mut model = CausalLm::<CpuAutodiff>::init_stage(
                        cfg, 0.2, ACTOR_SEED, &device, &actor_tp, &stage,
                    )
                    .unwrap();
                    // Random initialisation leaves each shard a view into its full tensor (a
                    // column slice is not contiguous, and flattening it copies); a trained or
                    // checkpoint-loaded model holds its own storage, as these copies do.
                    for t in model.export_shards() {
                        let values = Tensor::from_data(t.values.to_data(), &device);
                        model.load_shard(NamedTensor { values, ..t }).unwrap();
                    }
                    let optim = OptimConfig {
                        lr: 1e-3,
                        ..Default::default()
                    };
                    let mut actor = MegatronActor::new(
                        model,
                        ModelOptimizer::new(&optim, 1).unwrap(),
                        settings(),
                    );
                    if pp > 1 {
                        actor = actor.with_pipeline_parallel(g.pp().clone());
                    }
                    let rtp = TpGroup::new(g.get(GroupKind::RolloutTp).clone(), false);
                    let rollout_model =
                        CausalLm::<B>::init_sharded(cfg, 0.2, ACTOR_SEED + 1, &device, &rtp)
                            .unwrap();
                    let mut rollout =
                        NativeRollout::new(cfg.clone(), rollout_model, engine_config(), device)
                            .unwrap();
                    let mut manager = HybridShardingManager {
                        plan: WeightSyncPlan {
                            bucket_bytes,
                            shards_fit: rollout_tp == tp && pp == 1,
                        },
                        free_cache_engine: true,
                        release_weights: false,
                    };
                    barrier.wait();
                    let before = if measure {
                        CountingAllocator::reset_peak()
                    } else {
                        0
                    };
                    barrier.wait();
                    let report =
                        futures::executor::block_on(manager.enter(&actor, &mut rollout)).unwrap();
                    barrier.wait();
                    let extra_bytes = CountingAllocator::peak().saturating_sub(before);
                    let completions = rollout.generate(requests()).unwrap();
                    let model = rollout.model().unwrap();
                    RankResult {
                        shards: model.export_shards(),
                        slices: model.shard_slices(),
                        completions,
                        extra_bytes,
                        synced_bytes: report.bytes,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn num_integer_lcm(a: usize, b: usize) -> usize {
    let gcd = |mut x: usize, mut y: usize| {
        while y != 0 {
            (x, y) = (y, x % y);
        }
        x
    };
    a / gcd(a, b) * b
}

#[test]
fn every_training_layout_syncs_into_every_rollout_tp() {
    let _serial = ONE_LAYOUT_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let cfg = model_config(16, 2);
    let device = Default::default();
    let single = CausalLm::<B>::init(&cfg, 0.2, ACTOR_SEED, &device);
    let full: std::collections::HashMap<String, Vec<f32>> = single
        .export_shards()
        .iter()
        .map(|t| (t.name.clone(), values(t)))
        .collect();
    let want = NativeRollout::new(cfg.clone(), single, engine_config(), device)
        .unwrap()
        .generate(requests())
        .unwrap();
    assert!(want.iter().any(|c| c.tokens.len() > 1));
    for tp in [1, 2, 4] {
        for pp in [1, 2] {
            for rollout_tp in [1, 2, 4] {
                let what = format!("train tp={tp} pp={pp} → rollout tp={rollout_tp}");
                // A small bucket: many buckets, and a tensor larger than one travels alone.
                let results = sync_and_generate(&cfg, (tp, pp, rollout_tp), 2048, false);
                for (rank, r) in results.iter().enumerate() {
                    for t in &r.shards {
                        let slice = &r.slices[&t.name];
                        assert_eq!(
                            values(t),
                            slice.cut(&full[&t.name], &t.shape),
                            "{what}: rank {rank} {}",
                            t.name
                        );
                    }
                    assert_eq!(r.completions, want, "{what}: rank {rank} generations");
                }
            }
        }
    }
}

/// Gathering for a rollout of another layout holds at most a bucket of full tensors per rank
/// (and a few tensors' gather buffers) beyond what the rollout's own tensor-by-tensor replacement
/// costs, not the whole model; a bucket as large as the model holds all of it at once.
#[test]
fn a_weight_sync_holds_one_bucket_at_a_time() {
    let _serial = ONE_LAYOUT_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // 8 layers of hidden 64: ~1.1 MB of f32 weights; buckets of 4 and 64 KiB.
    let cfg = model_config(64, 8);
    let largest = (64 * 96 * 4) as u64;
    let peak = |layout, bucket| {
        let r = sync_and_generate(&cfg, layout, bucket, true);
        (r[0].extra_bytes, r[0].synced_bytes as u64, r.len() as u64)
    };
    // The same sync into a rollout of the actor's own layout (tp = 2): shards go over as they
    // are, nothing gathered; what remains is the replacement itself.
    let (baseline, _, _) = peak((2, 1, 2), 64 << 10);
    for bucket in [4usize << 10, 64 << 10] {
        let (extra, model_bytes, ranks) = peak((2, 1, 1), bucket);
        let gathered = extra.saturating_sub(baseline);
        // A few tensors' worth of gather buffers (the all-gather's pieces and result, the
        // in-process communicator's host copies), whichever way the ranks interleave.
        let bound = ranks * (bucket as u64 + 6 * largest);
        assert!(
            gathered <= bound,
            "bucket {bucket}: {gathered} bytes held for gathering over {ranks} ranks, bound \
             {bound} (model {model_bytes} per rank)"
        );
        assert!(
            model_bytes > 4 * (bucket as u64 + 3 * largest),
            "the bound is meaningful"
        );
    }
    let (extra, model_bytes, ranks) = peak((2, 1, 1), 64 << 20);
    assert!(
        extra.saturating_sub(baseline) > ranks * model_bytes * 9 / 10,
        "one bucket for the whole model: {extra} bytes"
    );
}

//! Data parallel on simulated ranks: one PPO update of the actor and of the critic on dp = 2 or
//! 4 ranks (each with its share of the mini-batch, gradients summed in buckets over a
//! `LocalCommunicator` group) gives the single rank's loss, gradient norm and updated weights,
//! also with the distributed optimizer (AdamW state sharded over the ranks).

use std::sync::Arc;

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl_core::algorithms::aggregation::LossAggMode;
use verl_core::backend::{CpuAutodiff, CpuBackend};
use verl_core::config::OptimConfig;
use verl_core::traits::{Actor, CheckpointContents, Communicator, Critic};
use verl_core::{DataProto, Metrics};
use verl_megatron::hf::{HeadKind, HfModelConfig, Qwen2Dims};
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::LocalCommunicator;
use verl_megatron::workers::TrainingRole;
use verl_megatron::workers::{
    ActorSettings, CriticSettings, MegatronActor, MegatronCritic, ModelOptimizer,
};

const ROWS: usize = 8;
const PROMPT: usize = 3;
const RESPONSE: usize = 4;

fn model_cfg() -> HfModelConfig {
    HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 19,
        hidden_size: 16,
        intermediate_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 64,
    })
}

/// A PPO batch with varied response lengths and seeded values.
fn batch() -> DataProto<CpuBackend> {
    let device = Default::default();
    let t = PROMPT + RESPONSE;
    let mut ids = Vec::new();
    let mut attn = Vec::new();
    let mut pos = Vec::new();
    let mut resp_mask = Vec::new();
    for r in 0..ROWS {
        let len = 1 + r % RESPONSE;
        for j in 0..t {
            ids.push(((r * 7 + j * 3) % 19) as i64);
            let live = j < PROMPT + len;
            attn.push(live as i64);
            pos.push(j as i64);
            if j >= PROMPT {
                resp_mask.push(live as i64);
            }
        }
    }
    let int2 = |v: Vec<i64>, w: usize| {
        Tensor::<CpuBackend, 2, Int>::from_data(TensorData::new(v, [ROWS, w]), &device)
    };
    let float2 = |f: &dyn Fn(usize) -> f32| {
        let v: Vec<f32> = (0..ROWS * RESPONSE).map(f).collect();
        Tensor::<CpuBackend, 2>::from_data(TensorData::new(v, [ROWS, RESPONSE]), &device)
    };
    let responses: Vec<i64> = (0..ROWS)
        .flat_map(|r| ids[r * t + PROMPT..(r + 1) * t].to_vec())
        .collect();
    let mut d = DataProto::new();
    d.insert_int("input_ids", int2(ids, t)).unwrap();
    d.insert_int("attention_mask", int2(attn, t)).unwrap();
    d.insert_int("position_ids", int2(pos, t)).unwrap();
    d.insert_int("responses", int2(responses, RESPONSE))
        .unwrap();
    d.insert_int("response_mask", int2(resp_mask, RESPONSE))
        .unwrap();
    d.insert_float("old_log_probs", float2(&|i| -2.5 - 0.1 * (i % 5) as f32))
        .unwrap();
    d.insert_float(
        "advantages",
        float2(&|i| ((i * 37) % 11) as f32 / 5.0 - 1.0),
    )
    .unwrap();
    d.insert_float("values", float2(&|i| ((i * 13) % 7) as f32 / 7.0))
        .unwrap();
    d.insert_float("returns", float2(&|i| ((i * 29) % 5) as f32 / 5.0))
        .unwrap();
    d
}

/// Adam divides each gradient by its own running magnitude, so an element whose summed
/// gradient nearly cancels gets an lr-sized step whose sign is decided by rounding: a different
/// (parallel) summation order then moves it differently. A larger `eps` keeps the step linear
/// in such tiny gradients, so the weights compare the parallel sums themselves.
fn optim() -> OptimConfig {
    OptimConfig {
        lr: 1e-2,
        eps: 1e-3,
        clip_grad: 0.5,
        ..Default::default()
    }
}

/// One update on `data` (this rank's share) with `rows_per_rank` rows per mini-batch.
fn update(
    data: DataProto<CpuBackend>,
    rows_per_rank: usize,
    micro: usize,
    comm: Option<Arc<dyn Communicator<CpuBackend>>>,
    distributed: bool,
) -> (Metrics, Metrics, Vec<Vec<f32>>, usize) {
    let token_mean = (LossAggMode::TokenMean, None);
    update_with(token_mean, data, rows_per_rank, micro, comm, distributed)
}

/// [`update`] with the actor's loss aggregation and `loss_scale_factor`.
fn update_with(
    (loss_agg_mode, loss_scale_factor): (LossAggMode, Option<f64>),
    data: DataProto<CpuBackend>,
    rows_per_rank: usize,
    micro: usize,
    comm: Option<Arc<dyn Communicator<CpuBackend>>>,
    distributed: bool,
) -> (Metrics, Metrics, Vec<Vec<f32>>, usize) {
    let device = Default::default();
    let settings = ActorSettings {
        mini_batch_rows: rows_per_rank,
        micro_batch_rows: micro,
        log_prob_micro_batch_rows: micro,
        ppo_epochs: 2,
        shuffle: false,
        seed: 0,
        policy_loss: "vanilla".into(),
        loss_params: Default::default(),
        loss_agg_mode,
        loss_scale_factor,
        entropy_coeff: 0.01,
        use_kl_loss: false,
        kl_loss_coef: 0.0,
        kl_loss_type: "low_var_kl".parse().unwrap(),
        temperature: 1.0,
        bypass: None,
    };
    let model = CausalLm::<CpuAutodiff>::init(&model_cfg(), 0.2, 7, &device);
    let optimizer = || {
        ModelOptimizer::new(&optim(), 10)
            .unwrap()
            .with_distributed_optimizer(distributed)
    };
    let mut actor = MegatronActor::new(model, optimizer(), settings);
    let mut vcfg = model_cfg();
    vcfg.head = HeadKind::TokenClassification { num_labels: 1 };
    vcfg.tie_word_embeddings = false;
    let value_model = CausalLm::<CpuAutodiff>::init(&vcfg, 0.2, 8, &device);
    let mut critic = MegatronCritic::new(
        value_model,
        optimizer(),
        CriticSettings {
            mini_batch_rows: rows_per_rank,
            micro_batch_rows: micro,
            forward_micro_batch_rows: micro,
            ppo_epochs: 2,
            shuffle: false,
            seed: 0,
            cliprange_value: 0.2,
            loss_agg_mode: LossAggMode::TokenMean,
        },
    );
    if let Some(c) = comm {
        // A small bucket, so the gradients go in several collectives.
        actor = actor.with_data_parallel(c.clone(), 500);
        critic = critic.with_data_parallel(c, 500);
    }
    let (am, cm) = futures::executor::block_on(async {
        (
            actor.update_policy(&data).await.unwrap(),
            critic.update_critic(&data).await.unwrap(),
        )
    });
    let optimizer_tensors = actor
        .checkpoint_state(CheckpointContents::ALL)
        .optimizer
        .len()
        + critic
            .checkpoint_state(CheckpointContents::ALL)
            .optimizer
            .len();
    let weights = actor
        .checkpoint_state(CheckpointContents::MODEL)
        .model
        .into_iter()
        .chain(critic.checkpoint_state(CheckpointContents::MODEL).model)
        .map(|t| t.values.into_data().to_vec::<f32>().unwrap())
        .collect();
    (am, cm, weights, optimizer_tensors)
}

/// verl's `loss_scale_factor` divides `seq-mean-token-sum-norm`'s loss: the first mini-batch's
/// policy loss (before any step) with twice the response width is half of the default's, which
/// divides by that width.
#[test]
fn loss_scale_factor_divides_seq_mean_token_sum_norm() {
    let data = batch();
    let width = data.int::<2>("responses").unwrap().dims()[1] as f64;
    let norm = LossAggMode::SeqMeanTokenSumNorm;
    let first = |factor| {
        let (m, ..) = update_with((norm, factor), data.clone(), ROWS, 3, None, false);
        m.0["actor/pg_loss"][0]
    };
    let (by_width, by_twice) = (first(None), first(Some(2.0 * width)));
    assert!(by_width.abs() > 1e-6, "a loss to compare: {by_width}");
    rel_close(
        by_twice,
        by_width / 2.0,
        "pg_loss with loss_scale_factor = 2 x width",
    );
    rel_close(
        first(Some(width)),
        by_width,
        "pg_loss with loss_scale_factor = width",
    );
}

fn rel_close(a: f64, b: f64, what: &str) {
    assert!(
        (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1e-3),
        "{what}: {a} vs {b}"
    );
}

fn check_dp(dp: usize, micro: usize, distributed: bool) {
    let data = batch();
    let (single_a, single_c, single_w, single_state) = update(data.clone(), ROWS, 3, None, false);
    let share = ROWS / dp;
    let results: Vec<(Metrics, Metrics, Vec<Vec<f32>>, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalCommunicator::group(dp)
            .into_iter()
            .enumerate()
            .map(|(r, c)| {
                let part = data.slice(r * share, (r + 1) * share).unwrap();
                s.spawn(move || update(part, share, micro, Some(Arc::new(c)), distributed))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let states: Vec<usize> = results.iter().map(|r| r.3).collect();
    if distributed {
        // Each rank keeps moments for its own parameters only: together, exactly the whole.
        assert_eq!(states.iter().sum::<usize>(), single_state, "{states:?}");
        assert!(states.iter().all(|&n| n < single_state), "{states:?}");
    } else {
        assert!(states.iter().all(|&n| n == single_state), "{states:?}");
    }
    for (r, (a, c, w, _)) in results.iter().enumerate() {
        for key in ["actor/pg_loss", "actor/grad_norm"] {
            for (x, y) in single_a.0[key].iter().zip(&a.0[key]) {
                rel_close(*x, *y, &format!("dp {dp} rank {r} {key}"));
            }
        }
        for key in ["critic/vf_loss", "critic/grad_norm"] {
            for (x, y) in single_c.0[key].iter().zip(&c.0[key]) {
                rel_close(*x, *y, &format!("dp {dp} rank {r} {key}"));
            }
        }
        let scale = single_w.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in single_w.iter().zip(w).enumerate() {
            for (p, q) in x.iter().zip(y) {
                assert!(
                    (p - q).abs() <= 1e-5 * scale,
                    "dp {dp} rank {r} tensor {i}: {p} vs {q}"
                );
            }
        }
        // Every rank applied the same reduced gradients: identical weights, bit for bit.
        assert_eq!(w, &results[0].2, "dp {dp} rank {r} drifted from rank 0");
    }
}

#[test]
fn two_data_parallel_ranks_update_as_one() {
    check_dp(2, 2, false);
    check_dp(2, 4, false);
}

#[test]
fn four_data_parallel_ranks_update_as_one() {
    check_dp(4, 1, false);
}

#[test]
fn the_distributed_optimizer_shards_adam_state_and_updates_as_one() {
    check_dp(2, 2, true);
    check_dp(4, 1, true);
}

//! The role workers through the worker group with verl's dispatch modes: on two data-parallel
//! ranks, rollout (MegatronPpAsDp), log-probs (MegatronCompute, OneToAll), reference log-probs
//! critic values and reward-model scores give what one rank gives.

use burn::module::AutodiffModule;
use verl::backend::{CpuAutodiff, CpuBackend};
use verl::config::OptimConfig;
use verl::dispatch::DispatchMode;

use verl::megatron::hf::{HeadKind, HfModelConfig, Qwen2Dims};
use verl::megatron::models::CausalLm;
use verl::megatron::workers::{
    ActorRolloutRefWorker, ActorSettings, CriticSettings, CriticWorker, HybridShardingManager,
    MegatronActor, MegatronCritic, ModelOptimizer, ParamOffload, ReferenceWorker,
    RewardModelWorker,
};
use verl::rollout::{EngineConfig, KvBudget, NativeRollout, SamplingParams};
use verl::topology::{ParallelConfig, Topology};
use verl::trainer::data::{prompt_batch, Codec, PromptRow};
use verl::worker::WorkerGroup;
use verl::DataProto;

fn model_cfg() -> HfModelConfig {
    let mut m = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: 17,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 256,
    });
    m.eos_token_ids = vec![1];
    m
}

fn settings() -> ActorSettings {
    ActorSettings {
        mini_batch_rows: 4,
        micro_batch_rows: 2,
        log_prob_micro_batch_rows: 3,
        ppo_epochs: 1,
        shuffle: false,
        seed: 0,
        policy_loss: "vanilla".into(),
        loss_params: Default::default(),
        loss_agg_mode: verl::algorithms::aggregation::LossAggMode::TokenMean,
        loss_scale_factor: None,
        entropy_coeff: 0.0,
        use_kl_loss: false,
        kl_loss_coef: 0.0,
        kl_loss_type: "low_var_kl".parse().unwrap(),
        temperature: 1.0,
        bypass: None,
    }
}

fn actor_group(world: usize) -> WorkerGroup<ActorRolloutRefWorker<CpuAutodiff>> {
    let topo = Topology::new(ParallelConfig::default(), world).unwrap();
    WorkerGroup::spawn(world, move |ctx| {
        let device = Default::default();
        let cfg = model_cfg();
        let model = CausalLm::<CpuAutodiff>::init(&cfg, 0.2, 3, &device);
        let inner = model.valid();
        let engine = EngineConfig {
            prompt_length: 8,
            response_length: 5,
            kv_budget: KvBudget::Tokens(1 << 12),
            sampling: SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
            n: 2,
            eos_token_ids: vec![1],
            ..Default::default()
        };
        let rollout = NativeRollout::new(cfg, inner.clone(), engine, device).unwrap();
        Ok(ActorRolloutRefWorker {
            coords: topo.coords(ctx.rank)?,
            actor: MegatronActor::new(
                model,
                ModelOptimizer::new(&OptimConfig::default(), 10).unwrap(),
                settings(),
            ),
            rollout: Box::new(rollout),
            reference: Some(inner),
            sharding: HybridShardingManager {
                free_cache_engine: true,
                ..Default::default()
            },
            reference_offload: None,
        })
    })
    .unwrap()
}

fn prompts() -> DataProto<CpuBackend> {
    let codec = Codec::Char(verl::tasks::CharTokenizer::arithmetic());
    let rows: Vec<PromptRow> = ["1+2=", "33+4=", "5+66=", "7+8=", "12+34=", "9+9="]
        .iter()
        .enumerate()
        .map(|(i, p)| PromptRow {
            prompt: p.to_string(),
            prompt_ids: codec.encode_prompt(p).unwrap(),
            data_source: "test".into(),
            ground_truth: i.to_string(),
            extra_info: serde_json::Value::Null,
        })
        .collect();
    let refs: Vec<&PromptRow> = rows.iter().collect();
    let mut batch = prompt_batch(&refs, 0, "t", &Default::default()).unwrap();
    batch.meta_info.insert("do_sample".into(), false.into());
    batch
}

fn host(d: &DataProto<CpuBackend>, key: &str) -> Vec<f32> {
    d.to_data(key).unwrap().convert::<f32>().to_vec().unwrap()
}

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
}

async fn run_all(world: usize) -> Vec<DataProto<CpuBackend>> {
    let g = actor_group(world);
    let gen = g
        .call_proto(
            &DispatchMode::MegatronPpAsDp,
            "generate_sequences",
            prompts(),
            |w, _, d| Box::pin(w.generate_sequences(d)),
        )
        .await
        .unwrap();
    let inputs = gen
        .select(
            Some(&[
                "input_ids",
                "attention_mask",
                "position_ids",
                "responses",
                "response_mask",
            ]),
            Some(&[]),
            None,
        )
        .unwrap();
    let lp = g
        .call_proto(
            &DispatchMode::MegatronCompute,
            "compute_log_prob",
            inputs.clone(),
            |w, _, d| Box::pin(w.compute_log_prob(d)),
        )
        .await
        .unwrap();
    // ONE_TO_ALL: every rank gets the whole batch.
    let all = g
        .execute_all("compute_log_prob", inputs.clone(), |w, _, d| {
            Box::pin(w.compute_log_prob(d))
        })
        .await
        .unwrap();
    assert_eq!(all.len(), world);
    for other in &all[1..] {
        assert_eq!(host(other, "old_log_probs"), host(&all[0], "old_log_probs"));
    }
    let lp_all = all.into_iter().next().unwrap();
    // RANK_ZERO: only rank 0 runs.
    let zero = g
        .execute_rank_zero("compute_log_prob", inputs.clone(), |w, _, d| {
            Box::pin(w.compute_log_prob(d))
        })
        .await
        .unwrap();
    assert_eq!(host(&zero, "old_log_probs"), host(&lp_all, "old_log_probs"));
    let reference = g
        .call_proto(
            &DispatchMode::MegatronCompute,
            "compute_ref_log_prob",
            inputs.clone(),
            |w, _, d| Box::pin(w.compute_ref_log_prob(d)),
        )
        .await
        .unwrap();
    // A reference on its own ranks (not colocated) gives the colocated one's log-probs.
    let ref_topo = Topology::new(ParallelConfig::default(), world).unwrap();
    let standalone = WorkerGroup::spawn(world, move |ctx| {
        Ok(ReferenceWorker {
            coords: ref_topo.coords(ctx.rank)?,
            model: Some(CausalLm::<CpuBackend>::init(
                &model_cfg(),
                0.2,
                3,
                &Default::default(),
            )),
            // Its weights wait in host memory between calls (`ref.megatron.param_offload`).
            offload: Some(ParamOffload::new(Box::new(
                verl::offload::OffloadManager::new("reference"),
            ))),
            temperature: 1.0,
            micro_batch_rows: 4,
        })
    })
    .unwrap();
    let standalone = standalone
        .call_proto(
            &DispatchMode::MegatronCompute,
            "compute_ref_log_prob",
            inputs.clone(),
            |w, _, d| Box::pin(w.compute_ref_log_prob(d)),
        )
        .await
        .unwrap();
    close(
        &host(&standalone, "ref_log_prob"),
        &host(&reference, "ref_log_prob"),
    );
    let critic_topo = Topology::new(ParallelConfig::default(), world).unwrap();
    let critic = WorkerGroup::spawn(world, move |ctx| {
        let mut cfg = model_cfg();
        cfg.head = HeadKind::TokenClassification { num_labels: 1 };
        cfg.tie_word_embeddings = false;
        let model = CausalLm::<CpuAutodiff>::init(&cfg, 0.2, 4, &Default::default());
        Ok(CriticWorker {
            coords: critic_topo.coords(ctx.rank)?,
            critic: MegatronCritic::new(
                model,
                ModelOptimizer::new(&OptimConfig::default(), 10).unwrap(),
                CriticSettings {
                    mini_batch_rows: 4,
                    micro_batch_rows: 2,
                    forward_micro_batch_rows: 5,
                    ppo_epochs: 1,
                    shuffle: false,
                    seed: 0,
                    cliprange_value: 0.5,
                    loss_agg_mode: verl::algorithms::aggregation::LossAggMode::TokenMean,
                },
            ),
        })
    })
    .unwrap();
    let values = critic
        .call_proto(
            &DispatchMode::MegatronCompute,
            "compute_values",
            inputs.clone(),
            |w, _, d| Box::pin(w.compute_values(d)),
        )
        .await
        .unwrap();
    let rm_topo = Topology::new(ParallelConfig::default(), world).unwrap();
    let rm = WorkerGroup::spawn(world, move |ctx| {
        let cfg = reward_model_cfg();
        let model = CausalLm::<CpuBackend>::init(&cfg, 0.2, 5, &Default::default());
        RewardModelWorker::new(rm_topo.coords(ctx.rank)?, &cfg, model, 2)
    })
    .unwrap();
    let scores = rm
        .call_proto(
            &DispatchMode::MegatronCompute,
            "compute_rm_score",
            inputs,
            |w, _, d| Box::pin(w.compute_rm_score(d)),
        )
        .await
        .unwrap();
    vec![gen, lp, lp_all, reference, values, scores]
}

fn reward_model_cfg() -> HfModelConfig {
    let mut cfg = model_cfg();
    cfg.head = HeadKind::SequenceClassification { num_labels: 1 };
    cfg.tie_word_embeddings = false;
    cfg
}

/// The reward model's score per sequence, naively: a full forward pass over each row alone,
/// read at its last attended token.
fn naive_rm_scores(gen: &DataProto<CpuBackend>) -> Vec<f32> {
    let model = CausalLm::<CpuBackend>::init(&reward_model_cfg(), 0.2, 5, &Default::default());
    (0..gen.len())
        .map(|i| {
            let row = gen.slice(i, i + 1).unwrap();
            let mask = verl::megatron::workers::batch::float_col(&row, "attention_mask").unwrap();
            let out = model.forward(
                row.int::<2>("input_ids").unwrap(),
                Some(mask.clone()),
                Some(row.int::<2>("position_ids").unwrap()),
            );
            CausalLm::last_token_scores(out, Some(mask))
                .into_data()
                .to_vec::<f32>()
                .unwrap()[0]
        })
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn two_data_parallel_ranks_match_one() {
    let one = run_all(1).await;
    let two = run_all(2).await;
    // Greedy rollout: the same responses, in the same order, with the uid of each prompt.
    // do_sample = false: greedy, one sample per prompt (as verl).
    assert_eq!(one[0].len(), 6);
    for key in [
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
    ] {
        assert_eq!(host(&one[0], key), host(&two[0], key), "{key}");
    }
    assert_eq!(
        one[0].non_tensor("uid").unwrap(),
        two[0].non_tensor("uid").unwrap()
    );
    // Log-probs split by dp (MegatronCompute) or computed whole on every rank (OneToAll).
    close(
        &host(&one[1], "old_log_probs"),
        &host(&two[1], "old_log_probs"),
    );
    close(
        &host(&one[1], "old_log_probs"),
        &host(&two[2], "old_log_probs"),
    );
    close(&host(&one[1], "entropys"), &host(&two[1], "entropys"));
    // generate_sequences recomputed the old log-probs with the actor: the same values.
    close(
        &host(&one[0], "old_log_probs"),
        &host(&one[1], "old_log_probs"),
    );
    close(
        &host(&two[0], "old_log_probs"),
        &host(&one[1], "old_log_probs"),
    );
    // The reference starts as the actor: the same log-probs.
    close(
        &host(&one[1], "old_log_probs"),
        &host(&two[3], "ref_log_prob"),
    );
    close(&host(&one[4], "values"), &host(&two[4], "values"));
    // Reward-model scores: the same on two ranks, one per row on its last response token,
    // equal to a naive full forward read at the last attended token.
    let scores = host(&one[5], "rm_scores");
    close(&scores, &host(&two[5], "rm_scores"));
    let mask = host(&one[0], "response_mask");
    let r = mask.len() / one[0].len();
    let naive = naive_rm_scores(&one[0]);
    for (i, want) in naive.iter().enumerate() {
        let len = mask[i * r..(i + 1) * r].iter().sum::<f32>() as usize;
        assert!(len > 0, "row {i} has a response");
        for j in 0..r {
            if j == len - 1 {
                assert!(
                    (scores[i * r + j] - want).abs() < 1e-4,
                    "row {i}: {} vs {want}",
                    scores[i * r + j]
                );
            } else {
                assert_eq!(scores[i * r + j], 0.0, "row {i} slot {j}");
            }
        }
    }
}

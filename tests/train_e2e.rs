//! End to end: the trainer learns with GRPO, PPO's critic learns its values, and a reward model
//! gives the rewards. Short runs on the built-in addition task (one digit), a tiny model from
//! scratch, on the CPU default.

use std::collections::BTreeMap;

mod common;

use verl::trainer::MAIN_JOB;
use verl::ConfigBuilder;

fn run<S: AsRef<str>>(
    overrides: &[S],
) -> (
    verl::trainer::RunSummary,
    Vec<BTreeMap<String, f64>>,
    tempfile::TempDir,
) {
    let dir = tempfile::tempdir().unwrap();
    let validated = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides(overrides.iter().map(AsRef::as_ref))
        .set("trainer.default_local_dir", dir.path().display())
        .build()
        .unwrap();
    let summary = common::fit(validated);
    let lines = common::step_lines(&summary.metrics_path);
    (summary, lines, dir)
}

/// The error of a job with `overrides` that is refused while the config or the trainer is
/// built (before any step runs). Each job has its own output directory: tests run at once, and
/// a shared one would be refused as in use (the run lock) before the setting under test.
fn refusal(overrides: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let refused = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides(overrides.iter().copied())
        .set("trainer.default_local_dir", dir.path().display())
        .build()
        .map(verl::trainer::PpoTrainer::new);
    match refused {
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
        Ok(Ok(_)) => panic!("accepted: {overrides:?}"),
    }
}

/// The metric lines that carry `key`, which must be `count` of them.
fn lines_with<'a>(
    lines: &'a [BTreeMap<String, f64>],
    key: &str,
    count: usize,
) -> Vec<&'a BTreeMap<String, f64>> {
    let found: Vec<_> = lines.iter().filter(|l| l.contains_key(key)).collect();
    assert_eq!(found.len(), count, "{count} lines with {key}: {lines:?}");
    found
}

fn mean_of(lines: &[BTreeMap<String, f64>], key: &str) -> f64 {
    let v: Vec<f64> = lines.iter().filter_map(|l| l.get(key).copied()).collect();
    assert!(!v.is_empty(), "no {key}");
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn grpo_raises_the_score() {
    let (summary, lines, _dir) = run(&[
        "trainer.sft_warmup_steps=120",
        "trainer.total_training_steps=80",
        // Validated once more after the last step.
        "trainer.test_freq=80",
        "actor_rollout_ref.actor.optim.lr=0.0003",
        // This short recipe learns at a constant rate (the main job decays it).
        "actor_rollout_ref.actor.optim.lr_decay_style=constant",
    ]);
    // The plot of score and response length is there, as a PNG.
    let png = std::fs::read(&summary.plot_path).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let before = summary.val_score_before.unwrap();
    let after = summary.val_score_after.unwrap();
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).cloned().collect();
    assert_eq!(steps.len(), 80);
    // verl's metric names are all there.
    for key in [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "critic/score/mean",
        "critic/rewards/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/step",
        "perf/throughput",
        // The rest of verl's compute_data_metrics / compute_timing_metrics.
        "critic/score/max",
        "critic/rewards/min",
        "critic/advantages/max",
        "critic/returns/min",
        "response_length/min",
        "prompt_length/mean",
        "prompt_length/max",
        "prompt_length/min",
        "prompt_length/clip_ratio",
        "perf/time_per_step",
        "timing_per_token_ms/gen",
        "timing_per_token_ms/update_actor",
        "training/global_step",
        "training/epoch",
    ] {
        assert!(steps[0].contains_key(key), "missing {key}");
    }
    let early = mean_of(&steps[..10], "critic/score/mean");
    let late = mean_of(&steps[70..], "critic/score/mean");
    assert!(late > early + 0.05, "training score {early:.3} → {late:.3}");
    // Validation rises by a margin, or (when the warm-up already got close) ends at the ceiling.
    assert!(
        after > before + 0.05 || (after >= 0.99 && after >= before),
        "validation score {before:.3} → {after:.3}"
    );
}

#[test]
fn ppo_with_a_critic_lowers_the_value_loss() {
    let (_, lines, _dir) = run(&[
        "algorithm.adv_estimator=gae",
        "critic.enable=true",
        "critic.optim.lr=0.001",
        "critic.ppo_micro_batch_size_per_gpu=64",
        "trainer.sft_warmup_steps=20",
        "trainer.total_training_steps=25",
        "trainer.val_before_train=false",
    ]);
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).cloned().collect();
    assert!(steps[0].contains_key("critic/vf_loss") && steps[0].contains_key("critic/values/mean"));
    let early = mean_of(&steps[..5], "critic/vf_loss");
    let late = mean_of(&steps[20..], "critic/vf_loss");
    assert!(late < early * 0.5, "value loss {early:.4} → {late:.4}");
    // verl's explained variance of the values: at most 1, and better late than early.
    let ev = |s: &[BTreeMap<String, f64>]| mean_of(s, "critic/vf_explained_var");
    assert!(steps.iter().all(|s| s["critic/vf_explained_var"] <= 1.0));
    assert!(
        ev(&steps[20..]) > ev(&steps[..5]),
        "explained variance {:.3} → {:.3}",
        ev(&steps[..5]),
        ev(&steps[20..])
    );
    for key in [
        "critic/values/max",
        "critic/values/min",
        "critic/returns/max",
        "timing_per_token_ms/values",
        "timing_per_token_ms/update_critic",
    ] {
        assert!(steps[0].contains_key(key), "missing {key}");
    }
}

/// A reward model whose score is 0.25 at every token (zero score weights, bias 0.25), saved
/// as a Hugging Face directory sharing the addition task's character vocabulary.
fn constant_reward_model(dir: &std::path::Path) {
    use verl::megatron::hf::{save_pretrained, HeadKind, HfModelConfig, Qwen2Dims, SaveOptions};
    use verl::megatron::models::CausalLm;
    use verl::NamedTensor;
    let mut cfg = HfModelConfig::qwen2(Qwen2Dims {
        vocab_size: verl::tasks::CharTokenizer::arithmetic().vocab_size(),
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 256,
    });
    cfg.head = HeadKind::TokenClassification { num_labels: 1 };
    cfg.tie_word_embeddings = false;
    let device = Default::default();
    let model = CausalLm::<verl::backend::CpuBackend>::init(&cfg, 0.02, 1, &device);
    let weights: Vec<_> = model
        .export_weights()
        .into_iter()
        .map(|t| match t.name.as_str() {
            "score.weight" => NamedTensor::new(
                "score.weight",
                burn::tensor::Tensor::<_, 2>::zeros([1, 32], &device),
            ),
            "score.bias" => NamedTensor::new(
                "score.bias",
                burn::tensor::Tensor::<_, 1>::full([1], 0.25, &device),
            ),
            _ => t,
        })
        .collect();
    save_pretrained(&weights, &cfg.to_config_json(), dir, SaveOptions::default()).unwrap();
}

#[test]
fn a_reward_model_gives_the_rewards() {
    let rm = tempfile::tempdir().unwrap();
    constant_reward_model(rm.path());
    let (summary, lines, _dir) = run(&[
        "reward_model.enable=true".to_string(),
        format!("reward_model.model.path={}", rm.path().display()),
        "trainer.sft_warmup_steps=0".into(),
        "trainer.total_training_steps=3".into(),
    ]);
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).cloned().collect();
    assert_eq!(steps.len(), 3);
    for s in &steps {
        // Every sequence scores 0.25: the score, the rewards (no KL in reward) and the GRPO
        // advantages (equal scores in every group) follow by hand.
        assert!((s["critic/score/mean"] - 0.25).abs() < 1e-5, "{s:?}");
        assert!((s["critic/rewards/mean"] - 0.25).abs() < 1e-5, "{s:?}");
        assert!(s["critic/advantages/mean"].abs() < 1e-6, "{s:?}");
        assert!(s.contains_key("timing_s/rm"));
    }
    assert_eq!(summary.steps, 3);
}

/// A PPO job (with a critic) on `layout` logs the single rank's metrics: the warm-up and the
/// first steps agree within float tolerance (the ranks are threads with in-process
/// communicators on the CPU default).
fn trains_as_one_rank(layout: &[&str]) {
    trains_as_one_rank_from(&[], layout);
}

/// [`trains_as_one_rank`] with `base` overrides in both runs.
fn trains_as_one_rank_from(base: &[&str], layout: &[&str]) {
    // Two tensor-parallel groups training at once in one process can deadlock in burn's
    // autodiff clean-up (see `PipelineStage::before_backward`): one layout at a time.
    static ONE_LAYOUT_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = ONE_LAYOUT_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let common = [
        "algorithm.adv_estimator=gae",
        "critic.enable=true",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "trainer.sft_warmup_steps=8",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
    ];
    let mut single = common.to_vec();
    single.extend(base);
    let (_, one, _d1) = run(&single);
    let mut overrides = common.to_vec();
    overrides.extend(layout);
    let (_, many, _d2) = run(&overrides);
    common::assert_same_metrics(&one, &many, &format!("{layout:?}"));
}

/// tp = 2 × dp = 2, sequence parallel on (verl's default).
#[test]
fn four_ranks_with_tensor_parallel_train_as_one() {
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
    ]);
}

/// pp = 2 × tp = 2: the actor and critic as pipeline stages (1F1B), the rollout fed the whole
/// model gathered from both stages.
#[test]
fn four_ranks_with_pipeline_and_tensor_parallel_train_as_one() {
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
        "critic.megatron.pipeline_model_parallel_size=2",
    ]);
}

/// The rollout on its own tensor-parallel groups: tp = 2 like the actor's (each rank's shards
/// go over as they are), and tp = 2 under a pp = 2 × dp = 2 actor (the stages send their
/// buckets over, each rollout rank cuts its shard from the full weights, the old log-probs are
/// a separate pass).
#[test]
fn a_tensor_parallel_rollout_trains_as_one() {
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ]);
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1",
    ]);
}

/// Context parallel: cp = 2 × tp = 2 (sequence parallel on) for actor, reference and critic;
/// each rank runs its two chunks of every sequence, log-probs and values gathered back.
#[test]
fn context_parallel_trains_as_one() {
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
        "critic.megatron.context_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ]);
}

/// Expert parallel on a Qwen2-MoE model (4 experts, top 2, Megatron's load-balancing loss at
/// 0.01, `actor/moe_aux_loss` compared like every metric): ep = 2 with tp = 2 and its
/// experts split over etp = 1 (each tp rank routes half the tokens), and ep = 2 × cp = 2 with
/// experts following tp = 1; actor, reference and critic; the rollout gets every expert.
#[test]
fn expert_parallel_trains_as_one() {
    let moe = [
        "+actor_rollout_ref.model.override_config.num_experts=4",
        "+actor_rollout_ref.model.override_config.moe_intermediate_size=64",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
        "+critic.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ];
    let with = |layout: &[&'static str]| -> Vec<&'static str> {
        moe.iter().chain(layout).copied().collect()
    };
    trains_as_one_rank_from(
        &moe,
        &with(&[
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
            "critic.megatron.expert_model_parallel_size=2",
        ]),
    );
    trains_as_one_rank_from(
        &moe,
        &with(&[
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        ]),
    );
}

/// Step lines without `rollout/peak_batch`: the engine's peak batch depends on how the rows
/// split over rollout groups (a KV budget per group), a scheduling figure, not the model's.
fn drop_peak(lines: Vec<BTreeMap<String, f64>>) -> Vec<BTreeMap<String, f64>> {
    lines
        .into_iter()
        .map(|mut l| {
            l.remove("rollout/peak_batch");
            l
        })
        .collect()
}

/// Qwen3-MoE and Mixtral checkpoints from Hugging Face (the transformers fixtures: q/k norms, 4
/// routed experts with renormalised weights, no shared expert, layer 1 dense; Llama attention
/// and experts stored as `block_sparse_moe.*.w1/w3/w2`) train with GRPO from their paths, their
/// own tokenizers and chat templates; on tp = 2 × ep = 2 (etp = 1) each logs the single rank's
/// metrics.
#[test]
fn qwen3_moe_and_mixtral_checkpoints_train_and_expert_parallel_matches_one_rank() {
    for name in ["qwen3_moe", "mixtral"] {
        moe_checkpoint_trains_as_one_rank(name);
    }
}

/// DeepSeek-V3 (latent attention, sigmoid group-limited routing, a dense first layer) trains
/// with GRPO from its transformers fixture, and on tp = 2 × ep = 2 logs the single rank's
/// metrics.
#[test]
fn a_deepseek_v3_checkpoint_trains_and_expert_parallel_matches_one_rank() {
    moe_checkpoint_trains_as_one_rank("deepseek_v3");
}

/// Gemma 2 and Gemma 3 checkpoints (local and global layers, soft-caps, Gemma's norms) train
/// with GRPO from their paths, and on tp = 2 with sequence parallelism log the single rank's
/// metrics.
#[test]
fn gemma_checkpoints_train_and_tensor_parallel_matches_one_rank() {
    for name in ["gemma2", "gemma3"] {
        let one = train_fixture(name, &[]);
        let steps: Vec<_> = one.iter().filter(|l| l["step"] >= 1.0).collect();
        assert_eq!(steps.len(), 2, "{name}");
        assert!(
            steps.iter().all(|s| s["actor/pg_loss"].is_finite()),
            "{name}"
        );
        let many = train_fixture(
            name,
            &[
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.actor.megatron.sequence_parallel=true",
            ],
        );
        common::assert_same_metrics(&drop_peak(one), &drop_peak(many), &format!("{name} tp = 2"));
    }
}

fn moe_checkpoint_trains_as_one_rank(name: &str) {
    let train = |layout: &[&str]| {
        let mut overrides = vec![
            "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ];
        overrides.extend(layout);
        train_fixture(name, &overrides)
    };
    let one = train(&[]);
    let steps: Vec<_> = one.iter().filter(|l| l["step"] >= 1.0).collect();
    assert_eq!(steps.len(), 2);
    for s in &steps {
        assert!(
            s["actor/pg_loss"].is_finite() && s["actor/moe_aux_loss"] > 0.0,
            "{s:?}"
        );
    }
    let many = train(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
    ]);
    common::assert_same_metrics(
        &drop_peak(one),
        &drop_peak(many),
        &format!("{name} tp = 2 × ep = 2"),
    );
}

/// verl's `model.override_config.moe_config.freeze_moe_router`: the routers and shared-expert
/// gates keep their weights through the updates, on 2 data-parallel ranks with the distributed
/// optimizer too (the HF copies
/// saved after steps 1 and 2 hold the same routers, while the experts moved; without the switch
/// the routers move too); `moe_router_load_balancing_type` other than aux_loss / none is
/// refused naming the key.
#[test]
fn a_frozen_moe_router_keeps_its_weights() {
    let routers_and_experts = |freeze: bool| -> (f32, f32) {
        let mut overrides = vec![
            "+actor_rollout_ref.model.override_config.num_experts=4",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.sft_warmup_steps=0",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        ];
        if freeze {
            overrides
                .push("+actor_rollout_ref.model.override_config.moe_config.freeze_moe_router=true");
        }
        let (_, _, dir) = run(&overrides);
        let open = |step: usize| {
            let path = dir
                .path()
                .join(format!("global_step_{step}/actor/huggingface"));
            verl::megatron::hf::HfCheckpoint::open(&path).unwrap()
        };
        let (a, b) = (open(1), open(2));
        let moved = |suffix: &str| -> f32 {
            let names: Vec<String> = a
                .names()
                .filter(|n| n.ends_with(suffix))
                .map(str::to_string)
                .collect();
            assert!(!names.is_empty(), "{suffix}");
            names
                .iter()
                .map(|n| {
                    let (x, _) = a.read_f32(n).unwrap();
                    let (y, _) = b.read_f32(n).unwrap();
                    x.iter()
                        .zip(&y)
                        .map(|(p, q)| (p - q).abs())
                        .fold(0f32, f32::max)
                })
                .fold(0f32, f32::max)
        };
        (
            moved("mlp.gate.weight").max(moved("shared_expert_gate.weight")),
            moved("experts.0.up_proj.weight"),
        )
    };
    let (routers, experts) = routers_and_experts(true);
    assert_eq!(
        routers, 0.0,
        "frozen routers (or shared-expert gates) moved"
    );
    assert!(experts > 0.0, "the experts should train");
    let (routers, _) = routers_and_experts(false);
    assert!(routers > 0.0, "control: an unfrozen router moves");
    let text = refusal(&[
        "+actor_rollout_ref.model.override_config.num_experts=4",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type=sinkhorn",
    ]);
    assert!(text.contains("moe_router_load_balancing_type"), "{text}");
}

/// Router replay R2 (`actor.router_replay.mode=R2`) on an MoE actor with two mini-batches a
/// step on 2 data-parallel ranks, padded and packed: the update replays the old-log-prob
/// pass's experts for every real token (none missing, whatever the regrouping), the second
/// mini-batch after an optimizer step. R2 with context parallel, balance_batch across
/// data-parallel ranks or bypass mode is refused naming the key.
#[test]
fn router_replay_r2_replays_every_token_of_the_update() {
    for packed in [false, true] {
        let mut overrides = vec![
            "+actor_rollout_ref.model.override_config.num_experts=4",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=0",
            // Two mini-batches a step: the second forward runs after an optimizer step.
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.shuffle=true",
            "actor_rollout_ref.actor.router_replay.mode=R2",
        ];
        if packed {
            overrides.push("actor_rollout_ref.model.use_remove_padding=true");
        }
        let (_, lines, _dir) = run(&overrides);
        for line in lines_with(&lines, "actor/router_replay_tokens", 2) {
            assert!(line["actor/router_replay_tokens"] > 0.0, "{line:?}");
            assert_eq!(line["actor/router_replay_missing_tokens"], 0.0, "{line:?}");
        }
    }
    for (extra, key) in [
        (
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "context_parallel_size",
        ),
        ("trainer.balance_batch=true", "balance_batch"),
        (
            "algorithm.rollout_correction.bypass_mode=true",
            "bypass_mode",
        ),
    ] {
        let text = refusal(&[
            "+actor_rollout_ref.model.override_config.num_experts=4",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.router_replay.mode=R2",
            extra,
        ]);
        assert!(
            text.contains(key) && text.contains("router_replay"),
            "{text}"
        );
    }
}

/// Router replay R3 on an MoE actor at dp = 2, packed, with balance_batch moving rows between
/// ranks: the rollout records every fed token's experts and the update replays them for every
/// real token (each row's last, sampled and never fed, is left to the router and not counted
/// missing). R3 without the rollout recording, with context parallel or on a dense model is
/// refused naming the key.
#[test]
fn router_replay_r3_replays_the_rollouts_routing() {
    let (_, lines, _dir) = run(&[
        "+actor_rollout_ref.model.override_config.num_experts=4",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.sft_warmup_steps=0",
        "trainer.balance_batch=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.shuffle=true",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    ]);
    for line in lines_with(&lines, "actor/router_replay_tokens", 2) {
        assert!(line["actor/router_replay_tokens"] > 0.0, "{line:?}");
        assert_eq!(line["actor/router_replay_missing_tokens"], 0.0, "{line:?}");
        // The fraction of replayed tokens the trainer's routers would route elsewhere.
        let disagreement = line["actor/router_replay_disagreement"];
        assert!((0.0..1.0).contains(&disagreement), "{line:?}");
    }
    for (extra, key) in [
        ("trainer.n_gpus_per_node=2", "enable_rollout_routing_replay"),
        (
            "actor_rollout_ref.actor.megatron.context_parallel_size=2",
            "context_parallel_size",
        ),
    ] {
        let mut overrides = vec![
            "+actor_rollout_ref.model.override_config.num_experts=4",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            extra,
        ];
        if key != "enable_rollout_routing_replay" {
            overrides.push("actor_rollout_ref.rollout.enable_rollout_routing_replay=true");
        }
        let text = refusal(&overrides);
        assert!(text.contains(key) && text.contains("R3"), "{text}");
    }
    // A dense model has no routing to replay.
    let text = refusal(&[
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    ]);
    assert!(
        text.contains("no experts") && text.contains("router_replay.mode"),
        "{text}"
    );
}

/// verl's dynamic batch size on every pass (actor update, old and reference log-probs, critic
/// update and values) with a 40-token budget (rows of up to 12 tokens) on dp = 2: the
/// micro-batches are regrouped by tokens and trimmed; losses, gradient norms, rewards,
/// advantages and values are the fixed single rank's. (Metrics averaged per micro-batch —
/// clip fractions, entropy, KL, predicted values — depend on the grouping, as verl's do, and
/// are left out.)
#[test]
fn dynamic_batch_size_trains_as_fixed() {
    let common = [
        "algorithm.adv_estimator=gae",
        "critic.enable=true",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "trainer.sft_warmup_steps=8",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ];
    let per_micro_batch = [
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "critic/vpred_mean",
        "critic/vf_clipfrac",
    ];
    let strip = |lines: Vec<BTreeMap<String, f64>>| -> Vec<BTreeMap<String, f64>> {
        lines
            .into_iter()
            .map(|mut l| {
                l.retain(|k, _| !per_micro_batch.contains(&k.as_str()));
                l
            })
            .collect()
    };
    let (_, one, _d1) = run(&common);
    let mut dynamic = common.to_vec();
    dynamic.extend([
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=40",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=40",
    ]);
    let (_, many, _d2) = run(&dynamic);
    common::assert_same_metrics(&strip(one), &strip(many), "dynamic batch size");
}

/// `model.use_fused_kernels`: the actor's and reference's log-probs and entropies from the
/// fused, chunked head on tp = 2 (vocabulary-parallel) log the plain single rank's metrics.
#[test]
fn the_fused_head_trains_as_the_plain_one() {
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.model.use_fused_kernels=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ]);
}

/// Megatron's activation recompute from verl's `override_transformer_config` keys: the actor
/// recomputes every layer (uniform, 1) on tp = 2 with sequence parallelism, the critic its
/// first layer (block, 1) on pp = 2; the metrics are the single rank's keeping everything.
#[test]
fn recomputed_activations_train_as_kept_ones() {
    let otc = "megatron.override_transformer_config";
    let replays = verl::megatron::models::causal_lm::chunk_replays();
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.pipeline_model_parallel_size=2",
        &format!("+actor_rollout_ref.actor.{otc}.recompute_granularity=full"),
        &format!("+actor_rollout_ref.actor.{otc}.recompute_method=uniform"),
        &format!("+actor_rollout_ref.actor.{otc}.recompute_num_layers=1"),
        &format!("+critic.{otc}.recompute_granularity=full"),
        &format!("+critic.{otc}.recompute_method=block"),
        &format!("+critic.{otc}.recompute_num_layers=1"),
    ]);
    assert!(
        verl::megatron::models::causal_lm::chunk_replays() > replays,
        "no chunk was recomputed"
    );
}

/// `model.use_remove_padding` (actor and reference) and `critic.model.use_remove_padding`:
/// each micro-batch's sequences packed into one row, on tp = 2 × cp = 2 (the packed row split
/// over both, attention within each sequence only), log the padded single rank's metrics.
#[test]
fn packed_sequences_train_as_padded() {
    trains_as_one_rank(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.context_parallel_size=2",
        "critic.megatron.context_parallel_size=2",
        "actor_rollout_ref.model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ]);
}

/// Two steps after the warm-up with token-level IS weights and a sequence-level k3 rejection
/// at 0.01: the rollout-correction tests run it on agreeing and on disagreeing log-probs.
const TOKEN_IS_WITH_K3_REJECTION: [&str; 5] = [
    "trainer.total_training_steps=2",
    "trainer.sft_warmup_steps=4",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_rs=seq_max_k3",
    "algorithm.rollout_correction.rollout_rs_threshold=0.01",
];

/// `algorithm.rollout_correction` (decoupled mode): the rollout returns its log-probs, token
/// IS weights and a k3 rejection come from them against the recomputed old log-probs, and
/// their metrics are logged. On the CPU default the sampler and the recompute agree to f32
/// rounding, so the weights are 1 and nothing is rejected; the update runs with the weights.
#[test]
fn rollout_correction_with_agreeing_log_probs_weights_one_and_rejects_nothing() {
    let (_, lines, _dir) = run(&TOKEN_IS_WITH_K3_REJECTION);
    let steps = lines_with(&lines, "rollout_corr/kl", 2);
    for l in steps {
        assert!(
            (l["rollout_corr/rollout_is_mean"] - 1.0).abs() < 1e-3,
            "{l:?}"
        );
        assert!(l["rollout_corr/kl"].abs() < 1e-3, "{l:?}");
        assert_eq!(l["rollout_corr/rollout_rs_masked_fraction"], 0.0, "{l:?}");
        assert!(l.contains_key("actor/pg_loss"), "the actor updated: {l:?}");
    }
}

/// The train/rollout mismatch, measured every step the rollout returns its log-probs (no
/// correction asked for), as verl logs it. The rollout and the trainer share the model code,
/// so on the CPU default the two log-probs of a token differ by f32 rounding alone: this test
/// fails if a change to either path makes the tiny model's mismatch grow past that.
#[test]
fn train_rollout_mismatch_is_logged_every_step_and_stays_at_rounding() {
    let (_, lines, _dir) = run(&[
        "trainer.total_training_steps=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]);
    let steps = lines_with(&lines, "training/rollout_probs_diff_max", 2);
    for l in steps {
        eprintln!(
            "mismatch: probs diff max {:e} mean {:e}, kl {:e}, k3 {:e}, pearson {}",
            l["training/rollout_probs_diff_max"],
            l["training/rollout_probs_diff_mean"],
            l["rollout_corr/kl"],
            l["rollout_corr/k3_kl"],
            l["training/rollout_actor_probs_pearson_corr"]
        );
        assert_eq!(l["training/rollout_probs_diff_valid"], 1.0);
        // Measured here: a largest probability gap of 1.6e-7 to 1.8e-7 between the rollout
        // and the recomputed old log-probs; the bound leaves a factor of ten for other CPUs'
        // rounding.
        assert!(l["training/rollout_probs_diff_max"] < 2e-6, "{l:?}");
        // `rollout_corr/` is the actor's (the policy as it moves in the update, as verl logs
        // it): 2e-8 to 4e-8 here, where the update has one mini-batch; bounded loosely, as
        // more mini-batches would move the policy.
        assert!(l["rollout_corr/kl"].abs() < 1e-3, "{l:?}");
        assert!(l["rollout_corr/k3_kl"].abs() < 1e-4, "{l:?}");
        assert!(
            l["training/rollout_actor_probs_pearson_corr"] > 0.99999,
            "{l:?}"
        );
        // Metrics alone: no weights, nothing rejected, the step as without them.
        assert!(!l.contains_key("rollout_corr/rollout_is_mean"), "{l:?}");
    }
}

/// A rollout engine whose log-probs disagree with the trainer's recompute on every other
/// response (3 nats lower on each token), as a rollout with a different numeric path would.
struct DisagreeingRollout {
    inner: Box<dyn verl::traits::RolloutEngine<verl::backend::DefaultBackend>>,
}

#[async_trait::async_trait(?Send)]
impl verl::traits::RolloutEngine<verl::backend::DefaultBackend> for DisagreeingRollout {
    async fn generate_sequences(
        &mut self,
        prompts: verl::DataProto<verl::backend::DefaultBackend>,
    ) -> verl::Result<verl::DataProto<verl::backend::DefaultBackend>> {
        let mut out = self.inner.generate_sequences(prompts).await?;
        if let Ok(lp) = out.float::<2>("rollout_log_probs") {
            let [rows, width] = lp.dims();
            let shift: Vec<f32> = (0..rows * width)
                .map(|i| if (i / width) % 2 == 0 { -3.0 } else { 0.0 })
                .collect();
            let shift = burn::tensor::Tensor::<verl::backend::DefaultBackend, 1>::from_floats(
                shift.as_slice(),
                &lp.device(),
            )
            .reshape([rows, width]);
            out.insert_float("rollout_log_probs", lp + shift)?;
        }
        Ok(out)
    }

    async fn update_weights(
        &mut self,
        weights: verl::core::WeightStream<'_, verl::backend::DefaultBackend>,
    ) -> verl::Result<()> {
        self.inner.update_weights(weights).await
    }

    async fn sleep(&mut self, level: verl::traits::SleepLevel) -> verl::Result<()> {
        self.inner.sleep(level).await
    }

    async fn wake_up(&mut self) -> verl::Result<()> {
        self.inner.wake_up().await
    }

    fn is_sleeping(&self) -> bool {
        self.inner.is_sleeping()
    }

    fn state(&self) -> serde_json::Value {
        self.inner.state()
    }

    fn load_state(&mut self, state: &serde_json::Value) -> verl::Result<()> {
        self.inner.load_state(state)
    }
}

/// The steps' metric lines of a short run on the tiny job whose rollout is a
/// [`DisagreeingRollout`], with `overrides`.
fn run_disagreeing(overrides: &[&str]) -> Vec<BTreeMap<String, f64>> {
    let dir = tempfile::tempdir().unwrap();
    let validated = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides(common::TINY_JOB.iter().copied())
        .overrides(overrides.iter().copied())
        .set("trainer.default_local_dir", dir.path().display())
        .resolve()
        .unwrap();
    let mut trainer = verl::trainer::PpoTrainer::builder(validated)
        .rollout(|inner| Box::new(DisagreeingRollout { inner }))
        .build()
        .unwrap();
    let summary = common::fit_trainer(&mut trainer);
    common::step_lines(&summary.metrics_path)
}

/// Rejection that rejects: a rollout whose log-probs sit 3 nats below the recompute on every
/// other response has those responses' k3 divergence far over the threshold, so sequence
/// rejection masks half the sequences (every response is at least one token long), and the IS
/// weights of the shifted tokens are e^3 while the others stay 1.
#[test]
fn rollout_correction_rejects_the_responses_whose_log_probs_disagree() {
    let lines = run_disagreeing(&TOKEN_IS_WITH_K3_REJECTION);
    let steps = lines_with(&lines, "rollout_corr/kl", 2);
    for l in steps {
        // Half the sequences; by tokens, the shifted rows' share of the response tokens.
        let seqs = l["rollout_corr/rollout_rs_seq_masked_fraction"];
        assert!(
            (seqs - 0.5).abs() < 1e-9,
            "half the responses rejected: {l:?}"
        );
        let tokens = l["rollout_corr/rollout_rs_masked_fraction"];
        assert!(tokens > 0.3 && tokens < 0.7, "{l:?}");
        // The shifted tokens' IS weight is e^3; the others' 1.
        assert!(
            (l["rollout_corr/rollout_is_max"] - 3f64.exp()).abs() < 1e-3,
            "{l:?}"
        );
        assert!(
            (l["rollout_corr/rollout_is_min"] - 1.0).abs() < 1e-3,
            "{l:?}"
        );
        // The off-policy figures are the actor's, over the tokens rejection kept (as verl's
        // actor sees the rejected mask): the agreeing rows only.
        assert!(l["rollout_corr/kl"].abs() < 1e-3, "{l:?}");
        assert!(l.contains_key("actor/pg_loss"), "the actor updated: {l:?}");
    }
}

/// Bypass mode (`loss_type: reinforce` with token weights) under a rollout whose log-probs sit
/// 3 nats below the policy's on every other response: no old-log-prob pass, the rollout's
/// log-probs stand in for the old ones, and the correction runs in the actor's loss against
/// the current policy: the shifted tokens' weights are e^3 before truncation (2 after), the
/// others' 1, and the policy's divergence from the sampler is the shift's share.
#[test]
fn bypass_mode_trains_on_the_rollouts_log_probs() {
    let lines = run_disagreeing(&[
        "trainer.total_training_steps=2",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=token",
    ]);
    let steps = lines_with(&lines, "actor/pg_loss", 2);
    for l in steps {
        assert!(!l.contains_key("timing_s/old_log_prob"), "{l:?}");
        // The weights against the current policy, from the actor's loss.
        assert!(l["rollout_corr/rollout_is_max"] > 15.0, "{l:?}");
        assert!(
            (l["rollout_corr/rollout_is_min"] - 1.0).abs() < 0.05,
            "{l:?}"
        );
        assert!(l["rollout_corr/rollout_is_mean"] > 2.0, "{l:?}");
        // REINFORCE's divergence: log π_rollout − log π, −3 on the shifted share.
        assert!(l["actor/ppo_kl"] < -0.5, "{l:?}");
        assert!(l["actor/pg_loss"].is_finite(), "{l:?}");
        assert_eq!(l["actor/pg_clipfrac"], 0.0, "{l:?}");
    }
}

/// A committed Hugging Face fixture's directory (`verl-megatron/tests/fixtures/{name}`).
fn fixture_dir(name: &str) -> String {
    format!(
        "{}/verl-megatron/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Two steps from scratch on a fixture's model, tokenizer and chat template
/// (`actor_rollout_ref.model.path`), over 16 arithmetic prompts (responses of up to 8 tokens),
/// with `overrides` on top: the run's step lines.
fn train_fixture(name: &str, overrides: &[&str]) -> Vec<BTreeMap<String, f64>> {
    train_fixture_rows(name, overrides, |_, _| {})
}

/// [`train_fixture`] with each prompt row `i` edited by `edit` first.
fn train_fixture_rows(
    name: &str,
    overrides: &[&str],
    edit: impl Fn(usize, &mut verl::trainer::data::PromptRow),
) -> Vec<BTreeMap<String, f64>> {
    use verl::trainer::data::PromptRow;
    use verl::trainer::PpoTrainer;
    let dir = tempfile::tempdir().unwrap();
    let config = ConfigBuilder::new()
        .overrides(MAIN_JOB)
        .overrides([
            "trainer.total_training_steps=2",
            "trainer.sft_warmup_steps=0",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "data.max_prompt_length=32",
            "data.max_response_length=8",
        ])
        .overrides(overrides.iter().copied())
        .set("actor_rollout_ref.model.path", fixture_dir(name))
        .set("trainer.default_local_dir", dir.path().display())
        .resolve()
        .unwrap();
    let rows = (0..16).map(|i| {
        let mut row = PromptRow::new(
            format!("{i}+1="),
            "verl_rs/arithmetic",
            &(i + 1).to_string(),
        );
        edit(i, &mut row);
        row
    });
    let mut trainer = PpoTrainer::builder(config).data(rows).build().unwrap();
    let summary = common::fit_trainer(&mut trainer);
    common::step_lines(&summary.metrics_path)
}

/// verl's multi-turn job with no Rust code: `multi_turn.enable` and a verl tool file
/// (`tool_config_path`) on an HF model, each row's `extra_info.tools_kwargs` reaching its
/// tools. The agent loop runs every sample (the tiny random model rarely calls the tool) and the
/// run trains. (The fixture's template ignores `tools`; `verl-rollout/tests/hf_chat.rs` checks
/// the listing, `verl-rollout/tests/agent_loop.rs` the kwargs reaching a tool.)
#[test]
fn a_verl_tool_file_runs_the_agent_loop_on_an_hf_model() {
    let dir = tempfile::tempdir().unwrap();
    let tools = dir.path().join("tools.yaml");
    std::fs::write(
        &tools,
        "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n",
    )
    .unwrap();
    let tool_file = format!(
        "actor_rollout_ref.rollout.multi_turn.tool_config_path={}",
        tools.display()
    );
    let lines = train_fixture_rows(
        "qwen2",
        &[
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            &tool_file,
        ],
        |i, row| {
            row.extra_info = serde_json::json!({"tools_kwargs": {"calc_gsm8k_reward":
                {"create_kwargs": {"ground_truth": (i + 1).to_string()}}}});
        },
    );
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let turns = l
            .get("rollout/agent_turns_mean")
            .copied()
            .unwrap_or(f64::NAN);
        assert!((1.0..=2.0).contains(&turns), "{l:?}");
        assert!(l.contains_key("rollout/tool_calls_mean"), "{l:?}");
        assert!(l["actor/pg_loss"].is_finite(), "{l:?}");
    }
}

/// PPO whose critic starts from a causal LM (`critic.model.path`, verl's way: the LM's backbone
/// under a new value head; `verl-megatron/tests/heads.rs` checks the weights), on the qwen2
/// fixture as both actor and critic: it trains, and its value loss is a number.
#[test]
fn a_critic_from_an_lm_path_trains() {
    let critic = format!("critic.model.path={}", fixture_dir("qwen2"));
    let lines = train_fixture(
        "qwen2",
        &[
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            "critic.ppo_micro_batch_size_per_gpu=64",
            &critic,
        ],
    );
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).collect();
    assert_eq!(steps.len(), 2);
    for s in steps {
        assert!(s["critic/vf_loss"].is_finite() && s["critic/values/mean"].is_finite());
    }
}

/// `trainer.balance_batch` (verl's default) reorders the update's rows across two
/// data-parallel ranks by tokens: generation and scoring are untouched (step 1's scores equal
/// the unbalanced run's), the balanced chunks are logged under verl's `global_seqlen/*` names and
/// are never heavier than the batch order's.
#[test]
fn balanced_data_parallel_logs_its_chunks_and_keeps_the_rollout() {
    let base = [
        "trainer.n_gpus_per_node=2",
        "trainer.sft_warmup_steps=0",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
    ];
    let (_, plain, _d1) = run(&base);
    let mut balanced_run = base.to_vec();
    balanced_run.push("trainer.balance_batch=true");
    let (_, balanced, _d2) = run(&balanced_run);
    let steps = |lines: &[BTreeMap<String, f64>]| -> Vec<BTreeMap<String, f64>> {
        lines.iter().filter(|l| l["step"] >= 1.0).cloned().collect()
    };
    let (plain, balanced) = (steps(&plain), steps(&balanced));
    assert_eq!(
        plain[0]["critic/score/mean"],
        balanced[0]["critic/score/mean"]
    );
    assert!(!plain[0].contains_key("global_seqlen/max"));
    for s in &balanced {
        assert!(
            s["global_seqlen/balanced_max"] <= s["global_seqlen/max"],
            "{s:?}"
        );
        assert!(s["actor/pg_loss"].is_finite() && s["actor/grad_norm"].is_finite());
    }
}

/// verl's generation dumps: `trainer.rollout_data_dir` gets `<step>.jsonl` for every step, a
/// line per response (`input`, `output`, `gts`, `score`, `step`) whose scores average to the
/// step's `critic/score/mean`; `trainer.validation_data_dir` gets the validation before training
/// as step 0, a line per validation prompt.
#[test]
fn rollout_and_validation_generations_are_dumped_as_verl_does() {
    let dumps = tempfile::tempdir().unwrap();
    let (rollouts, vals) = (dumps.path().join("rollout"), dumps.path().join("val"));
    let (summary, lines, _dir) = run(&[
        "trainer.total_training_steps=2".to_string(),
        "trainer.sft_warmup_steps=0".to_string(),
        "trainer.val_before_train=true".to_string(),
        format!("trainer.rollout_data_dir={}", rollouts.display()),
        format!("+trainer.validation_data_dir={}", vals.display()),
    ]);
    let read = |path: std::path::PathBuf| -> Vec<serde_json::Value> {
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let steps: Vec<_> = lines.iter().filter(|l| l["step"] >= 1.0).collect();
    assert_eq!(steps.len(), 2);
    for (k, metrics) in steps.iter().enumerate() {
        let step = k as u64 + 1;
        let dumped = read(rollouts.join(format!("{step}.jsonl")));
        // The main job: 16 prompts × 8 samples a step.
        assert_eq!(dumped.len(), 128, "step {step}");
        for d in &dumped {
            for key in ["input", "output", "gts", "score", "step"] {
                assert!(d.get(key).is_some(), "step {step}: no {key} in {d}");
            }
            assert_eq!(d["step"], step);
            // The built-in task's prompts are sums ("3+4=") and their truths the answers.
            let input = d["input"].as_str().unwrap();
            assert!(input.contains('+'), "{input}");
            let gts = d["gts"].as_str().unwrap();
            assert!(
                !gts.is_empty() && gts.chars().all(|c| c.is_ascii_digit()),
                "{gts}"
            );
        }
        let mean = dumped
            .iter()
            .map(|d| d["score"].as_f64().unwrap())
            .sum::<f64>()
            / dumped.len() as f64;
        assert!(
            (mean - metrics["critic/score/mean"]).abs() < 1e-9,
            "step {step}: dumped scores {mean} vs critic/score/mean {}",
            metrics["critic/score/mean"]
        );
    }
    let val = read(vals.join("0.jsonl"));
    assert!(!val.is_empty());
    let val_mean = val
        .iter()
        .map(|d| d["score"].as_f64().unwrap())
        .sum::<f64>()
        / val.len() as f64;
    assert!((val_mean - summary.val_score_before.unwrap()).abs() < 1e-9);
    assert!(val.iter().all(|d| d["step"] == 0));
    // verl's validation metric beside ours: one data source (the built-in task), greedy, one
    // response per prompt.
    let before = lines.iter().find(|l| l["step"] == 0.0).unwrap();
    let core: Vec<_> = before
        .iter()
        .filter(|(k, _)| k.starts_with("val-core/") && k.ends_with("/reward/mean@1"))
        .collect();
    assert_eq!(core.len(), 1, "{before:?}");
    assert!((core[0].1 - before["val/score/mean"]).abs() < 1e-12);
}

/// `trainer.val_only`: the run validates the starting policy (no warm-up, no step), logs it as
/// step 0 and stops; on a saved run it validates the checkpoint at its step.
#[test]
fn val_only_validates_and_stops() {
    let (summary, lines, dir) = run(&[
        "trainer.val_only=true",
        "trainer.val_before_train=true",
        "trainer.sft_warmup_steps=5",
        "trainer.total_training_steps=3",
    ]);
    assert_eq!(summary.steps, 0);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["step"], 0.0);
    let v = summary.val_score_before.expect("validated");
    assert_eq!(lines[0]["val/score/mean"], v);
    // No step was taken, so nothing was saved.
    assert!(!dir
        .path()
        .join("latest_checkpointed_iteration.txt")
        .exists());

    // Two trained steps saved, then a validation-only run of that checkpoint at its step.
    let trained = tempfile::tempdir().unwrap();
    let cfg = |extra: &[&str]| {
        ConfigBuilder::new()
            .overrides(MAIN_JOB)
            .overrides(common::TINY_JOB.iter().copied())
            .overrides([
                "trainer.total_training_steps=2",
                "trainer.sft_warmup_steps=0",
                "trainer.save_freq=2",
                "trainer.test_freq=2",
                "trainer.val_before_train=true",
            ])
            .overrides(extra.iter().copied())
            .set("trainer.default_local_dir", trained.path().display())
            .build()
            .unwrap()
    };
    let first = common::fit(cfg(&[]));
    assert_eq!(first.steps, 2);
    let again = common::fit(cfg(&["trainer.val_only=true"]));
    assert_eq!(again.steps, 0);
    assert_eq!(again.resumed_at, Some(2));
    let lines = common::step_lines(&again.metrics_path);
    let last = lines.last().unwrap();
    assert_eq!(last["step"], 2.0);
    // The saved policy scores as it did when validated at the end of training.
    assert!((again.val_score_before.unwrap() - first.val_score_after.unwrap()).abs() < 1e-9);
}

/// verl's `dapo` reward manager: with the overlong buffer as long as the responses may be
/// (`len` = `max_resp_len` = 4), every response loses `penalty_factor · length / 4`, so step 1's
/// mean score (the same rollouts as the naive run's: nothing has been updated yet) is the
/// naive one minus 0.5 · mean length / 4. Both the trainer's (`reward_kwargs`) and the DAPO
/// recipe's (`overlong_buffer`) forms.
#[test]
fn dapo_overlong_shaping_lowers_scores_by_the_buffer_ramp() {
    let base = [
        "trainer.total_training_steps=1",
        "trainer.sft_warmup_steps=4",
        "trainer.val_before_train=false",
    ];
    let (_, naive, _d0) = run(&base);
    let forms: [&[&str]; 2] = [
        &[
            "reward_model.reward_manager=dapo",
            "+reward_model.reward_kwargs.max_resp_len=4",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
        ],
        &[
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=0.5",
        ],
    ];
    for form in forms {
        let overrides: Vec<&str> = base.iter().chain(form).copied().collect();
        let (_, dapo, _d1) = run(&overrides);
        let (n, d) = (&naive[0], &dapo[0]);
        assert_eq!(
            n["response_length/mean"], d["response_length/mean"],
            "the same rollouts"
        );
        let expected = n["critic/score/mean"] - 0.5 * n["response_length/mean"] / 4.0;
        assert!(
            (d["critic/score/mean"] - expected).abs() < 1e-6,
            "{form:?}: {} vs {expected}",
            d["critic/score/mean"]
        );
    }
}

/// `overlong_buffer.log` (and verl's dapo `acc`): validation reports each reward extra per data
/// source, `val-core/<source>/acc/mean@1` as the core variable and the shaped reward,
/// `overlong_reward` and `overlong` as auxiliary ones; the shaped reward is acc plus the
/// shaping, and every response of up to 4 tokens against a 4-token buffer is overlong or at
/// the limit.
#[test]
fn dapo_log_reports_the_shaping_as_validation_extras() {
    let (_, lines, _dir) = run(&[
        "trainer.total_training_steps=1",
        "trainer.sft_warmup_steps=0",
        "trainer.val_before_train=true",
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.penalty_factor=0.5",
        "reward_model.overlong_buffer.log=true",
    ]);
    let before = &lines[0];
    assert_eq!(before["step"], 0.0);
    let find = |section: &str, name: &str| -> Vec<(String, f64)> {
        before
            .iter()
            .filter(|(k, _)| k.starts_with(section) && k.contains(&format!("/{name}/mean@")))
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    };
    let acc = find("val-core/", "acc");
    assert!(!acc.is_empty(), "{before:?}");
    for (key, acc) in acc {
        // A data source may hold slashes (`verl_rs/arithmetic`).
        let source = key
            .strip_prefix("val-core/")
            .and_then(|k| k.strip_suffix("/acc/mean@1"))
            .expect("one response per validation prompt");
        let aux = |name: &str| before[&format!("val-aux/{source}/{name}/mean@1")];
        let (reward, shaping, overlong) = (aux("reward"), aux("overlong_reward"), aux("overlong"));
        assert!(
            (reward - (acc + shaping)).abs() < 1e-9,
            "{reward} vs {acc} + {shaping}"
        );
        assert!((-0.5..=0.0).contains(&shaping), "{shaping}");
        assert!((0.0..=1.0).contains(&overlong), "{overlong}");
        assert!(!before.contains_key(&format!("val-core/{source}/reward/mean@1")));
    }
}

/// The builder's agent loop on the built-in task, with verl's `multi_turn` limits: each rank's
/// engine runs it, a turn whose first token is even "calls" the calculator, the tool's answer
/// comes back as the task's tokens (masked out of the loss), no trajectory takes more than
/// `max_assistant_turns` turns, and the run trains to its end with turns and calls logged.
/// The tool's reward (0.5 a call) reaches the reward function in `extra_info["tool_rewards"]`,
/// as verl's reward managers merge `tool_extra_fields`. `multi_turn.enable` without an agent
/// loop, or with a format other than hermes, is refused.
#[test]
fn the_builders_agent_loop_trains_with_tool_turns() {
    use verl::core::error::ToolError;
    use verl::rollout::agent::{
        render_hermes, Agent, AgentLoopConfig, Calculator, ChatTurns, ToolCall, ToolSet,
    };
    use verl::tasks::CharTokenizer;
    use verl::traits::{RewardInput, Tool, ToolOutput};
    /// The calculator, scoring each call 0.5.
    struct Scored;
    #[async_trait::async_trait(?Send)]
    impl Tool for Scored {
        fn name(&self) -> &str {
            "calculator"
        }
        fn schema(&self) -> serde_json::Value {
            Calculator.schema()
        }
        async fn call(&self, arguments: &serde_json::Value) -> Result<ToolOutput, ToolError> {
            let out = Calculator.call(arguments).await?;
            Ok(ToolOutput {
                reward: Some(0.5),
                ..out
            })
        }
    }
    struct EvenCalls(CharTokenizer);
    impl ChatTurns for EvenCalls {
        fn decode(&self, tokens: &[u32]) -> String {
            match tokens.first() {
                Some(t) if t % 2 == 0 => render_hermes(
                    "",
                    &[ToolCall {
                        name: "calculator".into(),
                        arguments: serde_json::json!({"expression": "2+2"}),
                    }],
                ),
                _ => self.0.decode(tokens),
            }
        }
        fn tool_turn(&self, answers: &[String]) -> Result<Vec<u32>, verl::rollout::RolloutError> {
            Ok(self
                .0
                .encode(&format!(" {} ", answers.join(" ")))
                .expect("digits"))
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::tiny_config(
        dir.path(),
        &[
            "trainer.sft_warmup_steps=0",
            "data.max_response_length=12",
            // verl's limits replace the agent's own 3 turns.
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        ],
    );
    let mut trainer = verl::trainer::PpoTrainer::builder(cfg)
        .agent(|| Agent {
            chat: Box::new(EvenCalls(CharTokenizer::arithmetic())),
            tools: ToolSet::new().with(Scored),
            config: AgentLoopConfig {
                max_assistant_turns: 3,
                // Short turns leave room for tool turns in 12-token responses.
                max_turn_tokens: Some(2),
                response_length: 0,
                max_parallel_calls: 1,
                max_tool_response_length: 16,
                tool_response_truncate_side: Default::default(),
                sampling: Default::default(),
            },
        })
        .reward(|input: &RewardInput| {
            input.extra_info["tool_rewards"]
                .as_array()
                .map_or(-1.0, |r| {
                    r.iter().filter_map(serde_json::Value::as_f64).sum()
                })
        })
        .build()
        .unwrap();
    let summary = common::fit_trainer(&mut trainer);
    assert_eq!(summary.steps, 2);
    let lines = common::step_lines(&summary.metrics_path);
    let turns: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.get("rollout/agent_turns_mean").copied())
        .collect();
    assert_eq!(turns.len(), 2, "{lines:?}");
    // About half the first turns start with an even token and call the tool.
    assert!(turns.iter().all(|&t| t > 1.0 && t <= 2.0), "{turns:?}");
    let calls: Vec<f64> = lines
        .iter()
        .filter_map(|l| l.get("rollout/tool_calls_mean").copied())
        .collect();
    assert!(
        calls.len() == 2 && calls.iter().all(|&c| c > 0.0),
        "{calls:?}"
    );
    // Every call scored 0.5 and the reward function summed what it was handed.
    let scored: Vec<(f64, f64)> = lines
        .iter()
        .filter_map(|l| {
            Some((
                l.get("critic/score/mean")?,
                l.get("rollout/tool_calls_mean")?,
            ))
        })
        .map(|(s, c)| (*s, *c))
        .collect();
    assert_eq!(scored.len(), 2, "{lines:?}");
    for (score, c) in scored {
        assert!((score - 0.5 * c).abs() < 1e-6, "score {score}, calls {c}");
    }
    // Without an agent loop, or with what is not built, multi_turn is refused by key.
    let text = refusal(&["actor_rollout_ref.rollout.multi_turn.enable=true"]);
    assert!(
        text.contains("multi_turn.enable") && text.contains("PpoTrainerBuilder::agent"),
        "{text}"
    );
    let text = refusal(&[
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=gpt-oss",
    ]);
    assert!(text.contains("multi_turn.format"), "{text}");
    // A tool file that cannot be read, or on the built-in task (no chat template), is refused.
    let text = refusal(&[
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nonexistent/tools.yaml",
    ]);
    assert!(
        text.contains("multi_turn.tool_config_path") && text.contains("cannot be read"),
        "{text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tools.yaml");
    std::fs::write(&file, "tools:\n  - class_name: verl_rs.tools.Calculator\n").unwrap();
    let text = refusal(&[
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        &format!(
            "actor_rollout_ref.rollout.multi_turn.tool_config_path={}",
            file.display()
        ),
    ]);
    assert!(text.contains("character tokenizer has none"), "{text}");
}

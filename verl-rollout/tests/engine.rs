//! The native rollout engine: cached generation equals full recompute, batch invariance,
//! continuous batching, stop / length handling, the sampled distribution, verl's layout,
//! per-tensor weight updates and sleep / wake-up.

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use futures::stream;
use verl_core::backend::CpuBackend as B;
use verl_core::config::Truncation;
use verl_core::traits::{RolloutEngine, SleepLevel};
use verl_core::{DataProto, NamedTensor};
use verl_megatron::hf::{HfCheckpoint, HfModelConfig};
use verl_megatron::models::router_replay::record_routing;
use verl_megatron::models::{generate, CausalLm, GenerateOptions};
use verl_rollout::{
    Detokenizer, EngineConfig, FinishReason, KvBudget, NativeRollout, Request, RolloutError,
    Sampler, SamplingParams,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../verl-megatron/tests/fixtures")
        .join(name)
}

fn load(name: &str) -> (HfModelConfig, CausalLm<B>) {
    let dir = fixture(name);
    let cfg = HfModelConfig::from_dir(&dir).unwrap();
    let model = CausalLm::from_checkpoint(
        &cfg,
        &HfCheckpoint::open(&dir).unwrap(),
        &Default::default(),
    )
    .unwrap();
    (cfg, model)
}

fn greedy_config(max_num_seqs: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs,
        prompt_length: 24,
        response_length: 10,
        kv_budget: KvBudget::Tokens(1 << 16),
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn engine(name: &str, cfg: EngineConfig) -> NativeRollout<B> {
    let (model_cfg, model) = load(name);
    NativeRollout::new(model_cfg, model, cfg, Default::default()).unwrap()
}

/// Deterministic pseudo-random prompts of varied lengths.
fn prompts(count: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as u32
    };
    (0..count)
        .map(|_| {
            let len = 1 + next() as usize % 20;
            (0..len).map(|_| 3 + next() % 300).collect()
        })
        .collect()
}

fn requests(prompts: &[Vec<u32>], params: SamplingParams, max_new: usize) -> Vec<Request> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.clone(),
            sampler: Sampler::new(params, i as u64).unwrap(),
            max_new_tokens: max_new,
        })
        .collect()
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..Default::default()
    }
}

#[test]
fn cached_greedy_equals_cache_less_recompute() {
    for name in ["qwen2", "llama3", "qwen3", "qwen2_moe"] {
        let mut cfg = greedy_config(4);
        cfg.ignore_eos = true;
        let mut e = engine(name, cfg);
        let ps = prompts(6, 7);
        let out = e.generate(requests(&ps, greedy(), 10)).unwrap();
        let model = e.model().unwrap();
        for (p, c) in ps.iter().zip(&out) {
            let reference = generate(
                model,
                p,
                &GenerateOptions {
                    max_new_tokens: 10,
                    temperature: 0.0,
                    seed: 0,
                    eos_token_ids: vec![],
                },
                &Default::default(),
            );
            assert_eq!(c.tokens, reference, "{name}: prompt {p:?}");
            assert_eq!(c.finish, FinishReason::Length);
        }
    }
}

#[test]
fn a_prompt_alone_equals_the_same_prompt_in_a_mixed_batch() {
    let mut cfg = greedy_config(3);
    cfg.ignore_eos = true;
    let mut e = engine("qwen2", cfg);
    let ps = prompts(9, 11);
    let batched = e.generate(requests(&ps, greedy(), 10)).unwrap();
    for (i, p) in ps.iter().enumerate() {
        let alone = e
            .generate(requests(std::slice::from_ref(p), greedy(), 10))
            .unwrap();
        assert_eq!(alone[0], batched[i], "prompt {i}");
    }
}

#[test]
fn continuous_batching_streams_three_times_max_num_seqs_in_order() {
    let max_num_seqs = 4;
    let mut cfg = greedy_config(max_num_seqs);
    cfg.ignore_eos = true;
    let mut e = engine("qwen2", cfg);
    let ps = prompts(3 * max_num_seqs, 5);
    // Different lengths finish at different steps, so slots are refilled mid-flight.
    let reqs: Vec<Request> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            prompt: p.clone(),
            sampler: Sampler::new(greedy(), i as u64).unwrap(),
            max_new_tokens: 2 + i % 7,
        })
        .collect();
    let out = e.generate(reqs).unwrap();
    let stats = e.last_stats();
    assert_eq!(out.len(), ps.len());
    assert_eq!(stats.peak_batch, max_num_seqs);
    assert!(
        stats.prefill_steps > 1,
        "requests were admitted as slots freed"
    );
    let total: usize = (0..ps.len()).map(|i| 2 + i % 7).sum();
    assert_eq!(stats.generated_tokens, total);
    assert!(stats.decode_steps < total, "decoding was batched");
    for (i, p) in ps.iter().enumerate() {
        let alone = e
            .generate(requests(std::slice::from_ref(p), greedy(), 2 + i % 7))
            .unwrap();
        assert_eq!(out[i], alone[0], "request {i} returned in its place");
    }
}

/// A prompt's `n` samples admitted together share one prefill; what they generate (sampled,
/// with log-probs) is what they generate when every sample prefills its own copy.
#[test]
fn samples_of_one_prompt_share_a_prefill_and_generate_the_same() {
    let n = 4;
    let ps = prompts(3, 21);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 50,
        ..Default::default()
    };
    let reqs = || -> Vec<Request> {
        ps.iter()
            .flat_map(|p| std::iter::repeat_n(p, n))
            .enumerate()
            .map(|(i, p)| Request {
                prompt: p.clone(),
                sampler: Sampler::new(params, i as u64).unwrap(),
                max_new_tokens: 8,
            })
            .collect()
    };
    let mut cfg = greedy_config(16);
    cfg.ignore_eos = true;
    cfg.calculate_log_probs = true;
    cfg.sampling = params;
    let mut shared = engine("qwen2", cfg.clone());
    let with = shared.generate(reqs()).unwrap();
    let stats = shared.last_stats();
    let unique: usize = ps.iter().map(Vec::len).sum();
    assert_eq!(stats.prompt_tokens, n * unique);
    assert_eq!(stats.prefilled_tokens, unique, "each prompt prefilled once");
    cfg.enable_prefix_caching = false;
    let mut apart = engine("qwen2", cfg);
    let without = apart.generate(reqs()).unwrap();
    assert_eq!(apart.last_stats().prefilled_tokens, n * unique);
    assert_eq!(with, without);
    // The samples did differ from each other (they were sampled, not copied).
    assert!(with[..n].iter().any(|c| c.tokens != with[0].tokens));
}

/// With a prefill budget of 7 tokens, prompts of up to 20 tokens are prefilled in chunks while
/// other slots decode; every response (sampled, with log-probs) equals the one generated with
/// whole prefills.
#[test]
fn chunked_prefill_generates_what_whole_prefills_generate() {
    let ps = prompts(9, 13);
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        ..Default::default()
    };
    for name in ["qwen2", "llama3"] {
        let mut cfg = greedy_config(3);
        cfg.ignore_eos = true;
        cfg.calculate_log_probs = true;
        cfg.sampling = params;
        let mut whole = engine(name, cfg.clone());
        let want = whole.generate(requests(&ps, params, 6)).unwrap();
        cfg.max_num_batched_tokens = 7;
        let mut chunked = engine(name, cfg.clone());
        // Same tokens; log-probs equal up to the summation order of other batch shapes.
        let same = |got: &[verl_rollout::Completion]| {
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.tokens, w.tokens, "{name}: request {i}");
                for (a, b) in g.log_probs.iter().zip(&w.log_probs) {
                    assert!((a - b).abs() < 1e-4, "{name}: request {i}: {a} vs {b}");
                }
            }
        };
        let got = chunked.generate(requests(&ps, params, 6)).unwrap();
        let stats = chunked.last_stats();
        assert_eq!(stats.prefilled_tokens, stats.prompt_tokens);
        assert!(stats.prefill_steps > whole.last_stats().prefill_steps);
        same(&got);
        // Off, a prompt over the budget waits for a step of its own and is prefilled whole.
        cfg.enable_chunked_prefill = false;
        let mut apart = engine(name, cfg);
        same(&apart.generate(requests(&ps, params, 6)).unwrap());
    }
}

#[test]
fn stop_tokens_and_length_limits_end_sequences_exactly() {
    let mut cfg = greedy_config(2);
    cfg.ignore_eos = true;
    let mut e = engine("qwen2", cfg.clone());
    let p = prompts(1, 3);
    let free = e.generate(requests(&p, greedy(), 10)).unwrap().remove(0);
    // Length: exactly max_new_tokens.
    let short = e.generate(requests(&p, greedy(), 4)).unwrap().remove(0);
    assert_eq!(short.tokens, free.tokens[..4]);
    assert_eq!(short.finish, FinishReason::Length);
    // A stop id ends the response right after its first occurrence, kept as the last token.
    let stop = free.tokens[2];
    let first = free.tokens.iter().position(|&t| t == stop).unwrap();
    cfg.stop_token_ids = vec![stop];
    let mut e = engine("qwen2", cfg.clone());
    let stopped = e.generate(requests(&p, greedy(), 10)).unwrap().remove(0);
    assert_eq!(stopped.tokens, free.tokens[..=first]);
    assert_eq!(stopped.finish, FinishReason::Stop);
    // EOS likewise, unless ignore_eos.
    cfg.stop_token_ids.clear();
    cfg.eos_token_ids = vec![stop];
    cfg.ignore_eos = false;
    let mut e = engine("qwen2", cfg.clone());
    assert_eq!(
        e.generate(requests(&p, greedy(), 10)).unwrap()[0].tokens,
        free.tokens[..=first]
    );
    cfg.ignore_eos = true;
    let mut e = engine("qwen2", cfg.clone());
    assert_eq!(e.generate(requests(&p, greedy(), 10)).unwrap()[0], free);
    // A stop string spanning tokens 2 and 3 ends the response at the token completing it.
    let text = |ids: &[u32]| -> String { ids.iter().map(|i| format!("<{i}>")).collect() };
    let stop = format!("{}><{}", free.tokens[2], free.tokens[3]);
    let end = (1..=free.tokens.len())
        .find(|&n| text(&free.tokens[..n]).contains(&stop))
        .unwrap();
    cfg.stop = vec![stop];
    let mut e = engine("qwen2", cfg.clone());
    let err = e.generate(requests(&p, greedy(), 10)).unwrap_err();
    assert!(
        err.to_string().contains("actor_rollout_ref.rollout.stop"),
        "{err}"
    );
    struct Angled;
    impl Detokenizer for Angled {
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter().map(|i| format!("<{i}>")).collect()
        }
    }
    let mut e = engine("qwen2", cfg).with_detokenizer(std::sync::Arc::new(Angled));
    let stopped = e.generate(requests(&p, greedy(), 10)).unwrap().remove(0);
    assert_eq!(stopped.tokens, free.tokens[..end]);
    assert_eq!(stopped.finish, FinishReason::Stop);
}

/// The first sampled token follows softmax(logits / T) restricted to the top-k (chi-square, fixed
/// seed, p = 0.001).
#[test]
fn sampled_tokens_follow_the_target_distribution() {
    let params = SamplingParams {
        temperature: 1.5,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        seed: 1234,
    };
    let mut cfg = greedy_config(64);
    cfg.sampling = params;
    cfg.ignore_eos = true;
    let mut e = engine("qwen2", cfg);
    let prompt = vec![5u32, 17, 42, 7];
    let logits = e
        .model()
        .unwrap()
        .forward(
            Tensor::<B, 2, Int>::from_data(
                TensorData::new(prompt.iter().map(|&t| t as i64).collect(), [1, 4]),
                &Default::default(),
            ),
            None,
            None,
        )
        .narrow(1, 3, 1)
        .reshape([320])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let target = params.distribution(&logits);
    let draws = 3000;
    let out = e
        .generate(requests(&vec![prompt; draws], params, 1))
        .unwrap();
    let mut counts = vec![0usize; 320];
    for c in &out {
        counts[c.tokens[0] as usize] += 1;
    }
    let mut chi2 = 0.0;
    let mut support = 0;
    for (i, &p) in target.iter().enumerate() {
        if p == 0.0 {
            assert_eq!(counts[i], 0, "token {i} is outside the top-k");
            continue;
        }
        support += 1;
        let expected = p * draws as f64;
        chi2 += (counts[i] as f64 - expected).powi(2) / expected;
    }
    assert_eq!(support, 4);
    // 3 degrees of freedom, p = 0.001.
    assert!(chi2 < 16.27, "chi-square {chi2}");
    // Same seed, same samples.
    let again = e
        .generate(requests(&vec![vec![5u32, 17, 42, 7]; 50], params, 1))
        .unwrap();
    assert_eq!(again[..], out[..50]);
}

fn prompt_batch(ps: &[Vec<u32>], width: usize) -> DataProto<B> {
    let d = Default::default();
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for p in ps {
        let pad = width - p.len();
        ids.extend(std::iter::repeat_n(0i64, pad).chain(p.iter().map(|&t| t as i64)));
        mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1, p.len())));
    }
    let mut proto = DataProto::new();
    proto
        .insert_int(
            "input_ids",
            Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [ps.len(), width]), &d),
        )
        .unwrap();
    proto
        .insert_int(
            "attention_mask",
            Tensor::<B, 2, Int>::from_data(TensorData::new(mask, [ps.len(), width]), &d),
        )
        .unwrap();
    proto
}

fn host(proto: &DataProto<B>, key: &str) -> Vec<i64> {
    proto
        .to_data(key)
        .unwrap()
        .convert::<i64>()
        .iter::<i64>()
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn generate_sequences_writes_verls_layout_and_log_probs_match_recompute() {
    let n = 3;
    let mut cfg = greedy_config(8);
    cfg.sampling = SamplingParams {
        temperature: 0.8,
        top_k: -1,
        top_p: 0.95,
        min_p: 0.0,
        seed: 9,
    };
    cfg.n = n;
    cfg.eos_token_ids = vec![2];
    cfg.pad_token_id = 0;
    cfg.calculate_log_probs = true;
    let mut e = engine("qwen2", cfg);
    let ps = prompts(4, 21);
    let width = 20;
    let mut input = prompt_batch(&ps, width);
    input
        .insert_non_tensor(
            "data_source",
            (0..4)
                .map(|i| serde_json::json!(format!("src{i}")))
                .collect(),
        )
        .unwrap();
    let out = e.generate_sequences(input).await.unwrap();
    let rows = 4 * n;
    let r = 10;
    assert_eq!(out.len(), rows);
    let prompts_t = host(&out, "prompts");
    let responses = host(&out, "responses");
    let input_ids = host(&out, "input_ids");
    let attention = host(&out, "attention_mask");
    let positions = host(&out, "position_ids");
    let response_mask = host(&out, "response_mask");
    let uids = out.non_tensor("uid").unwrap();
    let sources = out.non_tensor("data_source").unwrap();
    let log_probs: Vec<f32> = out
        .to_data("rollout_log_probs")
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let model = e.model().unwrap();
    for row in 0..rows {
        let p = &ps[row / n];
        let pad = width - p.len();
        // Prompts left-padded, as given.
        assert!(prompts_t[row * width..row * width + pad]
            .iter()
            .all(|&t| t == 0));
        let prompt_row: Vec<u32> = prompts_t[row * width + pad..(row + 1) * width]
            .iter()
            .map(|&t| t as u32)
            .collect();
        assert_eq!(&prompt_row, p);
        // Responses right-padded; the mask covers the generated tokens, EOS included.
        let resp = &responses[row * r..(row + 1) * r];
        let mask = &response_mask[row * r..(row + 1) * r];
        let len = mask.iter().sum::<i64>() as usize;
        assert!(len >= 1 && mask[..len].iter().all(|&m| m == 1));
        assert!(resp[len..].iter().all(|&t| t == 0));
        if let Some(eos) = resp[..len].iter().position(|&t| t == 2) {
            assert_eq!(eos, len - 1, "EOS ends the response");
        } else {
            assert_eq!(len, r);
        }
        // input_ids = prompts ‖ responses; attention mask and positions line up.
        let total = width + r;
        assert_eq!(
            &input_ids[row * total..row * total + width],
            &prompts_t[row * width..(row + 1) * width]
        );
        assert_eq!(&input_ids[row * total + width..(row + 1) * total], resp);
        let att = &attention[row * total..(row + 1) * total];
        assert_eq!(att.iter().sum::<i64>() as usize, p.len() + len);
        let pos = &positions[row * total..(row + 1) * total];
        for (j, &got) in pos.iter().enumerate().skip(pad) {
            assert_eq!(got, (j - pad) as i64);
        }
        // Samples of one prompt share its uid and columns.
        assert_eq!(uids[row], uids[(row / n) * n]);
        assert_eq!(sources[row], serde_json::json!(format!("src{}", row / n)));
        if row % n == 0 && row > 0 {
            assert_ne!(uids[row], uids[row - 1]);
        }
        // The rollout log-probs equal log softmax(logits / T) of a full forward pass over the
        // sequence: what the actor recomputes.
        let seq: Vec<i64> = p
            .iter()
            .map(|&t| t as i64)
            .chain(resp[..len].iter().copied())
            .collect();
        let t = seq.len();
        let logits = model
            .forward(
                Tensor::<B, 2, Int>::from_data(
                    TensorData::new(seq.clone(), [1, t]),
                    &Default::default(),
                ),
                None,
                None,
            )
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for j in 0..len {
            let at = p.len() - 1 + j;
            let row_logits = &logits[at * 320..(at + 1) * 320];
            let expected = verl_rollout::engine::log_prob_at(row_logits, resp[j] as u32, 0.8);
            let got = log_probs[row * r + j];
            assert!(
                (got - expected).abs() < 1e-4,
                "row {row} token {j}: {got} vs {expected}"
            );
        }
        assert!(log_probs[row * r + len..(row + 1) * r]
            .iter()
            .all(|&x| x == 0.0));
    }
    // Validation settings from meta_info: greedy, one sample.
    let mut val = prompt_batch(&ps, width);
    val.meta_info
        .insert("validate".into(), serde_json::json!(true));
    let out = e.generate_sequences(val).await.unwrap();
    assert_eq!(out.len(), 4);
    // A call's `max_tokens` caps its responses (the layout keeps response_length columns).
    let mut short = prompt_batch(&ps, width);
    short
        .meta_info
        .insert("max_tokens".into(), serde_json::json!(3));
    let out = e.generate_sequences(short).await.unwrap();
    let mask = host(&out, "response_mask");
    assert_eq!(mask.len(), 4 * n * r);
    for row in mask.chunks(r) {
        assert!(row[3..].iter().all(|&m| m == 0) && row[0] == 1);
    }
    let mut over = prompt_batch(&ps, width);
    over.meta_info
        .insert("max_tokens".into(), serde_json::json!(r + 1));
    let err = e.generate_proto(&over).unwrap_err().to_string();
    assert!(err.contains("meta_info.max_tokens"), "{err}");
}

#[test]
fn prompt_limits_refuse_or_truncate_as_configured() {
    let mut cfg = greedy_config(2);
    cfg.prompt_length = 6;
    cfg.ignore_eos = true;
    let long: Vec<u32> = (10..20).collect();
    let mut e = engine("qwen2", cfg.clone());
    let err = e
        .generate_proto(&prompt_batch(&[vec![5, 6], long.clone()], 10))
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            RolloutError::PromptTooLong {
                row: 1,
                len: 10,
                limit: 6,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("data.max_prompt_length") && msg.contains("truncation"),
        "{msg}"
    );
    cfg.truncation = Truncation::Left;
    let mut e = engine("qwen2", cfg);
    let out = e
        .generate_proto(&prompt_batch(std::slice::from_ref(&long), 10))
        .unwrap();
    // Left truncation keeps the last 6 tokens, and the prompt width shrinks to the limit.
    let kept: Vec<u32> = long[4..].to_vec();
    assert_eq!(
        host(&out, "prompts"),
        kept.iter().map(|&t| t as i64).collect::<Vec<_>>()
    );
    let direct = e.generate(requests(&[kept], greedy(), 10)).unwrap();
    let resp: Vec<u32> = host(&out, "responses").iter().map(|&t| t as u32).collect();
    assert_eq!(resp, direct[0].tokens);
}

#[test]
fn a_kv_budget_below_one_sequence_is_refused_naming_the_key() {
    let (model_cfg, model) = load("qwen2");
    let mut cfg = greedy_config(2);
    cfg.kv_budget = KvBudget::Tokens(20);
    let err = NativeRollout::<B>::new(model_cfg, model, cfg, Default::default())
        .err()
        .unwrap();
    assert!(err.to_string().contains("kv_cache_tokens"), "{err}");
}

fn weight_stream(tensors: Vec<NamedTensor<B>>) -> verl_core::WeightStream<'static, B> {
    Box::pin(stream::iter(tensors.into_iter().map(Ok)))
}

#[tokio::test(flavor = "current_thread")]
async fn update_weights_sleep_and_wake_up() {
    let mut cfg = greedy_config(4);
    cfg.ignore_eos = true;
    let mut e = engine("qwen2", cfg.clone());
    let (model_cfg, _) = load("qwen2");
    let other = CausalLm::<B>::init(&model_cfg, 0.3, 77, &Default::default());
    let ps = prompts(5, 2);
    let reference = NativeRollout::new(model_cfg.clone(), other.clone(), cfg, Default::default())
        .unwrap()
        .generate(requests(&ps, greedy(), 10))
        .unwrap();
    let before = e.generate(requests(&ps, greedy(), 10)).unwrap();
    assert_ne!(before, reference, "the two models differ");

    // A wrong name or shape is refused and named.
    let mut bad = other.export_weights();
    bad[0].name = "model.embed_tokens.weights".into();
    let err = e.update_weights(weight_stream(bad)).await.unwrap_err();
    assert!(
        err.to_string().contains("model.embed_tokens.weights"),
        "{err}"
    );
    let wrong = NamedTensor::new(
        "model.layers.1.mlp.up_proj.weight",
        Tensor::<B, 2>::zeros([64, 31], &Default::default()),
    );
    let err = e
        .update_weights(weight_stream(vec![wrong]))
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("[64, 32]"),
        "{msg}"
    );

    // In place, tensor by tensor.
    e.update_weights(weight_stream(other.export_weights()))
        .await
        .unwrap();
    assert_eq!(e.generate(requests(&ps, greedy(), 10)).unwrap(), reference);

    // Sleep frees the KV cache; wake-up rebuilds it.
    assert!(e.kv_cache_bytes() > 0);
    e.sleep(SleepLevel::KvCache).await.unwrap();
    assert!(e.is_sleeping());
    assert_eq!(e.kv_cache_bytes(), 0);
    assert!(matches!(
        e.generate(requests(&ps, greedy(), 10)),
        Err(RolloutError::Asleep)
    ));
    e.wake_up().await.unwrap();
    assert!(e.kv_cache_bytes() > 0);
    assert_eq!(e.generate(requests(&ps, greedy(), 10)).unwrap(), reference);

    // Sleeping with `All` releases the weights too; a full stream rebuilds the model.
    e.sleep(SleepLevel::All).await.unwrap();
    e.wake_up().await.unwrap();
    assert!(matches!(
        e.generate(requests(&ps, greedy(), 10)),
        Err(RolloutError::WeightsReleased)
    ));
    let mut partial = before_weights();
    partial.pop();
    let err = e.update_weights(weight_stream(partial)).await.unwrap_err();
    assert!(err.to_string().contains("never provided"), "{err}");
    e.update_weights(weight_stream(before_weights()))
        .await
        .unwrap();
    assert_eq!(e.generate(requests(&ps, greedy(), 10)).unwrap(), before);
}

fn before_weights() -> Vec<NamedTensor<B>> {
    load("qwen2").1.export_weights()
}

fn prefix_config(max_num_seqs: usize, retain: bool, caching: bool) -> EngineConfig {
    EngineConfig {
        prompt_length: 40,
        ignore_eos: true,
        enable_prefix_caching: caching,
        retain_prefixes: retain,
        ..greedy_config(max_num_seqs)
    }
}

/// Later samples of a prompt that waited for a slot keep the prompt a finished sibling left in
/// its slot and prefill only its last token; the tokens are those of an engine without prefix
/// caching.
#[test]
fn a_finished_prompt_serves_samples_that_waited_for_a_slot() {
    let base = prompts(2, 5);
    // Three samples of each prompt, two slots: the third sample of each waits.
    let ps: Vec<Vec<u32>> = base
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), 3))
        .collect();
    let mut cached = engine("qwen2", prefix_config(2, false, true));
    let mut plain = engine("qwen2", prefix_config(2, false, false));
    let with = cached.generate(requests(&ps, greedy(), 6)).unwrap();
    let without = plain.generate(requests(&ps, greedy(), 6)).unwrap();
    assert_eq!(with, without);
    let stats = cached.last_stats();
    // The first prompt's third sample at least keeps all of it but its last token.
    assert!(stats.reused_prefix_tokens >= base[0].len() - 1, "{stats:?}");
    assert!(
        stats.prefilled_tokens + stats.reused_prefix_tokens <= plain.last_stats().prefilled_tokens
    );
    assert_eq!(plain.last_stats().reused_prefix_tokens, 0);
    assert_eq!(
        plain.last_stats().prefilled_tokens,
        plain.last_stats().prompt_tokens
    );
}

/// A multi-turn continuation (the last turn's prompt and response, then new tokens) keeps the
/// conversation its slot holds, also for a request that finished early and sat out decode steps
/// of the others; after a weight update nothing is reused.
#[tokio::test(flavor = "current_thread")]
async fn a_continuation_reuses_its_conversation_until_the_weights_change() {
    let turn1: Vec<Vec<u32>> = prompts(3, 21)
        .into_iter()
        .map(|p| p[..p.len().min(12)].to_vec())
        .collect();
    // Different lengths: the first request finishes first and sits out the others' steps.
    let first = |e: &mut NativeRollout<B>| {
        let mut reqs = requests(&turn1, greedy(), 8);
        reqs[0].max_new_tokens = 2;
        e.generate(reqs).unwrap()
    };
    let mut e = engine("qwen2", prefix_config(4, true, true));
    let out1 = first(&mut e);
    let turn2: Vec<Vec<u32>> = turn1
        .iter()
        .zip(&out1)
        .enumerate()
        .map(|(i, (p, c))| [p.clone(), c.tokens.clone(), vec![7 + i as u32, 11]].concat())
        .collect();
    let again = e.generate(requests(&turn2, greedy(), 5)).unwrap();
    // Each slot held its prompt and every response token but the last.
    let held: usize = turn1
        .iter()
        .zip(&out1)
        .map(|(p, c)| p.len() + c.tokens.len() - 1)
        .sum();
    assert_eq!(e.last_stats().reused_prefix_tokens, held);
    let mut fresh = engine("qwen2", prefix_config(4, true, false));
    assert_eq!(
        again,
        fresh.generate(requests(&turn2, greedy(), 5)).unwrap()
    );

    // The same weights loaded again: what the slots held is forgotten all the same.
    first(&mut e);
    e.update_weights(weight_stream(before_weights()))
        .await
        .unwrap();
    let after = e.generate(requests(&turn2, greedy(), 5)).unwrap();
    assert_eq!(e.last_stats().reused_prefix_tokens, 0);
    assert_eq!(after, again);
}

/// Samples of a prompt waiting together share one prefill of it rather than each resuming from
/// a slot that holds only its first tokens; once a slot holds the whole prompt, the remaining
/// samples resume from it. Without `retain_prefixes` a call starts from no prefix.
#[test]
fn waiting_samples_share_a_prefill_unless_a_slot_holds_most_of_their_prompt() {
    let start = [5u32, 6];
    let q1 = [&start[..], &[40, 41, 42, 43, 44, 45]].concat();
    let q2 = [&start[..], &[50, 51, 52, 53, 54, 55]].concat();
    let y: Vec<u32> = start.iter().copied().chain(60..74).collect();
    let ps = vec![
        q1.clone(),
        q2.clone(),
        y.clone(),
        y.clone(),
        y.clone(),
        y.clone(),
    ];
    let mut cached = engine("qwen2", prefix_config(2, false, true));
    let with = cached.generate(requests(&ps, greedy(), 4)).unwrap();
    let mut plain = engine("qwen2", prefix_config(2, false, false));
    assert_eq!(with, plain.generate(requests(&ps, greedy(), 4)).unwrap());
    let s = cached.last_stats();
    // q1 and q2; y once for its first two samples; one token each for the last two, which
    // keep all of y but its last token.
    assert_eq!(
        s.prefilled_tokens,
        q1.len() + q2.len() + y.len() + 2,
        "{s:?}"
    );
    assert_eq!(s.reused_prefix_tokens, 2 * (y.len() - 1));
    // The same call again starts from no prefix: the same prefills and reuse as the first.
    let again = cached.generate(requests(&ps, greedy(), 4)).unwrap();
    assert_eq!(again, with);
    let t = cached.last_stats();
    assert_eq!(
        (t.prefilled_tokens, t.reused_prefix_tokens),
        (s.prefilled_tokens, s.reused_prefix_tokens)
    );
}

/// The experts a cache-less forward of `tokens` routes each position to, `[position][layer][k]`.
fn routing_of(model: &CausalLm<B>, tokens: &[u32], layers: usize, k: usize) -> Vec<i64> {
    let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
    let ids = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids, [1, tokens.len()]),
        &Default::default(),
    );
    let (_, routing) = record_routing(|| model.forward(ids, None, None));
    let mut out = vec![-1; tokens.len() * layers * k];
    for (&layer, chosen) in &routing.layers {
        for (pos, ids) in chosen.chunks(k).enumerate() {
            let at = (pos * layers + layer) * k;
            out[at..at + k].copy_from_slice(ids);
        }
    }
    out
}

/// Router replay R3: every completion's routing is the experts a cache-less forward of its
/// prompt and fed response chooses, position for position, whether the prompt was prefilled
/// once for several samples, in chunks, or resumed from a finished sibling's slot; a dense
/// model and an engine not asked record nothing.
#[test]
fn the_rollout_records_the_experts_of_every_fed_token() {
    let base = prompts(3, 11);
    // Three samples of each prompt, two slots: samples share prefills, wait for slots and
    // resume from what a finished sibling left.
    let ps: Vec<Vec<u32>> = base
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), 3))
        .collect();
    for chunked in [false, true] {
        let mut cfg = prefix_config(2, false, true);
        cfg.record_routing = true;
        if chunked {
            cfg.max_num_batched_tokens = 5;
        }
        let mut e = engine("qwen2_moe", cfg);
        let (layers, k) = e.routing_shape().expect("an MoE model records");
        assert_eq!((layers, k), (2, 2));
        let out = e.generate(requests(&ps, greedy(), 6)).unwrap();
        assert!(e.last_stats().reused_prefix_tokens > 0 || chunked);
        let model = e.model().unwrap();
        for (p, c) in ps.iter().zip(&out) {
            let fed = [&p[..], &c.tokens[..c.tokens.len() - 1]].concat();
            assert_eq!(c.routed_experts.len(), fed.len() * layers * k);
            assert!(c.routed_experts.iter().all(|&x| (0..4).contains(&x)));
            assert_eq!(
                c.routed_experts,
                routing_of(model, &fed, layers, k),
                "chunked {chunked}: prompt {p:?}"
            );
        }
    }
    // Not asked, or a dense model: nothing recorded.
    let mut plain = engine("qwen2_moe", prefix_config(2, false, true));
    assert_eq!(plain.routing_shape(), None);
    let out = plain.generate(requests(&ps[..2], greedy(), 3)).unwrap();
    assert!(out.iter().all(|c| c.routed_experts.is_empty()));
    let mut cfg = prefix_config(2, false, true);
    cfg.record_routing = true;
    assert_eq!(engine("qwen2", cfg).routing_shape(), None);
}

/// Router replay R3 in verl's layout: `routed_experts` `[rows, prompt + response width,
/// layers, k]` holds each fed token's experts in its own column (what a cache-less forward of
/// the row chooses) and -1 on padding and on each row's last token.
#[tokio::test(flavor = "current_thread")]
async fn generate_sequences_returns_routed_experts_in_the_tokens_columns() {
    let mut cfg = greedy_config(4);
    cfg.n = 2;
    cfg.eos_token_ids = vec![2];
    cfg.record_routing = true;
    let mut e = engine("qwen2_moe", cfg);
    let ps = prompts(3, 4);
    let out = e.generate_sequences(prompt_batch(&ps, 20)).await.unwrap();
    let routed = out.int::<4>("routed_experts").unwrap();
    let [rows, total, layers, k] = routed.dims();
    assert_eq!((rows, total, layers, k), (6, 30, 2, 2));
    let routed: Vec<i64> = routed.into_data().convert::<i64>().iter::<i64>().collect();
    let (ids, mask) = (host(&out, "input_ids"), host(&out, "attention_mask"));
    let model = e.model().unwrap();
    let per = layers * k;
    for row in 0..rows {
        let cols: Vec<usize> = (0..total).filter(|&c| mask[row * total + c] == 1).collect();
        let tokens: Vec<u32> = cols.iter().map(|&c| ids[row * total + c] as u32).collect();
        let expected = routing_of(model, &tokens[..tokens.len() - 1], layers, k);
        for c in 0..total {
            let got = &routed[(row * total + c) * per..(row * total + c + 1) * per];
            match cols[..cols.len() - 1].iter().position(|&x| x == c) {
                Some(q) => assert_eq!(got, &expected[q * per..(q + 1) * per], "row {row} col {c}"),
                None => assert_eq!(got, [-1; 4], "row {row} col {c}"),
            }
        }
    }
}

/// Gives experts 2 and 3 of every MoE layer the same router row, plus `nudge` times expert 0's
/// row for expert 3: with no nudge their scores tie exactly for every token; with a small one
/// the tie breaks by the sign of a token's score for expert 0, as another kernel's rounding
/// would break it.
fn tie_routers(model: &mut CausalLm<B>, nudge: f32) {
    use verl_megatron::models::feed_forward::FeedForward;
    for layer in model.layers.iter_mut() {
        if let FeedForward::Moe(block) = &mut layer.mlp {
            let w = block.gate.weight.val();
            let [experts, hidden] = w.dims();
            assert_eq!(experts, 4);
            let row = |e: usize| w.clone().narrow(0, e, 1);
            let tied = row(2) + row(0) * nudge;
            let w = Tensor::cat(vec![w.clone().narrow(0, 0, 3), tied], 0);
            assert_eq!(w.dims(), [experts, hidden]);
            block.gate.weight = burn::module::Param::from_tensor(w);
        }
    }
}

/// Router replay R3 against a trainer whose numerics break routing ties the other way. Two
/// experts of every MoE layer tie exactly in the rollout's model; the trainer's copy nudges
/// one of them by 1e-5 of another row, as a different kernel's rounding would. Forwarding
/// the rollout's rows with the routing the batch carries, mapped as the actor maps it, gives
/// back the rollout's log-probs to 5e-6. Without replay, the flipped ties move them by up to
/// 0.29.
#[tokio::test(flavor = "current_thread")]
async fn replaying_the_rollouts_routing_gives_training_the_rollouts_log_probs() {
    use std::sync::Arc;
    use verl_megatron::models::router_replay::replay_routing;
    use verl_megatron::workers::routing_store::{token_origins, RoutingStore};

    let (model_cfg, mut rollout_model) = load("qwen2_moe");
    let mut trainer = rollout_model.clone();
    tie_routers(&mut rollout_model, 0.0);
    tie_routers(&mut trainer, 1e-5);
    let mut cfg = greedy_config(4);
    cfg.record_routing = true;
    cfg.calculate_log_probs = true;
    cfg.ignore_eos = true;
    let mut e = NativeRollout::new(model_cfg, rollout_model, cfg, Default::default()).unwrap();
    let out = e
        .generate_sequences(prompt_batch(&prompts(4, 3), 20))
        .await
        .unwrap();
    let [rows, total] = out.int::<2>("input_ids").unwrap().dims();
    let r = out.int::<2>("responses").unwrap().dims()[1];
    let (ids, mask, positions) = (
        host(&out, "input_ids"),
        host(&out, "attention_mask"),
        host(&out, "position_ids"),
    );
    let rollout_lp: Vec<f32> = out
        .to_data("rollout_log_probs")
        .unwrap()
        .convert::<f32>()
        .iter::<f32>()
        .collect();
    let response_mask = host(&out, "response_mask");
    // The trainer's log-probs of the response tokens (temperature 1: greedy sampling).
    let log_probs = |replay: Option<Arc<verl_megatron::models::router_replay::Routing>>| {
        let d = Default::default();
        let int = |v: &[i64]| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(v.to_vec(), [rows, total]), &d)
        };
        let mask_f = int(&mask).float();
        let forward = || trainer.forward(int(&ids), Some(mask_f), Some(int(&positions)));
        let logits = match replay {
            Some(routing) => replay_routing(routing, forward),
            None => forward(),
        };
        let lp = burn::tensor::activation::log_softmax(logits, 2);
        let lp: Vec<f32> = lp.into_data().convert::<f32>().iter::<f32>().collect();
        let vocab = lp.len() / (rows * total);
        let mut out = Vec::new();
        for row in 0..rows {
            for j in 0..r {
                if response_mask[row * r + j] == 1 {
                    let col = total - r + j;
                    let token = ids[row * total + col] as usize;
                    out.push(lp[(row * total + col - 1) * vocab + token]);
                }
            }
        }
        out
    };
    let real: Vec<f32> = rollout_lp
        .iter()
        .zip(&response_mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&lp, _)| lp)
        .collect();
    let worst = |lp: Vec<f32>| -> f32 {
        lp.iter()
            .zip(&real)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    };
    let store = RoutingStore::from_routed_experts(&out).unwrap();
    let mask_f: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
    let origins = token_origins(&ids, &mask_f, &positions, (rows, total), None);
    let (replay, missing) = store.replay_for(&origins);
    assert_eq!(missing, 0, "every fed token's routing is in the batch");
    let replayed = worst(log_probs(Some(Arc::new(replay))));
    let own = worst(log_probs(None));
    assert!(replayed < 1e-4, "replayed: {replayed:e}");
    assert!(
        own > 1e-2,
        "control: the trainer's own routing moved the log-probs: {own:e}"
    );
}

/// The rollout engine as the agent loop's turn generator: a trajectory whose model calls no
/// tool is one turn, token for token what the engine generates for the same request.
#[test]
fn the_agent_loop_runs_turns_on_the_engine() {
    use verl_rollout::agent::{run_agent_loop, AgentFinish, ChatTurns, ToolSet};
    /// No text decodes to a tool call: every trajectory answers in one turn.
    struct Plain;
    impl ChatTurns for Plain {
        fn decode(&self, tokens: &[u32]) -> String {
            format!("{} tokens", tokens.len())
        }
        fn tool_turn(&self, _: &[String]) -> Result<Vec<u32>, RolloutError> {
            Ok(Vec::new())
        }
    }
    let mut cfg = greedy_config(4);
    cfg.ignore_eos = true;
    cfg.retain_prefixes = true;
    let ps = prompts(3, 8);
    let loop_cfg = loop_config();
    let trajectories = agent_requests(&ps);
    let mut e = engine("qwen2", cfg.clone());
    let out = futures::executor::block_on(run_agent_loop(
        &mut e,
        &Plain,
        &ToolSet::new(),
        trajectories,
        &loop_cfg,
    ))
    .unwrap();
    let plain = engine("qwen2", cfg)
        .generate(requests(&ps, greedy(), 6))
        .unwrap();
    for (t, c) in out.iter().zip(&plain) {
        assert_eq!(t.response, c.tokens);
        assert_eq!(t.response_mask, vec![1; 6]);
        assert_eq!((t.assistant_turns, t.finish), (1, AgentFinish::Answered));
    }
}

/// The agent loop's limits in these tests: greedy turns of at most 6 tokens in responses of 10.
fn loop_config() -> verl_rollout::agent::AgentLoopConfig {
    verl_rollout::agent::AgentLoopConfig {
        max_assistant_turns: 3,
        max_turn_tokens: Some(6),
        response_length: 10,
        max_parallel_calls: 1,
        max_tool_response_length: 64,
        tool_response_truncate_side: Default::default(),
        sampling: greedy(),
    }
}

/// One trajectory per prompt, numbered in order.
fn agent_requests(ps: &[Vec<u32>]) -> Vec<verl_rollout::agent::AgentRequest> {
    ps.iter()
        .enumerate()
        .map(|(i, p)| verl_rollout::agent::AgentRequest {
            prompt: p.clone(),
            id: i as u64,
            tools_kwargs: serde_json::Value::Null,
        })
        .collect()
}

/// The first `calls` turns decode to a calculator call, the rest to plain text.
struct CallFirst {
    calls: std::cell::Cell<usize>,
}

impl verl_rollout::agent::ChatTurns for CallFirst {
    fn decode(&self, _: &[u32]) -> String {
        let left = self.calls.get();
        if left == 0 {
            return "the answer".into();
        }
        self.calls.set(left - 1);
        let call = verl_rollout::agent::ToolCall {
            name: "calculator".into(),
            arguments: serde_json::json!({"expression": "2+2"}),
        };
        verl_rollout::agent::render_hermes("", &[call])
    }
    fn tool_turn(&self, answers: &[String]) -> Result<Vec<u32>, RolloutError> {
        assert_eq!(answers, ["4"]);
        Ok(vec![5, 6, 7])
    }
}

/// A second turn on the engine: every trajectory's first turn "calls" the calculator, the
/// tool turn is 3 fixed tokens, and the second turn, generated from a conversation longer than
/// `prompt_length` and resumed from what the slot kept of the first turn, is what the engine
/// generates for that conversation alone.
#[test]
fn the_agent_loop_continues_conversations_on_the_engine() {
    use verl_rollout::agent::{run_agent_loop, AgentFinish, Calculator, ToolSet};
    let mut cfg = greedy_config(4);
    cfg.ignore_eos = true;
    cfg.retain_prefixes = true;
    let ps = prompts(3, 8);
    assert!(ps.iter().any(|p| p.len() + 6 + 3 > cfg.prompt_length));
    let loop_cfg = loop_config();
    let trajectories = agent_requests(&ps);
    let mut e = engine("qwen2", cfg.clone());
    let chat = CallFirst {
        calls: std::cell::Cell::new(ps.len()),
    };
    let tools = ToolSet::new().with(Calculator);
    let out = futures::executor::block_on(run_agent_loop(
        &mut e,
        &chat,
        &tools,
        trajectories,
        &loop_cfg,
    ))
    .unwrap();
    // The second turn resumed each conversation from what its slot kept of the first.
    let kept: usize = ps.iter().map(|p| p.len() + 5).sum();
    assert_eq!(e.last_stats().reused_prefix_tokens, kept);
    let mut fresh = engine("qwen2", cfg);
    for (p, t) in ps.iter().zip(&out) {
        assert_eq!((t.assistant_turns, t.tool_calls), (2, 1));
        assert_eq!(t.finish, AgentFinish::Length);
        assert_eq!(t.response.len(), 10);
        assert_eq!(&t.response[6..9], [5, 6, 7]);
        assert_eq!(t.response_mask, [1, 1, 1, 1, 1, 1, 0, 0, 0, 1]);
        let conversation = [&p[..], &t.response[..9]].concat();
        let alone = fresh
            .generate(requests(&[conversation], greedy(), 1))
            .unwrap();
        assert_eq!(t.response[9..], alone[0].tokens[..]);
    }
}

/// Answers "4" and scores each call with its row's `create_kwargs.row`.
struct RowScored;

#[async_trait::async_trait(?Send)]
impl verl_core::traits::Tool for RowScored {
    fn name(&self) -> &str {
        "calculator"
    }
    fn schema(&self) -> serde_json::Value {
        serde_json::json!({})
    }
    async fn call(
        &self,
        _: &serde_json::Value,
    ) -> Result<verl_core::traits::ToolOutput, verl_core::error::ToolError> {
        unreachable!("the loop calls call_with")
    }
    async fn call_with(
        &self,
        _: &serde_json::Value,
        create_kwargs: &serde_json::Value,
    ) -> Result<verl_core::traits::ToolOutput, verl_core::error::ToolError> {
        Ok(verl_core::traits::ToolOutput {
            text: "4".into(),
            reward: create_kwargs["row"].as_f64(),
        })
    }
}

/// `generate_sequences` with an agent loop set: every sample calls the calculator once, the
/// tool turn's tokens sit in the response with `response_mask` 0 and log-prob 0, and the
/// rollout reports its turns and calls. With two samples a prompt, sample j's tool reads row
/// j / 2's `extra_info.tools_kwargs`, and its reward comes back in `tool_extra_fields`.
#[tokio::test(flavor = "current_thread")]
async fn generate_sequences_runs_the_agent_loop_with_tool_tokens_masked() {
    use verl_rollout::agent::{Agent, ToolSet};
    let mut cfg = greedy_config(8);
    cfg.n = 2;
    cfg.ignore_eos = true;
    cfg.retain_prefixes = true;
    cfg.calculate_log_probs = true;
    let agent = Agent {
        chat: Box::new(CallFirst {
            calls: std::cell::Cell::new(6),
        }),
        tools: ToolSet::new().with(RowScored),
        // Each call's response length and sampling replace the config's.
        config: loop_config(),
    };
    let mut e = engine("qwen2", cfg).with_agent(agent).unwrap();
    let mut batch = prompt_batch(&prompts(3, 4), 20);
    batch
        .insert_non_tensor(
            "extra_info",
            (0..3)
                .map(|row| serde_json::json!({"tools_kwargs": {"calculator": {"create_kwargs": {"row": row}}}}))
                .collect(),
        )
        .unwrap();
    let out = e.generate_sequences(batch).await.unwrap();
    let fields = out.non_tensor(verl_rollout::TOOL_EXTRA_FIELDS_KEY).unwrap();
    for (j, f) in fields.iter().enumerate() {
        assert_eq!(
            f["tool_rewards"],
            serde_json::json!([(j / 2) as f64]),
            "sample {j}"
        );
    }
    let (mask, responses) = (host(&out, "response_mask"), host(&out, "responses"));
    let log_probs: Vec<f32> = out
        .to_data("rollout_log_probs")
        .unwrap()
        .convert::<f32>()
        .iter::<f32>()
        .collect();
    assert_eq!(out.len(), 6);
    for row in 0..6 {
        let at = row * 10;
        assert_eq!(mask[at..at + 10], [1, 1, 1, 1, 1, 1, 0, 0, 0, 1]);
        assert_eq!(responses[at + 6..at + 9], [5, 6, 7]);
        assert_eq!(log_probs[at + 6..at + 9], [0.0; 3]);
        assert!(log_probs[at..at + 6].iter().all(|&lp| lp < 0.0));
    }
    let metrics = &out.meta_info["metrics"];
    assert_eq!(metrics["rollout/agent_turns_mean"][0], 2.0);
    assert_eq!(metrics["rollout/tool_calls_mean"][0], 1.0);
    // Router replay's recording is refused with an agent loop.
    let mut cfg = greedy_config(2);
    cfg.record_routing = true;
    let refused = engine("qwen2_moe", cfg).with_agent(Agent {
        chat: Box::new(CallFirst {
            calls: std::cell::Cell::new(0),
        }),
        tools: ToolSet::new(),
        config: loop_config(),
    });
    assert!(refused
        .err()
        .unwrap()
        .to_string()
        .contains("enable_rollout_routing_replay"));
}

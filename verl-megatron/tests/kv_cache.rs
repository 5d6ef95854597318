//! KV-cached decoding: a left-padded batch, prefilled then decoded one token at a time, gives
//! each prompt exactly the tokens the cache-less loop gives it alone.

mod common;
use common::{fixture, load_model};

use burn::tensor::{Int, Tensor, TensorData};
use verl_core::backend::CpuBackend as B;
use verl_megatron::models::{generate, CausalLm, GenerateOptions, KvCache};

fn argmax(row: &[f32]) -> i64 {
    row.iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as i64
}

/// The fixtures whose cached generation is checked against the cache-less loop: every
/// attention kind (grouped-query, q/k norms, MoE, sliding windows, Gemma's, latent attention).
const CACHED_FIXTURES: [&str; 10] = [
    "qwen2",
    "llama3",
    "qwen3",
    "qwen2_moe",
    "mistral_sliding",
    "qwen2_sliding",
    "gemma2",
    "gemma3",
    "deepseek_v3",
    "deepseek_v3_no_q_lora",
];

/// Greedy, batched, with the cache; returns the new tokens per row.
fn cached_greedy(model: &CausalLm<B>, prompts: &[Vec<i64>], steps: usize) -> Vec<Vec<i64>> {
    let d = Default::default();
    let (b, width) = (prompts.len(), prompts.iter().map(Vec::len).max().unwrap());
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    let mut pos = Vec::new();
    for p in prompts {
        let pad = width - p.len();
        ids.extend(std::iter::repeat_n(0, pad).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0.0f32, pad).chain(std::iter::repeat_n(1.0, p.len())));
        pos.extend(std::iter::repeat_n(0, pad).chain(0..p.len() as i64));
    }
    let mut cache = KvCache::default();
    let mut mask_t = Tensor::<B, 2>::from_data(TensorData::new(mask, [b, width]), &d);
    let logits = model.forward_cached(
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [b, width]), &d),
        mask_t.clone(),
        Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [b, width]), &d),
        &mut cache,
    );
    let v = logits.dims()[2];
    let last = |logits: Tensor<B, 3>| -> Vec<i64> {
        let t = logits.dims()[1];
        let flat: Vec<f32> = logits
            .narrow(1, t - 1, 1)
            .reshape([b, v])
            .to_data()
            .to_vec()
            .unwrap();
        flat.chunks(v).map(argmax).collect()
    };
    let mut next = last(logits);
    let mut out: Vec<Vec<i64>> = next.iter().map(|&t| vec![t]).collect();
    let mut positions: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
    for _ in 1..steps {
        mask_t = Tensor::cat(vec![mask_t, Tensor::ones([b, 1], &d)], 1);
        let logits = model.forward_cached(
            Tensor::<B, 2, Int>::from_data(TensorData::new(next.clone(), [b, 1]), &d),
            mask_t.clone(),
            Tensor::<B, 2, Int>::from_data(TensorData::new(positions.clone(), [b, 1]), &d),
            &mut cache,
        );
        next = last(logits);
        for (o, &t) in out.iter_mut().zip(&next) {
            o.push(t);
        }
        for p in &mut positions {
            *p += 1;
        }
    }
    assert_eq!(cache.len, width + steps - 1);
    out
}

#[test]
fn cached_batched_greedy_equals_the_cache_less_loop_for_every_architecture() {
    let prompts = vec![
        vec![1i64, 17, 33, 5, 90],
        vec![3, 200, 44],
        vec![9, 8, 7, 6, 5, 4, 3],
    ];
    for name in CACHED_FIXTURES {
        let dir = fixture(name);
        let (_, model) = load_model(&dir);
        let batched = cached_greedy(&model, &prompts, 10);
        for (p, got) in prompts.iter().zip(&batched) {
            let prompt: Vec<u32> = p.iter().map(|&x| x as u32).collect();
            let opts = GenerateOptions {
                max_new_tokens: 10,
                temperature: 0.0,
                seed: 0,
                eos_token_ids: vec![],
            };
            let alone: Vec<i64> = generate(&model, &prompt, &opts, &Default::default())
                .into_iter()
                .map(i64::from)
                .collect();
            assert_eq!(got, &alone, "{name}: prompt {p:?}");
        }
    }
}

#[test]
fn clearing_the_cache_starts_over() {
    let dir = fixture("qwen2");
    let (_, model) = load_model(&dir);
    let a = cached_greedy(&model, &[vec![4, 5, 6]], 4);
    let b = cached_greedy(&model, &[vec![4, 5, 6]], 4);
    assert_eq!(a, b);
    let mut cache = KvCache::<B>::default();
    let d = Default::default();
    model.forward_cached(
        Tensor::from_ints([[4, 5]], &d),
        Tensor::ones([1, 2], &d),
        Tensor::from_ints([[0, 1]], &d),
        &mut cache,
    );
    assert_eq!(cache.len, 2);
    cache.clear();
    assert_eq!(cache.len, 0);
}

/// A prompt prefilled in chunks (its first part, then continuations attending to the cached
/// part) gives the logits of the prompt prefilled at once, and decodes the same tokens after;
/// two chunked prompts of different lengths and starts run as one padded batch.
#[test]
fn chunked_prefill_equals_a_whole_prefill() {
    use verl_megatron::models::SlotKvCache;
    for name in CACHED_FIXTURES {
        let (cfg, model) = load_model(&fixture(name));
        let d = Default::default();
        let new_cache = || {
            SlotKvCache::<B>::new(
                cfg.num_hidden_layers,
                cfg.num_key_value_heads,
                cfg.head_dim,
                2,
                32,
                &d,
            )
        };
        let prompts: [Vec<u32>; 2] = [
            (0..13).map(|j| 3 + j * 17 % 250).collect(),
            (0..8).map(|j| 5 + j * 29 % 250).collect(),
        ];
        let rows = |t: Tensor<B, 2>| -> Vec<Vec<f32>> {
            let v = t.dims()[1];
            let flat: Vec<f32> = t.into_data().to_vec().unwrap();
            flat.chunks(v).map(<[f32]>::to_vec).collect()
        };
        let mut whole = new_cache();
        let reference = rows(model.prefill_slots(&prompts, &[0, 1], &mut whole));
        // Chunks: prompt 0 as 4 + 5 + 4 tokens, prompt 1 as 3 + 5.
        let mut chunked = new_cache();
        model.prefill_slots(
            &[prompts[0][..4].to_vec(), prompts[1][..3].to_vec()],
            &[0, 1],
            &mut chunked,
        );
        let second = rows(model.prefill_chunks(
            &[(0, 4, &prompts[0][4..9]), (1, 3, &prompts[1][3..])],
            &mut chunked,
        ));
        let third = rows(model.prefill_chunks(&[(0, 9, &prompts[0][9..])], &mut chunked));
        for (got, want) in [(&third[0], &reference[0]), (&second[1], &reference[1])] {
            let worst = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(worst < 1e-4, "{name}: chunked logits differ by {worst}");
            assert_eq!(argmax(got), argmax(want), "{name}");
        }
        // Decoding on from both caches gives the same tokens.
        let mut next: Vec<u32> = reference.iter().map(|r| argmax(r) as u32).collect();
        let mut pos = vec![13usize, 8];
        for _ in 0..5 {
            let window = pos.iter().max().unwrap() + 1;
            let a = rows(model.decode_slots(&next, &pos, window, &mut whole));
            let b = rows(model.decode_slots(&next, &pos, window, &mut chunked));
            let (ta, tb): (Vec<u32>, Vec<u32>) = (
                a.iter().map(|r| argmax(r) as u32).collect(),
                b.iter().map(|r| argmax(r) as u32).collect(),
            );
            assert_eq!(ta, tb, "{name}");
            next = ta;
            pos.iter_mut().for_each(|p| *p += 1);
        }
    }
}

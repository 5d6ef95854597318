//! Peak extra memory of loading a Hugging Face checkpoint: the loader must never hold more than
//! about one tensor beyond the model itself. A counting global allocator measures heap bytes.
//!
//! Run: `cargo bench --bench load_memory` (writes a random Qwen2-shaped checkpoint of ~78 M
//! parameters to a temporary directory first).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::Distribution;
use verl::backend::CpuBackend as B;
use verl::megatron::hf::{
    hf_tensor_specs, save_pretrained, HfCheckpoint, HfModelConfig, SaveOptions,
};
use verl::megatron::models::CausalLm;
use verl::NamedTensor;

struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::SeqCst);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size > layout.size() {
                grew(new_size - layout.size());
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: f64 = 1024.0 * 1024.0;

fn main() {
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 32000, "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "torch_dtype": "float32",
        "hidden_act": "silu", "max_position_embeddings": 4096
    });
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write config");
    let cfg = HfModelConfig::from_dir(dir.path()).expect("config");
    let device = Default::default();
    let specs = hf_tensor_specs(&cfg);
    {
        let weights: Vec<NamedTensor<B>> = specs
            .iter()
            .filter(|s| !s.optional)
            .map(|s| {
                let n: usize = s.shape.iter().product();
                NamedTensor {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    values: Tensor::<B, 1>::random([n], Distribution::Normal(0.0, 0.02), &device),
                }
            })
            .collect();
        save_pretrained(
            &weights,
            &config,
            dir.path(),
            SaveOptions {
                max_shard_bytes: 200 * 1024 * 1024,
                ..Default::default()
            },
        )
        .expect("save");
    }
    let params: usize = specs
        .iter()
        .filter(|s| !s.optional)
        .map(|s| s.shape.iter().product::<usize>())
        .sum();
    let largest = specs
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .max()
        .unwrap_or(0)
        * 4;

    let baseline = CURRENT.load(Ordering::SeqCst);
    PEAK.store(baseline, Ordering::SeqCst);
    let start = Instant::now();
    let ckpt = HfCheckpoint::open(dir.path()).expect("open");
    let model = CausalLm::<B>::from_checkpoint(&cfg, &ckpt, &device).expect("load");
    let seconds = start.elapsed().as_secs_f64();
    let resident = CURRENT.load(Ordering::SeqCst) - baseline;
    let peak = PEAK.load(Ordering::SeqCst) - baseline;
    let extra = peak.saturating_sub(resident);
    println!(
        "load_memory: qwen2-shaped, {:.1} M parameters ({:.1} MiB f32), largest tensor {:.1} MiB",
        params as f64 / 1e6,
        params as f64 * 4.0 / MIB,
        largest as f64 / MIB
    );
    println!("load_memory: resident after load {:.1} MiB, peak {:.1} MiB, peak extra {:.1} MiB = {:.2} × the largest tensor, {:.2} s", resident as f64 / MIB, peak as f64 / MIB, extra as f64 / MIB, extra as f64 / largest as f64, seconds);
    drop(model);
}

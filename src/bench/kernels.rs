//! `verl bench kernels` (the `cuda` build): every kernel of our own against its plain-burn
//! fallback on random inputs, odd sizes included, then the time of each cubek strategy on the
//! training step's product shapes (the table `verl_megatron::cuda::kernels::gemm` picks from).
//! Exits with an error when a kernel differs from its fallback beyond rounding.

use std::time::Instant;

use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType, TensorData, TensorPrimitive};
use verl::backend::{CudaAutodiff, CudaBackend};
use verl::megatron::cuda::kernels::gemm::{self, GemmKind, STRATEGY_NAMES};
use verl::megatron::cuda::rank_device;
use verl::megatron::layers::precision::{self, ComputeDtype};
use verl::megatron::workers::adamw::{AdamW, AdamWHyper};

use super::agreement::{relative_error, require_below};
use super::median;

type Device = burn::backend::cuda::CudaDevice;

/// max |a − b| (f32).
fn max_abs_diff<const D: usize>(a: Tensor<CudaBackend, D>, b: Tensor<CudaBackend, D>) -> f64 {
    (a - b).abs().max().into_scalar().elem::<f64>()
}

pub(crate) fn random<const D: usize>(
    shape: [usize; D],
    seed: u64,
    device: &Device,
) -> Tensor<CudaBackend, D> {
    CudaBackend::seed(device, seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// Fused AdamW against the chain of burn operations: three updates (the first without moments),
/// clipping factor 0.5, weight decay on.
fn check_adamw(device: &Device, failures: &mut Vec<String>) {
    let hyper = AdamWHyper {
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-8,
        weight_decay: 0.01,
    };
    let lr = 1e-3;
    println!("AdamW: fused kernel vs burn's chain (3 updates, lr {lr}, grad scale 0.5)");
    println!(
        "{:>10} {:>14} {:>14} {:>14} {:>14}",
        "n", "max|Δp|/lr", "max|Δp|/max|p|", "exp_avg rel", "exp_avg_sq rel"
    );
    for n in [1usize, 7, 4097, 1_000_003, 4864 * 896] {
        let mut fused = AdamW::<CudaBackend>::new(hyper);
        let mut chain = AdamW::<CudaBackend>::new(hyper).with_fused(false);
        let id = ParamId::new();
        let start = random([n], 1, device);
        let (mut a, mut b) = (start.clone(), start);
        for step in 0..3 {
            let g = random([n], 10 + step, device);
            a = fused.step_tensor(id, a, g.clone(), lr, 0.5);
            b = chain.step_tensor(id, b, g, lr, 0.5);
        }
        let scale = b.clone().abs().max().into_scalar().elem::<f64>();
        let diff = max_abs_diff(a, b);
        let (dp, dp_rel) = (diff / lr, diff / scale);
        let moments = |o: &AdamW<CudaBackend>| {
            let (_, m) = o.moments().next().expect("one parameter");
            (m.exp_avg.clone(), m.exp_avg_sq.clone(), m.time)
        };
        let (fa, fsq, ft) = moments(&fused);
        let (ca, csq, ct) = moments(&chain);
        let (ea, esq) = (relative_error(fa, ca), relative_error(fsq, csq));
        println!("{n:>10} {dp:>14.3e} {dp_rel:>14.3e} {ea:>14.3e} {esq:>14.3e}");
        // The kernel differs from the chain by fused multiply-adds only: parameters agree to a
        // few f32 ulps of their magnitude, moments to f32 rounding.
        if !(dp_rel < 1e-6 && ea < 1e-5 && esq < 1e-5 && ft == 3 && ct == 3) {
            failures.push(format!("AdamW n={n}: Δp/lr {dp:e}, moments {ea:e} {esq:e}"));
        }
    }
    // Time one update of a 136M-element tensor (the 0.5B model's embedding) each way.
    let n = 151_936 * 896;
    let p = random([n], 2, device);
    let g = random([n], 3, device);
    for fused in [true, false] {
        let mut o = AdamW::<CudaBackend>::new(hyper).with_fused(fused);
        let id = ParamId::new();
        let mut p = p.clone();
        let mut times = Vec::new();
        for i in 0..6 {
            let _ = CudaBackend::sync(device);
            let t = Instant::now();
            p = o.step_tensor(id, p, g.clone(), lr, 1.0);
            let _ = CudaBackend::sync(device);
            if i > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let ms = median(times);
        // Read p, g, m, v; write p, m, v: 28 bytes per element.
        println!(
            "AdamW {} over {n} elements: {ms:.2} ms ({:.0} GB/s effective)",
            if fused { "fused" } else { "chain" },
            28.0 * n as f64 / (ms / 1e3) / 1e9
        );
    }
}

/// A product shape of the 0.5B training step at 4 × 511 tokens: `lhs [.., m, k] · rhs [.., k, n]`,
/// each operand either stored as is or a transposed view of a stored `[.., k, m]` / `[.., n, k]`.
struct Product {
    label: &'static str,
    batch: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    lhs_t: bool,
    rhs_t: bool,
}

fn products() -> Vec<Product> {
    let p = |label, batch: &[usize], m, k, n, lhs_t, rhs_t| Product {
        label,
        batch: batch.to_vec(),
        m,
        k,
        n,
        lhs_t,
        rhs_t,
    };
    let rows = 4 * 511;
    vec![
        p("q/o x·Wᵀ", &[], rows, 896, 896, false, true),
        p("k/v x·Wᵀ", &[], rows, 896, 128, false, true),
        p("gate/up x·Wᵀ", &[], rows, 896, 4864, false, true),
        p("down x·Wᵀ", &[], rows, 4864, 896, false, true),
        p("lm_head x·Eᵀ", &[], rows, 896, 151_936, false, true),
        p("up dX=dY·W", &[], rows, 4864, 896, false, false),
        p("up dW=dYᵀ·X", &[], 4864, rows, 896, true, false),
        p("lm_head dX=dY·E", &[], rows, 151_936, 896, false, false),
        p("lm_head dW=dYᵀ·X", &[], 151_936, rows, 896, true, false),
        p("attn q·kᵀ", &[4, 2], 7 * 511, 64, 511, false, true),
        p("attn p·v", &[4, 2], 7 * 511, 511, 64, false, false),
        p("odd 33x17·17x65", &[], 33, 17, 65, false, false),
        p("odd 40x24·24x56 Bᵀ", &[], 40, 24, 56, false, true),
        p("odd 1x8·8x3", &[], 1, 8, 3, false, true),
    ]
}

/// The operands of a product (bf16), with transposed views where the shape says so.
fn operands(
    s: &Product,
    seed: u64,
    device: &Device,
) -> (Tensor<CudaBackend, 4>, Tensor<CudaBackend, 4>) {
    let batch = match s.batch.as_slice() {
        [] => [1, 1],
        [a] => [1, *a],
        [a, b, ..] => [*a, *b],
    };
    let make = |rows: usize, cols: usize, t: bool, seed| {
        let stored = if t {
            [batch[0], batch[1], cols, rows]
        } else {
            [batch[0], batch[1], rows, cols]
        };
        let x = random(stored, seed, device).cast(FloatDType::BF16);
        if t {
            x.swap_dims(2, 3)
        } else {
            x
        }
    };
    (
        make(s.m, s.k, s.lhs_t, seed),
        make(s.k, s.n, s.rhs_t, seed + 1),
    )
}

pub(crate) fn strip<const D: usize>(
    t: Tensor<CudaBackend, D>,
) -> verl::megatron::cuda::kernels::CudaPrimitive {
    t.into_primitive().tensor()
}

/// The seam's products (forward, and both gradients under autodiff) against burn's product.
fn check_gemm(device: &Device, failures: &mut Vec<String>) {
    println!(
        "\nproducts: the seam's cubek and own kernels vs burn's product (bf16 in, f32 accumulate)"
    );
    println!(
        "{:<20} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "shape", "cubek out", "cubek dA", "cubek dB", "own out", "own dA", "own dB"
    );
    for s in products() {
        let (a, b) = operands(&s, 7, device);
        let probe_dims = {
            let c = a.clone().matmul(b.clone());
            c.dims()
        };
        let probe = random(probe_dims, 9, device);
        let run = |kind: GemmKind| {
            gemm::set_kind(kind);
            let _bf16 = precision::enter(ComputeDtype::Bf16);
            let lift = |t: Tensor<CudaBackend, 4>| {
                Tensor::<CudaAutodiff, 4>::from_inner(t.cast(FloatDType::F32)).require_grad()
            };
            let (x, y) = (lift(a.clone()), lift(b.clone()));
            let c = precision::matmul(x.clone(), y.clone());
            let grads = (c.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            let grad = |t: &Tensor<CudaAutodiff, 4>| t.grad(&grads).expect("a gradient");
            (c.inner(), grad(&x), grad(&y))
        };
        let (c0, da0, db0) = run(GemmKind::Burn);
        print!("{:<20}", s.label);
        for kind in [GemmKind::Cubek, GemmKind::Own] {
            let (c1, da1, db1) = run(kind);
            let e = [
                relative_error(c1, c0.clone()),
                relative_error(da1, da0.clone()),
                relative_error(db1, db0.clone()),
            ];
            print!(" {:>12.3e} {:>12.3e} {:>12.3e}", e[0], e[1], e[2]);
            // All are bf16 products of the same operands, rounded to bf16: rounding apart.
            require_below(
                failures,
                format!("product {} ({kind:?})", s.label),
                &e,
                1e-2,
            );
        }
        println!();
    }
    gemm::set_kind(GemmKind::Cubek);
}

/// Our GEMM against burn's product on every stored layout (A and B row-major or transposed)
/// and edge sizes, operands given directly (no autodiff).
fn check_own_gemm(device: &Device, failures: &mut Vec<String>) {
    for kernel in [
        "own",
        "own_cp",
        "own_f32",
        "wmma",
        "decode",
        "decode_f32",
        "tiles",
        "tiles_f32",
    ] {
        check_gemm_kernel(kernel, device, failures);
    }
}

/// Our GEMM kernel `kernel` (`own`: wgmma on Hopper; `wmma`) against burn's product, in every
/// operand layout and on odd sizes.
fn check_gemm_kernel(kernel: &str, device: &Device, failures: &mut Vec<String>) {
    println!("\n{kernel} GEMM vs burn's product, by layout (relative error)");
    let sizes: &[(usize, usize, usize)] =
        if kernel.starts_with("decode") || kernel.starts_with("tiles") {
            // A decode step's products: batches of 1 to 64 rows (and past a tile's 16 / 32 / 64)
            // against wide weights, and odd edges.
            &[
                (1, 3584, 4608),
                (7, 896, 4864),
                (16, 4864, 896),
                (33, 200, 130),
                (64, 18944, 512),
                (100, 72, 200),
                (1, 8, 3),
            ]
        } else {
            &[
                (2044, 896, 896),
                (2044, 128, 896),
                (2044, 4864, 896),
                (2044, 896, 128),
                (896, 2044, 4864),
                (130, 72, 200),
                (1, 8, 3),
            ]
        };
    for &(m, k, n) in sizes {
        print!("({m:>5}, {k:>5}, {n:>5})");
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let make = |rows: usize, cols: usize, t: bool, seed| {
                if t {
                    random([1, 1, cols, rows], seed, device)
                        .cast(FloatDType::BF16)
                        .swap_dims(2, 3)
                } else {
                    random([1, 1, rows, cols], seed, device).cast(FloatDType::BF16)
                }
            };
            let (a, b) = (make(m, k, a_t, 21), make(k, n, b_t, 22));
            let reference = a.clone().matmul(b.clone());
            match gemm::launch_strategy(kernel, strip(a), strip(b)) {
                Ok(c) => {
                    let c = Tensor::<CudaBackend, 4>::from_primitive(TensorPrimitive::Float(c));
                    let e = relative_error(c, reference);
                    print!(
                        "  {}{}: {e:>9.2e}",
                        if a_t { "T" } else { "N" },
                        if b_t { "T" } else { "N" }
                    );
                    if !(e.is_finite() && e < 1e-2) {
                        failures.push(format!(
                            "{kernel} GEMM ({m}, {k}, {n}) a_t {a_t} b_t {b_t}: {e}"
                        ));
                    }
                }
                Err(e) => print!(
                    "  {}{}: not taken ({e})",
                    if a_t { "T" } else { "N" },
                    if b_t { "T" } else { "N" }
                ),
            }
        }
        println!();
    }
}

/// Milliseconds per product of each cubek strategy (and burn's default) on each shape.
fn time_strategies(device: &Device, repeat: usize) {
    println!(
        "\nproduct time per strategy (ms, median of {repeat}; TFLOP/s in brackets; - = cannot run)"
    );
    print!("{:<20}", "shape");
    // `VERL_BENCH_STRATEGIES=a,b` times only those cubek strategies (some fail at launch on
    // some shapes and leave the device unusable for the rest of the run).
    let only = std::env::var("VERL_BENCH_STRATEGIES").ok();
    let strategies: Vec<&str> = STRATEGY_NAMES
        .iter()
        .copied()
        .filter(|n| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|x| x == *n))
        })
        .collect();
    for name in ["burn", "own", "own_cp", "wmma"]
        .iter()
        .chain(strategies.iter())
    {
        print!(" {name:>22}");
    }
    println!();
    for s in products() {
        let (a, b) = operands(&s, 3, device);
        let flops =
            2.0 * (s.m * s.k * s.n) as f64 * s.batch.iter().product::<usize>().max(1) as f64;
        print!("{:<20}", s.label);
        let burn = |a: Tensor<CudaBackend, 4>, b: Tensor<CudaBackend, 4>| Ok(strip(a.matmul(b)));
        let mut cells = vec![
            time_product(device, repeat, &a, &b, burn),
            time_product(device, repeat, &a, &b, |a, b| {
                gemm::launch_strategy("own", strip(a), strip(b))
            }),
            time_product(device, repeat, &a, &b, |a, b| {
                gemm::launch_strategy("own_cp", strip(a), strip(b))
            }),
            time_product(device, repeat, &a, &b, |a, b| {
                gemm::launch_strategy("wmma", strip(a), strip(b))
            }),
        ];
        for &name in &strategies {
            cells.push(time_product(device, repeat, &a, &b, |a, b| {
                gemm::launch_strategy(name, strip(a), strip(b))
            }));
        }
        for ms in cells {
            match ms {
                Some(ms) => print!(" {:>12.3} ({:>6.1})", ms, flops / (ms / 1e3) / 1e12),
                None => print!(" {:>22}", "-"),
            }
        }
        println!();
    }
}

fn time_product(
    device: &Device,
    repeat: usize,
    a: &Tensor<CudaBackend, 4>,
    b: &Tensor<CudaBackend, 4>,
    f: impl Fn(
        Tensor<CudaBackend, 4>,
        Tensor<CudaBackend, 4>,
    ) -> Result<verl::megatron::cuda::kernels::CudaPrimitive, String>,
) -> Option<f64> {
    // Two untimed runs: the first compiles the kernel.
    for _ in 0..2 {
        f(a.clone(), b.clone()).ok()?;
    }
    let _ = CudaBackend::sync(device);
    let mut times = Vec::new();
    for _ in 0..repeat {
        let t = Instant::now();
        let out = f(a.clone(), b.clone()).ok()?;
        let _ = CudaBackend::sync(device);
        times.push(t.elapsed().as_secs_f64() * 1e3);
        drop(Tensor::<CudaBackend, 4>::from_primitive(
            TensorPrimitive::Float(out),
        ));
    }
    Some(median(times))
}

/// One attention shape of the checks: batch, sequence, query heads, kv heads, head size, and
/// the left padding of each row (0: none), and a sliding window.
struct AttentionCase {
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    padding: Vec<usize>,
    window: Option<usize>,
}

fn attention_cases() -> Vec<AttentionCase> {
    let c = |batch, seq, heads, kv_heads, head_dim, padding: &[usize]| AttentionCase {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
        padding: padding.to_vec(),
        window: None,
    };
    let windowed = |case: AttentionCase, window| AttentionCase {
        window: Some(window),
        ..case
    };
    vec![
        c(4, 511, 14, 2, 64, &[]),
        c(2, 37, 4, 2, 64, &[0, 9]),
        c(1, 130, 14, 2, 64, &[]),
        c(2, 64, 2, 2, 128, &[3, 0]),
        c(3, 200, 12, 2, 128, &[0, 70, 150]),
        c(1, 1, 2, 1, 16, &[]),
        c(2, 65, 8, 8, 32, &[64, 1]),
        // Sliding windows (Mistral, Gemma), not aligned to the 64-key tiles, with padding.
        windowed(c(2, 200, 8, 2, 64, &[0, 30]), 37),
        windowed(c(1, 300, 4, 4, 128, &[]), 100),
    ]
}

/// Fused attention against the decomposed path: output and the gradients of q, k and v, under
/// a random probe of the output; causal, grouped-query, left padding.
fn check_attention(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::models::attention::{decomposed_attention, AttentionMask};
    use verl::megatron::ops::{FusedOps, FusedScores};
    type A = CudaAutodiff;
    println!("\nattention: fused kernel vs the decomposed path (bf16 products)");
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10}",
        "batch x seq, heads/kv, dim", "out rel", "dq rel", "dk rel", "dv rel"
    );
    let _bf16 = precision::enter(ComputeDtype::Bf16);
    for (n, c) in attention_cases().into_iter().enumerate() {
        let seed = 1000 + 10 * n as u64;
        let q = random([c.batch, c.seq, c.heads, c.head_dim], seed, device);
        let k = random([c.batch, c.seq, c.kv_heads, c.head_dim], seed + 1, device);
        let v = random([c.batch, c.seq, c.kv_heads, c.head_dim], seed + 2, device);
        let probe = random([c.batch, c.seq, c.heads * c.head_dim], seed + 3, device);
        let mut mask = vec![1.0f32; c.batch * c.seq];
        for (row, &pad) in c.padding.iter().enumerate() {
            for m in &mut mask[row * c.seq..row * c.seq + pad.min(c.seq)] {
                *m = 0.0;
            }
        }
        let key_mask = (!c.padding.is_empty()).then(|| {
            Tensor::<A, 2>::from_data(TensorData::new(mask.clone(), [c.batch, c.seq]), device)
        });
        let lift =
            |t: &Tensor<CudaBackend, 4>| Tensor::<A, 4>::from_inner(t.clone()).require_grad();
        let run = |fused: bool| {
            let (qa, ka, va) = (lift(&q), lift(&k), lift(&v));
            let out = if fused {
                let out = A::fused_attention(
                    qa.clone(),
                    ka.clone(),
                    va.clone(),
                    key_mask.clone(),
                    FusedScores {
                        window: c.window,
                        ..FusedScores::plain(c.head_dim)
                    },
                )
                .map_err(|_| "the fused kernel did not take the call".to_string())?;
                out.reshape([c.batch, c.seq, c.heads * c.head_dim])
            } else {
                let bias = AttentionMask::causal(c.batch, c.seq, key_mask.clone(), device)
                    .bias_within(c.window);
                decomposed_attention(
                    qa.clone().swap_dims(1, 2),
                    ka.clone().swap_dims(1, 2),
                    va.clone().swap_dims(1, 2),
                    &bias,
                )
            };
            let grads = (out.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            let g = |t: &Tensor<A, 4>| t.grad(&grads).ok_or("no gradient".to_string());
            Ok::<_, String>((out.inner(), g(&qa)?, g(&ka)?, g(&va)?))
        };
        let label = format!(
            "{} x {}, {}/{}, {}{}",
            c.batch,
            c.seq,
            c.heads,
            c.kv_heads,
            c.head_dim,
            if c.padding.is_empty() { "" } else { ", padded" }
        );
        let label = match c.window {
            Some(w) => format!("{label}, window {w}"),
            None => label,
        };
        match (run(true), run(false)) {
            (Ok((o1, q1, k1, v1)), Ok((o0, q0, k0, v0))) => {
                let e = [
                    relative_error(o1, o0),
                    relative_error(q1, q0),
                    relative_error(k1, k0),
                    relative_error(v1, v0),
                ];
                println!(
                    "{label:<28} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e}",
                    e[0], e[1], e[2], e[3]
                );
                // bf16 operands on both sides, rounded at different points.
                require_below(failures, format!("attention {label}"), &e, 2e-2);
            }
            (a, b) => failures.push(format!(
                "attention {label}: fused {:?}, decomposed {:?}",
                a.err(),
                b.err()
            )),
        }
    }
}

/// Milliseconds of one attention forward and its backward, at the 0.5B step's shape, the 1.5B /
/// 7B step's (head size 128) and at 2k tokens, with the rate of the causal products (the forward's two,
/// the backward's five, each over half of the scores).
fn time_attention(device: &Device, repeat: usize) {
    // Keep in step with bench/peers/attention.py (torch's SDPA at the same shapes).
    for (b, t, h, kv, d) in [
        (4, 511, 14, 2, 64),
        (8, 1024, 12, 2, 128),
        (4, 2048, 12, 2, 128),
    ] {
        time_attention_shape(device, repeat, [b, t, h, kv, d]);
    }
}

fn time_attention_shape(device: &Device, repeat: usize, [b, t, h, kv, d]: [usize; 5]) {
    use verl::megatron::models::attention::{attention_bias, decomposed_attention};
    use verl::megatron::ops::{FusedOps, FusedScores};
    type A = CudaAutodiff;
    let _bf16 = precision::enter(ComputeDtype::Bf16);
    let q = random([b, t, h, d], 5, device);
    let k = random([b, t, kv, d], 6, device);
    let v = random([b, t, kv, d], 7, device);
    let bias = attention_bias::<A>(b, t, 0, None, device);
    // Causal: half of the b·h·t² scores, 2·d flops each per product.
    let product_flops = (b * h * t * t * d) as f64;
    println!(
        "\nattention, {b} x {t}, {h}/{kv} heads, dim {d} (median of {repeat}): forward, backward ms (TFLOP/s)"
    );
    for fused in [false, true] {
        let (mut fwd, mut bwd, mut issued) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..repeat + 2 {
            let lift =
                |x: &Tensor<CudaBackend, 4>| Tensor::<A, 4>::from_inner(x.clone()).require_grad();
            let (qa, ka, va) = (lift(&q), lift(&k), lift(&v));
            let _ = CudaBackend::sync(device);
            let start = Instant::now();
            let out = if fused {
                match A::fused_attention(qa, ka, va, None, FusedScores::plain(d)) {
                    Ok(o) => o.reshape([b, t, h * d]),
                    Err(_) => return,
                }
            } else {
                decomposed_attention(
                    qa.swap_dims(1, 2),
                    ka.swap_dims(1, 2),
                    va.swap_dims(1, 2),
                    &bias,
                )
            };
            let host = start.elapsed().as_secs_f64() * 1e3;
            let _ = CudaBackend::sync(device);
            let forward = start.elapsed().as_secs_f64() * 1e3;
            let start = Instant::now();
            let _grads = out.sum().backward();
            let _ = CudaBackend::sync(device);
            if i >= 2 {
                fwd.push(forward);
                bwd.push(start.elapsed().as_secs_f64() * 1e3);
                issued.push(host);
            }
        }
        let (f, g) = (median(fwd), median(bwd));
        println!(
            "  {:<11} {:>8.3} ms ({:>5.1}) {:>8.3} ms ({:>5.1}), forward issued in {:.3} ms",
            if fused { "fused" } else { "decomposed" },
            f,
            2.0 * product_flops / f / 1e9,
            g,
            5.0 * product_flops / g / 1e9,
            median(issued)
        );
    }
}

/// RMSNorm output and the gradients of its input and weight, through the fused kernel or
/// burn's chain, under a random probe.
fn norm_run<const D: usize>(
    x: &Tensor<CudaBackend, D>,
    weight: &Tensor<CudaBackend, 1>,
    probe: &Tensor<CudaBackend, D>,
    fused: bool,
) -> Result<[Tensor<CudaBackend, 1>; 3], String> {
    use verl::megatron::cuda::kernels::norm;
    use verl::megatron::layers::RmsNorm;
    norm::SWITCH.set(fused);
    let xa = Tensor::<CudaAutodiff, D>::from_inner(x.clone()).require_grad();
    let layer = RmsNorm::new(
        Tensor::<CudaAutodiff, 1>::from_inner(weight.clone()).require_grad(),
        1e-6,
    );
    let y = layer.forward(xa.clone());
    let grads = (y.clone() * Tensor::from_inner(probe.clone()))
        .sum()
        .backward();
    norm::SWITCH.set(true);
    let dx = xa.grad(&grads).ok_or("no gradient for x")?;
    let dw = layer
        .weight
        .grad(&grads)
        .ok_or("no gradient for the weight")?;
    Ok([y.inner().flatten(0, D - 1), dx.flatten(0, D - 1), dw])
}

/// The fused RMSNorm against burn's chain: output and both gradients.
fn check_norm(device: &Device, failures: &mut Vec<String>) {
    println!(
        "
RMSNorm: fused kernel vs burn's chain"
    );
    println!(
        "{:<26} {:>10} {:>10} {:>10}",
        "rows x hidden", "y rel", "dx rel", "dw rel"
    );
    type Run = Result<[Tensor<CudaBackend, 1>; 3], String>;
    let mut compare = |label: String, fused: Run, chain: Run| {
        match (fused, chain) {
            (Ok([y1, dx1, dw1]), Ok([y0, dx0, dw0])) => {
                let e = [
                    relative_error(y1, y0),
                    relative_error(dx1, dx0),
                    relative_error(dw1, dw0),
                ];
                println!(
                    "{label:<26} {:>10.3e} {:>10.3e} {:>10.3e}",
                    e[0], e[1], e[2]
                );
                // f32 on both sides, sums in another order.
                require_below(failures, format!("RMSNorm {label}"), &e, 1e-4);
            }
            (a, b) => failures.push(format!(
                "RMSNorm {label}: fused {:?}, chain {:?}",
                a.err(),
                b.err()
            )),
        }
    };
    // No hidden size of 1: there x̂ = ±1 and dx = rstd·g·w·ε/(x² + ε) cancels to rounding noise
    // on both sides, so a relative error compares noise (0.17 measured).
    for (n, &(rows, hidden)) in [(2044, 896), (33, 17), (1, 7), (7, 4096), (300, 1536)]
        .iter()
        .enumerate()
    {
        let seed = 4000 + 10 * n as u64;
        let x = random([rows, hidden], seed, device) * 3.0;
        let w = random([hidden], seed + 1, device) + 1.0;
        let probe = random([rows, hidden], seed + 2, device);
        compare(
            format!("{rows} x {hidden}"),
            norm_run(&x, &w, &probe, true),
            norm_run(&x, &w, &probe, false),
        );
    }
    // Per-head norms (Qwen3's q/k norm) over a 4-D [batch, seq, heads, head_dim] view.
    let x = random([3, 5, 14, 64], 4100, device);
    let w = random([64], 4101, device) + 1.0;
    let probe = random([3, 5, 14, 64], 4102, device);
    compare(
        "3 x 5 x 14 x 64 (per head)".into(),
        norm_run(&x, &w, &probe, true),
        norm_run(&x, &w, &probe, false),
    );
    check_add_norm(device, failures);
}

/// The decode step's residual sum and norm in one launch (`verl_add_rms_norm_bf16`) against
/// the add, the norm kernel and the cast it replaces: equal to the bit, with and without the
/// residual, at hidden sizes held in registers (up to 8 192) and past them.
fn check_add_norm(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::norm;
    use verl::megatron::ops::reference;
    println!(
        "
residual + RMSNorm + bf16 cast in one launch vs the three (max |diff|, must be 0)"
    );
    for (n, &(rows, hidden)) in [(1, 3584), (64, 896), (5, 17), (3, 9000)]
        .iter()
        .enumerate()
    {
        let seed = 4200 + 10 * n as u64;
        let h = random([rows, hidden], seed, device) * 3.0;
        let delta = random([rows, hidden], seed + 1, device);
        let w = random([hidden], seed + 2, device) + 1.0;
        for with_delta in [true, false] {
            let d = with_delta.then(|| delta.clone());
            let fused = norm::add_rms_norm_bf16(h.clone(), d.clone(), w.clone(), 1e-6);
            let (s1, y1) = match fused {
                Ok(out) => out,
                Err(_) => {
                    failures.push(format!("add + RMSNorm {rows} x {hidden}: kernel not taken"));
                    continue;
                }
            };
            let (s0, y0) = reference::add_rms_norm_bf16(h.clone(), d, w.clone(), 1e-6);
            let f32_of = |t: Tensor<CudaBackend, 2>| t.cast(FloatDType::F32);
            let (ds, dy) = (max_abs_diff(s1, s0), max_abs_diff(f32_of(y1), f32_of(y0)));
            println!(
                "  {rows:>3} x {hidden:>5}, residual {with_delta:<5}: sum {ds:.1e}, y {dy:.1e}"
            );
            if ds != 0.0 || dy != 0.0 {
                failures.push(format!(
                    "add + RMSNorm {rows} x {hidden} (residual {with_delta}): sum {ds}, y {dy}"
                ));
            }
        }
    }
}

/// The fused SwiGLU gate against burn's `silu(g) · u`: output and both gradients.
fn check_swiglu(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::swiglu;
    use verl::megatron::models::mlp::swiglu as gate;
    println!("\nSwiGLU gate: fused kernel vs burn's silu(g) * u");
    for (n, &(rows, cols)) in [(2044, 4864), (33, 17), (1, 1)].iter().enumerate() {
        let seed = 5000 + 10 * n as u64;
        let g = random([rows, cols], seed, device) * 4.0;
        let u = random([rows, cols], seed + 1, device);
        let probe = random([rows, cols], seed + 2, device);
        let run = |fused: bool| {
            swiglu::SWITCH.set(fused);
            let ga = Tensor::<CudaAutodiff, 2>::from_inner(g.clone()).require_grad();
            let ua = Tensor::<CudaAutodiff, 2>::from_inner(u.clone()).require_grad();
            let out = gate(ga.clone(), ua.clone());
            let grads = (out.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            swiglu::SWITCH.set(true);
            (out.inner(), ga.grad(&grads), ua.grad(&grads))
        };
        let label = format!("{rows} x {cols}");
        match (run(true), run(false)) {
            ((o1, Some(g1), Some(u1)), (o0, Some(g0), Some(u0))) => {
                let e = [
                    relative_error(o1, o0),
                    relative_error(g1, g0),
                    relative_error(u1, u0),
                ];
                println!(
                    "{label:<26} out {:.3e}  dg {:.3e}  du {:.3e}",
                    e[0], e[1], e[2]
                );
                require_below(failures, format!("SwiGLU {label}"), &e, 1e-5);
            }
            _ => failures.push(format!("SwiGLU {label}: a gradient is missing")),
        }
    }
}

/// The bias add with our column-sum gradient against burn's broadcast add: output and both
/// gradients, on long, wide, odd and single-row shapes.
fn check_bias(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::bias;
    println!("\nbias add: column-sum gradient kernel vs burn's broadcast add");
    for (n, &(rows, cols)) in [(8192, 256), (2044, 896), (70_001, 3), (33, 17), (1, 5)]
        .iter()
        .enumerate()
    {
        let seed = 5500 + 10 * n as u64;
        let y = random([rows, cols], seed, device);
        let b = random([cols], seed + 1, device);
        let probe = random([rows, cols], seed + 2, device);
        let run = |fused: bool| {
            let ya = Tensor::<CudaAutodiff, 2>::from_inner(y.clone()).require_grad();
            let ba = Tensor::<CudaAutodiff, 1>::from_inner(b.clone()).require_grad();
            let out = if fused {
                match bias::add_bias_tracked(ya.clone(), ba.clone()) {
                    Ok(out) => out,
                    Err(_) => return None,
                }
            } else {
                ya.clone() + ba.clone().unsqueeze_dim(0)
            };
            let grads = (out.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            Some((out.inner(), ya.grad(&grads)?, ba.grad(&grads)?))
        };
        let label = format!("{rows} x {cols}");
        match (run(true), run(false)) {
            (Some((o1, y1, b1)), Some((o0, y0, b0))) => {
                let e = [
                    relative_error(o1, o0),
                    relative_error(y1, y0),
                    relative_error(b1, b0),
                ];
                println!(
                    "{label:<26} out {:.3e}  dy {:.3e}  db {:.3e}",
                    e[0], e[1], e[2]
                );
                require_below(failures, format!("bias add {label}"), &e, 1e-5);
            }
            _ => failures.push(format!(
                "bias add {label}: not taken, or a gradient is missing"
            )),
        }
    }
}

/// The fused rotary embedding against burn's operations: output and the input's gradient, for
/// x `[batch, seq, heads, dim]` and tables `[batch, seq, 1, dim]`.
fn check_rope(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::rope;
    use verl::megatron::hf::RopeScaling;
    use verl::megatron::layers::RotaryEmbedding;
    // The cos/sin tables computed on the GPU against the host's, positions up to 32 767.
    println!("\nRoPE tables: on the GPU vs on the host (max abs difference)");
    for (head_dim, theta) in [(64, 1_000_000.0), (128, 10_000.0)] {
        let rope = RotaryEmbedding::new(head_dim, theta, RopeScaling::Default);
        let positions: Vec<i64> = (0..2 * 4096).map(|i| (i * 4) % 32_768).collect();
        let positions =
            Tensor::<CudaBackend, 2, Int>::from_data(TensorData::new(positions, [2, 4096]), device);
        let (cos_gpu, sin_gpu) = rope.tables(&positions);
        let (cos_host, sin_host) = rope.tables_on_host(&positions);
        let diff = |a: Tensor<CudaBackend, 4>, b: Tensor<CudaBackend, 4>| {
            (a - b).abs().max().into_scalar().elem::<f64>()
        };
        let e = [diff(cos_gpu, cos_host), diff(sin_gpu, sin_host)];
        println!(
            "head dim {head_dim}, theta {theta}: cos {:.2e}, sin {:.2e}",
            e[0], e[1]
        );
        require_below(
            failures,
            format!("RoPE tables head dim {head_dim}"),
            &e,
            1e-5,
        );
    }
    println!("\nRoPE: fused kernel vs burn's operations");
    for (n, &(b, t, h, d)) in [
        (4, 511, 14, 64),
        (2, 37, 2, 128),
        (1, 1, 1, 2),
        (3, 5, 7, 18),
    ]
    .iter()
    .enumerate()
    {
        let seed = 6000 + 10 * n as u64;
        let x = random([b, t, h, d], seed, device);
        let angles = random([b, t, 1, d], seed + 1, device) * 3.0;
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let probe = random([b, t, h, d], seed + 2, device);
        let run = |fused: bool| {
            rope::SWITCH.set(fused);
            let xa = Tensor::<CudaAutodiff, 4>::from_inner(x.clone()).require_grad();
            let lift =
                |c: &Tensor<CudaBackend, 4>| Tensor::<CudaAutodiff, 4>::from_inner(c.clone());
            let y = RotaryEmbedding::apply(xa.clone(), &lift(&cos), &lift(&sin));
            let grads = (y.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            rope::SWITCH.set(true);
            (y.inner(), xa.grad(&grads))
        };
        let label = format!("{b} x {t} x {h} x {d}");
        match (run(true), run(false)) {
            ((y1, Some(g1)), (y0, Some(g0))) => {
                let e = [relative_error(y1, y0), relative_error(g1, g0)];
                println!("{label:<26} y {:.3e}  dx {:.3e}", e[0], e[1]);
                require_below(failures, format!("RoPE {label}"), &e, 1e-5);
            }
            _ => failures.push(format!("RoPE {label}: no gradient for x")),
        }
    }
}

/// The multi-tensor sums of squares against burn's square and sum per tensor: 37 tensors (three
/// launches) of odd sizes, a vector, a transposed view and a [151 936, 896] matrix.
fn check_sum_squares(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::sum_squares::sums_of_squares;
    println!("\nsums of squares: one launch per 16 tensors vs burn's square and sum per tensor");
    let mut tensors: Vec<Tensor<CudaBackend, 2>> = (0..34)
        .map(|i| random([1 + 37 * i, 1 + (i * 53) % 900], 7000 + i as u64, device))
        .collect();
    tensors.push(random([1, 4097], 7100, device));
    tensors.push(random([300, 896], 7101, device).swap_dims(0, 1));
    tensors.push(random([151_936, 896], 7102, device) * 0.01);
    let reference: Vec<f64> = tensors
        .iter()
        .map(|t| t.clone().powi_scalar(2).sum().into_scalar() as f64)
        .collect();
    match sums_of_squares(&tensors) {
        Some(sums) if sums.len() == reference.len() => {
            let worst = sums
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-30))
                .fold(0.0f64, f64::max);
            println!("37 tensors: worst relative difference {worst:.3e}");
            if !(worst.is_finite() && worst < 1e-5) {
                failures.push(format!("sums of squares: {worst:e}"));
            }
        }
        other => failures.push(format!("sums of squares: {other:?}")),
    }
}

/// Log-probs, entropy and the logits' gradient of `[batch, len, vocab]` logits, through the
/// fused kernel or burn's chain (`vocab_parallel_log_probs` at tp = 1), under a random probe.
fn vocab_run(
    logits: &Tensor<CudaBackend, 3>,
    labels: &Tensor<CudaBackend, 2, Int>,
    probe: &Tensor<CudaBackend, 2>,
    fused: bool,
) -> (
    Tensor<CudaBackend, 2>,
    Tensor<CudaBackend, 2>,
    Option<Tensor<CudaBackend, 3>>,
) {
    use verl::megatron::cuda::kernels::vocab;
    use verl::megatron::models::vocab_parallel_log_probs;
    use verl::megatron::parallel::TpGroup;
    vocab::SWITCH.set(fused);
    let x = Tensor::<CudaAutodiff, 3>::from_inner(logits.clone()).require_grad();
    let labels = Tensor::<CudaAutodiff, 2, Int>::from_inner(labels.clone());
    let (lp, entropy) = vocab_parallel_log_probs(x.clone(), labels, &TpGroup::none(), 0, true);
    let entropy = entropy.expect("asked for");
    let probe = Tensor::<CudaAutodiff, 2>::from_inner(probe.clone());
    let loss = (lp.clone() * probe.clone()).sum() + (entropy.clone() * probe.sqrt()).sum();
    let grads = loss.backward();
    let dx = x.grad(&grads);
    vocab::SWITCH.set(true);
    (lp.inner(), entropy.inner(), dx)
}

/// The fused vocabulary statistics against burn's chain: log-probs, entropy and the logits'
/// gradient (f32 logits, and bf16 logits against the chain on their f32 values), then the
/// raw statistics with labels outside the shard against the same formulas in burn.
fn check_vocab(device: &Device, failures: &mut Vec<String>) {
    println!(
        "
vocabulary log-probs: fused kernel vs burn's log_softmax + gather chain"
    );
    println!(
        "{:<26} {:>10} {:>10} {:>10}",
        "batch x len x vocab", "logp rel", "entr rel", "dx rel"
    );
    let cases = [
        (2, 511, 151_936, false),
        (3, 7, 1000, false),
        (1, 1, 5, false),
        (2, 33, 4097, false),
        (2, 65, 32_003, true),
    ];
    for (n, &(b, len, vocab, bf16)) in cases.iter().enumerate() {
        let seed = 3000 + 10 * n as u64;
        // Logits of a trained model's size (a few units), with one large outlier per row.
        let logits = random([b, len, vocab], seed, device) * 4.0;
        let logits = if bf16 {
            logits.cast(FloatDType::BF16)
        } else {
            logits
        };
        let labels = Tensor::<CudaBackend, 2, Int>::random(
            [b, len],
            Distribution::Uniform(0.0, vocab as f64),
            device,
        );
        let probe = random([b, len], seed + 1, device).abs();
        let reference = if bf16 {
            logits.clone().cast(FloatDType::F32)
        } else {
            logits.clone()
        };
        let (lp1, h1, dx1) = vocab_run(&logits, &labels, &probe, true);
        let (lp0, h0, dx0) = vocab_run(&reference, &labels, &probe, false);
        let label = format!("{b} x {len} x {vocab}{}", if bf16 { " bf16" } else { "" });
        match (dx1, dx0) {
            (Some(dx1), Some(dx0)) => {
                let e = [
                    relative_error(lp1, lp0),
                    relative_error(h1, h0),
                    relative_error(dx1.cast(FloatDType::F32), dx0),
                ];
                println!(
                    "{label:<26} {:>10.3e} {:>10.3e} {:>10.3e}",
                    e[0], e[1], e[2]
                );
                // f32: the same sums in another order; bf16: the gradient is rounded to bf16.
                let bound = if bf16 { 1e-2 } else { 1e-4 };
                require_below(failures, format!("vocab {label}"), &e, bound);
            }
            _ => failures.push(format!("vocab {label}: no gradient for the logits")),
        }
    }
    check_vocab_stats_outside(device, failures);
}

/// The raw statistics (m, s, p, w) with a third of the labels outside the shard (negative,
/// label logit 0) against the same formulas in burn.
fn check_vocab_stats_outside(device: &Device, failures: &mut Vec<String>) {
    use verl::megatron::cuda::kernels::vocab::vocab_stats;
    let (rows, vocab) = (37, 3001);
    let x = random([rows, vocab], 77, device) * 4.0;
    let labels: Vec<i32> = (0..rows as i32)
        .map(|r| {
            if r % 3 == 0 {
                -1
            } else {
                (r * 97) % vocab as i32
            }
        })
        .collect();
    let labels_t =
        Tensor::<CudaBackend, 1, Int>::from_data(TensorData::new(labels.clone(), [rows]), device);
    match vocab_stats(x.clone(), labels_t) {
        Ok(stats) => {
            let m = x.clone().max_dim(1);
            let e = (x.clone() - m.clone()).exp();
            let s = e.clone().sum_dim(1);
            let w = (e * x.clone()).sum_dim(1);
            let picked: Vec<f32> = {
                let xs = x.into_data().to_vec::<f32>().unwrap_or_default();
                labels
                    .iter()
                    .enumerate()
                    .map(|(r, &l)| {
                        if l < 0 {
                            0.0
                        } else {
                            xs[r * vocab + l as usize]
                        }
                    })
                    .collect()
            };
            let p = Tensor::<CudaBackend, 1>::from_data(TensorData::new(picked, [rows]), device)
                .reshape([rows, 1]);
            let reference = Tensor::cat(vec![m, s, p, w], 1);
            let e = relative_error(stats, reference);
            println!(
                "{:<26} {e:>10.3e} (m, s, p, w; a third of the labels outside)",
                "stats 37 x 3001"
            );
            if !(e.is_finite() && e < 1e-5) {
                failures.push(format!("vocab stats with outside labels: {e}"));
            }
        }
        Err(_) => failures.push("vocab stats: the kernel did not take f32 logits".into()),
    }
}

/// Forward + backward of the step's log-probs (2044 x 151 936 f32 logits), fused and chained.
fn time_vocab(device: &Device, repeat: usize) {
    let (b, len, vocab) = (4, 511, 151_936);
    let logits = random([b, len, vocab], 9, device) * 4.0;
    let labels = Tensor::<CudaBackend, 2, Int>::random(
        [b, len],
        Distribution::Uniform(0.0, vocab as f64),
        device,
    );
    let probe = random([b, len], 10, device).abs();
    println!(
        "
log-probs + entropy forward and backward, {b} x {len} x {vocab} f32 (median of {repeat}):"
    );
    for fused in [false, true] {
        let mut times = Vec::new();
        for i in 0..repeat + 2 {
            let _ = CudaBackend::sync(device);
            let start = Instant::now();
            let out = vocab_run(&logits, &labels, &probe, fused);
            drop(out);
            let _ = CudaBackend::sync(device);
            if i >= 2 {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        println!(
            "  {:<11} {:>8.3} ms",
            if fused { "fused" } else { "chain" },
            median(times)
        );
    }
}

/// Host microseconds to issue one operation (read before waiting) and microseconds per operation
/// once the device has finished, over `n` back-to-back calls of `op` with no sync between them.
fn launch_cost(device: &Device, n: usize, mut op: impl FnMut()) -> (f64, f64) {
    op();
    let _ = CudaBackend::sync(device);
    let t = Instant::now();
    for _ in 0..n {
        op();
    }
    let issued = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let _ = CudaBackend::sync(device);
    (issued, t.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// What one burn operation costs the host on burn-cuda: the training step is bound by issuing
/// thousands of small operations, not by the GPU running them.
fn time_launches(device: &Device) {
    println!(
        "
launch cost: µs per operation, host issue / finished (1000 calls, no sync between)"
    );
    let rows = 4 * 511;
    let x32 = random([rows, 896], 1, device);
    let y32 = random([rows, 896], 2, device);
    let (x16, y16) = (
        x32.clone().cast(FloatDType::BF16),
        y32.clone().cast(FloatDType::BF16),
    );
    let w16 = random([896, 896], 3, device).cast(FloatDType::BF16);
    let report =
        |label: &str, (issued, done): (f64, f64)| println!("{label:<44} {issued:>9.1} {done:>9.1}");
    let n = 1000;
    report(
        "add f32 [2044, 896]",
        launch_cost(device, n, || {
            let _ = x32.clone() + y32.clone();
        }),
    );
    report(
        "add bf16 [2044, 896]",
        launch_cost(device, n, || {
            let _ = x16.clone() + y16.clone();
        }),
    );
    report(
        "mul_scalar bf16 [2044, 896]",
        launch_cost(device, n, || {
            let _ = x16.clone() * 0.5;
        }),
    );
    report(
        "cast f32 -> bf16 [2044, 896]",
        launch_cost(device, n, || {
            let _ = x32.clone().cast(FloatDType::BF16);
        }),
    );
    report(
        "sum_dim f32 [2044, 896] -> [2044, 1]",
        launch_cost(device, n, || {
            let _ = x32.clone().sum_dim(1);
        }),
    );
    report("add f32 [1, 8]", {
        let (a, b) = (random([1, 8], 4, device), random([1, 8], 5, device));
        launch_cost(device, n, || {
            let _ = a.clone() + b.clone();
        })
    });
    report(
        "burn matmul bf16 x·Wᵀ (2044, 896, 896)",
        launch_cost(device, n, || {
            let _ = x16.clone().matmul(w16.clone().transpose());
        }),
    );
    report(
        "cubek seam x·Wᵀ (2044, 896, 896)",
        launch_cost(device, n, || {
            let _ = gemm::launch_strategy(
                "specialized_tma_mma",
                strip(x16.clone()),
                strip(w16.clone().transpose()),
            );
        }),
    );
    let xa = Tensor::<CudaAutodiff, 2>::from_inner(x32.clone()).require_grad();
    let ya = Tensor::<CudaAutodiff, 2>::from_inner(y32.clone()).require_grad();
    report(
        "autodiff add f32 (graph recorded)",
        launch_cost(device, n, || {
            let _ = xa.clone() + ya.clone();
        }),
    );
    report(
        "autodiff add + backward f32",
        launch_cost(device, 200, || {
            let _ = (xa.clone() + ya.clone()).sum().backward();
        }),
    );
    // The step keeps ~16 GiB in thousands of buffers: does a full pool make allocation slower?
    let held: Vec<_> = (0..3000)
        .map(|i| random([896, 896], 100 + i, device))
        .collect();
    let _ = CudaBackend::sync(device);
    report(
        "add f32 [2044, 896], 3000 buffers held",
        launch_cost(device, n, || {
            let _ = x32.clone() + y32.clone();
        }),
    );
    drop(held);
}

/// One kernel family's check against its fallback.
type Check = fn(&Device, &mut Vec<String>);

/// Both GEMM checks: our kernel against burn's product, then cubek's strategies.
fn check_gemms(device: &Device, failures: &mut Vec<String>) {
    check_own_gemm(device, failures);
    check_gemm(device, failures);
}

/// The checked families by name, in the order they run.
const CHECKS: [(&str, Check); 13] = [
    ("adamw", check_adamw),
    ("gemm", check_gemms),
    ("decode_gemm", super::decode_products::check_decode_gemm),
    ("attention", check_attention),
    ("vocab", check_vocab),
    ("norm", check_norm),
    ("swiglu", check_swiglu),
    ("bias", check_bias),
    ("rope", check_rope),
    ("sum_squares", check_sum_squares),
    ("sampling", super::rollout_kernels::check_sampling),
    ("decode", super::rollout_kernels::check_decode),
    ("upload", check_upload),
];

/// `verl bench kernels`: every family, or those `only` names (`launches` times launches only).
pub(crate) fn kernels(repeat: usize, time: bool, only: &[String]) -> Result<(), String> {
    let families: Vec<&str> = CHECKS
        .iter()
        .map(|(name, _)| *name)
        .chain(["launches"])
        .collect();
    if let Some(unknown) = only.iter().find(|f| !families.contains(&f.as_str())) {
        return Err(format!(
            "--only: no kernel family `{unknown}`; the families are {}",
            families.join(", ")
        ));
    }
    let on = |family: &str| only.is_empty() || only.iter().any(|f| f == family);
    let device = rank_device(0);
    let mut failures = Vec::new();
    for (name, check) in CHECKS {
        if on(name) {
            check(&device, &mut failures);
        }
    }
    if on("launches") {
        time_launches(&device);
    }
    if on("attention") {
        time_attention(&device, repeat);
    }
    if on("vocab") {
        time_vocab(&device, repeat);
    }
    if time && on("gemm") {
        time_strategies(&device, repeat);
    }
    if time && on("decode_gemm") {
        // The configuration sweep only when asked for by name.
        let sweep = only.iter().any(|f| f == "decode_gemm");
        super::decode_products::time_decode_gemm(&device, repeat, sweep);
    }
    if failures.is_empty() {
        println!("\nall kernels agree with their fallbacks");
        Ok(())
    } else {
        Err(format!("kernels differ from their fallbacks: {failures:?}"))
    }
}

/// The pinned-staging upload (`verl_megatron::cuda::upload`) against burn's `from_data`: the
/// same bytes on the device for tensors below the cut-over, one chunk, several (reusing the
/// staging), an odd tail; then both paths' rate on 2 GiB of bf16.
fn check_upload(device: &Device, failures: &mut Vec<String>) {
    use burn::tensor::{DType, TensorData};
    use verl::megatron::cuda::upload::{upload, MIN_BYTES};
    println!("\nupload: pinned staging and a copy kernel vs burn's from_data");
    let bytes_of = |n: usize, seed: u64| -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    };
    for (elements, dtype) in [
        (MIN_BYTES / 2 - 1, DType::BF16),
        (MIN_BYTES / 2 + 3, DType::BF16),
        (MIN_BYTES / 4 + 1, DType::F32),
        ((64 << 20) * 5 / 2 + 5, DType::BF16),
        ((64 << 20) * 9 / 4 + 7, DType::F32),
    ] {
        let raw = bytes_of(elements * dtype.size(), elements as u64);
        let data = TensorData::from_bytes_vec(raw.clone(), [elements], dtype);
        let staged = upload(&data, device);
        let path = if staged.is_some() {
            "staged"
        } else {
            "from_data"
        };
        let t = staged.unwrap_or_else(|| Tensor::from_data(data, (device, dtype)));
        let back = t.into_data();
        let same = back.as_bytes() == raw.as_slice();
        println!("{elements} x {dtype:?} ({path}): bytes equal: {same}");
        if !same {
            failures.push(format!("upload of {elements} x {dtype:?} ({path})"));
        }
    }
    // A shard as runs straight from a file: 1000 rows of an odd width, over three chunks.
    {
        use verl::megatron::cuda::upload::upload_runs;
        let row = 2 * 70_001;
        let raw = bytes_of(1000 * row, 5);
        let runs: Vec<&[u8]> = raw.chunks(row).collect();
        let t = upload_runs(&runs, raw.len() / 2, DType::BF16, device);
        let same = t.is_some_and(|t| t.into_data().as_bytes() == raw.as_slice());
        println!("1000 runs of {row} bytes (staged): bytes equal: {same}");
        if !same {
            failures.push("upload of 1000 runs".into());
        }
    }
    let raw = bytes_of(1 << 31, 99);
    for staged in [true, false] {
        verl::megatron::cuda::upload::SWITCH.set(staged);
        let mut seconds = Vec::new();
        for _ in 0..3 {
            let data = TensorData::from_bytes_vec(raw.clone(), [raw.len() / 2], DType::BF16);
            let _ = CudaBackend::sync(device);
            let started = std::time::Instant::now();
            let t = upload(&data, device)
                .unwrap_or_else(|| Tensor::from_data(data, (device, DType::BF16)));
            let _ = CudaBackend::sync(device);
            seconds.push(started.elapsed().as_secs_f64());
            drop(t);
        }
        let best = seconds.iter().copied().fold(f64::INFINITY, f64::min);
        println!(
            "2 GiB bf16, {}: best of 3 {:.3} s = {:.2} GB/s",
            if staged { "staged" } else { "from_data" },
            best,
            (1u64 << 31) as f64 / best / 1e9
        );
    }
    verl::megatron::cuda::upload::SWITCH.set(true);
}

//! `verl bench kernels` (the `cuda` build): every kernel of our own against its plain-burn
//! fallback on random inputs, odd sizes included, then the time of each cubek strategy on the
//! training step's product shapes (the table `verl_megatron::cuda::kernels::gemm` picks from).
//! Exits with an error when a kernel differs from its fallback beyond rounding.

use std::time::Instant;

use burn::module::ParamId;
use burn::prelude::*;
use burn::tensor::{Distribution, FloatDType, TensorPrimitive};
use verl::backend::{CudaAutodiff, CudaBackend};
use verl::megatron::cuda::kernels::gemm::{self, GemmKind, STRATEGY_NAMES};
use verl::megatron::cuda::rank_device;
use verl::megatron::layers::precision::{self, ComputeDtype};
use verl::megatron::workers::adamw::{AdamW, AdamWHyper};

use super::median;

type Device = burn::backend::cuda::CudaDevice;

/// ‖a − b‖ / ‖b‖ (0 when both are zero).
fn relative_error<const D: usize>(a: Tensor<CudaBackend, D>, b: Tensor<CudaBackend, D>) -> f64 {
    let norm = |t: Tensor<CudaBackend, D>| {
        t.cast(FloatDType::F32)
            .powf_scalar(2.0)
            .sum()
            .sqrt()
            .into_scalar()
            .elem::<f64>()
    };
    let (a, b) = (a.cast(FloatDType::F32), b.cast(FloatDType::F32));
    let den = norm(b.clone());
    let num = norm(a - b);
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// max |a − b| (f32).
fn max_abs_diff<const D: usize>(a: Tensor<CudaBackend, D>, b: Tensor<CudaBackend, D>) -> f64 {
    (a - b).abs().max().into_scalar().elem::<f64>()
}

fn random<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<CudaBackend, D> {
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

fn strip<const D: usize>(
    t: Tensor<CudaBackend, D>,
) -> verl::megatron::cuda::kernels::CudaPrimitive {
    t.into_primitive().tensor()
}

/// The seam's products (forward, and both gradients under autodiff) against burn's product.
fn check_gemm(device: &Device, failures: &mut Vec<String>) {
    println!("\nproducts: cubek seam vs burn's product (bf16 in, f32 accumulate)");
    println!(
        "{:<20} {:>12} {:>12} {:>12}",
        "shape", "out rel", "dA rel", "dB rel"
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
        let (c1, da1, db1) = run(GemmKind::Cubek);
        let e = [
            relative_error(c1, c0),
            relative_error(da1, da0),
            relative_error(db1, db0),
        ];
        println!(
            "{:<20} {:>12.3e} {:>12.3e} {:>12.3e}",
            s.label, e[0], e[1], e[2]
        );
        // Both are bf16 products of the same operands, rounded to bf16: rounding apart.
        if !e.iter().all(|e| e.is_finite() && *e < 1e-2) {
            failures.push(format!("product {}: {e:?}", s.label));
        }
    }
    gemm::set_kind(GemmKind::Cubek);
}

/// Milliseconds per product of each cubek strategy (and burn's default) on each shape.
fn time_strategies(device: &Device, repeat: usize) {
    println!(
        "\nproduct time per strategy (ms, median of {repeat}; TFLOP/s in brackets; - = cannot run)"
    );
    print!("{:<20}", "shape");
    for name in ["burn"].iter().chain(STRATEGY_NAMES.iter()) {
        print!(" {name:>22}");
    }
    println!();
    for s in products() {
        let (a, b) = operands(&s, 3, device);
        let flops =
            2.0 * (s.m * s.k * s.n) as f64 * s.batch.iter().product::<usize>().max(1) as f64;
        print!("{:<20}", s.label);
        let burn = |a: Tensor<CudaBackend, 4>, b: Tensor<CudaBackend, 4>| Ok(strip(a.matmul(b)));
        let mut cells = vec![time_product(device, repeat, &a, &b, burn)];
        for name in STRATEGY_NAMES {
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

/// `verl bench kernels`.
pub fn kernels(repeat: usize, time: bool) -> Result<(), String> {
    let device = rank_device(0);
    let mut failures = Vec::new();
    check_adamw(&device, &mut failures);
    check_gemm(&device, &mut failures);
    if time {
        time_strategies(&device, repeat);
    }
    if failures.is_empty() {
        println!("\nall kernels agree with their fallbacks");
        Ok(())
    } else {
        Err(format!("kernels differ from their fallbacks: {failures:?}"))
    }
}

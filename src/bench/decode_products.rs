//! `verl bench kernels --only decode_gemm` (the `cuda` build): a decode step's products, a few
//! batch rows against a weight stored `[n, k]`. Checks the weight-stream kernel
//! (`verl_megatron::cuda::kernels::decode_gemm`) and on Hopper the `wgmma` decode kernel
//! (`decode_wgmma`) against burn's product on edge sizes and that a row's result does not depend
//! on the batch; then times them, the `wmma` decode tiles and burn's product on the Qwen2.5-7B
//! layer's shapes, with the weight bandwidth each reaches, and sweeps the stream's
//! configurations.

use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{FloatDType, TensorPrimitive};
use verl::backend::CudaBackend;
use verl::megatron::cuda::kernels::gemm;
use verl::megatron::cuda::kernels::CudaPrimitive;

use super::agreement::relative_error;
use super::kernels::{random, strip};

type Device = burn::backend::cuda::CudaDevice;

/// Activations `[1, 1, m, k]` (bf16) and the transposed view of a `[n, k]` weight (bf16).
fn operands(
    m: usize,
    k: usize,
    n: usize,
    seed: u64,
    device: &Device,
) -> (Tensor<CudaBackend, 4>, Tensor<CudaBackend, 4>) {
    let a = random([1, 1, m, k], seed, device).cast(FloatDType::BF16);
    let w = random([1, 1, n, k], seed + 1, device).cast(FloatDType::BF16);
    (a, w.swap_dims(2, 3))
}

fn tensor(p: CudaPrimitive) -> Tensor<CudaBackend, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// The stream kernel (the decode step's default choice) against burn's product, and a row's
/// result at several batch sizes.
pub(crate) fn check_decode_gemm(device: &Device, failures: &mut Vec<String>) {
    println!("\ndecode products: the weight stream vs burn's product (relative error)");
    // Batches around the 8-row groups and 16-row tiles; k not a multiple of a chunk (128);
    // n not a multiple of a tile (16 / 32); the 7B layer's shapes.
    let sizes = [
        (1, 3584, 4608),
        (3, 136, 24),
        (8, 896, 4864),
        (9, 200, 130),
        (16, 4864, 896),
        (17, 1000, 33),
        (33, 18944, 512),
        (64, 3584, 3584),
        (64, 8, 3),
        (100, 896, 4864),
        (128, 3584, 520),
    ];
    for (m, k, n) in sizes {
        for (i, kernel) in [
            "decode_f32",
            "decode",
            "decode_stream_f32",
            "stream:1,8,2_f32",
            "stream:2,4,4,2_f32",
            "stream:4,4,2,2",
            "stream:2,8,2,2,2_f32",
            "stream:2,8,2,1,1,1_f32",
            "stream:4,8,2,1,2,1",
            "stream:2,4,2,2,1,1_f32",
            "shared:1,4,4,1_f32",
            "shared:2,3,4,0",
            "shared:2,4,4,1",
            "shared:2,4,3,0_f32",
            "wgmma:1,1,8_f32",
            "wgmma:1,1,4",
            "wgmma:2,2,4_f32",
            "wgmma:3,2,4_f32",
            "wgmma:3,1,3,2_f32",
            "wgmma:1,2,5,8",
        ]
        .into_iter()
        .enumerate()
        {
            // Operands of their own for each kernel: a kernel that leaves outputs unwritten
            // cannot pass on the previous kernel's results left in reused memory.
            let (a, b) = operands(m, k, n, 31 + 2 * i as u64, device);
            let reference = a.clone().matmul(b.clone()).cast(FloatDType::F32);
            match gemm::launch_strategy(kernel, strip(a), strip(b)) {
                Ok(c) => {
                    let c = tensor(c).cast(FloatDType::F32);
                    let worst = (c.clone() - reference.clone()).abs().max().into_scalar();
                    let top = reference.clone().abs().max().into_scalar();
                    let e = relative_error(c, reference);
                    println!("  ({m:>3}, {k:>5}, {n:>5}) {kernel:<11} {e:>9.2e} (max {:.1e} of the largest)", worst / top.max(f32::MIN_POSITIVE));
                    // bf16 operands, f32 sums: the reference's bf16 rounding (and ours, for
                    // the bf16 result) apart, overall and in every element.
                    if !(e.is_finite() && e < 1e-2 && worst <= 1e-2 * top) {
                        failures.push(format!(
                            "decode product {kernel} ({m}, {k}, {n}): {e}, largest difference {worst} of {top}"
                        ));
                    }
                }
                // A configuration that does not fit this batch (or this GPU) is skipped.
                Err(e) if skipped(kernel, &e) => {}
                Err(e) => failures.push(format!("decode product {kernel} ({m}, {k}, {n}): {e}")),
            }
        }
    }
    // A batch's rows at batch 1, 5, 17, 40, 64, 100 and 128 against the same rows of a batch of
    // 256, to the bit, in each family of kernels that share a k order: the stream and the
    // shared-stage kernel (whole, and one block per residue), whose sums run in one order
    // whatever the batch; and on Hopper the wgmma kernel in every configuration (the split is
    // the shape's), whose rows 64-127 of a block come from a second instruction. The crate's
    // choice for this shape (`decode_f32`) is the stream's family: its 8 tiles × 4 splits are
    // too few for `wgmma` by shape (`DecodeWgmma::pays_for`).
    let (k, n) = (3584, 512);
    let (a, b) = operands(256, k, n, 41, device);
    let families: [(&str, &[&str]); 2] = [
        (
            "decode_stream_f32",
            &[
                "decode_stream_f32",
                "decode_f32",
                "shared:2,3,4,0_f32",
                "shared:1,4,4,1_f32",
            ],
        ),
        (
            "wgmma:1,1,4_f32",
            &["wgmma:1,1,8_f32", "wgmma:2,2,4_f32", "wgmma:3,1,3_f32"],
        ),
    ];
    for (reference, kernels) in families {
        let full = gemm::launch_strategy(reference, strip(a.clone()), strip(b.clone())).map(tensor);
        for m in [1, 5, 17, 40, 64, 100, 128] {
            for kernel in kernels {
                let part = gemm::launch_strategy(
                    kernel,
                    strip(a.clone().narrow(2, 0, m)),
                    strip(b.clone()),
                )
                .map(tensor);
                match (&full, part) {
                    (Ok(f), Ok(p)) => {
                        let d = (f.clone().narrow(2, 0, m) - p).abs().max().into_scalar();
                        println!("  rows at batch {m:>3} ({kernel}) vs 256 ({reference}): max |diff| {d:e}");
                        if d != 0.0 {
                            failures.push(format!(
                                "decode product {kernel}: batch {m} differs from 256 by {d}"
                            ));
                        }
                    }
                    (_, Err(e)) if skipped(kernel, &e) => {}
                    (Err(e), _) if skipped(reference, e) => {}
                    (f, p) => failures.push(format!(
                        "decode product batch invariance ({kernel}): {:?} {:?}",
                        f.as_ref().err(),
                        p.err()
                    )),
                }
            }
        }
    }
}

/// A configuration the strategy cannot run at this batch, or the wgmma kernel off Hopper.
fn skipped(kernel: &str, e: &str) -> bool {
    (kernel.starts_with("stream:") && e.contains("no stream configuration"))
        || (kernel.starts_with("shared:") && e.contains("no shared-stage configuration"))
        || (kernel.starts_with("wgmma:")
            && (e.contains("no wgmma configuration") || e.contains("needs a Hopper GPU")))
}

/// One product shape of a Qwen2.5-7B (or 0.5B) decode step: `[m, k] · [n, k]ᵀ`.
struct Shape {
    label: &'static str,
    k: usize,
    n: usize,
}

const SHAPES: [Shape; 7] = [
    Shape {
        label: "qkv",
        k: 3584,
        n: 4608,
    },
    Shape {
        label: "o",
        k: 3584,
        n: 3584,
    },
    Shape {
        label: "gate_up",
        k: 3584,
        n: 37_888,
    },
    Shape {
        label: "down",
        k: 18_944,
        n: 3584,
    },
    Shape {
        label: "lm_head",
        k: 3584,
        n: 152_064,
    },
    // Qwen2-0.5B's MLP: short rows, where a block's few chunks leave the pipeline empty.
    Shape {
        label: "0.5B gu",
        k: 896,
        n: 9728,
    },
    Shape {
        label: "0.5B dn",
        k: 4864,
        n: 896,
    },
];

const BATCHES: [usize; 6] = [1, 8, 16, 32, 64, 128];

/// Microseconds per product (host issue, finished) over `n` back-to-back launches cycling
/// through `weights` (enough copies that the set does not fit in L2).
fn time_launches(
    device: &Device,
    kernel: &str,
    a: &Tensor<CudaBackend, 4>,
    weights: &[Tensor<CudaBackend, 4>],
    n: usize,
) -> Option<(f64, f64)> {
    let run = |i: usize| {
        gemm::launch_strategy(
            kernel,
            strip(a.clone()),
            strip(weights[i % weights.len()].clone()),
        )
        .ok()
    };
    // Untimed: the first launch compiles.
    for i in 0..2 {
        run(i)?;
    }
    let _ = CudaBackend::sync(device);
    let t = Instant::now();
    for i in 0..n {
        run(i)?;
    }
    let issued = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let _ = CudaBackend::sync(device);
    Some((issued, t.elapsed().as_secs_f64() * 1e6 / n as f64))
}

/// The stream's configurations the sweep tries
/// (`row_tiles,warps,slices[,row_groups[,batch_splits[,staged]]]`).
const SWEEP: [&str; 12] = [
    "1,8,2",
    "2,8,2",
    "2,8,2,1,2",
    "2,8,2,1,4",
    "1,8,2,1,1,1",
    "2,8,2,1,1,1",
    "2,8,2,1,2,1",
    "2,8,2,1,4,1",
    "4,8,2,1,1,1",
    "4,8,2,1,2,1",
    "2,4,2,2,1,1",
    "4,4,2,1,1,1",
];

/// Times the 7B decode products by each kernel; `sweep` adds every configuration of [`SWEEP`].
pub(crate) fn time_decode_gemm(device: &Device, repeat: usize, sweep: bool) {
    println!(
        "\ndecode products, Qwen2.5-7B layer shapes: µs per product (finished; host issue in \
         brackets) and the weight's GB/s"
    );
    println!(
        "{:<8} {:>5} {:>10} {:>18} {:>18} {:>18} {:>18} {:>9}",
        "shape",
        "batch",
        "burn",
        "training kernel",
        "wmma tiles",
        "stream",
        "decode",
        "decode GB/s"
    );
    let n = 20 * repeat.max(1);
    for s in SHAPES {
        let bytes = (s.k * s.n * 2) as f64;
        // Copies enough to leave L2 (50 MB on an H100) behind between launches of one weight.
        let copies = (200e6 / bytes).ceil().max(1.0) as usize;
        let weights: Vec<_> = (0..copies)
            .map(|i| operands(1, s.k, s.n, 100 + i as u64, device).1)
            .collect();
        for m in BATCHES {
            let a = random([1, 1, m, s.k], 7, device).cast(FloatDType::BF16);
            let cell = |kernel: &str| match time_launches(device, kernel, &a, &weights, n) {
                Some((issued, done)) => (format!("{done:>8.1} ({issued:>5.1})"), done),
                None => (format!("{:>18}", "-"), f64::NAN),
            };
            let burn = {
                let _ = CudaBackend::sync(device);
                let t = Instant::now();
                for i in 0..n {
                    let _ = a.clone().matmul(weights[i % copies].clone());
                }
                let _ = CudaBackend::sync(device);
                t.elapsed().as_secs_f64() * 1e6 / n as f64
            };
            let (training, _) = cell("own_f32");
            let (tiles, _) = cell("tiles_f32");
            // The mma.sync stream (or the shared-stage kernel where it is faster), and the
            // decode step's choice (the wgmma kernel on Hopper).
            let (stream, _) = cell("decode_stream_f32");
            let (decode, us) = cell("decode_f32");
            println!(
                "{:<8} {m:>5} {burn:>10.1} {training:>18} {tiles:>18} {stream:>18} {decode:>18} {:>9.0}",
                s.label,
                bytes / us / 1e3
            );
            if sweep {
                let mut line = String::new();
                for cfg in SWEEP {
                    let (_, us) = cell(&format!("stream:{cfg}_f32"));
                    line.push_str(&format!(" {cfg}={:.0}", bytes / us / 1e3));
                }
                println!("  sweep GB/s:{line}");
            }
        }
    }
}

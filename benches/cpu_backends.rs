//! Chooses the embedded CPU backend: burn's `flex` against `ndarray` on a matmul and on a small
//! transformer forward + backward with autodiff. Results go in docs/PERFORMANCE.md.
//!
//! Run: `cargo bench --bench cpu_backends`

use std::time::Duration;

use burn::backend::Autodiff;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::prelude::*;
use burn::tensor::Distribution;
use criterion::{criterion_group, criterion_main, Criterion};

const BATCH: usize = 4;
const SEQ: usize = 64;
const D_MODEL: usize = 128;

fn matmul<B: Backend>(c: &mut Criterion, name: &str, n: usize) {
    let device = B::Device::default();
    let a = Tensor::<B, 2>::random([n, n], Distribution::Normal(0.0, 1.0), &device);
    let b = Tensor::<B, 2>::random([n, n], Distribution::Normal(0.0, 1.0), &device);
    c.bench_function(&format!("matmul_{n}/{name}"), |bench| {
        // Reading one scalar back forces the work on every backend.
        bench.iter(|| {
            a.clone()
                .matmul(b.clone())
                .slice([0..1, 0..1])
                .into_scalar()
        })
    });
}

fn transformer_step<B: Backend>(c: &mut Criterion, name: &str) {
    type Ad<B> = Autodiff<B>;
    let device: B::Device = Default::default();
    let model: TransformerEncoder<Ad<B>> =
        TransformerEncoderConfig::new(D_MODEL, 4 * D_MODEL, 4, 2)
            .with_dropout(0.0)
            .init(&device);
    let x = Tensor::<Ad<B>, 3>::random(
        [BATCH, SEQ, D_MODEL],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    c.bench_function(
        &format!("transformer_fwd_bwd_b{BATCH}_s{SEQ}_d{D_MODEL}_l2/{name}"),
        |bench| {
            bench.iter(|| {
                let y = model.forward(TransformerEncoderInput::new(x.clone()));
                let loss = y.powf_scalar(2.0).mean();

                loss.backward()
            })
        },
    );
}

fn backends(c: &mut Criterion) {
    for n in [256, 512] {
        matmul::<burn_flex::Flex>(c, "flex", n);
        matmul::<burn_ndarray::NdArray>(c, "ndarray", n);
    }
    transformer_step::<burn_flex::Flex>(c, "flex");
    transformer_step::<burn_ndarray::NdArray>(c, "ndarray");
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = backends
}
criterion_main!(benches);

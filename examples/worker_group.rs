//! Embedding a `WorkerGroup` with a worker of your own: four thread ranks laid out as
//! tp = 2 × dp = 2, each holding a (here trivial) length-penalty scorer, called with
//! Megatron's `MegatronCompute` dispatch: the batch is split over dp, both tp ranks of a dp
//! group get the same chunk, and the outputs are collected from tp rank 0, in row order.
//!
//! `cargo run --release --example worker_group`

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use verl::backend::DefaultBackend;
use verl::dispatch::{megatron_dispatch_info, DispatchInfo, DispatchMode};
use verl::topology::{ParallelConfig, RankCoords, Topology};
use verl::worker::{RankContext, Worker, WorkerGroup};
use verl::DataProto;

type B = DefaultBackend;

/// Scores each row −0.01 per response token; a real worker would hold a model shard.
struct LengthPenalty {
    coords: RankCoords,
}

impl Worker for LengthPenalty {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        megatron_dispatch_info(&self.coords, mesh)
    }
}

impl LengthPenalty {
    async fn score(&mut self, data: DataProto<B>) -> verl::Result<DataProto<B>> {
        let mask = data.int::<2>("response_mask")?.float();
        let penalty = mask.sum_dim(1) * -0.01;
        let mut out = DataProto::new();
        out.insert_float("length_penalty", penalty)?;
        // Which ranks computed this chunk (tp rank 0 of each dp group is collected).
        let rank = Tensor::<B, 2>::full(
            [data.len(), 1],
            self.coords.dp_rank as f32,
            &Default::default(),
        );
        out.insert_float("dp_rank", rank)?;
        Ok(out)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let layout = ParallelConfig {
        tp: 2,
        ..Default::default()
    };
    let topo = Topology::new(layout, 4)?;
    let group = WorkerGroup::spawn(4, move |ctx: RankContext| {
        Ok(LengthPenalty {
            coords: topo.coords(ctx.rank)?,
        })
    })?;
    // Eight responses of 1..=8 tokens.
    let rows = 8;
    let mask: Vec<i64> = (0..rows)
        .flat_map(|r| (0..8).map(move |t| i64::from(t <= r)))
        .collect();
    let mut batch = DataProto::<B>::new();
    let mask =
        Tensor::<B, 2, Int>::from_data(TensorData::new(mask, [rows, 8]), &Default::default());
    batch.insert_int("response_mask", mask)?;
    let out = group
        .call_proto(&DispatchMode::MegatronCompute, "score", batch, |w, _, d| {
            Box::pin(w.score(d))
        })
        .await?;
    let penalty: Vec<f32> = out
        .float::<2>("length_penalty")?
        .into_data()
        .to_vec()
        .map_err(|e| format!("{e:?}"))?;
    let dp: Vec<f32> = out
        .float::<2>("dp_rank")?
        .into_data()
        .to_vec()
        .map_err(|e| format!("{e:?}"))?;
    for (r, p) in penalty.iter().enumerate() {
        assert!((p + 0.01 * (r + 1) as f32).abs() < 1e-6, "row {r}: {p}");
    }
    // Rows 0..4 went to dp rank 0, rows 4..8 to dp rank 1.
    assert_eq!(dp, vec![0., 0., 0., 0., 1., 1., 1., 1.]);
    println!("worker group: {rows} rows scored on 2 dp groups of 2 tp ranks: {penalty:?}");
    Ok(())
}

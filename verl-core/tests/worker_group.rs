//! The single controller's worker group: every dispatch mode, failures, panics and timeouts.

use std::time::{Duration, Instant};

use burn::tensor::{Int, Tensor, TensorData};
use verl_core::backend::CpuBackend as B;
use verl_core::dispatch::{megatron_dispatch_info, DispatchInfo, DispatchMode};
use verl_core::error::{Error, WorkerError};
use verl_core::topology::{ParallelConfig, RankCoords, Topology};
use verl_core::worker::{RankContext, Worker, WorkerGroup};
use verl_core::DataProto;

struct RankWorker {
    coords: RankCoords,
    calls: usize,
    rollout_tp: usize,
}

impl Worker for RankWorker {
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo> {
        if mesh == "rollout" {
            // A rollout mesh with its own tp: dp index = rank / rollout_tp, collect from its tp rank 0.
            let r = self.coords.rank;
            let world = self.coords.tp_size
                * self.coords.cp_size
                * self.coords.dp_size
                * self.coords.pp_size;
            return Some(DispatchInfo {
                dp_rank: r / self.rollout_tp,
                dp_size: world / self.rollout_tp,
                is_collect: r.is_multiple_of(self.rollout_tp),
            });
        }
        megatron_dispatch_info(&self.coords, mesh)
    }
}

fn group(cfg: ParallelConfig, world: usize) -> WorkerGroup<RankWorker> {
    let topo = Topology::new(cfg, world).unwrap();
    WorkerGroup::spawn(world, move |ctx: RankContext| {
        Ok(RankWorker {
            coords: topo.coords(ctx.rank)?,
            calls: 0,
            rollout_tp: 2,
        })
    })
    .unwrap()
}

fn rows(len: usize) -> DataProto<B> {
    let mut p = DataProto::<B>::new();
    let v: Vec<i64> = (0..len as i64).collect();
    p.insert_int(
        "row",
        Tensor::<B, 1, Int>::from_data(TensorData::new(v, [len]), &Default::default()),
    )
    .unwrap();
    p
}

/// Each rank adds 100 to its rows and records which rank produced them.
fn tag(
    w: &mut RankWorker,
    _ctx: RankContext,
    data: DataProto<B>,
) -> verl_core::worker::MethodFuture<'_, DataProto<B>> {
    Box::pin(async move {
        w.calls += 1;
        let mut out = data.clone();
        let row: Tensor<B, 1, Int> = data.int("row")?;
        out.insert_int("row", row.add_scalar(100))?;
        out.insert_non_tensor("rank", vec![serde_json::json!(w.coords.rank); data.len()])?;
        Ok(out)
    })
}

fn column(p: &DataProto<B>) -> (Vec<i64>, Vec<u64>) {
    let rows = p
        .to_data("row")
        .unwrap()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    let ranks = p
        .non_tensor("rank")
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    (rows, ranks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_to_all_all_to_all_and_rank_zero() {
    let g = group(
        ParallelConfig {
            tp: 2,
            ..Default::default()
        },
        4,
    );
    let ranks = g
        .execute_all("count", (), |w: &mut RankWorker, ctx, ()| {
            Box::pin(async move {
                w.calls += 1;
                Ok((ctx.rank, w.calls))
            })
        })
        .await
        .unwrap();
    assert_eq!(ranks, vec![(0, 1), (1, 1), (2, 1), (3, 1)]);
    // State persists on each rank between calls.
    let again = g
        .execute_per_rank(
            "count",
            vec![10, 20, 30, 40],
            |w: &mut RankWorker, _ctx, x: i32| {
                Box::pin(async move {
                    w.calls += 1;
                    Ok(x + w.calls as i32)
                })
            },
        )
        .await
        .unwrap();
    assert_eq!(again, vec![12, 22, 32, 42]);
    let zero = g
        .execute_rank_zero("rank", (), |_w: &mut RankWorker, ctx, ()| {
            Box::pin(async move { Ok(ctx.rank) })
        })
        .await
        .unwrap();
    assert_eq!(zero, 0);
    let wrong = g
        .execute_per_rank("count", vec![1, 2], |_w: &mut RankWorker, _ctx, x: i32| {
            Box::pin(async move { Ok(x) })
        })
        .await;
    assert!(wrong
        .unwrap_err()
        .to_string()
        .contains("2 inputs given for 4 ranks"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn megatron_compute_collects_last_stage_tp0() {
    // tp=2, pp=2 on 8 ranks: dp=2; collect ranks are 4 (dp 0) and 6 (dp 1).
    let g = group(
        ParallelConfig {
            tp: 2,
            pp: 2,
            ..Default::default()
        },
        8,
    );
    let out = g
        .call_proto(&DispatchMode::MegatronCompute, "tag", rows(6), tag)
        .await
        .unwrap();
    let (r, ranks) = column(&out);
    assert_eq!(r, vec![100, 101, 102, 103, 104, 105]);
    assert_eq!(ranks, vec![4, 4, 4, 6, 6, 6]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp_as_dp_dp_compute_proto_and_a_custom_mesh() {
    let g = group(
        ParallelConfig {
            tp: 2,
            pp: 2,
            ..Default::default()
        },
        8,
    );
    // pp counts as dp: 4 chunks; tp=0 ranks collect: (dp0,pp0)=0, (dp0,pp1)=4, (dp1,pp0)=2, (dp1,pp1)=6.
    let out = g
        .call_proto(&DispatchMode::MegatronPpAsDp, "tag", rows(4), tag)
        .await
        .unwrap();
    assert_eq!(column(&out), (vec![100, 101, 102, 103], vec![0, 4, 2, 6]));

    let out = g
        .call_proto(&DispatchMode::DpComputeProto, "tag", rows(8), tag)
        .await
        .unwrap();
    assert_eq!(column(&out).1, (0..8).collect::<Vec<u64>>());

    // A mesh no dispatch code knows about: rollout tp = 2 → 4 chunks, collected from even ranks.
    let out = g
        .call_proto(
            &DispatchMode::Nd {
                mesh: "rollout".into(),
            },
            "tag",
            rows(4),
            tag,
        )
        .await
        .unwrap();
    assert_eq!(column(&out), (vec![100, 101, 102, 103], vec![0, 2, 4, 6]));

    let err = g
        .call_proto(
            &DispatchMode::Nd {
                mesh: "critic".into(),
            },
            "tag",
            rows(4),
            tag,
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("no dispatch info for mesh `critic`"),
        "{err}"
    );
    let err = g
        .call_proto(&DispatchMode::OneToAll, "tag", rows(4), tag)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("execute_all"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_padding_through_meta_info() {
    let g = group(ParallelConfig::default(), 4);
    let mut data = rows(6);
    assert!(g
        .call_proto(&DispatchMode::MegatronCompute, "tag", data.clone(), tag)
        .await
        .is_err());
    data.meta_info.insert(
        verl_core::worker::AUTO_PADDING_KEY.into(),
        serde_json::json!(true),
    );
    let out = g
        .call_proto(&DispatchMode::MegatronCompute, "tag", data, tag)
        .await
        .unwrap();
    assert_eq!(column(&out).0, vec![100, 101, 102, 103, 104, 105]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_rank_cancels_the_others_and_is_named() {
    let g = group(ParallelConfig::default(), 4);
    let start = Instant::now();
    let err = g
        .execute_all("update_actor", (), |_w: &mut RankWorker, ctx, ()| {
            Box::pin(async move {
                if ctx.rank == 2 {
                    return Err(Error::backend(
                        "actor",
                        std::io::Error::other("loss is NaN"),
                    ));
                }
                // The others wait in a "collective" that rank 2 never joins.
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(())
            })
        })
        .await
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "cancellation must not wait for the collective"
    );
    match err {
        Error::Worker(WorkerError::Failed {
            rank, ref method, ..
        }) => {
            assert_eq!((rank, method.as_str()), (2, "update_actor"));
            assert!(err.to_string().contains("loss is NaN"));
        }
        other => panic!("expected the root failure of rank 2, got {other}"),
    }
    // The cancelled ranks returned to idle: the group still works.
    assert!(!g.is_poisoned());
    let ok = g
        .execute_all("ping", (), |_w: &mut RankWorker, ctx, ()| {
            Box::pin(async move { Ok(ctx.rank) })
        })
        .await;
    assert_eq!(ok.unwrap(), vec![0, 1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_rank_is_reported_and_poisons_the_group() {
    let g = group(ParallelConfig::default(), 2);
    let err = g
        .execute_all("compute_log_prob", (), |_w: &mut RankWorker, ctx, ()| {
            Box::pin(async move {
                if ctx.rank == 1 {
                    panic!("index out of bounds in rank 1");
                }
                Ok(())
            })
        })
        .await
        .unwrap_err();
    match &err {
        Error::Worker(WorkerError::Panicked {
            rank,
            method,
            message,
        }) => {
            assert_eq!((*rank, method.as_str()), (1, "compute_log_prob"));
            assert!(message.contains("index out of bounds"));
        }
        other => panic!("expected a panic report, got {other}"),
    }
    assert!(g.is_poisoned());
    let again = g
        .execute_all("ping", (), |_w: &mut RankWorker, _ctx, ()| {
            Box::pin(async move { Ok(()) })
        })
        .await;
    assert!(matches!(
        again,
        Err(Error::Worker(WorkerError::Poisoned { .. }))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_rank_times_out_instead_of_hanging() {
    let g = group(ParallelConfig::default(), 2).with_timeout(Duration::from_millis(300));
    let start = Instant::now();
    let err = g
        .execute_all("generate_sequences", (), |_w: &mut RankWorker, ctx, ()| {
            Box::pin(async move {
                if ctx.rank == 1 {
                    // Synchronous work that cannot be cancelled.
                    std::thread::sleep(Duration::from_secs(3));
                }
                Ok(())
            })
        })
        .await
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2));
    match err {
        Error::Worker(WorkerError::Timeout {
            ref method,
            ref pending,
            ..
        }) => {
            assert_eq!(method, "generate_sequences");
            assert_eq!(pending, &vec![1]);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(g.is_poisoned());
}

#[test]
fn a_worker_that_fails_to_build_names_its_rank() {
    let err = WorkerGroup::<RankWorker>::spawn(3, |ctx: RankContext| {
        if ctx.rank == 1 {
            return Err(verl_core::error::WorkerError::Spawn {
                rank: 1,
                message: "out of memory".into(),
            }
            .into());
        }
        let topo = Topology::new(ParallelConfig::default(), 3)?;
        Ok(RankWorker {
            coords: topo.coords(ctx.rank)?,
            calls: 0,
            rollout_tp: 1,
        })
    })
    .err()
    .expect("spawn must fail");
    let msg = err.to_string();
    assert!(
        msg.contains("rank 1") && msg.contains("out of memory"),
        "{msg}"
    );
}

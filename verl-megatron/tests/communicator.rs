//! The in-process and TCP communicators: every collective equals its naive definition on 1–4
//! ranks (property tests over random data, both implementations, bit-identical reductions),
//! point-to-point pairs in order, topology groups reduce over their own members only, and
//! mismatches or departed peers are errors, not hangs.

use burn::prelude::*;
use proptest::prelude::*;
use verl_core::backend::CpuBackend as B;
use verl_core::error::CommError;
use verl_core::topology::{ParallelConfig, Topology};
use verl_core::traits::{Communicator, CommunicatorExt, ReduceOp};
use verl_megatron::parallel::{LocalCommunicator, ProcessGroups, Rendezvous, TcpCommunicator};

fn t(v: &[f32]) -> Tensor<B, 1> {
    Tensor::from_floats(v, &Default::default())
}

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

type Comm = Box<dyn Communicator<B>>;

/// A new group of `n` ranks: in-process handles, or TCP ones (real sockets on localhost, met
/// through a rendezvous table, as rank processes meet).
fn group(n: usize, tcp: bool) -> Vec<Comm> {
    if !tcp {
        return LocalCommunicator::group(n)
            .into_iter()
            .map(|c| Box::new(c) as Comm)
            .collect();
    }
    let table = Rendezvous::serve("127.0.0.1:0").unwrap();
    let addr = table.addr().to_string();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let addr = addr.clone();
                s.spawn(move || {
                    let r = Rendezvous::client(&addr);
                    Box::new(TcpCommunicator::connect(&r, "test", rank, n, "127.0.0.1").unwrap())
                        as Comm
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `f` on every rank of a new group, one thread each; results in rank order.
fn on_ranks<T: Send>(n: usize, tcp: bool, f: impl Fn(Comm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = group(n, tcp)
            .into_iter()
            .map(|c| s.spawn(|| f(c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn data_strategy() -> impl Strategy<Value = (usize, Vec<Vec<f32>>)> {
    (1usize..=4, 1usize..=3).prop_flat_map(|(n, k)| {
        // A length divisible by n, for reduce-scatter.
        let len = n * k;
        (
            Just(n),
            prop::collection::vec(prop::collection::vec(-10.0f32..10.0, len), n),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    #[test]
    fn collectives_equal_their_definitions((n, data) in data_strategy(), tcp in any::<bool>()) {
        let len = data[0].len();
        let sum: Vec<f32> = (0..len).map(|i| data.iter().map(|d| d[i]).sum()).collect();
        let max: Vec<f32> = (0..len)
            .map(|i| data.iter().map(|d| d[i]).fold(f32::MIN, f32::max))
            .collect();
        let out = on_ranks(n, tcp, |c| {
            let r = c.rank();
            let mine = &data[r];
            let s = host(c.all_reduce(t(mine), ReduceOp::Sum).unwrap());
            let a = host(c.all_reduce(t(mine), ReduceOp::Avg).unwrap());
            let m = host(c.all_reduce(t(mine), ReduceOp::Max).unwrap());
            let g: Vec<Vec<f32>> = c.all_gather(t(mine)).unwrap().into_iter().map(host).collect();
            let rs = host(c.reduce_scatter(t(mine), ReduceOp::Sum).unwrap());
            let b = host(c.broadcast(t(mine), n - 1).unwrap());
            // Rank i sends chunk j (length j + 1, filled with 10 i + j) to rank j.
            let chunks: Vec<Tensor<B, 1>> = (0..n)
                .map(|j| t(&vec![(10 * r + j) as f32; j + 1]))
                .collect();
            let a2a: Vec<Vec<f32>> = c
                .all_to_all(chunks, &vec![r + 1; n])
                .unwrap()
                .into_iter()
                .map(host)
                .collect();
            c.barrier().unwrap();
            (s, a, m, g, rs, b, a2a)
        });
        let chunk = len / n;
        for (r, (s, a, m, g, rs, b, a2a)) in out.into_iter().enumerate() {
            // Every rank reduces in rank order: bit-identical sums everywhere.
            prop_assert_eq!(&s, &sum);
            for (x, y) in a.iter().zip(&sum) {
                prop_assert!((x - y / n as f32).abs() <= 1e-6 * y.abs().max(1.0));
            }
            prop_assert_eq!(&m, &max);
            prop_assert_eq!(&g, &data);
            prop_assert_eq!(&rs, &sum[r * chunk..(r + 1) * chunk].to_vec());
            prop_assert_eq!(&b, &data[n - 1]);
            let want: Vec<Vec<f32>> = (0..n).map(|i| vec![(10 * i + r) as f32; r + 1]).collect();
            prop_assert_eq!(&a2a, &want);
        }
    }

    #[test]
    fn shaped_gather_and_scatter_follow_the_dimension(n in 1usize..=4, rows in 1usize..=3, dim in 0usize..2, tcp in any::<bool>()) {
        // Rank r holds a [rows, 2n] matrix of r; gather along `dim` stacks them in rank order,
        // reduce-scatter along dim 1 returns this rank's columns of the sum.
        let out = on_ranks(n, tcp, |c| {
            let r = c.rank() as f32;
            let m = Tensor::<B, 2>::full([rows, 2 * n], r, &Default::default());
            let g = c.all_gather_dim(m.clone(), dim).unwrap();
            let rs = c.reduce_scatter_dim(m, 1, ReduceOp::Sum).unwrap();
            (g.dims(), host(g), rs.dims(), host(rs))
        });
        let total: f32 = (0..n).map(|r| r as f32).sum();
        for (gdims, g, rsdims, rs) in out {
            let mut want_dims = [rows, 2 * n];
            want_dims[dim] *= n;
            prop_assert_eq!(gdims, want_dims);
            let want: Vec<f32> = if dim == 0 {
                (0..n).flat_map(|r| vec![r as f32; rows * 2 * n]).collect()
            } else {
                (0..rows).flat_map(|_| (0..n).flat_map(|r| vec![r as f32; 2 * n])).collect()
            };
            prop_assert_eq!(g, want);
            prop_assert_eq!(rsdims, [rows, 2]);
            prop_assert_eq!(rs, vec![total; rows * 2]);
        }
    }

    #[test]
    fn interleaved_collectives_follow_the_middle_dimension(n in 1usize..=4, outer in 1usize..=3, inner in 1usize..=3, tcp in any::<bool>()) {
        // Element (o, i) of rank r's [outer, inner] part is 100r + 10o + i. The gather places
        // part r at r of the middle of [outer, n, inner]; the reduce-scatter of a rank's
        // [outer, n, inner] input (element (o, p, i) = 100r + 10o + p + i / 10) returns the sum
        // over ranks at its own place p = rank.
        let value = |r: usize, o: usize, i: usize| (100 * r + 10 * o + i) as f32;
        let out = on_ranks(n, tcp, |c| {
            let r = c.rank();
            let part: Vec<f32> = (0..outer)
                .flat_map(|o| (0..inner).map(move |i| value(r, o, i)))
                .collect();
            let g = c.all_gather_interleaved(t(&part), outer).unwrap();
            let full: Vec<f32> = (0..outer)
                .flat_map(|o| {
                    (0..n).flat_map(move |p| {
                        (0..inner).map(move |i| (100 * r + 10 * o + p) as f32 + i as f32 / 10.0)
                    })
                })
                .collect();
            let rs = c
                .reduce_scatter_interleaved(t(&full), ReduceOp::Sum, outer)
                .unwrap();
            (r, host(g), host(rs))
        });
        for (r, g, rs) in out {
            let mut want_g = Vec::new();
            for o in 0..outer {
                for p in 0..n {
                    want_g.extend((0..inner).map(|i| value(p, o, i)));
                }
            }
            prop_assert_eq!(g, want_g);
            let mut want_rs = Vec::new();
            for o in 0..outer {
                for i in 0..inner {
                    // Summed in rank order, as every implementation does.
                    let mut acc = 0f32;
                    for q in 0..n {
                        let x = (100 * q + 10 * o + r) as f32 + i as f32 / 10.0;
                        acc = if q == 0 { x } else { acc + x };
                    }
                    want_rs.push(acc);
                }
            }
            prop_assert_eq!(rs, want_rs);
        }
    }
}

#[test]
fn interleaved_collectives_refuse_a_length_that_does_not_split() {
    let out = on_ranks(2, false, |c| {
        let gather = c
            .all_gather_interleaved(t(&[1.0, 2.0, 3.0]), 2)
            .unwrap_err();
        let scatter = c
            .reduce_scatter_interleaved(t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), ReduceOp::Sum, 2)
            .unwrap_err();
        (gather.to_string(), scatter.to_string())
    });
    for (gather, scatter) in out {
        assert!(gather.contains("[outer 2, ranks 1, inner]"), "{gather}");
        assert!(scatter.contains("[outer 2, ranks 2, inner]"), "{scatter}");
    }
}

#[test]
fn send_and_recv_pair_in_order() {
    // A ring: each rank sends two messages to the next and receives the previous one's.
    for tcp in [false, true] {
        let out = on_ranks(3, tcp, |c| {
            let r = c.rank();
            let n = 3;
            c.send(t(&[r as f32, 1.0]), (r + 1) % n).unwrap();
            c.send(t(&[r as f32, 2.0, 2.0]), (r + 1) % n).unwrap();
            let prev = (r + n - 1) % n;
            let first = host(c.recv(prev, 2, &Default::default()).unwrap());
            let second = host(c.recv(prev, 3, &Default::default()).unwrap());
            (first, second)
        });
        for (r, (first, second)) in out.into_iter().enumerate() {
            let prev = ((r + 2) % 3) as f32;
            assert_eq!(first, vec![prev, 1.0]);
            assert_eq!(second, vec![prev, 2.0, 2.0]);
        }
    }
}

#[test]
fn topology_groups_reduce_over_their_members() {
    // tp = 2, dp = 2 on 4 ranks: ranks (0,1) and (2,3) are tp groups, (0,2) and (1,3) dp groups.
    let topo = Topology::new(
        ParallelConfig {
            tp: 2,
            ..Default::default()
        },
        4,
    )
    .unwrap();
    let table = Rendezvous::serve("127.0.0.1:0").unwrap();
    for tcp in [false, true] {
        let groups: Vec<Option<ProcessGroups<B>>> = if tcp {
            vec![None; 4]
        } else {
            ProcessGroups::<B>::local(&topo)
                .into_iter()
                .map(Some)
                .collect()
        };
        let (topo, addr) = (&topo, table.addr().to_string());
        let out: Vec<(f32, f32, f32)> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, g)| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        // As a rank process builds its groups: its own handles only.
                        let g = g.unwrap_or_else(|| {
                            let r = Rendezvous::client(&addr);
                            ProcessGroups::tcp(topo, rank, &r, "127.0.0.1", "actor").unwrap()
                        });
                        let mine = t(&[rank as f32]);
                        let tp = host(g.tp().all_reduce(mine.clone(), ReduceOp::Sum).unwrap())[0];
                        let dp = host(g.dp().all_reduce(mine.clone(), ReduceOp::Sum).unwrap())[0];
                        let world = host(g.world.all_reduce(mine, ReduceOp::Sum).unwrap())[0];
                        (tp, dp, world)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            out,
            vec![
                (1.0, 2.0, 6.0),
                (1.0, 4.0, 6.0),
                (5.0, 2.0, 6.0),
                (5.0, 4.0, 6.0)
            ]
        );
    }
}

#[test]
fn mismatches_and_departed_peers_are_errors() {
    for tcp in [false, true] {
        let out = on_ranks(2, tcp, |c| {
            let r = c.rank();
            c.all_reduce(t(&vec![1.0; r + 1]), ReduceOp::Sum).err()
        });
        assert!(out.iter().all(|e| matches!(e, Some(CommError::Shape(_)))));

        // A departed peer fails the survivor at once (a TCP peer's closed socket is seen
        // without waiting for the timeout).
        let start = std::time::Instant::now();
        let mut group = group(2, tcp);
        let survivor = group.remove(0);
        drop(group); // rank 1 is gone
        let err = survivor.all_reduce(t(&[1.0]), ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, CommError::PeerGone(_)), "{err}");
        let err = survivor.recv(1, 1, &Default::default()).unwrap_err();
        assert!(matches!(err, CommError::PeerGone(_)), "{err}");
        assert!(err.to_string().contains("rank 1"), "{err}");
        assert!(start.elapsed().as_secs() < 10, "{:?}", start.elapsed());
        let err = survivor.send(t(&[1.0]), 5).unwrap_err();
        assert!(
            matches!(err, CommError::BadRank { rank: 5, world: 2 }),
            "{err}"
        );
    }
}

/// A rank that fails aborts its group: a peer blocked in a collective gets the failing rank's
/// reason at once, not after `VERL_COMM_TIMEOUT_S` (600 s by default here).
#[test]
fn a_failing_rank_aborts_its_peers_collectives_at_once() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use verl_core::worker::{RankContext, Worker, WorkerGroup};

    struct Ranked {
        rank: usize,
        comm: Arc<dyn Communicator<B>>,
    }
    impl Worker for Ranked {
        fn dispatch_info(&self, _mesh: &str) -> Option<verl_core::dispatch::DispatchInfo> {
            None
        }
    }
    let handles = std::sync::Mutex::new(
        LocalCommunicator::group(3)
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>(),
    );
    let group = WorkerGroup::spawn(3, move |ctx: RankContext| {
        let comm: Arc<dyn Communicator<B>> =
            Arc::new(handles.lock().unwrap()[ctx.rank].take().unwrap());
        let aborting = comm.clone();
        ctx.on_failure(move |why: &str| aborting.abort(why));
        Ok(Ranked {
            rank: ctx.rank,
            comm,
        })
    })
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let start = Instant::now();
    let err = rt
        .block_on(
            group.execute_all("save_checkpoint", (), |w: &mut Ranked, _ctx, ()| {
                Box::pin(async move {
                    if w.rank == 2 {
                        // Give the peers time to block in the collective first.
                        std::thread::sleep(Duration::from_millis(300));
                        return Err(verl_core::Error::backend("test", "disk full"));
                    }
                    w.comm.all_reduce(t(&[1.0]), ReduceOp::Sum)?;
                    Ok(())
                })
            }),
        )
        .unwrap_err()
        .to_string();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert!(
        err.contains("rank 2") && err.contains("save_checkpoint"),
        "{err}"
    );
    assert!(err.contains("disk full"), "the cause comes first: {err}");
}

#[test]
fn an_aborted_group_answers_every_waiting_rank() {
    let comms = LocalCommunicator::group(2);
    let errs: Vec<String> = std::thread::scope(|s| {
        let mut it = comms.into_iter();
        let (a, b) = (it.next().unwrap(), it.next().unwrap());
        let waiter = s.spawn(move || {
            Communicator::<B>::all_reduce(&b, t(&[1.0]), ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        Communicator::<B>::abort(&a, "rank 0 failed in update_actor: out of memory");
        let late = Communicator::<B>::barrier(&a).unwrap_err().to_string();
        vec![waiter.join().unwrap(), late]
    });
    for e in errs {
        assert!(e.contains("rank 0 failed in update_actor"), "{e}");
    }
}

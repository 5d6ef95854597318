//! Dispatch plans: every data-parallel mode splits and collects without losing or duplicating rows.

use burn::tensor::{Int, Tensor, TensorData};
use proptest::prelude::*;
use verl_core::backend::CpuBackend as B;
use verl_core::dispatch::{DispatchInfo, DispatchMode, DispatchPlan};
use verl_core::topology::{ParallelConfig, Topology};
use verl_core::DataProto;

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

fn ids(p: &DataProto<B>) -> Vec<i64> {
    p.to_data("row")
        .unwrap()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap()
}

fn layouts() -> impl Strategy<Value = (ParallelConfig, usize)> {
    (1usize..=2, 1usize..=3, 1usize..=2, 1usize..=3).prop_map(|(tp, pp, cp, dp)| {
        (
            ParallelConfig {
                tp,
                pp,
                cp,
                ..Default::default()
            },
            tp * pp * cp * dp,
        )
    })
}

fn plan_for(
    topo: &Topology,
    f: fn(&verl_core::topology::RankCoords) -> DispatchInfo,
) -> DispatchPlan {
    let infos = (0..topo.world_size())
        .map(|r| f(&topo.coords(r).unwrap()))
        .collect();
    DispatchPlan::new("test", infos).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    #[test]
    fn megatron_compute_round_trips((cfg, world) in layouts(), per in 1usize..4) {
        let topo = Topology::new(cfg, world).unwrap();
        let plan = plan_for(&topo, DispatchInfo::megatron_compute);
        let data = rows(topo.dp() * per);
        let (parts, pad) = plan.split(&data, false).unwrap();
        // Every tp/cp/pp rank of a dp group sees the same chunk.
        prop_assert_eq!(parts.len(), world);
        for (r, part) in parts.iter().enumerate() {
            let c = topo.coords(r).unwrap();
            let expect: Vec<i64> = ((c.dp_rank * per) as i64..((c.dp_rank + 1) * per) as i64).collect();
            prop_assert_eq!(ids(part), expect);
        }
        // Collect ranks are tp=0, cp=0 on the last stage, one per dp index.
        for &r in plan.collect_ranks() {
            let c = topo.coords(r).unwrap();
            prop_assert!(c.tp_rank == 0 && c.cp_rank == 0 && c.is_last_pp_stage());
        }
        let back = plan.collect(parts.into_iter().map(Some).collect(), pad).unwrap();
        prop_assert_eq!(ids(&back), ids(&data));
    }

    #[test]
    fn pp_as_dp_round_trips((cfg, world) in layouts(), per in 1usize..3) {
        let topo = Topology::new(cfg.clone(), world).unwrap();
        let plan = plan_for(&topo, DispatchInfo::megatron_pp_as_dp);
        prop_assert_eq!(plan.dp_size(), topo.dp() * cfg.pp * cfg.cp);
        let data = rows(plan.dp_size() * per);
        let (parts, pad) = plan.split(&data, false).unwrap();
        // tp peers share a chunk; different pp stages get different chunks.
        for r in 0..world {
            let c = topo.coords(r).unwrap();
            let peer = topo.rank_of(0, c.cp_rank, c.dp_rank, c.pp_rank).unwrap();
            prop_assert_eq!(ids(&parts[r]), ids(&parts[peer]));
        }
        let back = plan.collect(parts.into_iter().map(Some).collect(), pad).unwrap();
        prop_assert_eq!(ids(&back), ids(&data));
    }

    #[test]
    fn auto_padding_is_removed_on_collect((cfg, world) in layouts(), len in 1usize..10) {
        let topo = Topology::new(cfg, world).unwrap();
        let plan = plan_for(&topo, DispatchInfo::megatron_compute);
        let data = rows(len);
        let (parts, pad) = plan.split(&data, true).unwrap();
        let back = plan.collect(parts.into_iter().map(Some).collect(), pad).unwrap();
        prop_assert_eq!(ids(&back), ids(&data));
    }
}

#[test]
fn pp_as_dp_order_by_hand() {
    // pp=2, dp=4 (tp=1): chunk index = dp_rank·pp + pp_rank, so with rows A..H the stage-0 ranks
    // (0..4) hold A C E G and the stage-1 ranks (4..8) hold B D F H; collected back as A..H.
    let topo = Topology::new(
        ParallelConfig {
            pp: 2,
            ..Default::default()
        },
        8,
    )
    .unwrap();
    let plan = plan_for(&topo, DispatchInfo::megatron_pp_as_dp);
    let (parts, _) = plan.split(&rows(8), false).unwrap();
    let got: Vec<i64> = parts.iter().map(|p| ids(p)[0]).collect();
    assert_eq!(got, vec![0, 2, 4, 6, 1, 3, 5, 7]);
}

#[test]
fn indivisible_batch_is_refused_without_auto_padding() {
    let topo = Topology::new(ParallelConfig::default(), 4).unwrap();
    let plan = plan_for(&topo, DispatchInfo::megatron_compute);
    let err = plan.split(&rows(6), false).unwrap_err().to_string();
    assert!(
        err.contains("6 rows") && err.contains("4 data-parallel chunks"),
        "{err}"
    );
}

#[test]
fn inconsistent_infos_are_refused() {
    let dup = vec![
        DispatchInfo {
            dp_rank: 0,
            dp_size: 2,
            is_collect: true,
        },
        DispatchInfo {
            dp_rank: 0,
            dp_size: 2,
            is_collect: true,
        },
    ];
    assert!(DispatchPlan::new("m", dup)
        .unwrap_err()
        .to_string()
        .contains("both collect"));
    let missing = vec![
        DispatchInfo {
            dp_rank: 0,
            dp_size: 2,
            is_collect: true,
        },
        DispatchInfo {
            dp_rank: 1,
            dp_size: 2,
            is_collect: false,
        },
    ];
    assert!(DispatchPlan::new("m", missing)
        .unwrap_err()
        .to_string()
        .contains("no rank collects dp index 1"));
    let sizes = vec![
        DispatchInfo {
            dp_rank: 0,
            dp_size: 2,
            is_collect: true,
        },
        DispatchInfo {
            dp_rank: 1,
            dp_size: 3,
            is_collect: true,
        },
    ];
    assert!(DispatchPlan::new("m", sizes).is_err());
}

#[test]
fn collect_scales_padding_when_rows_multiply() {
    // A method that turns each row into 2 (n samples per prompt) still gets its padding removed.
    let plan =
        DispatchPlan::new("m", (0..2).map(|r| DispatchInfo::per_rank(r, 2)).collect()).unwrap();
    let (parts, pad) = plan.split(&rows(3), true).unwrap();
    assert_eq!(pad.pad, 1);
    let doubled: Vec<_> = parts
        .into_iter()
        .map(|p| Some(p.repeat(2, true).unwrap()))
        .collect();
    let back = plan.collect(doubled, pad).unwrap();
    assert_eq!(ids(&back), vec![0, 0, 1, 1, 2, 2]);
}

#[test]
fn mode_names_follow_verl() {
    assert_eq!(DispatchMode::MegatronCompute.name(), "MEGATRON_COMPUTE");
    assert_eq!(DispatchMode::MegatronPpAsDp.name(), "MEGATRON_PP_AS_DP");
    assert_eq!(DispatchMode::OneToAll.name(), "ONE_TO_ALL");
    assert_eq!(
        DispatchMode::Nd {
            mesh: "rollout".into()
        }
        .name(),
        "ND_COMPUTE(rollout)"
    );
}

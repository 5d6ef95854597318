//! The parallel topology: Megatron's rank order, groups that partition the world, refusals.

use std::collections::BTreeSet;

use proptest::prelude::*;
use verl_core::topology::{
    masked_orthogonal_groups, GroupKind, ModelDims, ParallelConfig, Topology,
};

fn layouts() -> impl Strategy<Value = (ParallelConfig, usize)> {
    (
        1usize..=4,
        1usize..=3,
        1usize..=2,
        1usize..=3,
        1usize..=4,
        prop::option::of(1usize..=2),
    )
        .prop_filter_map("expert view must fit", |(tp, pp, cp, dp, ep, etp)| {
            let world = tp * pp * cp * dp;
            let cfg = ParallelConfig {
                tp,
                pp,
                cp,
                ep,
                etp,
                ..Default::default()
            };
            // The expert-tensor groups split a tp group's ranks (etp divides tp).
            let fits = world % (cfg.expert_tp() * ep * pp) == 0 && tp % cfg.expert_tp() == 0;
            fits.then_some((cfg, world))
        })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_group_family_partitions_the_world((cfg, world) in layouts()) {
        let topo = Topology::new(cfg.clone(), world).unwrap();
        let dp = topo.dp();
        let edp = topo.expert_dp();
        for kind in GroupKind::ALL {
            let groups = topo.groups(kind);
            let mut seen = BTreeSet::new();
            for g in groups {
                for &r in g {
                    prop_assert!(seen.insert(r), "{kind:?}: rank {r} in two groups");
                }
            }
            prop_assert_eq!(seen.len(), world, "{:?} does not cover the world", kind);
            let size = match kind {
                GroupKind::Tp => cfg.tp,
                GroupKind::Cp => cfg.cp,
                GroupKind::Dp => dp,
                GroupKind::Pp => cfg.pp,
                GroupKind::DpCp => dp * cfg.cp,
                GroupKind::TpCp => cfg.tp * cfg.cp,
                GroupKind::ModelParallel => cfg.tp * cfg.pp,
                GroupKind::ExpertTp => cfg.expert_tp(),
                GroupKind::Ep => cfg.ep,
                GroupKind::ExpertDp => edp,
                GroupKind::ExpertModelParallel => cfg.expert_tp() * cfg.ep * cfg.pp,
                GroupKind::RolloutTp => topo.rollout_tp(),
            };
            prop_assert!(groups.iter().all(|g| g.len() == size), "{:?} group size", kind);
        }
    }

    #[test]
    fn coordinates_map_back_to_the_rank((cfg, world) in layouts()) {
        let topo = Topology::new(cfg, world).unwrap();
        for rank in 0..world {
            let c = topo.coords(rank).unwrap();
            prop_assert_eq!(topo.rank_of(c.tp_rank, c.cp_rank, c.dp_rank, c.pp_rank).unwrap(), rank);
            // Members of a rank's tp group differ from it only in tp_rank, and so on.
            for &other in topo.group_of(rank, GroupKind::Tp).unwrap() {
                let o = topo.coords(other).unwrap();
                prop_assert_eq!((o.cp_rank, o.dp_rank, o.pp_rank), (c.cp_rank, c.dp_rank, c.pp_rank));
            }
            for &other in topo.group_of(rank, GroupKind::Dp).unwrap() {
                let o = topo.coords(other).unwrap();
                prop_assert_eq!((o.tp_rank, o.cp_rank, o.pp_rank), (c.tp_rank, c.cp_rank, c.pp_rank));
            }
            for &other in topo.group_of(rank, GroupKind::Ep).unwrap() {
                let o = topo.coords(other).unwrap();
                prop_assert_eq!((o.etp_rank, o.edp_rank, o.pp_rank), (c.etp_rank, c.edp_rank, c.pp_rank));
            }
            // The dense and expert views agree on the pipeline stage.
            let pp_group = topo.group_of(rank, GroupKind::Pp).unwrap();
            prop_assert_eq!(pp_group[c.pp_rank], rank);
        }
    }
}

#[test]
fn megatron_rank_order_by_hand() {
    // tp=2, cp=1, pp=2 on 8 ranks: dp=2. Megatron: tp groups [0,1],[2,3],...; pp groups [0,4],[1,5],...;
    // dp groups [0,2],[1,3],[4,6],[5,7].
    let topo = Topology::new(
        ParallelConfig {
            tp: 2,
            pp: 2,
            ..Default::default()
        },
        8,
    )
    .unwrap();
    assert_eq!(
        topo.groups(GroupKind::Tp),
        &[vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        topo.groups(GroupKind::Pp),
        &[vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(
        topo.groups(GroupKind::Dp),
        &[vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        topo.groups(GroupKind::ModelParallel),
        &[vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
    );

    // tp=2, cp=2 on 8 ranks: cp groups stride tp; dp×cp groups hold what gradients reduce over.
    let topo = Topology::new(
        ParallelConfig {
            tp: 2,
            cp: 2,
            ..Default::default()
        },
        8,
    )
    .unwrap();
    assert_eq!(
        topo.groups(GroupKind::Cp),
        &[vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        topo.groups(GroupKind::DpCp),
        &[vec![0, 2, 4, 6], vec![1, 3, 5, 7]]
    );

    // Experts: tp=2, ep=2, etp=1 on 4 ranks: ep groups are [0,1],[2,3] (etp fastest, then ep).
    let topo = Topology::new(
        ParallelConfig {
            tp: 2,
            ep: 2,
            etp: Some(1),
            ..Default::default()
        },
        4,
    )
    .unwrap();
    assert_eq!(topo.groups(GroupKind::Ep), &[vec![0, 1], vec![2, 3]]);
    assert_eq!(topo.groups(GroupKind::ExpertDp), &[vec![0, 2], vec![1, 3]]);
    assert_eq!(topo.coords(3).unwrap().ep_rank, 1);
}

#[test]
fn masked_groups_match_megatron_example() {
    // Megatron's docstring example: tp=2, dp=3, pp=2 (order tp-dp-pp); dp groups.
    let dp = masked_orthogonal_groups(&[2, 3, 2], &[false, true, false]);
    assert_eq!(
        dp,
        vec![vec![0, 2, 4], vec![1, 3, 5], vec![6, 8, 10], vec![7, 9, 11]]
    );
}

#[test]
fn impossible_layouts_are_refused_by_field() {
    let err = Topology::new(
        ParallelConfig {
            tp: 4,
            ..Default::default()
        },
        6,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`tp`") && err.contains("does not divide the world size 6"),
        "{err}"
    );
    assert!(
        err.contains("4, 8, 12"),
        "suggests world sizes that fit: {err}"
    );

    let err = Topology::new(
        ParallelConfig {
            ep: 3,
            ..Default::default()
        },
        4,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("`ep`"), "{err}");

    let err = ParallelConfig {
        vpp: Some(2),
        ..Default::default()
    }
    .validate(4)
    .unwrap_err()
    .to_string();
    assert!(err.contains("`vpp`") && err.contains("pp > 1"), "{err}");

    let err = ParallelConfig {
        tp: 0,
        ..Default::default()
    }
    .validate(4)
    .unwrap_err()
    .to_string();
    assert!(err.contains("`tp`"), "{err}");
    assert!(Topology::new(ParallelConfig::default(), 0).is_err());
    assert!(Topology::new(ParallelConfig::default(), 2)
        .unwrap()
        .coords(2)
        .is_err());
}

#[test]
fn model_dimensions_must_divide() {
    let dims = ModelDims {
        num_layers: 4,
        num_attention_heads: 6,
        num_key_value_heads: 2,
        intermediate_size: 64,
        vocab_size: 100,
        num_experts: None,
        moe_intermediate_size: None,
        expert_keys: verl_core::topology::QWEN_MOE_KEYS,
    };
    assert!(ParallelConfig {
        tp: 2,
        pp: 2,
        ..Default::default()
    }
    .validate_for_model(&dims)
    .is_ok());
    let err = ParallelConfig {
        tp: 4,
        ..Default::default()
    }
    .validate_for_model(&dims)
    .unwrap_err()
    .to_string();
    assert!(err.contains("num_attention_heads (6)"), "{err}");
    let err = ParallelConfig {
        pp: 8,
        ..Default::default()
    }
    .validate_for_model(&dims)
    .unwrap_err()
    .to_string();
    assert!(err.contains("only 4 layers"), "{err}");
    let err = ParallelConfig {
        pp: 2,
        vpp: Some(3),
        ..Default::default()
    }
    .validate_for_model(&dims)
    .unwrap_err()
    .to_string();
    assert!(err.contains("stages"), "{err}");
    let err = ParallelConfig {
        ep: 2,
        ..Default::default()
    }
    .validate_for_model(&dims)
    .unwrap_err()
    .to_string();
    assert!(err.contains("no experts"), "{err}");
    let moe = ModelDims {
        num_experts: Some(6),
        moe_intermediate_size: Some(32),
        ..dims
    };
    let err = ParallelConfig {
        ep: 4,
        ..Default::default()
    }
    .validate_for_model(&moe)
    .unwrap_err()
    .to_string();
    assert!(err.contains("num_experts (6)"), "{err}");
    // A Mixtral's config calls them num_local_experts and intermediate_size.
    let mixtral = ModelDims {
        expert_keys: ("num_local_experts", "intermediate_size"),
        ..moe
    };
    let err = ParallelConfig {
        ep: 4,
        ..Default::default()
    }
    .validate_for_model(&mixtral)
    .unwrap_err()
    .to_string();
    assert!(err.contains("num_local_experts (6)"), "{err}");
}

#[test]
fn sequence_parallel_is_inert_at_tp_one() {
    assert!(!ParallelConfig {
        sequence_parallel: true,
        ..Default::default()
    }
    .sequence_parallel_active());
    assert!(ParallelConfig {
        tp: 2,
        sequence_parallel: true,
        ..Default::default()
    }
    .sequence_parallel_active());
}

/// An expert-tensor group wider than tp (or not dividing it) is refused, naming etp.
#[test]
fn an_expert_tensor_size_that_does_not_divide_tp_is_refused() {
    for (tp, etp) in [(1, 2), (3, 2), (2, 4)] {
        let cfg = ParallelConfig {
            tp,
            etp: Some(etp),
            ..Default::default()
        };
        let e = Topology::new(cfg, 12).unwrap_err().to_string();
        assert!(e.contains("etp") && e.contains("must divide tp"), "{e}");
    }
}

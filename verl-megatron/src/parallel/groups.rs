//! One communicator per process group of a topology, for each rank.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::prelude::*;
use verl_core::topology::{GroupKind, Topology};
use verl_core::traits::Communicator;

use verl_core::error::CommError;

use super::{CpGroup, LocalCommunicator, Rendezvous, TcpCommunicator, TpGroup};

/// A rank's communicators: the whole world and each group family of the topology
/// (tensor, data, pipeline, context, expert, ...).
#[derive(Clone)]
pub struct ProcessGroups<B: Backend> {
    pub world: Arc<dyn Communicator<B>>,
    groups: BTreeMap<GroupKind, Arc<dyn Communicator<B>>>,
}

impl<B: Backend> ProcessGroups<B> {
    /// A rank's groups from their communicators (the world's and one per group kind).
    pub fn from_parts(
        world: Arc<dyn Communicator<B>>,
        groups: BTreeMap<GroupKind, Arc<dyn Communicator<B>>>,
    ) -> Self {
        Self { world, groups }
    }

    /// The communicator of this rank's group of `kind`.
    pub fn get(&self, kind: GroupKind) -> &Arc<dyn Communicator<B>> {
        &self.groups[&kind]
    }

    pub fn tp(&self) -> &Arc<dyn Communicator<B>> {
        self.get(GroupKind::Tp)
    }

    pub fn dp(&self) -> &Arc<dyn Communicator<B>> {
        self.get(GroupKind::Dp)
    }

    pub fn pp(&self) -> &Arc<dyn Communicator<B>> {
        self.get(GroupKind::Pp)
    }

    /// Where dense gradients are reduced (data × context parallel).
    pub fn dp_cp(&self) -> &Arc<dyn Communicator<B>> {
        self.get(GroupKind::DpCp)
    }

    /// A function that aborts every communicator of this rank (see
    /// [`Communicator::abort`]): what a worker registers to run when one of its methods fails.
    pub fn aborter(&self) -> impl Fn(&str) + Send + Sync + 'static {
        let all: Vec<Arc<dyn Communicator<B>>> = std::iter::once(self.world.clone())
            .chain(self.groups.values().cloned())
            .collect();
        move |reason: &str| {
            for c in &all {
                c.abort(reason);
            }
        }
    }

    /// In-process groups for every rank of `topo` (index = global rank), each rank's handles to
    /// be moved to its thread: how CPU runs simulate a multi-GPU layout.
    pub fn local(topo: &Topology) -> Vec<ProcessGroups<B>> {
        let world = topo.world_size();
        let mut world_handles: Vec<Option<Arc<dyn Communicator<B>>>> =
            LocalCommunicator::group(world)
                .into_iter()
                .map(|c| Some(Arc::new(c) as Arc<dyn Communicator<B>>))
                .collect();
        let mut per_rank: Vec<BTreeMap<GroupKind, Arc<dyn Communicator<B>>>> =
            vec![BTreeMap::new(); world];
        for kind in GroupKind::ALL {
            for members in topo.groups(kind) {
                for (&global, handle) in members.iter().zip(LocalCommunicator::group(members.len()))
                {
                    per_rank[global].insert(kind, Arc::new(handle));
                }
            }
        }
        per_rank
            .into_iter()
            .enumerate()
            .map(|(r, groups)| ProcessGroups {
                world: world_handles[r].take().expect("one per rank"),
                groups,
            })
            .collect()
    }

    /// This rank's groups of `topo` when the ranks are processes: one [`TcpCommunicator`] per
    /// group, met through `rendezvous` under names that start with `prefix` (a role's name, so
    /// two roles' layouts never mix). `host` is an address the peers reach this process on.
    /// Every rank of the job calls it with the same `topo` and `prefix`.
    pub fn tcp(
        topo: &Topology,
        rank: usize,
        rendezvous: &Rendezvous,
        host: &str,
        prefix: &str,
    ) -> Result<ProcessGroups<B>, CommError> {
        let world = topo.world_size();
        let world_comm =
            TcpCommunicator::connect(rendezvous, &format!("{prefix}.world"), rank, world, host)?;
        let mut groups: BTreeMap<GroupKind, Arc<dyn Communicator<B>>> = BTreeMap::new();
        for kind in GroupKind::ALL {
            let (index, position, size) = membership(topo, kind, rank)?;
            let key = format!("{prefix}.{kind:?}{index}");
            let members = topo.groups(kind).get(index).cloned().unwrap_or_default();
            let comm = TcpCommunicator::connect(rendezvous, &key, position, size, host)?
                .with_members(members);
            groups.insert(kind, Arc::new(comm));
        }
        Ok(ProcessGroups {
            world: Arc::new(world_comm),
            groups,
        })
    }
}

/// Which group of family `kind` holds `rank` (its index among the family's groups), the
/// rank's position in it, and its size.
pub fn membership(
    topo: &Topology,
    kind: GroupKind,
    rank: usize,
) -> Result<(usize, usize, usize), CommError> {
    topo.groups(kind)
        .iter()
        .enumerate()
        .find_map(|(index, m)| {
            m.iter()
                .position(|&r| r == rank)
                .map(|position| (index, position, m.len()))
        })
        .ok_or(CommError::BadRank {
            rank,
            world: topo.world_size(),
        })
}

/// The groups a model's layers hold: tensor (with sequence parallel), context and expert
/// parallel. What builds a [`crate::models::CausalLm`] on one rank of a layout; a bare
/// [`TpGroup`] converts into it (no cp, no ep).
#[derive(Clone, Debug, Default)]
pub struct ModelGroups {
    pub tp: TpGroup,
    pub cp: CpGroup,
    /// Expert parallel: the ranks among which the routed experts are distributed and tokens
    /// exchanged (all-to-all).
    pub ep: TpGroup,
    /// Expert tensor parallel: the ranks splitting each expert's features; `None` = the tp
    /// group (Megatron's default, `expert_tensor_parallel_size` unset).
    pub etp: Option<TpGroup>,
}

impl ModelGroups {
    /// This rank's model groups out of its process groups.
    pub fn of<B: Backend>(groups: &ProcessGroups<B>, sequence_parallel: bool) -> Self {
        Self {
            tp: TpGroup::new(groups.tp().clone(), sequence_parallel),
            cp: CpGroup::new(groups.get(GroupKind::Cp).clone()),
            ep: TpGroup::new(groups.get(GroupKind::Ep).clone(), false),
            etp: Some(TpGroup::new(groups.get(GroupKind::ExpertTp).clone(), false)),
        }
    }

    /// The expert tensor parallel group in force.
    pub fn expert_tp(&self) -> &TpGroup {
        self.etp.as_ref().unwrap_or(&self.tp)
    }
}

impl From<&TpGroup> for ModelGroups {
    fn from(tp: &TpGroup) -> Self {
        Self {
            tp: tp.clone(),
            ..Default::default()
        }
    }
}

impl From<&ModelGroups> for ModelGroups {
    fn from(groups: &ModelGroups) -> Self {
        groups.clone()
    }
}

//! One communicator per process group of a topology, for each rank.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::prelude::*;
use verl_core::topology::{GroupKind, Topology};
use verl_core::traits::Communicator;

use verl_core::error::CommError;

use super::{LocalCommunicator, Rendezvous, TcpCommunicator};

/// A rank's communicators: the whole world and each group family of the topology
/// (tensor, data, pipeline, context, expert, ...).
#[derive(Clone)]
pub struct ProcessGroups<B: Backend> {
    pub world: Arc<dyn Communicator<B>>,
    groups: BTreeMap<GroupKind, Arc<dyn Communicator<B>>>,
}

impl<B: Backend> ProcessGroups<B> {
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
            let (index, members) = topo
                .groups(kind)
                .iter()
                .enumerate()
                .find(|(_, m)| m.contains(&rank))
                .ok_or(CommError::BadRank { rank, world })?;
            let position = members
                .iter()
                .position(|&r| r == rank)
                .expect("rank is a member");
            let key = format!("{prefix}.{kind:?}{index}");
            let comm = TcpCommunicator::connect(rendezvous, &key, position, members.len(), host)?;
            groups.insert(kind, Arc::new(comm));
        }
        Ok(ProcessGroups {
            world: Arc::new(world_comm),
            groups,
        })
    }
}

//! How the single controller splits a batch over rank workers and collects their results.
//!
//! Every data-parallel mode is an instance of one general rule, as in verl's newer
//! `make_nd_compute_dataproto_dispatch_fn`: for a named mesh, each rank publishes a
//! [`DispatchInfo`] — its data-parallel index in that mesh, the mesh's dp size, and whether it is
//! a *collect* rank. The controller splits the batch into `dp_size` chunks, sends each rank the
//! chunk of its dp index, and concatenates the collect ranks' outputs in dp order. The Megatron
//! modes only differ in how a rank's [`RankCoords`] map to a `DispatchInfo`:
//!
//! | mode | dp index of a rank | dp size | collect ranks |
//! |---|---|---|---|
//! | `DpComputeProto` | rank | world | all |
//! | `MegatronCompute` | dp_rank | dp | tp = 0, cp = 0, last pp stage |
//! | `MegatronPpAsDp` | (cp_rank·dp + dp_rank)·pp + pp_rank | dp·cp·pp | tp = 0 |
//! | `Nd { mesh }` | whatever the workers publish for `mesh` | | |
//!
//! A new layout (context or expert parallel, a rollout mesh with its own tp) therefore needs a new
//! mapping, not new dispatch code.
//!
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::Tensor;
//! use verl_core::dispatch::{DispatchInfo, DispatchPlan};
//! use verl_core::topology::{ParallelConfig, Topology};
//! use verl_core::DataProto;
//!
//! // tp=2, pp=2 on 8 ranks: dp = 2.
//! let topo = Topology::new(ParallelConfig { tp: 2, pp: 2, ..Default::default() }, 8)?;
//! let infos: Vec<_> = (0..8).map(|r| DispatchInfo::megatron_compute(&topo.coords(r).unwrap())).collect();
//! let plan = DispatchPlan::new("megatron_compute", infos)?;
//! let mut data = DataProto::<Flex>::new();
//! data.insert_float("x", Tensor::<Flex, 1>::from_floats([0., 1., 2., 3.], &Default::default()))?;
//! let (per_rank, pad) = plan.split(&data, false)?;
//! assert_eq!(per_rank.len(), 8);
//! // Ranks 0-1 (dp 0, pp 0) and 4-5 (dp 0, pp 1) get rows 0..2.
//! assert_eq!(per_rank[5].to_data("x")?.to_vec::<f32>().unwrap(), vec![0., 1.]);
//! // Collect from the last stage's tp=0 ranks: 4 (dp 0) and 6 (dp 1).
//! let outputs = per_rank.into_iter().map(Some).collect();
//! assert_eq!(plan.collect(outputs, pad)?.len(), 4);
//! # Ok::<(), verl_core::Error>(())
//! ```

use burn::prelude::Backend;
use serde::{Deserialize, Serialize};

use crate::error::{DispatchError, Result};
use crate::topology::RankCoords;
use crate::DataProto;

/// Mesh name under which a Megatron worker publishes its `MegatronCompute` info.
pub const MESH_MEGATRON_COMPUTE: &str = "megatron_compute";
/// Mesh name of the rollout engine's layout (verl's `"rollout"` mesh): groups of
/// `rollout.tensor_model_parallel_size` consecutive ranks, each generating one chunk, collected
/// from each group's first rank.
pub const MESH_ROLLOUT: &str = "rollout";

/// Mesh name under which a Megatron worker publishes its `MegatronPpAsDp` info.
pub const MESH_MEGATRON_PP_AS_DP: &str = "megatron_pp_as_dp";

/// How a method's input reaches the ranks and how their outputs come back.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DispatchMode {
    /// The same input to every rank; every rank's output, in rank order.
    OneToAll,
    /// One input per rank (given as a list), one output per rank.
    AllToAll,
    /// The same input to every rank; only rank 0's output is returned.
    RankZero,
    /// Like `AllToAll`: one input per rank, outputs listed in rank order.
    DpCompute,
    /// A `DataProto` split into world-size chunks, one per rank; outputs concatenated.
    DpComputeProto,
    /// Split by dp; every tp/cp/pp rank of a dp group gets the same chunk; collect from tp=0,
    /// cp=0 on the last pipeline stage.
    MegatronCompute,
    /// For rollout: pp (and cp) count as data parallel; split by dp·cp·pp, collect from tp=0.
    MegatronPpAsDp,
    /// The general rule on a mesh whose dispatch info the workers publish.
    Nd { mesh: String },
}

impl DispatchMode {
    /// The mesh whose published [`DispatchInfo`] drives this mode, for the data-parallel modes.
    pub fn mesh(&self) -> Option<&str> {
        match self {
            DispatchMode::MegatronCompute => Some(MESH_MEGATRON_COMPUTE),
            DispatchMode::MegatronPpAsDp => Some(MESH_MEGATRON_PP_AS_DP),
            DispatchMode::Nd { mesh } => Some(mesh),
            _ => None,
        }
    }

    /// The name verl uses for the mode (for messages).
    pub fn name(&self) -> String {
        match self {
            DispatchMode::Nd { mesh } => format!("ND_COMPUTE({mesh})"),
            other => serde_json::to_value(other)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        }
    }
}

/// What a rank publishes about itself for one mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchInfo {
    /// Which of the `dp_size` chunks this rank receives.
    pub dp_rank: usize,
    /// Number of chunks the batch is split into for this mesh.
    pub dp_size: usize,
    /// Whether this rank's output is part of the collected result.
    pub is_collect: bool,
}

impl DispatchInfo {
    /// Every rank its own chunk, every output collected (`DpComputeProto`).
    pub fn per_rank(rank: usize, world_size: usize) -> Self {
        Self {
            dp_rank: rank,
            dp_size: world_size,
            is_collect: true,
        }
    }

    /// The rollout mesh ([`MESH_ROLLOUT`]): chunk `rank / rollout_tp`, collected from the
    /// first rank of each rollout tensor-parallel group.
    pub fn rollout(c: &RankCoords) -> Self {
        let tp = c.rollout_tp_size.max(1);
        let world = c.tp_size * c.cp_size * c.dp_size * c.pp_size;
        Self {
            dp_rank: c.rank / tp,
            dp_size: world / tp,
            is_collect: c.rank.is_multiple_of(tp),
        }
    }

    /// verl's `MEGATRON_COMPUTE`.
    pub fn megatron_compute(c: &RankCoords) -> Self {
        Self {
            dp_rank: c.dp_rank,
            dp_size: c.dp_size,
            is_collect: c.tp_rank == 0 && c.cp_rank == 0 && c.is_last_pp_stage(),
        }
    }

    /// verl's `MEGATRON_PP_AS_DP`: dp index = (cp_rank·dp + dp_rank)·pp + pp_rank.
    pub fn megatron_pp_as_dp(c: &RankCoords) -> Self {
        let dp_cp = c.cp_rank * c.dp_size + c.dp_rank;
        Self {
            dp_rank: dp_cp * c.pp_size + c.pp_rank,
            dp_size: c.dp_size * c.cp_size * c.pp_size,
            is_collect: c.tp_rank == 0,
        }
    }
}

/// Rows added by auto-padding in [`DispatchPlan::split`], to be removed by [`DispatchPlan::collect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Padding {
    /// Rows added.
    pub pad: usize,
    /// Length of the batch after padding.
    pub padded_len: usize,
}

/// A checked split/collect plan over the ranks of a worker group.
#[derive(Debug, Clone)]
pub struct DispatchPlan {
    mode: String,
    infos: Vec<DispatchInfo>,
    dp_size: usize,
    /// `collectors[d]` = the rank whose output is chunk `d` of the result.
    collectors: Vec<usize>,
}

impl DispatchPlan {
    /// Checks that the published infos agree on the dp size and that each dp index has exactly
    /// one collect rank (so the collected result is complete and has no duplicates).
    pub fn new(mode: &str, infos: Vec<DispatchInfo>) -> Result<Self> {
        let err = |message: String| DispatchError::Plan {
            mode: mode.to_string(),
            message,
        };
        let first = infos.first().ok_or_else(|| err("no ranks".into()))?;
        let dp_size = first.dp_size;
        if dp_size == 0 {
            return Err(err("dp_size is 0".into()).into());
        }
        let mut collectors = vec![None; dp_size];
        for (rank, info) in infos.iter().enumerate() {
            if info.dp_size != dp_size {
                return Err(err(format!(
                    "rank {rank} says dp_size {} but rank 0 says {dp_size}",
                    info.dp_size
                ))
                .into());
            }
            if info.dp_rank >= dp_size {
                return Err(err(format!(
                    "rank {rank} has dp index {} ≥ dp_size {dp_size}",
                    info.dp_rank
                ))
                .into());
            }
            if info.is_collect {
                if let Some(other) = collectors[info.dp_rank].replace(rank) {
                    return Err(err(format!(
                        "ranks {other} and {rank} both collect dp index {}",
                        info.dp_rank
                    ))
                    .into());
                }
            }
        }
        let collectors = collectors
            .into_iter()
            .enumerate()
            .map(|(d, c)| c.ok_or_else(|| err(format!("no rank collects dp index {d}"))))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            mode: mode.to_string(),
            infos,
            dp_size,
            collectors,
        })
    }

    /// Number of chunks.
    pub fn dp_size(&self) -> usize {
        self.dp_size
    }

    /// Ranks whose outputs are collected, in dp order.
    pub fn collect_ranks(&self) -> &[usize] {
        &self.collectors
    }

    /// One input per rank. With `auto_pad`, a batch whose length does not divide dp_size is
    /// padded first (rows repeated from the start) and the pad count is returned for
    /// [`Self::collect`]; without it such a batch is refused.
    pub fn split<B: Backend>(
        &self,
        data: &DataProto<B>,
        auto_pad: bool,
    ) -> Result<(Vec<DataProto<B>>, Padding)> {
        let (data, pad) = if !data.len().is_multiple_of(self.dp_size) {
            if !auto_pad {
                return Err(DispatchError::Plan {
                    mode: self.mode.clone(),
                    message: format!(
                        "a batch of {} rows cannot be split over {} data-parallel chunks; use a batch size divisible by {} or enable auto-padding",
                        data.len(),
                        self.dp_size,
                        self.dp_size
                    ),
                }
                .into());
            }
            data.pad_to_divisor(self.dp_size)?
        } else {
            (data.clone(), 0)
        };
        let padding = Padding {
            pad,
            padded_len: data.len(),
        };
        let chunks = data.chunk(self.dp_size)?;
        Ok((
            self.infos
                .iter()
                .map(|i| chunks[i.dp_rank].clone())
                .collect(),
            padding,
        ))
    }

    /// Concatenates the collect ranks' outputs in dp order and removes `pad` rows of padding
    /// (scaled if the method changed the row count by a whole factor, e.g. n samples per prompt).
    /// Outputs of non-collect ranks are ignored and may be `None`.
    pub fn collect<B: Backend>(
        &self,
        mut outputs: Vec<Option<DataProto<B>>>,
        padding: Padding,
    ) -> Result<DataProto<B>> {
        let parts = self
            .collectors
            .iter()
            .map(|&r| {
                outputs
                    .get_mut(r)
                    .and_then(Option::take)
                    .ok_or_else(|| DispatchError::Plan {
                        mode: self.mode.clone(),
                        message: format!("collect rank {r} returned no output"),
                    })
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let out = DataProto::concat(parts)?;
        if padding.pad == 0 {
            return Ok(out);
        }
        // The padded rows sit at the end of the last chunk; a method that turns each row into
        // `k` rows (kept adjacent) leaves their `k·pad` outputs at the end too.
        if padding.padded_len == 0 || out.len() % padding.padded_len != 0 {
            return Err(DispatchError::Plan {
                mode: self.mode.clone(),
                message: format!(
                    "cannot remove auto-padding: the method returned {} rows for {} padded input rows (not a whole multiple)",
                    out.len(),
                    padding.padded_len
                ),
            }
            .into());
        }
        let factor = out.len() / padding.padded_len;
        Ok(out.unpad(padding.pad * factor)?)
    }
}

/// The dispatch info of a Megatron-parallel rank for the two Megatron meshes; `None` for others.
pub fn megatron_dispatch_info(coords: &RankCoords, mesh: &str) -> Option<DispatchInfo> {
    match mesh {
        MESH_MEGATRON_COMPUTE => Some(DispatchInfo::megatron_compute(coords)),
        MESH_MEGATRON_PP_AS_DP => Some(DispatchInfo::megatron_pp_as_dp(coords)),
        MESH_ROLLOUT => Some(DispatchInfo::rollout(coords)),
        _ => None,
    }
}

//! Megatron's parallel topology: which tp/cp/dp/pp (and expert) coordinates each rank has, and
//! which process groups it belongs to.
//!
//! # Rank order
//!
//! As in Megatron-core with its default order `tp-cp-ep-dp-pp`, tensor parallel varies fastest,
//! then context parallel, then data parallel, then pipeline parallel:
//!
//! ```text
//! rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))      dp = world / (tp·cp·pp)
//! ```
//!
//! Expert layers (MoE) use a second decomposition of the same ranks, again as Megatron does:
//! expert tensor parallel fastest, then expert parallel, then expert data parallel, then pp:
//!
//! ```text
//! rank = etp_rank + etp * (ep_rank + ep * (edp_rank + edp * pp_rank))  edp = world / (etp·ep·pp)
//! ```
//!
//! Both share the pipeline dimension, so a rank has the same pp stage in both views. Within a
//! group, members are listed with the fastest dimension first; groups are listed in the order of
//! the remaining dimensions, fastest first.
//!
//! ```
//! use verl_core::topology::{GroupKind, ParallelConfig, Topology};
//!
//! let topo = Topology::new(ParallelConfig { tp: 2, pp: 2, ..Default::default() }, 8)?;
//! assert_eq!(topo.dp(), 2);
//! let c = topo.coords(5)?;
//! assert_eq!((c.tp_rank, c.dp_rank, c.pp_rank), (1, 0, 1));
//! assert_eq!(topo.group_of(5, GroupKind::Tp)?, &[4, 5]);
//! assert_eq!(topo.group_of(5, GroupKind::Pp)?, &[1, 5]);
//! # Ok::<(), verl_core::error::TopologyError>(())
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::TopologyError;

type Result<T> = std::result::Result<T, TopologyError>;

/// The parallel layout of a Megatron-style model: sizes per dimension; dp is derived from the
/// world size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Tensor parallel size (`tensor_model_parallel_size`).
    pub tp: usize,
    /// Pipeline parallel size (`pipeline_model_parallel_size`).
    pub pp: usize,
    /// Virtual pipeline stages per pp rank (`virtual_pipeline_model_parallel_size`); `None` = off.
    pub vpp: Option<usize>,
    /// Context parallel size (`context_parallel_size`).
    pub cp: usize,
    /// Expert parallel size (`expert_model_parallel_size`).
    pub ep: usize,
    /// Expert tensor parallel size (`expert_tensor_parallel_size`); `None` = same as `tp`.
    pub etp: Option<usize>,
    /// Sequence parallel. Has an effect only when tp > 1 (Megatron turns it off at tp = 1).
    pub sequence_parallel: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            tp: 1,
            pp: 1,
            vpp: None,
            cp: 1,
            ep: 1,
            etp: None,
            sequence_parallel: false,
        }
    }
}

impl ParallelConfig {
    /// Expert tensor parallel size in force (`etp`, or `tp` when unset).
    pub fn expert_tp(&self) -> usize {
        self.etp.unwrap_or(self.tp)
    }

    /// Whether sequence parallelism is actually on (requested and tp > 1).
    pub fn sequence_parallel_active(&self) -> bool {
        self.sequence_parallel && self.tp > 1
    }

    /// Ranks one model replica spans, dense view: tp·cp·pp.
    pub fn model_ranks(&self) -> usize {
        self.tp.saturating_mul(self.cp).saturating_mul(self.pp)
    }

    /// Checks the layout against a world size and returns the derived data-parallel size.
    pub fn validate(&self, world_size: usize) -> Result<usize> {
        if world_size == 0 {
            return Err(invalid("world_size", "must be at least 1".into()));
        }
        for (field, v) in [
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
        ] {
            if v == 0 {
                return Err(invalid(
                    field,
                    "must be at least 1 (1 means no parallelism in this dimension)".into(),
                ));
            }
        }
        if self.etp == Some(0) {
            return Err(invalid(
                "etp",
                "must be at least 1, or unset to follow tp".into(),
            ));
        }
        match self.vpp {
            Some(0) => {
                return Err(invalid(
                    "vpp",
                    "must be at least 1, or unset to turn virtual pipelining off".into(),
                ))
            }
            Some(v) if v > 1 && self.pp == 1 => {
                return Err(invalid(
                    "vpp",
                    format!("= {v} needs pipeline parallelism; set pp > 1 or unset vpp"),
                ))
            }
            _ => {}
        }
        if !self.tp.is_multiple_of(self.expert_tp()) {
            return Err(invalid(
                "etp",
                format!(
                    "= {} must divide tp = {}: the ranks of a tensor-parallel group hold the same \
                     tokens and each block of etp of them routes a share of those tokens to the \
                     experts (an expert-tensor group wider than tp is not supported)",
                    self.expert_tp(),
                    self.tp
                ),
            ));
        }
        let dense = self.model_ranks();
        if !world_size.is_multiple_of(dense) {
            return Err(invalid(
                "tp",
                format!(
                    "× cp × pp = {}×{}×{} = {dense} does not divide the world size {world_size}. {}",
                    self.tp,
                    self.cp,
                    self.pp,
                    fits(world_size, dense)
                ),
            ));
        }
        let expert = self
            .expert_tp()
            .saturating_mul(self.ep)
            .saturating_mul(self.pp);
        if !world_size.is_multiple_of(expert) {
            return Err(invalid(
                "ep",
                format!(
                    "× etp × pp = {}×{}×{} = {expert} does not divide the world size {world_size}. {}",
                    self.ep,
                    self.expert_tp(),
                    self.pp,
                    fits(world_size, expert)
                ),
            ));
        }
        Ok(world_size / dense)
    }

    /// Checks the layout against a model's dimensions: everything tensor, pipeline and expert
    /// parallelism split must divide evenly. Run it before allocating any weights.
    pub fn validate_for_model(&self, model: &ModelDims) -> Result<()> {
        let tp = self.tp;
        let check = |field: &'static str,
                     what: &str,
                     n: usize,
                     by: usize,
                     by_name: &str|
         -> Result<()> {
            if !n.is_multiple_of(by) {
                return Err(invalid(
                    field,
                    format!("= {by}: {what} ({n}) is not divisible by {by_name}; {by_name} values that fit: {}", list(divisors(n).into_iter().filter(|d| *d <= 64))),
                ));
            }
            Ok(())
        };
        check(
            "tp",
            "num_attention_heads",
            model.num_attention_heads,
            tp,
            "tp",
        )?;
        check(
            "tp",
            "num_key_value_heads",
            model.num_key_value_heads,
            tp,
            "tp",
        )?;
        check("tp", "intermediate_size", model.intermediate_size, tp, "tp")?;
        // The vocabulary need not divide: it is padded to a multiple of tp (as Megatron pads
        // it), the padding masked out of the logits.
        let stages = self.pp.saturating_mul(self.vpp.unwrap_or(1));
        if model.num_layers < stages {
            return Err(invalid(
                "pp",
                format!(
                    "× vpp = {stages} stages, but the model has only {} layers",
                    model.num_layers
                ),
            ));
        }
        if self.vpp.unwrap_or(1) > 1 && !model.num_layers.is_multiple_of(stages) {
            return Err(invalid(
                "vpp",
                format!("num_layers ({}) must be divisible by pp × vpp = {stages} for the interleaved schedule", model.num_layers),
            ));
        }
        if let Some(experts) = model.num_experts {
            let (experts_key, width_key) = model.expert_keys;
            check("ep", experts_key, experts, self.ep, "ep")?;
            if let Some(moe_ffn) = model.moe_intermediate_size {
                check("etp", width_key, moe_ffn, self.expert_tp(), "etp")?;
            }
        } else if self.ep > 1 {
            return Err(invalid(
                "ep",
                format!(
                    "= {} but the model has no experts; use ep = 1 for a dense model",
                    self.ep
                ),
            ));
        }
        Ok(())
    }
}

/// The model sizes that a parallel layout must divide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDims {
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_experts: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    /// The config keys errors name for the two expert sizes: [`QWEN_MOE_KEYS`], or Mixtral's
    /// `num_local_experts` and `intermediate_size`.
    pub expert_keys: (&'static str, &'static str),
}

/// The expert sizes' keys in Qwen-MoE configs (and Megatron's names).
pub const QWEN_MOE_KEYS: (&str, &str) = ("num_experts", "moe_intermediate_size");

fn invalid(field: &'static str, message: String) -> TopologyError {
    TopologyError::Invalid { field, message }
}

/// The divisors of `n`, ascending (pairs up to √n, so a huge `n` in an error message costs
/// microseconds rather than a count to `n`).
fn divisors(n: usize) -> Vec<usize> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1usize;
    while d.checked_mul(d).is_some_and(|sq| sq <= n) {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

fn list(v: impl IntoIterator<Item = usize>) -> String {
    v.into_iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn fits(world: usize, product: usize) -> String {
    let worlds = (1..=4).filter_map(|k| product.checked_mul(k));
    format!(
        "World sizes that fit this layout: {}; or make the product one of {}",
        list(worlds),
        list(divisors(world))
    )
}

/// A rank's coordinates in both decompositions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankCoords {
    pub rank: usize,
    pub tp_rank: usize,
    pub cp_rank: usize,
    pub dp_rank: usize,
    pub pp_rank: usize,
    /// Expert tensor parallel rank.
    pub etp_rank: usize,
    pub ep_rank: usize,
    /// Expert data parallel rank.
    pub edp_rank: usize,
    pub tp_size: usize,
    pub cp_size: usize,
    pub dp_size: usize,
    pub pp_size: usize,
    pub etp_size: usize,
    pub ep_size: usize,
    pub edp_size: usize,
    /// The rollout engine's tensor parallel size ([`Topology::with_rollout_tp`]).
    pub rollout_tp_size: usize,
}

impl RankCoords {
    /// True on the last pipeline stage (where losses and log-probs are produced).
    pub fn is_last_pp_stage(&self) -> bool {
        self.pp_rank + 1 == self.pp_size
    }
    /// True on the first pipeline stage (which owns the embedding).
    pub fn is_first_pp_stage(&self) -> bool {
        self.pp_rank == 0
    }
}

/// The process-group families of the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Tensor parallel.
    Tp,
    /// Context parallel.
    Cp,
    /// Data parallel (without cp).
    Dp,
    /// Pipeline parallel.
    Pp,
    /// Data × context parallel: where gradients are reduced.
    DpCp,
    /// Tensor × context parallel.
    TpCp,
    /// Model parallel: tensor × pipeline.
    ModelParallel,
    /// Expert tensor parallel.
    ExpertTp,
    /// Expert parallel.
    Ep,
    /// Expert data parallel: where expert gradients are reduced.
    ExpertDp,
    /// Expert tensor × expert × pipeline parallel.
    ExpertModelParallel,
    /// The rollout engine's own tensor parallel (`rollout.tensor_model_parallel_size`):
    /// consecutive ranks, as verl's rollout mesh groups them; single ranks unless
    /// [`Topology::with_rollout_tp`] says otherwise.
    RolloutTp,
}

impl GroupKind {
    /// Every family, in a fixed order.
    pub const ALL: [GroupKind; 12] = [
        GroupKind::Tp,
        GroupKind::Cp,
        GroupKind::Dp,
        GroupKind::Pp,
        GroupKind::DpCp,
        GroupKind::TpCp,
        GroupKind::ModelParallel,
        GroupKind::ExpertTp,
        GroupKind::Ep,
        GroupKind::ExpertDp,
        GroupKind::ExpertModelParallel,
        GroupKind::RolloutTp,
    ];
}

/// The layout applied to a world: coordinates of every rank and every process group.
#[derive(Debug, Clone)]
pub struct Topology {
    config: ParallelConfig,
    world_size: usize,
    dp: usize,
    edp: usize,
    rollout_tp: usize,
    groups: BTreeMap<GroupKind, Vec<Vec<usize>>>,
    /// `membership[kind][rank]` = index of the rank's group in `groups[kind]`.
    membership: BTreeMap<GroupKind, Vec<usize>>,
}

/// Megatron's orthogonal group generation: `sizes` lists the dimensions fastest first; the
/// groups vary the masked dimensions and fix the others.
pub fn masked_orthogonal_groups(sizes: &[usize], mask: &[bool]) -> Vec<Vec<usize>> {
    let mut stride = Vec::with_capacity(sizes.len());
    let mut acc = 1;
    for &s in sizes {
        stride.push(acc);
        acc *= s;
    }
    let pick = |want: bool| -> (Vec<usize>, Vec<usize>) {
        sizes
            .iter()
            .zip(&stride)
            .zip(mask)
            .filter(|(_, &m)| m == want)
            .map(|((&s, &st), _)| (s, st))
            .unzip()
    };
    let (in_sizes, in_stride) = pick(true);
    let (out_sizes, out_stride) = pick(false);
    let decompose = |mut index: usize, shape: &[usize]| -> Vec<usize> {
        shape
            .iter()
            .map(|&s| {
                let c = index % s;
                index /= s;
                c
            })
            .collect()
    };
    let dot = |a: &[usize], b: &[usize]| a.iter().zip(b).map(|(x, y)| x * y).sum::<usize>();
    let group_size: usize = in_sizes.iter().product();
    let num_groups: usize = out_sizes.iter().product();
    (0..num_groups)
        .map(|g| {
            let base = dot(&decompose(g, &out_sizes), &out_stride);
            (0..group_size)
                .map(|r| base + dot(&decompose(r, &in_sizes), &in_stride))
                .collect()
        })
        .collect()
}

impl Topology {
    /// Applies `config` to `world_size` ranks; refuses impossible layouts before anything else.
    pub fn new(config: ParallelConfig, world_size: usize) -> Result<Self> {
        let dp = config.validate(world_size)?;
        let etp = config.expert_tp();
        let edp = world_size / (etp * config.ep * config.pp);
        // Dense view: [tp, cp, dp, pp]; expert view: [etp, ep, edp, pp] (fastest first).
        let dense = [config.tp, config.cp, dp, config.pp];
        let expert = [etp, config.ep, edp, config.pp];
        let mut groups = BTreeMap::new();
        for kind in GroupKind::ALL {
            let g = match kind {
                GroupKind::Tp => masked_orthogonal_groups(&dense, &[true, false, false, false]),
                GroupKind::Cp => masked_orthogonal_groups(&dense, &[false, true, false, false]),
                GroupKind::Dp => masked_orthogonal_groups(&dense, &[false, false, true, false]),
                GroupKind::Pp => masked_orthogonal_groups(&dense, &[false, false, false, true]),
                GroupKind::DpCp => masked_orthogonal_groups(&dense, &[false, true, true, false]),
                GroupKind::TpCp => masked_orthogonal_groups(&dense, &[true, true, false, false]),
                GroupKind::ModelParallel => {
                    masked_orthogonal_groups(&dense, &[true, false, false, true])
                }
                GroupKind::ExpertTp => {
                    masked_orthogonal_groups(&expert, &[true, false, false, false])
                }
                GroupKind::Ep => masked_orthogonal_groups(&expert, &[false, true, false, false]),
                GroupKind::ExpertDp => {
                    masked_orthogonal_groups(&expert, &[false, false, true, false])
                }
                GroupKind::ExpertModelParallel => {
                    masked_orthogonal_groups(&expert, &[true, true, false, true])
                }
                GroupKind::RolloutTp => (0..world_size).map(|r| vec![r]).collect(),
            };
            groups.insert(kind, g);
        }
        let membership = Self::memberships(&groups, world_size);
        Ok(Self {
            config,
            world_size,
            dp,
            edp,
            rollout_tp: 1,
            groups,
            membership,
        })
    }

    fn memberships(
        groups: &BTreeMap<GroupKind, Vec<Vec<usize>>>,
        world_size: usize,
    ) -> BTreeMap<GroupKind, Vec<usize>> {
        groups
            .iter()
            .map(|(kind, gs)| {
                let mut m = vec![0; world_size];
                for (i, g) in gs.iter().enumerate() {
                    for &r in g {
                        m[r] = i;
                    }
                }
                (*kind, m)
            })
            .collect()
    }

    /// The same layout with the rollout engine's own tensor parallel size: groups of `rollout_tp`
    /// consecutive ranks ([`GroupKind::RolloutTp`]), each generating one share of the prompts.
    ///
    /// ```
    /// use verl_core::topology::{GroupKind, ParallelConfig, Topology};
    /// let topo = Topology::new(ParallelConfig { tp: 4, ..Default::default() }, 4)?
    ///     .with_rollout_tp(2)?;
    /// assert_eq!(topo.groups(GroupKind::RolloutTp), &[vec![0, 1], vec![2, 3]]);
    /// # Ok::<(), verl_core::Error>(())
    /// ```
    pub fn with_rollout_tp(mut self, rollout_tp: usize) -> Result<Self> {
        if rollout_tp == 0 || !self.world_size.is_multiple_of(rollout_tp) {
            return Err(TopologyError::Invalid {
                field: "actor_rollout_ref.rollout.tensor_model_parallel_size",
                message: format!(
                    "= {rollout_tp} must be at least 1 and divide the world size {}",
                    self.world_size
                ),
            });
        }
        let groups = (0..self.world_size / rollout_tp)
            .map(|g| (g * rollout_tp..(g + 1) * rollout_tp).collect())
            .collect();
        self.groups.insert(GroupKind::RolloutTp, groups);
        self.membership = Self::memberships(&self.groups, self.world_size);
        self.rollout_tp = rollout_tp;
        Ok(self)
    }

    /// The rollout engine's tensor parallel size (1 unless [`Self::with_rollout_tp`]).
    pub fn rollout_tp(&self) -> usize {
        self.rollout_tp
    }

    pub fn config(&self) -> &ParallelConfig {
        &self.config
    }
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Data-parallel size (world / (tp·cp·pp)).
    pub fn dp(&self) -> usize {
        self.dp
    }
    /// Expert data-parallel size (world / (etp·ep·pp)).
    pub fn expert_dp(&self) -> usize {
        self.edp
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world_size {
            return Err(TopologyError::RankOutOfRange {
                rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// Coordinates of `rank` in the dense and expert views.
    pub fn coords(&self, rank: usize) -> Result<RankCoords> {
        self.check_rank(rank)?;
        let c = &self.config;
        let etp = c.expert_tp();
        Ok(RankCoords {
            rank,
            tp_rank: rank % c.tp,
            cp_rank: (rank / c.tp) % c.cp,
            dp_rank: (rank / (c.tp * c.cp)) % self.dp,
            pp_rank: rank / (c.tp * c.cp * self.dp),
            etp_rank: rank % etp,
            ep_rank: (rank / etp) % c.ep,
            edp_rank: (rank / (etp * c.ep)) % self.edp,
            tp_size: c.tp,
            cp_size: c.cp,
            dp_size: self.dp,
            pp_size: c.pp,
            etp_size: etp,
            ep_size: c.ep,
            edp_size: self.edp,
            rollout_tp_size: self.rollout_tp,
        })
    }

    /// The rank at the given dense coordinates.
    pub fn rank_of(
        &self,
        tp_rank: usize,
        cp_rank: usize,
        dp_rank: usize,
        pp_rank: usize,
    ) -> Result<usize> {
        let c = &self.config;
        if tp_rank >= c.tp || cp_rank >= c.cp || dp_rank >= self.dp || pp_rank >= c.pp {
            return Err(invalid(
                "coords",
                format!("(tp {tp_rank}, cp {cp_rank}, dp {dp_rank}, pp {pp_rank}) is outside tp={}, cp={}, dp={}, pp={}", c.tp, c.cp, self.dp, c.pp),
            ));
        }
        Ok(tp_rank + c.tp * (cp_rank + c.cp * (dp_rank + self.dp * pp_rank)))
    }

    /// All groups of one family, each listing its ranks.
    pub fn groups(&self, kind: GroupKind) -> &[Vec<usize>] {
        &self.groups[&kind]
    }

    /// The group of family `kind` that `rank` belongs to.
    pub fn group_of(&self, rank: usize, kind: GroupKind) -> Result<&[usize]> {
        self.check_rank(rank)?;
        Ok(&self.groups[&kind][self.membership[&kind][rank]])
    }
}

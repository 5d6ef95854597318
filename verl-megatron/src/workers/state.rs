//! A worker's model and optimizer as checkpoint state (`CheckpointState`), and back: weights
//! by HF name, AdamW moments under `<optimizer>/<name>.exp_avg{,_sq}`, counters in `extra`,
//! with each tensor's place in its full tensor (`extra.shards`, `verl_core::weights::ShardSlice`)
//! and the saving rank's layout (`extra.layout`).

use std::collections::HashMap;
use std::path::Path;

use burn::module::AutodiffModule;
use burn::prelude::*;
use serde_json::{json, Value};
use verl_core::traits::{
    CheckpointBackend, CheckpointContents, CheckpointState, Communicator, ReduceOp,
};
use verl_core::NamedTensor;

use super::optim::{ExpertParallelGrads, ModelOptimizer, TensorParallelGrads};
use crate::checkpoint::{DistCheckpoint, SavedLayout, ShardedCheckpoint};
use crate::models::CausalLm;
use crate::parallel::{ParallelAutodiffBackend, ParallelBackend};
use crate::MegatronError;

/// The state of `model` and its labelled optimizers; `counters` go into `extra` as they are.
pub(crate) fn save_state<B: ParallelAutodiffBackend>(
    model: &CausalLm<B>,
    optimizers: &[(&str, &ModelOptimizer<B, CausalLm<B>>)],
    counters: Value,
    contents: CheckpointContents,
) -> CheckpointState<B::InnerBackend> {
    let params = model.named_param_ids();
    let mut optimizer = Vec::new();
    let mut extras = serde_json::Map::new();
    if contents.optimizer {
        for (label, optim) in optimizers {
            let (tensors, extra) = optim.state(&params);
            optimizer.extend(tensors.into_iter().map(|mut t| {
                t.name = format!("{label}/{}", t.name);
                t
            }));
            extras.insert(label.to_string(), extra);
        }
    }
    CheckpointState {
        model: if contents.model {
            model.valid().export_shards()
        } else {
            Vec::new()
        },
        optimizer,
        // Where each tensor (and its moments, which share its name) sits in the full tensor,
        // and the layout it was saved on: what loading on another layout reads.
        extra: json!({
            "optimizers": extras,
            "counters": counters,
            "shards": model.shard_slices(),
            "layout": layout_of(model),
        }),
    }
}

fn layout_of<B: Backend>(model: &CausalLm<B>) -> SavedLayout {
    let (ep, etp) = match model.expert_groups() {
        Some((ep, etp)) => ((ep.rank, ep.size), (etp.rank, etp.size)),
        // No experts here: nothing to place, as saved before expert parallelism.
        None => ((0, 1), (0, 0)),
    };
    let etp = match etp {
        // Experts following tp are recorded as older checkpoints recorded them.
        (_, n) if n == model.tp.size && ep.1 == 1 => (0, 0),
        e => e,
    };
    SavedLayout {
        tp_rank: model.tp.rank,
        tp_size: model.tp.size,
        pp_stage: model.stage.stage,
        pp_stages: model.stage.stages,
        ep_rank: ep.0,
        ep_size: ep.1,
        etp_rank: etp.0,
        etp_size: etp.1,
    }
}

/// A frozen model's checkpoint state (the reference policy): its weights with where each sits
/// in the full tensor, so that it too loads on another layout.
pub(crate) fn model_state<B: Backend>(model: &CausalLm<B>) -> CheckpointState<B> {
    CheckpointState {
        model: model.export_shards(),
        optimizer: Vec::new(),
        extra: json!({ "shards": model.shard_slices(), "layout": layout_of(model) }),
    }
}

/// This rank's state from the dist checkpoint at `dir`, whatever layout saved it. Saved on
/// this rank's layout (and optimizer sharding, `sharded_over` per optimizer label), the rank's
/// own files are read as they are; otherwise each of `model`'s tensors (and its moments) is
/// assembled from the saved shards that overlap it ([`ShardedCheckpoint`]).
pub(crate) async fn read_dist_state<M: Backend, I: Backend>(
    dir: &Path,
    rank: usize,
    model: &CausalLm<M>,
    sharded_over: &[(&str, usize)],
    contents: CheckpointContents,
    device: &I::Device,
) -> verl_core::Result<CheckpointState<I>> {
    let own = DistCheckpoint::new(rank);
    let index = match ShardedCheckpoint::open(dir) {
        Ok(index) if index.is_indexed() => index,
        // Written before checkpoints recorded their layout: only the same layout loads.
        _ => return own.load(dir, contents, device).await,
    };
    let same_optimizer_sharding = !contents.optimizer
        || sharded_over.iter().all(|(label, n)| {
            let saved = index
                .extra_of(rank)
                .and_then(|e| e.pointer(&format!("/optimizers/{label}/sharded_over")))
                .map_or(Some(1), Value::as_u64);
            saved == Some(*n as u64)
        });
    if index.layout_of(rank) == Some(layout_of(model)) && same_optimizer_sharding {
        return own.load(dir, contents, device).await;
    }
    tracing::info!(
        "{}: saved by {} ranks on another layout; assembling rank {rank}'s shards",
        dir.display(),
        index.ranks()
    );
    Ok(index.load_for(rank, &model.shard_targets(), contents, device)?)
}

/// Loads the weights of `state` into `model` (every weight must be there, with its shape), then
/// each labelled optimizer's moments and counters; returns the saved `counters`.
pub(crate) fn load_state<B: ParallelAutodiffBackend>(
    model: &mut CausalLm<B>,
    optimizers: &mut [(&str, &mut ModelOptimizer<B, CausalLm<B>>)],
    state: CheckpointState<B::InnerBackend>,
    contents: CheckpointContents,
) -> Result<Value, MegatronError> {
    if contents.model {
        let expected = model.named_param_ids().len();
        if state.model.len() != expected {
            return Err(MegatronError::Checkpoint {
                message: format!(
                    "the checkpoint has {} weights, the model {expected}: was it saved from this model?",
                    state.model.len()
                ),
            });
        }
        for t in state.model {
            model.load_shard(NamedTensor {
                name: t.name,
                shape: t.shape,
                values: Tensor::from_inner(t.values),
            })?;
        }
    }
    if contents.optimizer {
        let params = model.named_param_ids();
        let mut by_label: HashMap<String, Vec<NamedTensor<B::InnerBackend>>> = HashMap::new();
        for mut t in state.optimizer {
            let (label, name) =
                t.name
                    .split_once('/')
                    .ok_or_else(|| MegatronError::Checkpoint {
                        message: format!("optimizer tensor `{}` has no optimizer label", t.name),
                    })?;
            let (label, name) = (label.to_string(), name.to_string());
            t.name = name;
            by_label.entry(label).or_default().push(t);
        }
        for (label, optim) in optimizers.iter_mut() {
            let extra = state
                .extra
                .pointer(&format!("/optimizers/{label}"))
                .ok_or_else(|| MegatronError::Checkpoint {
                    message: format!("the checkpoint has no state for optimizer `{label}`"),
                })?;
            optim.load_state(&params, by_label.remove(*label).unwrap_or_default(), extra)?;
        }
    }
    Ok(state.extra.get("counters").cloned().unwrap_or(Value::Null))
}

/// The optimizer's view of a tensor-parallel model (`None` at tp = 1).
pub(crate) fn tp_grads<B: ParallelAutodiffBackend>(
    model: &CausalLm<B>,
) -> Option<TensorParallelGrads<B::InnerBackend>> {
    let comm = model.tp.comm::<B::InnerBackend>()?;
    let (sharded, partial) = model.tp_param_sets();
    Some(TensorParallelGrads {
        comm,
        sharded,
        partial,
    })
}

/// `optim` set up for `model`'s tensor-parallel layout.
pub(crate) fn for_model<B: ParallelAutodiffBackend>(
    optim: ModelOptimizer<B, CausalLm<B>>,
    model: &CausalLm<B>,
) -> ModelOptimizer<B, CausalLm<B>> {
    let optim = match tp_grads(model) {
        Some(tp) => optim.with_tensor_parallel(tp),
        None => optim,
    };
    let Some((ep, etp)) = model.expert_groups() else {
        return optim;
    };
    let (experts, dense) = model.expert_param_sets();
    optim.with_expert_parallel(ExpertParallelGrads {
        experts,
        dense,
        etp: etp.comm::<B::InnerBackend>().filter(|c| c.world_size() > 1),
        ep: ep.comm::<B::InnerBackend>().filter(|c| c.world_size() > 1),
        expert_dp: None,
        distributed: ep.size > 1 || etp.size != model.tp.size,
    })
}

/// `values` summed over `dp` (as is without a group): the batch-wide counts a data-parallel
/// rank normalises its loss by.
pub(crate) fn dp_sum<B: ParallelBackend>(
    dp: Option<&dyn Communicator<B>>,
    values: &[f64],
) -> verl_core::Result<Vec<f64>> {
    match dp {
        Some(comm) if comm.world_size() > 1 => {
            let local: Vec<f32> = values.iter().map(|&v| v as f32).collect();
            let t = Tensor::<B, 1>::from_floats(local.as_slice(), &Default::default());
            let sum = comm.all_reduce(t, ReduceOp::Sum)?;
            Ok(sum.into_data().convert::<f64>().iter::<f64>().collect())
        }
        _ => Ok(values.to_vec()),
    }
}

/// How a mini-batch's MoE load-balancing losses are weighted and reported: Megatron averages
/// them over the mini-batch's micro-batches (over every data-parallel rank), so each
/// micro-batch's is multiplied by 1 / that count.
pub(crate) struct MoeAuxLoss {
    pub scale: f64,
    enabled: bool,
}

impl MoeAuxLoss {
    /// For `micro_batches` micro-batches on this rank (summed over `dp`).
    pub(super) fn of<B: ParallelAutodiffBackend>(
        model: &CausalLm<B>,
        micro_batches: usize,
        dp: Option<&dyn Communicator<B::InnerBackend>>,
    ) -> verl_core::Result<Self> {
        if model.moe_aux_loss_coeff <= 0.0 {
            return Ok(Self {
                scale: 0.0,
                enabled: false,
            });
        }
        let all = dp_sum(dp, &[micro_batches as f64])?[0].max(1.0);
        Ok(Self {
            scale: 1.0 / all,
            enabled: true,
        })
    }

    /// Pushes `{role}/moe_aux_loss`: this stage's scaled sum added over the pipeline stages and
    /// the data-parallel ranks (the mini-batch's mean load-balancing loss, all layers).
    pub(super) fn report<I: ParallelBackend>(
        &self,
        stage_total: f64,
        pp: Option<&dyn Communicator<I>>,
        dp: Option<&dyn Communicator<I>>,
        role: &str,
        metrics: &mut verl_core::Metrics,
    ) -> verl_core::Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let stages = dp_sum(pp, &[stage_total])?[0];
        metrics.push(format!("{role}/moe_aux_loss"), dp_sum(dp, &[stages])?[0]);
        Ok(())
    }
}

//! Each rank's process groups, and the reward model's worker group.

use verl_core::config::VerlConfig;
use verl_core::topology::Topology;
use verl_core::worker::WorkerGroup;
use verl_megatron::hf::{HfCheckpoint, HfModelConfig};
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::ProcessGroups;
use verl_megatron::workers::RewardModelWorker;

use super::error::{setup, TrainError};
use super::model::Infer;

/// Each rank's communicators, to be taken by that rank's thread when it builds its worker.
pub(super) type RankGroups = std::sync::Arc<std::sync::Mutex<Vec<Option<ProcessGroups<Infer>>>>>;

pub(super) fn rank_groups(topo: &Topology) -> RankGroups {
    std::sync::Arc::new(std::sync::Mutex::new(
        ProcessGroups::local(topo).into_iter().map(Some).collect(),
    ))
}

/// Rank `ctx.rank`'s communicators; a failure of any of its methods aborts them all, so its
/// peers stop waiting at once.
pub(super) fn take_groups(
    groups: &RankGroups,
    ctx: &verl_core::worker::RankContext,
) -> verl_core::Result<ProcessGroups<Infer>> {
    let rank = ctx.rank;
    let taken = groups
        .lock()
        .map_err(|_| {
            verl_core::Error::backend("trainer", "a rank panicked while taking its groups")
        })?
        .get_mut(rank)
        .and_then(Option::take)
        .ok_or_else(|| {
            verl_core::Error::backend("trainer", format!("rank {rank}'s groups were taken"))
        })?;
    let aborter = taken.aborter();
    ctx.on_failure(move |why: &str| aborter(why));
    Ok(taken)
}

/// The reward-model workers (`reward_model.enable`): a one-label score-head model loaded from
/// `reward_model.model.path`, fed the actor's token ids (so it must share the tokenizer).
pub(super) fn reward_model_group(
    cfg: &VerlConfig,
    vocab_size: usize,
) -> Result<Option<WorkerGroup<RewardModelWorker<Infer>>>, TrainError> {
    let rm = &cfg.reward_model;
    if !rm.enable {
        return Ok(None);
    }
    let path = rm.model.path.clone().ok_or_else(|| {
        setup("reward_model.enable=true needs reward_model.model.path: a Hugging Face directory with a …ForSequenceClassification (num_labels = 1) model")
    })?;
    if rm.model.input_tokenizer.is_some() {
        return Err(setup("reward_model.model.input_tokenizer: re-tokenising for a reward model with its own tokenizer is not supported; the reward model reads the actor's token ids, so unset it and use a reward model that shares the actor's tokenizer"));
    }
    let rm_cfg = HfModelConfig::from_dir(&path).map_err(setup)?;
    if rm_cfg.vocab_size != vocab_size {
        return Err(setup(format!(
            "reward_model.model.path = {path}: its vocab_size {} differs from the actor's {vocab_size}; the reward model must share the actor's tokenizer",
            rm_cfg.vocab_size
        )));
    }
    let ckpt = HfCheckpoint::open(&path).map_err(setup)?;
    let micro = rm
        .micro_batch_size_per_gpu
        .unwrap_or(cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n);
    let topo = Topology::new(rm.megatron.parallel(), 1).map_err(setup)?;
    let group = WorkerGroup::spawn(1, move |ctx| {
        let model = CausalLm::<Infer>::from_checkpoint(&rm_cfg, &ckpt, &Default::default())?;
        RewardModelWorker::new(topo.coords(ctx.rank)?, &rm_cfg, model, micro)
    })?;
    Ok(Some(group))
}

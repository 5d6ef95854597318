//! The single controller of a PPO / GRPO run: its state, the fit loop, validation, warm-up and
//! checkpoints.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value;
use verl_core::algorithms::advantage::AdvantageRegistry;
use verl_core::algorithms::kl::{KlController, KlPenalty};
use verl_core::config::{ValidatedConfig, VerlConfig};
use verl_core::traits::{RewardInput, RewardScore};
use verl_core::worker::{RoleGroup, WorkerGroup};
use verl_core::{DataProto, Metrics};
use verl_megatron::checkpoint::HfCheckpointer;
use verl_megatron::hf::SaveOptions;
use verl_megatron::workers::{CheckpointRequest, RewardModelWorker};

use super::checkpoint::{self, contents_of, LoopState};
use super::data::{Codec, PromptRow};
use super::error::{setup, TrainError};
use super::log::RunLog;
use super::model::Infer;
use super::ranks::RankProcesses;
use super::roles::{ActorWorker, CriticRank};
use super::scorer::Scorer;

/// What a run ended with.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// The RL steps this run did (a resumed run counts only its own).
    pub steps: u64,
    /// The step of the checkpoint the run resumed from, if it did.
    pub resumed_at: Option<u64>,
    /// `val/score/mean` after the warm-up (before RL) and at the end.
    pub val_score_before: Option<f64>,
    pub val_score_after: Option<f64>,
    pub metrics_path: PathBuf,
    /// `metrics.png`: score and response length against step.
    pub plot_path: PathBuf,
    pub seconds: f64,
}

/// The single controller of a PPO / GRPO run.
pub struct PpoTrainer {
    pub(super) cfg: VerlConfig,
    pub(super) validated: ValidatedConfig,
    pub(super) actor: RoleGroup<ActorWorker, Infer>,
    pub(super) critic: Option<RoleGroup<CriticRank, Infer>>,
    /// The rank processes, with `trainer.launcher=processes` (dropping them stops them).
    pub(super) processes: Option<RankProcesses>,
    pub(super) reward_model: Option<WorkerGroup<RewardModelWorker<Infer>>>,
    pub(super) codec: Codec,
    pub(super) train: Vec<PromptRow>,
    pub(super) val: Vec<PromptRow>,
    pub(super) kl_ctrl: Box<dyn KlController>,
    pub(super) kl_penalty: KlPenalty,
    pub(super) advantages: AdvantageRegistry<Infer>,
    pub(super) scorer: Scorer,
    /// `algorithm.rollout_correction`, parsed.
    pub(super) rollout_correction:
        Option<verl_core::algorithms::rollout_correction::RolloutCorrection>,
    /// `reward_model.reward_manager=dapo`'s overlong reward shaping, added to every score.
    pub(super) overlong: Option<verl_core::algorithms::reward::OverlongBuffer>,
    pub(super) log: RunLog,
    /// The output directory's lock, held for the trainer's life.
    pub(super) _run_lock: super::run_lock::RunLock,
    pub(super) needs_ref: bool,
    /// The old log-probs are a separate pass (see `RolePlans::old_log_prob_apart`).
    pub(super) old_log_prob_apart: bool,
    /// `algorithm.rollout_correction.bypass_mode`: no old-log-prob pass, the rollout's
    /// log-probs are the old ones, and the correction runs in the actor's loss.
    pub(super) bypass: bool,
    /// `trainer.balance_batch`: the actor's and the critic's data-parallel sizes, whose
    /// update inputs are reordered for balanced tokens per rank.
    pub(super) balance_dp: Option<(usize, usize)>,
    pub(super) total_steps: u64,
    /// The step being run (validation seeds its sampling with it).
    pub(super) global_step: u64,
    pub(super) out_dir: PathBuf,
    /// `config.json` of the actor's and the critic's HF copies.
    pub(super) actor_config_json: Value,
    pub(super) critic_config_json: Option<Value>,
    /// The checkpoint to resume from, and where its loop stood.
    pub(super) resume: Option<(PathBuf, LoopState)>,
    /// The steps this run saved, oldest first: the only checkpoints it may prune.
    pub(super) saved: Vec<u64>,
}

impl PpoTrainer {
    /// The validated config the run uses.
    pub fn config(&self) -> &ValidatedConfig {
        &self.validated
    }

    /// The training rows, in their loaded order (a hand-driven loop picks its batches here).
    pub fn train_rows(&self) -> &[PromptRow] {
        &self.train
    }

    /// Appends one step's metrics (reduced to means) to `metrics.jsonl` and the progress line,
    /// as [`Self::fit`] does after each step.
    pub fn record(&mut self, step: u64, metrics: &Metrics) -> Result<(), TrainError> {
        self.log.record(step, &metrics.reduce()).map_err(setup)
    }

    /// Saves every role's state as step `step`'s checkpoint (a hand-driven loop's save; its
    /// data order is not the fit loop's, so a resumed [`Self::fit`] starts a fresh epoch).
    pub async fn save(&mut self, step: u64) -> Result<PathBuf, TrainError> {
        let mut state = LoopState::fresh(self.train.len(), self.kl_ctrl.value());
        state.step = step;
        self.save_checkpoint(&state).await
    }

    /// Scores of every row of a generated batch (by the trainer's [`Scorer`], plus DAPO's
    /// overlong shaping with `reward_manager=dapo`, in training and validation as verl's
    /// manager scores both) with each row's reward extras, as verl's managers collect them:
    /// the function's dict entries (its `score` among them), the dapo manager's `acc` (a plain
    /// number's score before the shaping) and, with `overlong_buffer.log`, `overlong_reward`
    /// and `overlong`; and the responses' lengths.
    pub(super) async fn rewards_with_extras(
        &self,
        gen: &DataProto<Infer>,
    ) -> Result<(Vec<RewardScore>, Vec<f64>), TrainError> {
        let responses: Vec<i64> = gen
            .to_data("responses")?
            .convert::<i64>()
            .iter::<i64>()
            .collect();
        let mask: Vec<i64> = gen
            .to_data("response_mask")?
            .convert::<i64>()
            .iter::<i64>()
            .collect();
        let r = responses.len() / gen.len().max(1);
        let sources = gen.non_tensor("data_source")?;
        let truths = gen.non_tensor("reward_model")?;
        let extras = gen.non_tensor("extra_info").ok();
        let mut texts = Vec::with_capacity(gen.len());
        let mut lengths = Vec::with_capacity(gen.len());
        for i in 0..gen.len() {
            let len = mask[i * r..(i + 1) * r].iter().sum::<i64>() as usize;
            let ids: Vec<u32> = responses[i * r..i * r + len]
                .iter()
                .map(|&t| t as u32)
                .collect();
            texts.push(self.codec.decode(&ids));
            lengths.push(len as f64);
        }
        // An agent loop's tool rewards join each row's extra_info, as verl's reward managers
        // merge `tool_extra_fields` into it.
        let merged: Option<Vec<Value>> = gen
            .non_tensor(verl_rollout::TOOL_EXTRA_FIELDS_KEY)
            .ok()
            .map(|fields| {
                (0..gen.len())
                    .map(|i| {
                        let mut info = match extras.as_ref().map(|e| &e[i]) {
                            Some(Value::Object(m)) => m.clone(),
                            _ => serde_json::Map::new(),
                        };
                        if let Some(Value::Object(f)) = fields.get(i) {
                            info.extend(f.clone());
                        }
                        Value::Object(info)
                    })
                    .collect()
            });
        let null = Value::Null;
        let inputs: Vec<RewardInput<'_>> = (0..gen.len())
            .map(|i| RewardInput {
                data_source: sources[i].as_str().unwrap_or_default(),
                solution_str: &texts[i],
                ground_truth: truths[i]
                    .get("ground_truth")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
                extra_info: match &merged {
                    Some(m) => &m[i],
                    None => extras.as_ref().map_or(&null, |e| &e[i]),
                },
            })
            .collect();
        let mut scores = self.scorer.score_full(&inputs).await?;
        let dapo = self.cfg.reward_model.reward_manager == "dapo";
        for (s, &len) in scores.iter_mut().zip(&lengths) {
            // verl's dapo manager keeps a plain number's score as `acc` (before the shaping).
            if dapo && s.extra.is_empty() {
                s.extra.insert("acc".into(), s.score);
            }
            if let Some(buffer) = &self.overlong {
                let shaping = buffer.reward(len as usize);
                s.score += shaping;
                if buffer.log {
                    s.extra.insert("overlong_reward".into(), shaping);
                    s.extra
                        .insert("overlong".into(), f64::from(u8::from(shaping < 0.0)));
                }
            }
        }
        Ok((scores, lengths))
    }

    /// verl's `start_profile` / `stop_profile` on every rank of every role around a profiled
    /// step (nothing when the step is not listed in `global_profiler.steps`); the files the
    /// captures wrote are logged.
    pub(super) async fn profile(&self, method: &str, step: u64) -> Result<(), TrainError> {
        let p = &self.cfg.global_profiler;
        let listed = p.steps.as_ref().is_some_and(|s| s.contains(&step));
        if p.tool.is_none() || !listed {
            return Ok(());
        }
        let mut written: Vec<Vec<String>> = Vec::new();
        if method == "stop_profile" {
            written.extend(self.actor.call_all::<_, Vec<String>>(method, &step).await?);
            if let Some(critic) = &self.critic {
                written.extend(critic.call_all::<_, Vec<String>>(method, &step).await?);
            }
        } else {
            self.actor.call_all::<_, ()>(method, &step).await?;
            if let Some(critic) = &self.critic {
                critic.call_all::<_, ()>(method, &step).await?;
            }
        }
        for file in written.into_iter().flatten() {
            tracing::info!("profiler: step {step}: wrote {file}");
        }
        Ok(())
    }

    /// Saves step `state.step` in verl's layout (see [`checkpoint`]): every rank of each role
    /// writes its shard, then the loop state, then `latest_checkpointed_iteration.txt`; older
    /// checkpoints this run saved beyond the `trainer.max_*_ckpt_to_keep` limits are removed
    /// (see [`checkpoint::keep_limit`]: 0 keeps all, as in verl). A directory of the same step that this run did not write is set aside,
    /// never overwritten; `checksums.json` lists every file for verification at resume.
    pub async fn save_checkpoint(&mut self, state: &LoopState) -> Result<PathBuf, TrainError> {
        let dir = checkpoint::step_dir(&self.out_dir, state.step);
        if !self.saved.contains(&state.step) {
            let moved = checkpoint::set_aside(&self.out_dir, state.step)
                .map_err(|e| setup(format!("{}: {e}", dir.display())))?;
            if let Some(to) = moved {
                tracing::warn!(
                    "{} was not written by this run: moved to {} rather than overwritten",
                    dir.display(),
                    to.display()
                );
            }
        }
        let (contents, hf) = contents_of(
            &self.cfg.actor_rollout_ref.actor.checkpoint,
            "actor_rollout_ref.actor",
            true,
        )?;
        let req = CheckpointRequest {
            dir: dir.join("actor"),
            contents,
            hf: hf.then(|| HfCheckpointer {
                config_json: self.actor_config_json.clone(),
                options: SaveOptions::default(),
            }),
        };
        self.actor
            .call_all::<_, ()>("save_checkpoint", &req)
            .await?;
        if let Some(critic) = &self.critic {
            let (contents, hf) = contents_of(&self.cfg.critic.checkpoint, "critic", true)?;
            let req = CheckpointRequest {
                dir: dir.join("critic"),
                contents,
                hf: match (&self.critic_config_json, hf) {
                    (Some(json), true) => Some(HfCheckpointer {
                        config_json: json.clone(),
                        options: SaveOptions::default(),
                    }),
                    _ => None,
                },
            };
            critic.call_all::<_, ()>("save_checkpoint", &req).await?;
        }
        checkpoint::write_loop_state(&dir, state)?;
        checkpoint::write_checksums(&dir)?;
        checkpoint::mark_latest(&self.out_dir, state.step)
            .map_err(|e| setup(format!("{}: {e}", self.out_dir.display())))?;
        self.saved.retain(|&s| s != state.step);
        self.saved.push(state.step);
        let t = &self.cfg.trainer;
        // A run without a critic has no critic checkpoints for its limit to count.
        let critic_limit = t.max_critic_ckpt_to_keep.filter(|_| self.critic.is_some());
        let keep = checkpoint::keep_limit(t.max_actor_ckpt_to_keep, critic_limit);
        if let Some(k) = keep {
            checkpoint::prune(&self.out_dir, &mut self.saved, k)
                .map_err(|e| setup(format!("{}: {e}", self.out_dir.display())))?;
        }
        Ok(dir)
    }

    /// Loads every role's state from a `global_step_<N>` directory (`load_contents`).
    pub(super) async fn load_checkpoint(&mut self, dir: &Path) -> Result<(), TrainError> {
        let (contents, _) = contents_of(
            &self.cfg.actor_rollout_ref.actor.checkpoint,
            "actor_rollout_ref.actor",
            false,
        )?;
        let req = CheckpointRequest {
            dir: dir.join("actor"),
            contents,
            hf: None,
        };
        self.actor
            .call_all::<_, ()>("load_checkpoint", &req)
            .await?;
        if let Some(critic) = &self.critic {
            if !dir.join("critic").is_dir() {
                return Err(setup(format!(
                    "{}: no critic was saved in this checkpoint, but critic.enable is on",
                    dir.display()
                )));
            }
            let (contents, _) = contents_of(&self.cfg.critic.checkpoint, "critic", false)?;
            let req = CheckpointRequest {
                dir: dir.join("critic"),
                contents,
                hf: None,
            };
            critic.call_all::<_, ()>("load_checkpoint", &req).await?;
        }
        Ok(())
    }

    /// The whole run: warm-up, optional validation before training, the RL steps (epochs over
    /// the shuffled prompts, bounded by `trainer.total_training_steps`), validation every
    /// `trainer.test_freq` steps and at the end (none with test_freq <= 0, as verl), a checkpoint every `trainer.save_freq` steps
    /// and at the end. A run that finds a checkpoint (`trainer.resume_mode`) continues from it
    /// exactly: same batches, samples, optimizer state and metrics as if never stopped.
    pub async fn fit(&mut self) -> Result<RunSummary, TrainError> {
        let start = Instant::now();
        let mut ls = match self.resume.take() {
            Some((dir, mut ls)) => {
                self.load_checkpoint(&dir).await?;
                self.kl_ctrl.restore(ls.kl_coef);
                tracing::info!("resumed from {} (step {})", dir.display(), ls.step);
                if self.cfg.trainer.del_local_ckpt_after_load {
                    std::fs::remove_dir_all(&dir).map_err(setup)?;
                }
                // A validation-only run of a saved checkpoint (the other resumes go straight
                // on training).
                if self.cfg.trainer.val_only {
                    self.global_step = ls.step;
                    let val = self.validation_metrics().await?;
                    self.log.record(ls.step, &val).map_err(setup)?;
                    ls.val_before = val.get("val/score/mean").copied();
                }
                ls
            }
            None => {
                // `trainer.val_only` validates the starting policy: no warm-up.
                if !self.cfg.trainer.val_only {
                    self.warm_up().await?;
                }
                let mut ls = LoopState::fresh(self.train.len(), self.kl_ctrl.value());
                if self.cfg.trainer.val_before_train {
                    let val = self.validation_metrics().await?;
                    self.log.record(0, &val).map_err(setup)?;
                    ls.val_before = val.get("val/score/mean").copied();
                }
                ls
            }
        };
        if self.cfg.trainer.val_only {
            // verl's `trainer.val_only`: validate, log, and stop before any step.
            self.log.finish();
            if let Some(p) = &mut self.processes {
                p.finish()?;
            }
            return Ok(RunSummary {
                steps: 0,
                resumed_at: Some(ls.step).filter(|&s| s > 0),
                val_score_before: ls.val_before,
                val_score_after: ls.val_before,
                metrics_path: self.log.metrics_path().to_path_buf(),
                plot_path: self.log.plot_path(),
                seconds: start.elapsed().as_secs_f64(),
            });
        }
        let b = self.cfg.data.train_batch_size;
        let mut after = ls.val_before;
        let first_step = ls.step + 1;
        for step in ls.step + 1..=self.total_steps {
            self.global_step = step;
            if ls.cursor + b > ls.order.len() {
                if self.cfg.data.shuffle {
                    use rand::seq::SliceRandom;
                    use rand::SeedableRng;
                    let mut rng =
                        rand::rngs::StdRng::seed_from_u64(self.cfg.data.shuffle_seed() ^ ls.epoch);
                    ls.order.shuffle(&mut rng);
                }
                ls.epoch += 1;
                ls.cursor = 0;
            }
            let rows: Vec<PromptRow> = ls.order[ls.cursor..ls.cursor + b]
                .iter()
                .map(|&i| self.train[i].clone())
                .collect();
            ls.cursor += b;
            let refs: Vec<&PromptRow> = rows.iter().collect();
            self.profile("start_profile", step).await?;
            let metrics = self.step(step, &refs).await?;
            self.profile("stop_profile", step).await?;
            let mut reduced = metrics.reduce();
            reduced.insert("training/epoch".into(), ls.epoch as f64);
            reduced.insert("training/global_step".into(), step as f64);
            let freq = self.cfg.trainer.test_freq;
            // As verl: every `test_freq` steps and after the last, never with test_freq <= 0
            // (a validation call can be the largest generation of a job).
            if freq > 0 && (step % freq as u64 == 0 || step == self.total_steps) {
                let val = self.validation_metrics().await?;
                after = val.get("val/score/mean").copied();
                reduced.extend(val);
            }
            self.log.record(step, &reduced).map_err(setup)?;
            ls.step = step;
            let save = self.cfg.trainer.save_freq;
            if save > 0 && (step % save as u64 == 0 || step == self.total_steps) {
                ls.kl_coef = self.kl_ctrl.value();
                self.save_checkpoint(&ls).await?;
            }
        }
        self.log.finish();
        if let Some(p) = &mut self.processes {
            p.finish()?;
        }
        Ok(RunSummary {
            steps: (self.total_steps + 1).saturating_sub(first_step),
            resumed_at: first_step.checked_sub(1).filter(|&s| s > 0),
            val_score_before: ls.val_before,
            val_score_after: after,
            metrics_path: self.log.metrics_path().to_path_buf(),
            plot_path: self.log.plot_path(),
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

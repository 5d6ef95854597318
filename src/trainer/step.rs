//! One PPO / GRPO step as public phases, in verl's order: [`PpoTrainer::generate`] →
//! [`PpoTrainer::score`] → [`PpoTrainer::compute_ref_log_prob`] →
//! [`PpoTrainer::compute_values`] → [`PpoTrainer::compute_advantages`] →
//! [`PpoTrainer::update_critic`] → [`PpoTrainer::update_actor`] → [`PpoTrainer::finish_step`].
//! [`PpoTrainer::step`] runs them in that order; a program driving the loop itself can call
//! them one by one and add its own phases between them (filter a batch, keep a replay buffer),
//! reading and changing [`StepBatch::data`].

use std::time::Instant;

use burn::prelude::*;
use serde_json::Value;
use verl_core::algorithms::advantage::AdvantageInput;
use verl_core::algorithms::reward::{apply_kl_penalty, token_level_rewards};
use verl_core::dispatch::DispatchMode;
use verl_core::{DataProto, Metrics};

use super::data::{prompt_batch, sft_batch, PromptRow};
use super::error::{setup, TrainError};
use super::model::Infer;
use super::ppo_trainer::PpoTrainer;
use super::val_metrics::ValRecord;

/// A step's batch between phases: verl's columns (`responses`, `old_log_probs`,
/// `token_level_scores`, `advantages`, ...) as the phases add them, and the step's metrics.
pub struct StepBatch {
    pub step: u64,
    pub data: DataProto<Infer>,
    pub metrics: Metrics,
    /// Each row's sequence score (set by [`PpoTrainer::score`]).
    pub scores: Vec<f64>,
    /// Each row's response length in tokens.
    pub lengths: Vec<f64>,
    started: Instant,
}

impl StepBatch {
    /// The response mask as floats.
    fn mask(&self) -> Result<Tensor<Infer, 2>, TrainError> {
        Ok(verl_megatron::workers::batch::float_col(
            &self.data,
            "response_mask",
        )?)
    }

    /// The columns a forward pass reads.
    fn model_inputs(&self) -> Result<DataProto<Infer>, TrainError> {
        self.columns(&[
            "input_ids",
            "attention_mask",
            "position_ids",
            "responses",
            "response_mask",
        ])
    }

    fn columns(&self, keys: &[&str]) -> Result<DataProto<Infer>, TrainError> {
        Ok(self.data.select(Some(keys), Some(&[]), None)?)
    }

    /// Records the time since `since` as `timing_s/<name>`.
    fn time(&mut self, name: &str, since: Instant) {
        self.metrics
            .push(format!("timing_s/{name}"), since.elapsed().as_secs_f64());
    }
}

impl PpoTrainer {
    /// Greedy validation (`rollout.val_kwargs`) on the validation set: `val/score/mean`.
    pub async fn validate(&mut self) -> Result<f64, TrainError> {
        let metrics = self.validation_metrics().await?;
        Ok(metrics.get("val/score/mean").copied().unwrap_or(0.0))
    }

    /// Validation as [`Self::validate`] runs it, with verl's metrics beside `val/score/mean`:
    /// per data source, for the reward and each reward extra, over each prompt's `n`
    /// responses, `mean@n`, and with `n > 1` `std@n`, `best@k` / `worst@k` (and `maj@k` where
    /// the reward function reports a `pred`) as verl's bootstrap computes them
    /// ([`super::val_metrics`]); the core variable (`acc` where reported, else the reward)'s
    /// headline figures at `n` in `val-core/`, the rest in `val-aux/`.
    pub async fn validation_metrics(
        &mut self,
    ) -> Result<std::collections::BTreeMap<String, f64>, TrainError> {
        let rows: Vec<&PromptRow> = self.val.iter().collect();
        let mut total = 0.0;
        let mut count = 0usize;
        let mut dump = Vec::new();
        // One record per response: data source, prompt, variables, answer.
        let mut records = Vec::new();
        // (input, output, score) of every response, for trainer.log_val_generations.
        let mut generations: Vec<(String, String, f64)> = Vec::new();
        let chunk_size = self.cfg.data.val_batch_size.unwrap_or(rows.len()).max(1);
        for (c, chunk) in rows.chunks(chunk_size).enumerate() {
            let mut batch = prompt_batch::<Infer>(
                chunk,
                self.codec.pad_token_id(),
                "val",
                &Default::default(),
            )?;
            // Each prompt's place in the whole validation set seeds its samples: without the
            // chunk's offset, prompt j of every chunk would draw the same samples.
            batch.insert_non_tensor(
                verl_rollout::PROMPT_INDEX_KEY,
                (0..chunk.len())
                    .map(|i| Value::from(c * chunk_size + i))
                    .collect(),
            )?;
            batch.meta_info.insert("validate".into(), Value::Bool(true));
            batch
                .meta_info
                .insert("recompute_log_prob".into(), Value::Bool(false));
            batch
                .meta_info
                .insert("global_steps".into(), self.global_step.into());
            let gen = self
                .actor
                .call_proto(&rollout_mesh(), "generate_sequences", batch)
                .await?;
            let (scored, _) = self.rewards_with_extras(&gen).await?;
            let scores: Vec<f64> = scored.iter().map(|s| s.score).collect();
            // The responses' texts, decoded once for the dump and the trackers' samples.
            let log_generations = self.cfg.trainer.log_val_generations > 0;
            let dumping = self.cfg.trainer.validation_data_dir.is_some();
            if log_generations || dumping {
                // verl's validation dumps carry the reward as an extra column too.
                let with_reward: Vec<_> = scored
                    .iter()
                    .map(|s| {
                        let mut s = s.clone();
                        s.extra.insert("reward".into(), s.score);
                        s
                    })
                    .collect();
                let lines = super::dump::generation_lines(
                    &gen,
                    &self.codec,
                    &scores,
                    &with_reward,
                    self.global_step,
                )?;
                if log_generations {
                    // The reward as scored (a function's own `score` extra may differ).
                    for (line, &score) in lines.iter().zip(&scores) {
                        let text = |k: &str| line[k].as_str().unwrap_or("").to_string();
                        generations.push((text("input"), text("output"), score));
                    }
                }
                if dumping {
                    dump.extend(lines);
                }
            }
            // A prompt's responses are consecutive rows.
            let per_prompt = (scores.len() / chunk.len().max(1)).max(1);
            let sources = gen.non_tensor("data_source")?;
            for (i, (s, source)) in scored.iter().zip(sources).enumerate() {
                let values = std::iter::once(("reward".to_string(), s.score))
                    .chain(s.extra.iter().map(|(name, &v)| (name.clone(), v)))
                    .collect();
                records.push(ValRecord {
                    source: source.as_str().unwrap_or("unknown").to_string(),
                    prompt: c * chunk_size + i / per_prompt,
                    values,
                    pred: s.pred.clone(),
                });
            }
            total += scores.iter().sum::<f64>();
            count += scores.len();
        }
        if let Some(dir) = &self.cfg.trainer.validation_data_dir {
            super::dump::write_generations(dir, self.global_step, &dump)?;
        }
        let to_log = self.cfg.trainer.log_val_generations;
        if to_log > 0 {
            let picked = super::val_metrics::generations_to_log(generations, to_log);
            self.log.record_generations(self.global_step, &picked);
        }
        let samples: Vec<_> = records.iter().map(ValRecord::sample).collect();
        let mut metrics = super::val_metrics::validation_metrics(&samples);
        metrics.insert("val/score/mean".into(), total / count.max(1) as f64);
        Ok(metrics)
    }

    /// Supervised warm-up on ground-truth answers (`trainer.sft_warmup_steps`), then the
    /// reference policy is set to the warmed-up actor.
    pub async fn warm_up(&mut self) -> Result<(), TrainError> {
        let steps = self.cfg.trainer.sft_warmup_steps;
        let b = self.cfg.data.train_batch_size * self.cfg.actor_rollout_ref.rollout.n;
        for s in 0..steps {
            let rows: Vec<&PromptRow> = (0..b)
                .map(|i| &self.train[(s as usize * b + i) % self.train.len()])
                .collect();
            let batch =
                sft_batch::<Infer>(&rows, &self.codec, &Default::default()).map_err(setup)?;
            let out = self
                .actor
                .call_proto(&DispatchMode::MegatronCompute, "sft_step", batch)
                .await?;
            let m = metrics_of(&out);
            self.log.sft(s + 1, steps, &m.reduce()).map_err(setup)?;
        }
        // Without warm-up steps the reference built with the actor already is its policy.
        if self.needs_ref && steps > 0 {
            self.actor.call_all::<_, ()>("set_reference", &()).await?;
        }
        Ok(())
    }

    /// One PPO / GRPO step on `rows`, every phase in verl's order; returns the step's metrics
    /// (verl's names).
    pub async fn step(&mut self, step: u64, rows: &[&PromptRow]) -> Result<Metrics, TrainError> {
        let mut batch = self.generate(step, rows).await?;
        self.score(&mut batch).await?;
        self.compute_ref_log_prob(&mut batch).await?;
        self.compute_values(&mut batch).await?;
        self.compute_advantages(&mut batch)?;
        self.update_critic(&mut batch).await?;
        self.update_actor(&mut batch).await?;
        self.finish_step(batch)
    }

    /// Samples `rollout.n` responses per prompt of `rows` with the current policy, and the old
    /// log-probs (recomputed by the actor, in the same call unless the rollout's layout differs
    /// from the actor's).
    pub async fn generate(
        &mut self,
        step: u64,
        rows: &[&PromptRow],
    ) -> Result<StepBatch, TrainError> {
        let started = Instant::now();
        let mut metrics = Metrics::default();
        let mut batch = prompt_batch::<Infer>(
            rows,
            self.codec.pad_token_id(),
            &format!("s{step}"),
            &Default::default(),
        )?;
        batch.meta_info.insert("global_steps".into(), step.into());
        // The rollout's chunks are not the actor's (pipeline stages, or the rollout's own
        // tensor parallel size), so the old log-probs are a separate pass; in bypass mode
        // there is none.
        if self.old_log_prob_apart || self.bypass {
            batch
                .meta_info
                .insert("recompute_log_prob".into(), Value::Bool(false));
        }
        let t = Instant::now();
        let mut gen = self
            .actor
            .call_proto(&rollout_mesh(), "generate_sequences", batch)
            .await?;
        let worker_metrics = metrics_of(&gen);
        gen.meta_info.remove("metrics");
        // The rollout alone: the old log-probs' recompute is timed apart (ranks run in
        // parallel, so the slowest one's time).
        let recompute: f64 = worker_metrics
            .0
            .get("timing_s/old_log_prob")
            .map(|v| v.iter().copied().fold(0.0, f64::max))
            .unwrap_or(0.0);
        metrics.extend(worker_metrics);
        metrics.push("timing_s/gen", t.elapsed().as_secs_f64() - recompute);
        if self.bypass {
            // Bypass mode: the sampler's log-probs are the old ones (verl's apply_bypass_mode).
            let rollout = gen.float::<2>("rollout_log_probs").map_err(|_| {
                TrainError::Setup(
                    "algorithm.rollout_correction.bypass_mode: the rollout returned no \
                     rollout_log_probs (a custom rollout engine must honour \
                     calculate_log_probs)"
                        .into(),
                )
            })?;
            gen.insert_float("old_log_probs", rollout)?;
        } else if self.old_log_prob_apart {
            let t = Instant::now();
            let old = self
                .actor
                .call_proto(
                    &DispatchMode::MegatronCompute,
                    "compute_log_prob",
                    gen.clone(),
                )
                .await?;
            gen = gen.union(take_metrics(old, &mut metrics))?;
            metrics.push("timing_s/old_log_prob", t.elapsed().as_secs_f64());
        }
        Ok(StepBatch {
            step,
            data: gen,
            metrics,
            scores: Vec::new(),
            lengths: Vec::new(),
            started,
        })
    }

    /// Scores every response: the reward model's token scores when there is one (as verl's
    /// reward manager returns `rm_scores`), else the trainer's reward function (the builder's,
    /// or the rule-based scorer of each row's `data_source`) at each response's last token.
    /// Adds `token_level_scores`.
    pub async fn score(&mut self, batch: &mut StepBatch) -> Result<(), TrainError> {
        let t = Instant::now();
        let (scored, lengths) = self.rewards_with_extras(&batch.data).await?;
        let rule_scores: Vec<f64> = scored.iter().map(|s| s.score).collect();
        let (scores, token_scores) = match &self.reward_model {
            Some(rm) => {
                let out = rm
                    .call_proto(
                        &DispatchMode::MegatronCompute,
                        "compute_rm_score",
                        batch.model_inputs()?,
                        |w, _, d| Box::pin(w.compute_rm_score(d)),
                    )
                    .await?;
                let token = out.float::<2>("rm_scores")?;
                let per_seq: Vec<f64> = token
                    .clone()
                    .sum_dim(1)
                    .into_data()
                    .convert::<f64>()
                    .iter::<f64>()
                    .collect();
                batch.time("rm", t);
                (per_seq, token)
            }
            None => {
                let token = token_level_rewards(&rule_scores, &batch.mask()?).map_err(setup)?;
                (rule_scores, token)
            }
        };
        batch.time("reward", t);
        if let Ok(e) = batch.data.float::<2>("entropys") {
            let mean = verl_core::algorithms::masked::masked_mean(e, batch.mask()?)
                .into_scalar()
                .elem::<f64>();
            batch.metrics.push("actor/entropy_rollout", mean);
        }
        batch
            .data
            .insert_float("token_level_scores", token_scores)?;
        if let Some(dir) = &self.cfg.trainer.rollout_data_dir {
            let t = Instant::now();
            let lines = super::dump::generation_lines(
                &batch.data,
                &self.codec,
                &scores,
                &scored,
                batch.step,
            )?;
            super::dump::write_generations(dir, batch.step, &lines)?;
            batch.time("dump_rollout_generations", t);
        }
        batch.scores = scores;
        batch.lengths = lengths;
        Ok(())
    }

    /// The reference policy's log-probs (`ref_log_prob`), when the run has a reference (a KL
    /// loss or a KL penalty in the reward).
    pub async fn compute_ref_log_prob(&mut self, batch: &mut StepBatch) -> Result<(), TrainError> {
        if !self.needs_ref {
            return Ok(());
        }
        let t = Instant::now();
        let r = self
            .actor
            .call_proto(
                &DispatchMode::MegatronCompute,
                "compute_ref_log_prob",
                batch.model_inputs()?,
            )
            .await?;
        batch.data = batch
            .data
            .clone()
            .union(take_metrics(r, &mut batch.metrics))?;
        batch.time("ref", t);
        Ok(())
    }

    /// The critic's values (`values`), when the run has a critic.
    pub async fn compute_values(&mut self, batch: &mut StepBatch) -> Result<(), TrainError> {
        let Some(critic) = &self.critic else {
            return Ok(());
        };
        let t = Instant::now();
        let v = critic
            .call_proto(
                &DispatchMode::MegatronCompute,
                "compute_values",
                batch.model_inputs()?,
            )
            .await?;
        batch.data = batch
            .data
            .clone()
            .union(take_metrics(v, &mut batch.metrics))?;
        batch.time("values", t);
        Ok(())
    }

    /// `token_level_rewards` (the scores, minus the KL penalty with
    /// `algorithm.use_kl_in_reward`), then `advantages` and `returns` from the estimator
    /// `algorithm.adv_estimator` names (verl's, or one registered through the builder).
    pub fn compute_advantages(&mut self, batch: &mut StepBatch) -> Result<(), TrainError> {
        let t = Instant::now();
        let mask = batch.mask()?;
        let scores = batch.data.float::<2>("token_level_scores")?;
        let rewards = if self.cfg.algorithm.use_kl_in_reward {
            let (r, m) = apply_kl_penalty(
                scores,
                batch.data.float::<2>("old_log_probs")?,
                batch.data.float::<2>("ref_log_prob")?,
                mask.clone(),
                self.kl_ctrl.as_mut(),
                self.kl_penalty,
            )
            .map_err(setup)?;
            batch.metrics.extend(m);
            r
        } else {
            scores
        };
        let mask = self.correct_rollout(batch, mask)?;
        let uids: Vec<String> = batch
            .data
            .non_tensor("uid")?
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_string())
            .collect();
        let alg = &self.cfg.algorithm;
        let mut input = AdvantageInput::new(rewards.clone(), mask)
            .with_index(&uids)
            .with_gamma_lam(alg.gamma, alg.lam);
        input.norm_adv_by_std_in_grpo = alg.norm_adv_by_std_in_grpo;
        if self.critic.is_some() {
            input = input.with_values(batch.data.float::<2>("values")?);
        }
        if batch.data.contains("rollout_is_weights") {
            input.rollout_is_weights = Some(batch.data.float::<2>("rollout_is_weights")?);
        }
        let (adv, returns) = self
            .advantages
            .compute(&alg.adv_estimator, &input)
            .map_err(setup)?;
        batch.data.insert_float("advantages", adv)?;
        batch.data.insert_float("returns", returns)?;
        batch.data.insert_float("token_level_rewards", rewards)?;
        batch.time("adv", t);
        Ok(())
    }

    /// `algorithm.rollout_correction`: truncated importance weights (`rollout_is_weights`) and
    /// rejection (a new `response_mask`) from the rollout's log-probs against training's
    /// recompute. Returns the mask the advantages use.
    fn correct_rollout(
        &self,
        batch: &mut StepBatch,
        mask: Tensor<Infer, 2>,
    ) -> Result<Tensor<Infer, 2>, TrainError> {
        use verl_core::algorithms::rollout_correction::{
            rollout_correction, rollout_probs_diff_metrics,
        };
        // Bypass mode corrects inside the actor's loss, against the evolving policy.
        let Some(correction) = self.rollout_correction.as_ref().filter(|_| !self.bypass) else {
            return Ok(mask);
        };
        // Without the rollout's log-probs there is nothing to compare (verl's condition too).
        if !batch.data.contains("rollout_log_probs") {
            return Ok(mask);
        }
        let old = batch.data.float::<2>("old_log_probs")?;
        let rollout = batch.data.float::<2>("rollout_log_probs")?;
        // The mismatch metrics every step, as verl logs them (its debug metrics and the
        // correction's rollout_corr/ off-policy metrics), whether or not the correction acts.
        for (k, v) in rollout_probs_diff_metrics(&old, &rollout, &mask) {
            batch.metrics.push(k, v);
        }
        let out = rollout_correction(old, rollout, mask.clone(), correction).map_err(setup)?;
        for (k, v) in out.metrics {
            batch.metrics.push(k, v);
        }
        if !correction.is_active() {
            return Ok(mask);
        }
        if let Some(w) = out.weights {
            batch.data.insert_float("rollout_is_weights", w)?;
        }
        batch
            .data
            .insert_int("response_mask", out.response_mask.clone().int())?;
        Ok(out.response_mask)
    }

    /// The critic's PPO update on the batch's values and returns (when the run has a critic).
    pub async fn update_critic(&mut self, batch: &mut StepBatch) -> Result<(), TrainError> {
        let Some(critic) = &self.critic else {
            return Ok(());
        };
        let t = Instant::now();
        let inputs = batch.columns(&[
            "input_ids",
            "attention_mask",
            "position_ids",
            "responses",
            "response_mask",
            "values",
            "returns",
        ])?;
        let mut inputs = inputs;
        if let Some((_, dp)) = self.balance_dp {
            balance(&mut inputs, dp, "critic", &mut batch.metrics)?;
        }
        let out = critic
            .call_proto(&DispatchMode::MegatronCompute, "update_critic", inputs)
            .await?;
        batch.metrics.extend(metrics_of(&out));
        batch.time("update_critic", t);
        Ok(())
    }

    /// The actor's PPO update on the batch's advantages (after `trainer.critic_warmup` steps).
    pub async fn update_actor(&mut self, batch: &mut StepBatch) -> Result<(), TrainError> {
        if batch.step <= self.cfg.trainer.critic_warmup {
            return Ok(());
        }
        let mut keys = vec![
            "input_ids",
            "attention_mask",
            "position_ids",
            "responses",
            "response_mask",
            "old_log_probs",
            "advantages",
        ];
        if self.cfg.actor_rollout_ref.actor.use_kl_loss {
            keys.push("ref_log_prob");
        }
        if batch.data.contains("rollout_is_weights") {
            keys.push("rollout_is_weights");
        }
        // The actor tracks the moving policy against the sampler (verl's actors do).
        if !self.bypass && batch.data.contains("rollout_log_probs") {
            keys.push("rollout_log_probs");
        }
        // Router replay R3: the rollout's routing, replayed by the update.
        if batch.data.contains("routed_experts") {
            keys.push("routed_experts");
        }
        let mut inputs = batch.columns(&keys)?;
        if let Some((dp, _)) = self.balance_dp {
            balance(&mut inputs, dp, "actor", &mut batch.metrics)?;
        }
        let out = self
            .actor
            .call_proto(&DispatchMode::MegatronCompute, "update_actor", inputs)
            .await?;
        // The actor's `rollout_corr/` figures replace the trainer's of the same names, as
        // verl's metrics dict takes the later update; every other series adds up (memory
        // peaks, phase times).
        let mut actor = metrics_of(&out);
        let corrections = Metrics(
            actor
                .0
                .extract_if(.., |k, _| k.starts_with("rollout_corr/"))
                .collect(),
        );
        batch.metrics.replace_with(corrections);
        batch.metrics.extend(actor);
        Ok(())
    }

    /// The step's metrics: the phases' and the batch's data metrics under verl's names
    /// (scores, rewards, advantages, returns, values, response lengths, throughput).
    pub fn finish_step(&self, batch: StepBatch) -> Result<Metrics, TrainError> {
        let mask = batch.mask()?;
        let StepBatch {
            data,
            mut metrics,
            scores,
            lengths,
            started,
            ..
        } = batch;
        use super::data_metrics::{explained_variance, length_stats, masked_stats};
        let host = |t: Tensor<Infer, 2>| -> Vec<f64> {
            t.into_data().convert::<f64>().iter::<f64>().collect()
        };
        let response_mask: Vec<bool> = host(mask.clone()).iter().map(|&m| m > 0.0).collect();
        let mut push3 = |key: &str, stats: Option<(f64, f64, f64)>| {
            if let Some((mean, hi, lo)) = stats {
                metrics.push(format!("{key}/mean"), mean);
                metrics.push(format!("{key}/max"), hi);
                metrics.push(format!("{key}/min"), lo);
            }
        };
        let every = vec![true; scores.len()];
        push3("critic/score", masked_stats(&scores, &every));
        if let Ok(r) = data.float::<2>("token_level_rewards") {
            let sums = host((r * mask.clone()).sum_dim(1));
            push3("critic/rewards", masked_stats(&sums, &every));
        }
        // verl's advantages, returns and values statistics: over the response tokens.
        let token_column = |name: &str| data.float::<2>(name).ok().map(host);
        let advantages = token_column("advantages");
        let (returns, values) = (token_column("returns"), token_column("values"));
        for (name, column) in [
            ("advantages", &advantages),
            ("returns", &returns),
            ("values", &values),
        ] {
            if let Some(v) = column {
                push3(&format!("critic/{name}"), masked_stats(v, &response_mask));
            }
        }
        if let (Some(r), Some(v)) = (&returns, &values) {
            metrics.push(
                "critic/vf_explained_var",
                explained_variance(r, v, &response_mask),
            );
        }
        let (rollout, data_cfg) = (&self.cfg.actor_rollout_ref.rollout, &self.cfg.data);
        let response_limit = rollout
            .response_length
            .unwrap_or(data_cfg.max_response_length) as f64;
        let prompt_limit = rollout.prompt_length.unwrap_or(data_cfg.max_prompt_length) as f64;
        let attention = verl_megatron::workers::batch::float_col(&data, "attention_mask")?;
        let [_, width] = attention.dims();
        let prompt_width = width.saturating_sub(mask.dims()[1]);
        let prompt_lengths = host(attention.clone().narrow(1, 0, prompt_width).sum_dim(1));
        for (key, lens, limit) in [
            ("response_length", &lengths, response_limit),
            ("prompt_length", &prompt_lengths, prompt_limit),
        ] {
            let (mean, hi, lo, clipped) = length_stats(lens, limit);
            metrics.push(format!("{key}/mean"), mean);
            metrics.push(format!("{key}/max"), hi);
            metrics.push(format!("{key}/min"), lo);
            metrics.push(format!("{key}/clip_ratio"), clipped);
        }
        let step_s = started.elapsed().as_secs_f64();
        let tokens: f64 = attention.sum().into_scalar().elem::<f64>();
        metrics.push("timing_s/step", step_s);
        metrics.push("perf/time_per_step", step_s);
        metrics.push("perf/total_num_tokens", tokens);
        // verl's time per token of each phase: generation over the response tokens, the
        // passes over whole sequences over all tokens.
        let response_tokens: f64 = lengths.iter().sum();
        for (phase, count) in [
            ("gen", response_tokens),
            ("ref", tokens),
            ("values", tokens),
            ("adv", tokens),
            ("update_critic", tokens),
            ("update_actor", tokens),
        ] {
            let seconds = metrics
                .0
                .get(&format!("timing_s/{phase}"))
                .and_then(|v| v.last().copied());
            if let (Some(seconds), true) = (seconds, count > 0.0) {
                metrics.push(
                    format!("timing_per_token_ms/{phase}"),
                    seconds * 1e3 / count,
                );
            }
        }
        // verl's definition: tokens per second per GPU (rank) of the run.
        let ranks = (self.cfg.trainer.n_gpus_per_node * self.cfg.trainer.nnodes).max(1) as f64;
        metrics.push("perf/throughput", tokens / step_s.max(1e-9) / ranks);
        Ok(metrics)
    }
}

/// `data` without the metrics a worker returned in it, which go into `metrics`.
/// `trainer.balance_batch`: reorders an update's rows so that the `dp` contiguous chunks the
/// ranks receive carry balanced token counts (rows are independent by then: their advantages
/// and returns are computed), and logs verl's `global_seqlen/*` figures (the actor's only, as
/// verl's one reorder gives them).
fn balance(
    inputs: &mut DataProto<Infer>,
    dp: usize,
    role: &str,
    metrics: &mut Metrics,
) -> Result<(), TrainError> {
    use verl_core::algorithms::balance::{balanced_order, chunk_sums, verl_workload};
    let lens: Vec<usize> = inputs
        .int::<2>("attention_mask")?
        .sum_dim(1)
        .into_data()
        .convert::<i64>()
        .iter::<i64>()
        .map(|v| v.max(0) as usize)
        .collect();
    // Balanced as verl balances: by the rows' estimated compute; reported in tokens.
    let workloads: Vec<usize> = lens.iter().map(|&l| verl_workload(l)).collect();
    let order = balanced_order(&workloads, dp);
    if role == "actor" {
        let k = dp.max(1);
        let before = chunk_sums(&lens, &(0..lens.len()).collect::<Vec<_>>(), k);
        let after = chunk_sums(&lens, &order, k);
        let lo = |s: &[usize]| s.iter().min().copied().unwrap_or(0) as f64;
        let hi = |s: &[usize]| s.iter().max().copied().unwrap_or(0) as f64;
        metrics.push("global_seqlen/min", lo(&before));
        metrics.push("global_seqlen/max", hi(&before));
        metrics.push("global_seqlen/minmax_diff", hi(&before) - lo(&before));
        metrics.push(
            "global_seqlen/mean",
            lens.iter().sum::<usize>() as f64 / k as f64,
        );
        metrics.push("global_seqlen/balanced_min", lo(&after));
        metrics.push("global_seqlen/balanced_max", hi(&after));
    }
    inputs.reorder(&order)?;
    Ok(())
}

pub(super) fn take_metrics<B: Backend>(
    mut data: DataProto<B>,
    metrics: &mut Metrics,
) -> DataProto<B> {
    metrics.extend(metrics_of(&data));
    data.meta_info.remove("metrics");
    data
}

/// The metrics a worker returned in `meta_info["metrics"]` (one object of lists per rank, or
/// a list of them after collecting several ranks).
pub fn metrics_of<B: Backend>(data: &DataProto<B>) -> Metrics {
    let mut out = Metrics::default();
    let mut add = |obj: &serde_json::Map<String, Value>| {
        for (k, v) in obj {
            match v {
                Value::Array(xs) => xs
                    .iter()
                    .filter_map(Value::as_f64)
                    .for_each(|x| out.push(k.clone(), x)),
                other => {
                    if let Some(x) = other.as_f64() {
                        out.push(k.clone(), x)
                    }
                }
            }
        }
    };
    match data.meta_info.get("metrics") {
        Some(Value::Object(o)) => add(o),
        Some(Value::Array(parts)) => parts.iter().filter_map(Value::as_object).for_each(&mut add),
        _ => {}
    }
    out
}

/// How `generate_sequences` is dispatched: verl's rollout mesh (each rollout tensor-parallel
/// group one chunk, collected from its first rank).
pub(super) fn rollout_mesh() -> DispatchMode {
    DispatchMode::Nd {
        mesh: verl_core::dispatch::MESH_ROLLOUT.into(),
    }
}

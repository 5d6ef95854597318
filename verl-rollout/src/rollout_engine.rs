//! [`NativeRollout`] behind the core [`RolloutEngine`] trait: verl's batch layout in and out,
//! per-tensor weight updates, and sleep / wake-up.

use std::collections::HashMap;

use async_trait::async_trait;
use futures::StreamExt;
use verl_core::traits::{RolloutEngine, SleepLevel};
use verl_core::{DataProto, NamedTensor, Result, WeightStream};
use verl_megatron::models::CausalLm;
use verl_megatron::parallel::ParallelBackend;

use crate::agent::{run_agent_loop, AgentFinish, AgentRequest, Trajectory};
use crate::engine::{Completion, FinishReason, NativeRollout, Request};
use crate::error::RolloutError;
use crate::layout::{build_output, read_prompts};
use crate::sampling::Sampler;

/// The non-tensor column giving each prompt's index in the whole batch: the rollout seeds the
/// prompt's samples by it, so they do not depend on how the batch is split over ranks.
pub const PROMPT_INDEX_KEY: &str = "prompt_index";

/// The non-tensor column an agent-loop rollout adds (verl's `tool_extra_fields`): per response,
/// `{"turn_scores": [...], "tool_rewards": [...]}`, merged into the row's `extra_info` before
/// scoring, as verl's reward managers do.
pub const TOOL_EXTRA_FIELDS_KEY: &str = "tool_extra_fields";

/// Per-call settings read from `meta_info`, as verl's rollout reads them: `validate` (use
/// `val_kwargs`), `do_sample` (false: greedy, one sample), `n`, `temperature`, `max_tokens`
/// (at most `response_length` new tokens per response); and `global_steps`, which seeds the
/// call's requests.
///
/// A non-tensor column [`PROMPT_INDEX_KEY`] (integers) gives each prompt's index in the whole
/// batch; samples are seeded by it (else by the row's place in this call), so splitting a batch
/// over data-parallel ranks leaves every sample unchanged.
/// One generation call's prompts and requests, before generating.
struct PreparedCall {
    rows: Vec<Vec<u32>>,
    width: usize,
    n: usize,
    sampling: crate::SamplingParams,
    max_new_tokens: usize,
    /// The call's number in the requests' seeds.
    call: u64,
    requests: Vec<Request>,
    /// Each request's id (its sampler's seed).
    ids: Vec<u64>,
}

struct CallSettings {
    sampling: crate::SamplingParams,
    n: usize,
    max_tokens: Option<u64>,
}

impl<B: ParallelBackend> NativeRollout<B> {
    fn call_settings(&self, proto: &DataProto<B>) -> CallSettings {
        let meta = &proto.meta_info;
        let flag = |k: &str| meta.get(k).and_then(serde_json::Value::as_bool);
        let cfg = &self.config;
        let (mut sampling, mut n) = if flag("validate") == Some(true) {
            (cfg.val_sampling, cfg.val_n)
        } else {
            (cfg.sampling, cfg.n)
        };
        if flag("do_sample") == Some(false) {
            sampling.temperature = 0.0;
            n = 1;
        }
        if let Some(t) = meta.get("temperature").and_then(serde_json::Value::as_f64) {
            if sampling.temperature > 0.0 {
                sampling.temperature = t;
            }
        }
        if let Some(k) = meta.get("n").and_then(serde_json::Value::as_u64) {
            n = k as usize;
        }
        CallSettings {
            sampling,
            n,
            max_tokens: meta.get("max_tokens").and_then(serde_json::Value::as_u64),
        }
    }

    /// Generates for a batch in verl's layout (see [`crate::layout`]).
    pub fn generate_proto(&mut self, prompts: &DataProto<B>) -> Result<DataProto<B>, RolloutError> {
        let mut call = self.prepare_call(prompts)?;
        let completions = self.generate(std::mem::take(&mut call.requests))?;
        self.finish_call(prompts, &call, &completions, None)
    }

    /// Runs the agent loop set by [`Self::with_agent`] for every sample of the batch (each
    /// trajectory's first turn seeded as the single-turn request would be) and writes verl's
    /// layout, `response_mask` 0 on the tools' tokens.
    pub async fn generate_agent_proto(
        &mut self,
        prompts: &DataProto<B>,
    ) -> Result<DataProto<B>, RolloutError> {
        let call = self.prepare_call(prompts)?;
        let agent = self.agent.take().ok_or(RolloutError::Config {
            field: "agent",
            value: "none".into(),
            message: "no agent loop is set: build the engine with_agent".into(),
        })?;
        let mut cfg = agent.config.clone();
        cfg.response_length = call.max_new_tokens;
        // Request j is sample j % n of row j / n; its tools read the row's tools_kwargs.
        let extra = prompts.non_tensor("extra_info").ok();
        let requests = call
            .requests
            .iter()
            .zip(&call.ids)
            .enumerate()
            .map(|(j, (r, &id))| AgentRequest {
                prompt: r.prompt.clone(),
                id,
                tools_kwargs: extra
                    .and_then(|e| e.get(j / call.n))
                    .and_then(|row| row.get("tools_kwargs"))
                    .cloned()
                    .unwrap_or(serde_json::Value::Null),
            })
            .collect();
        cfg.sampling = call.sampling;
        let run = run_agent_loop(self, &*agent.chat, &agent.tools, requests, &cfg).await;
        self.agent = Some(agent);
        let trajectories = run?;
        let completions: Vec<Completion> = trajectories
            .iter()
            .map(|t| Completion {
                tokens: t.response.clone(),
                log_probs: t
                    .log_probs
                    .clone()
                    .unwrap_or_else(|| vec![0.0; t.response.len()]),
                finish: match t.finish {
                    AgentFinish::Length => FinishReason::Length,
                    _ => FinishReason::Stop,
                },
                routed_experts: Vec::new(),
            })
            .collect();
        let masks: Vec<Vec<u8>> = trajectories
            .iter()
            .map(|t| t.response_mask.clone())
            .collect();
        let mut out = self.finish_call(prompts, &call, &completions, Some(&masks))?;
        // verl's `tool_extra_fields`: what its reward managers merge into each row's
        // `extra_info` for the reward function (the tool rewards; no turn scores without
        // interactions).
        out.insert_non_tensor(
            TOOL_EXTRA_FIELDS_KEY,
            trajectories
                .iter()
                .map(|t| serde_json::json!({"turn_scores": [], "tool_rewards": t.tool_rewards}))
                .collect(),
        )?;
        let mean = |f: &dyn Fn(&Trajectory) -> usize| {
            trajectories.iter().map(f).sum::<usize>() as f64 / trajectories.len().max(1) as f64
        };
        if let Some(metrics) = out
            .meta_info
            .get_mut("metrics")
            .and_then(serde_json::Value::as_object_mut)
        {
            metrics.insert(
                "rollout/agent_turns_mean".into(),
                serde_json::json!([mean(&|t| t.assistant_turns)]),
            );
            metrics.insert(
                "rollout/tool_calls_mean".into(),
                serde_json::json!([mean(&|t| t.tool_calls)]),
            );
            metrics.insert(
                "rollout/malformed_tool_calls".into(),
                serde_json::json!([trajectories
                    .iter()
                    .map(|t| t.malformed_calls)
                    .sum::<usize>()]),
            );
        }
        Ok(out)
    }

    /// A call's prompts, settings and requests (each prompt's `n` samples, consecutive).
    fn prepare_call(&self, prompts: &DataProto<B>) -> Result<PreparedCall, RolloutError> {
        let settings = self.call_settings(prompts);
        if settings.n == 0 {
            return Err(RolloutError::Config {
                field: "meta_info.n",
                value: "0".into(),
                message: "must be at least 1".into(),
            });
        }
        let max_new_tokens = match settings.max_tokens {
            None => self.config.response_length,
            Some(m) if m >= 1 && m as usize <= self.config.response_length => m as usize,
            Some(m) => {
                return Err(RolloutError::Config {
                    field: "meta_info.max_tokens",
                    value: m.to_string(),
                    message: format!(
                        "1..={} new tokens fit (actor_rollout_ref.rollout.response_length)",
                        self.config.response_length
                    ),
                })
            }
        };
        let (rows, width) =
            read_prompts(prompts, self.config.prompt_length, self.config.truncation)?;
        // Requests are seeded by the call: the trainer's step when it says (`global_steps`, as
        // verl passes it; validation kept apart), so a resumed run samples what the
        // uninterrupted one would have; else the engine's own call counter.
        let meta = &prompts.meta_info;
        let call = match meta.get("global_steps").and_then(serde_json::Value::as_u64) {
            Some(step) => {
                let validate =
                    meta.get("validate").and_then(serde_json::Value::as_bool) == Some(true);
                (step << 1) | validate as u64
            }
            None => self.calls,
        };
        // A prompt's place in the whole batch when the caller says (PROMPT_INDEX_KEY), so a
        // data-parallel rank samples what one rank would for the same prompt.
        let indices = prompts.non_tensor(PROMPT_INDEX_KEY).ok();
        let mut requests = Vec::with_capacity(rows.len() * settings.n);
        let mut ids = Vec::with_capacity(rows.len() * settings.n);
        for (i, p) in rows.iter().enumerate() {
            let index = indices
                .and_then(|v| v.get(i))
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(i as u64);
            for k in 0..settings.n {
                let id = (call << 32) | (index * settings.n as u64 + k as u64);
                ids.push(id);
                requests.push(Request {
                    prompt: p.clone(),
                    sampler: Sampler::new(settings.sampling, id)?,
                    max_new_tokens,
                });
            }
        }
        Ok(PreparedCall {
            rows,
            width,
            n: settings.n,
            sampling: settings.sampling,
            max_new_tokens,
            call,
            requests,
            ids,
        })
    }

    /// The output batch of a prepared call from its completions (`masks`: each row's response
    /// mask, where the agent loop set one), with the rollout's metrics.
    fn finish_call(
        &self,
        prompts: &DataProto<B>,
        call: &PreparedCall,
        completions: &[Completion],
        masks: Option<&[Vec<u8>]>,
    ) -> Result<DataProto<B>, RolloutError> {
        let mut out = build_output(
            prompts,
            &call.rows,
            call.width,
            self.config.prompt_length,
            completions,
            masks,
            call.n,
            self.config.response_length,
            self.config.pad_token_id,
            self.config.calculate_log_probs,
            self.routing_shape().filter(|_| masks.is_none()),
            &format!("{}-{}", self.config.sampling.seed, call.call),
            &self.device,
        )?;
        let s = self.last_stats();
        // As metrics (lists, which concatenating ranks' outputs gathers), not a shared key.
        out.meta_info.insert(
            "metrics".into(),
            serde_json::json!({
                "rollout/prompt_tokens": [s.prompt_tokens],
                "rollout/generated_tokens": [s.generated_tokens],
                "rollout/decode_steps": [s.decode_steps],
                "rollout/peak_batch": [s.peak_batch],
                "rollout/seconds": [s.seconds],
                "rollout/prefill_seconds": [s.prefill_seconds],
                "rollout/reused_prefix_tokens": [s.reused_prefix_tokens],
                // Close to the decode time: the step is bound by the host issuing its work.
                "rollout/decode_enqueue_seconds": [s.decode_enqueue_seconds],
                "rollout/decode_tokens_per_s": [s.decode_tokens_per_second()],
            }),
        );
        Ok(out)
    }

    /// Applies a per-tensor weight stream: in place when the weights are loaded (each name and
    /// shape checked as it arrives), or by rebuilding the model after `sleep(All)` (every
    /// tensor required). Returns the number of tensors taken.
    pub async fn load_weight_stream(
        &mut self,
        mut weights: WeightStream<'_, B>,
    ) -> Result<usize, RolloutError> {
        let mut count = 0;
        // What the slots hold was computed with the weights being replaced.
        self.forget_prefixes();
        match self.model.as_mut() {
            Some(model) => {
                while let Some(t) = weights.next().await {
                    model.load_weight(t?.to_device(&self.device))?;
                    count += 1;
                }
                // Loading cleared the fused decode weights: stack the new values.
                model.prepare_generation();
            }
            None => {
                let mut staged: HashMap<String, NamedTensor<B>> = HashMap::new();
                while let Some(t) = weights.next().await {
                    let t = t?.to_device(&self.device);
                    staged.insert(t.name.clone(), t);
                    count += 1;
                }
                let model = CausalLm::from_named_shards(&self.model_config, staged, &self.tp)?
                    .with_compute_dtype(self.compute_dtype)
                    .with_generation_matrices();
                self.model = Some(model);
            }
        }
        Ok(count)
    }
}

#[async_trait(?Send)]
impl<B: ParallelBackend> RolloutEngine<B> for NativeRollout<B> {
    async fn generate_sequences(&mut self, prompts: DataProto<B>) -> Result<DataProto<B>> {
        match self.has_agent() {
            true => Ok(self.generate_agent_proto(&prompts).await?),
            false => Ok(self.generate_proto(&prompts)?),
        }
    }

    async fn update_weights(&mut self, weights: WeightStream<'_, B>) -> Result<()> {
        let n = self.load_weight_stream(weights).await?;
        tracing::debug!(tensors = n, "rollout weights updated");
        Ok(())
    }

    async fn sleep(&mut self, level: SleepLevel) -> Result<()> {
        self.free_cache();
        if level == SleepLevel::All {
            self.model = None;
        }
        self.sleeping = true;
        Ok(())
    }

    async fn wake_up(&mut self) -> Result<()> {
        if self.sleeping {
            self.sleeping = false;
            self.rebuild_cache();
        }
        Ok(())
    }

    fn is_sleeping(&self) -> bool {
        self.sleeping
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "calls": self.calls })
    }

    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        if let Some(c) = state.get("calls").and_then(serde_json::Value::as_u64) {
            self.calls = c;
        }
        Ok(())
    }
}

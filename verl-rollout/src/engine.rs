//! [`NativeRollout`]: batched, KV-cached generation with continuous batching.
//!
//! The engine owns a [`SlotKvCache`] of `slots` sequences. Each step it first admits waiting
//! requests into free slots (one right-padded prefill for all of them, bounded by
//! `max_num_batched_tokens`), then runs one decode step for every slot at once. A sequence
//! that stops frees its slot for the next request at once, so a batch larger than
//! `max_num_seqs` streams through. When no request waits and fewer than half the slots are
//! busy, the cache is compacted to the busy ones so the tail of a batch decodes cheaply.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::prelude::*;
use burn::tensor::{FloatDType, TensorData};
use verl_megatron::hf::HfModelConfig;
use verl_megatron::layers::precision::ComputeDtype;
use verl_megatron::models::router_replay::{record_routing, Routing};
use verl_megatron::models::{CausalLm, SlotKvCache};
use verl_megatron::parallel::{device_span, Collective, ParallelBackend, TpGroup};
use verl_megatron::sampling::{sample_rows, sample_vocab_parallel, RowSampling};

use crate::agent::Agent;
use crate::prefix_cache::SlotPrefixes;
use crate::routing::SlotRouting;

use crate::config::{EngineConfig, KvBudget, MemoryBase};
use crate::error::RolloutError;
use crate::sampling::Sampler;
use crate::stop::{Detokenizer, StopStrings};

/// What the KV cache stores keys and values as: bf16 with bf16 products (which round them to
/// bf16 before every product, so nothing changes but the cache's size, half of f32's, and the
/// decode step's reads of it), f32 otherwise. `VERL_KV_CACHE_DTYPE=f32` keeps f32 (to compare).
pub fn cache_dtype(compute: ComputeDtype) -> FloatDType {
    static F32_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let f32_only = *F32_ONLY.get_or_init(|| {
        std::env::var("VERL_KV_CACHE_DTYPE").is_ok_and(|v| v.eq_ignore_ascii_case("f32"))
    });
    match compute {
        ComputeDtype::Bf16 if !f32_only => FloatDType::BF16,
        _ => FloatDType::F32,
    }
}

/// The slots `config`'s KV budget allows on `device` now (at most `max_num_seqs`), agreed over
/// the tensor-parallel group `tp` (the smallest rank's: every rank of a group must decode the
/// same slots, and each measures its own card), with this rank's memory base and positions (a
/// debug event of target `verl_rollout::memory` each time). A collective over `tp`: its ranks
/// resolve together.
fn slots_in_budget<B: ParallelBackend>(
    config: &EngineConfig,
    (device, tp): (&B::Device, &TpGroup),
    per_position: usize,
    own_bytes: u64,
) -> (usize, MemoryBase, usize) {
    let base = MemoryBase::of(B::memory_usage(device), own_bytes);
    let positions = config.kv_budget.positions(base, per_position);
    let mut slots = (positions / config.max_model_len()).min(config.max_num_seqs);
    if tp.is_parallel() {
        // The group's minimum, as the maximum of the negated counts (exact in f32 below 2^24).
        let mine = Tensor::<B, 1>::from_floats([-(slots.min(1 << 24) as f32)], device);
        let least = tp.collective(mine, Collective::AllReduceMax).into_scalar();
        slots = (-least.elem::<f32>()).max(0.0) as usize;
    }
    tracing::debug!(
        target: "verl_rollout::memory",
        ?base,
        kv_budget = ?config.kv_budget,
        positions,
        slots,
        "KV budget resolved"
    );
    (slots, base, positions)
}

/// Bytes of the model's weights on this rank (what the rollout holds besides its cache).
fn weight_bytes<B: ParallelBackend>(model: &CausalLm<B>) -> u64 {
    model
        .export_shards()
        .iter()
        .map(|t| (t.values.dims()[0] * t.values.dtype().size()) as u64)
        .sum()
}

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub sampler: Sampler,
    pub max_new_tokens: usize,
}

/// Why a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS or stop token was sampled, or a token completed a stop string (kept as the
    /// last token).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    /// Each token's log-prob under the model at the sampling temperature (empty unless
    /// `calculate_log_probs`).
    pub log_probs: Vec<f32>,
    pub finish: FinishReason,
    /// With `EngineConfig::record_routing` on an MoE model, the experts each MoE layer chose
    /// for the prompt and every response token but the last (which is sampled, never fed):
    /// `[prompt + response - 1][num_hidden_layers][k]`, -1 for layers without experts. Empty
    /// otherwise.
    pub routed_experts: Vec<i64>,
}

/// What one call to [`NativeRollout::generate`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationStats {
    pub requests: usize,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_steps: usize,
    /// Prompt tokens run through prefills (less than `prompt_tokens` when samples of one
    /// prompt shared its prefill, or a slot already held the start of a prompt).
    pub prefilled_tokens: usize,
    /// Prompt tokens whose keys and values a finished request had left in the slot a request
    /// took ([`crate::prefix_cache`]): not prefilled again.
    pub reused_prefix_tokens: usize,
    pub decode_steps: usize,
    /// Most sequences decoded together.
    pub peak_batch: usize,
    /// Wall time of the whole call, and of its prefills.
    pub seconds: f64,
    pub prefill_seconds: f64,
    /// From the call's start to the first tokens (the first prefill's) on the host.
    pub first_token_seconds: f64,
    /// Whether tokens were sampled on the device (only ids and log-probs read back).
    pub sampled_on_device: bool,
    /// Host time spent issuing the decode steps' model work (on a GPU the work runs
    /// asynchronously: close to the decode time means the step is bound by launches).
    pub decode_enqueue_seconds: f64,
}

/// Where a step's results go: the slots, the finished requests' completions, and what the
/// slots hold once their requests finish.
type Placed<'a> = (
    &'a mut [Option<Active>],
    &'a mut [Option<Completion>],
    &'a mut SlotPrefixes,
);

/// One step's prefill work ([`NativeRollout::schedule`]): chunks that continue `(slot, first
/// position, tokens)`, admitted requests `(slot, request id, request, index into unique)`,
/// and the distinct prompts (or first chunks) to prefill.
struct StepPlan {
    continued: Vec<(usize, usize, Vec<u32>)>,
    admitted: Vec<(usize, usize, Request, usize)>,
    unique: Vec<Vec<u32>>,
}

struct Active {
    request: usize,
    /// The request's prompt (what a finished slot holds starts with it).
    prompt: Vec<u32>,
    /// Position the next fed token is written at (= tokens cached so far).
    pos: usize,
    /// Prompt tokens not cached yet (a chunked prefill in progress): the slot decodes once
    /// this is empty.
    pending: Vec<u32>,
    last: u32,
    tokens: Vec<u32>,
    log_probs: Vec<f32>,
    sampler: Sampler,
    max_new_tokens: usize,
}

impl Active {
    /// Request `request` (`req`) in a slot whose first `cached` prompt tokens are cached (or
    /// being prefilled this step).
    fn new(request: usize, req: &Request, cached: usize) -> Self {
        Self {
            request,
            prompt: req.prompt.clone(),
            pos: cached,
            pending: req.prompt[cached..].to_vec(),
            last: 0,
            tokens: Vec::new(),
            log_probs: Vec::new(),
            sampler: req.sampler.clone(),
            max_new_tokens: req.max_new_tokens,
        }
    }

    /// The tokens whose keys and values its slot holds once it finished with `completion`:
    /// the prompt and every response token but the last (sampled, never fed).
    fn cached(&self, completion: &Completion) -> Vec<u32> {
        let fed = completion.tokens.len().saturating_sub(1);
        [&self.prompt[..], &completion.tokens[..fed]].concat()
    }
}

/// The native rollout engine over a [`CausalLm`].
pub struct NativeRollout<B: ParallelBackend> {
    pub(crate) model_config: HfModelConfig,
    pub(crate) model: Option<CausalLm<B>>,
    pub(crate) config: EngineConfig,
    pub(crate) device: B::Device,
    /// The model's compute dtype, kept for rebuilding it after `sleep(All)`.
    pub(crate) compute_dtype: ComputeDtype,
    /// The engine's tensor-parallel group (`rollout.tensor_model_parallel_size`): each rank
    /// holds its heads' share of the weights and of the KV cache. Where the backend samples on
    /// the device, each rank draws from its vocabulary shard and the group combines a few
    /// numbers per row (`sample_vocab_parallel`); otherwise, or for rows with top-k or top-p,
    /// the vocabulary-parallel logits are gathered first (as vLLM does). Either way every rank
    /// of the group draws the same tokens, and the tokens a single GPU would.
    pub(crate) tp: TpGroup,
    cache: Option<SlotKvCache<B>>,
    /// What the cache's slots hold from finished requests (with `enable_prefix_caching`).
    prefixes: SlotPrefixes,
    /// The most slots the KV budget allows.
    max_slots: usize,
    /// Slots of the cache before the last sleep, rebuilt on wake-up.
    slots_before_sleep: usize,
    pub(crate) sleeping: bool,
    /// Generation calls so far: part of each request's seed.
    pub(crate) calls: u64,
    last_stats: GenerationStats,
    /// Reads the responses' text for stop strings ([`Self::with_detokenizer`]).
    detokenizer: Option<Arc<dyn Detokenizer>>,
    /// The experts each slot's cached positions were routed to (with `record_routing` on an
    /// MoE model), kept beside `prefixes`. Behind a lock because the steps that write it
    /// borrow the engine as they run the model.
    routing: Mutex<Option<SlotRouting>>,
    /// The agent loop `generate_sequences` runs ([`Self::with_agent`]), if any.
    pub(crate) agent: Option<Agent>,
}

impl<B: ParallelBackend> NativeRollout<B> {
    /// An engine over `model`. The KV budget is resolved here: it must hold at least one
    /// sequence of `prompt_length + response_length` positions.
    pub fn new(
        model_config: HfModelConfig,
        model: CausalLm<B>,
        config: EngineConfig,
        device: B::Device,
    ) -> Result<Self, RolloutError> {
        config.validate()?;
        let tp = model.tp.clone();
        if tp.sequence_parallel {
            return Err(RolloutError::Config {
                field: "actor_rollout_ref.rollout.tensor_model_parallel_size",
                value: tp.size.to_string(),
                message: "the rollout's tensor-parallel group runs without sequence parallel; \
                          build its model with a TpGroup that has it off"
                    .into(),
            });
        }
        let per_position = SlotKvCache::<B>::bytes_per_position(
            model_config.num_hidden_layers,
            model_config.num_key_value_heads / tp.size,
            model_config.head_dim,
            cache_dtype(model.compute_dtype),
        );
        // The generation model first: its bf16 matrices are what the rollout holds.
        let model = model.with_generation_matrices();
        let own_bytes = weight_bytes(&model);
        let (max_slots, base, positions) =
            slots_in_budget::<B>(&config, (&device, &tp), per_position, own_bytes);
        if max_slots == 0 {
            let gib = |b: u64| verl_core::memory::gib(b);
            let of = match (config.kv_budget, base) {
                (KvBudget::MemoryFraction(f), MemoryBase::Device { total, in_use, own }) => {
                    format!(
                        " ({f} of the device's {:.1} GiB less the rollout's {:.1} GiB of weights, \
                     at most what is free: {:.1} GiB in use)",
                        gib(total),
                        gib(own),
                        gib(in_use)
                    )
                }
                _ => String::new(),
            };
            return Err(RolloutError::Config {
                field: "actor_rollout_ref.rollout.gpu_memory_utilization",
                value: format!("{:?}", config.kv_budget),
                message: format!(
                    "the KV budget{of} holds {positions} positions, less than one sequence of {} \
                     ({per_position} bytes each); raise it or set `kv_cache_tokens`",
                    config.max_model_len()
                ),
            });
        }

        let compute_dtype = model.compute_dtype;
        Ok(Self {
            model_config,
            model: Some(model),
            config,
            device,
            compute_dtype,
            tp,
            cache: None,
            prefixes: SlotPrefixes::default(),
            max_slots,
            slots_before_sleep: 0,
            sleeping: false,
            calls: 0,
            last_stats: GenerationStats::default(),
            detokenizer: None,
            routing: Mutex::new(None),
            agent: None,
        })
    }

    /// The engine running `agent` for every sample of `generate_sequences` (multi-turn
    /// rollouts with tools; see [`crate::agent`]). Refused with `record_routing`: the loop's
    /// conversations do not carry routing yet.
    pub fn with_agent(mut self, agent: Agent) -> Result<Self, RolloutError> {
        if self.config.record_routing {
            return Err(RolloutError::Config {
                field: "actor_rollout_ref.rollout.enable_rollout_routing_replay",
                value: "true".into(),
                message: "an agent loop's rollout does not record routing yet: set it false".into(),
            });
        }
        self.agent = Some(agent);
        Ok(self)
    }

    /// Whether an agent loop is set.
    pub fn has_agent(&self) -> bool {
        self.agent.is_some()
    }

    /// The engine with a detokenizer (the model's tokenizer), which stop strings
    /// (`EngineConfig::stop`) need.
    pub fn with_detokenizer(mut self, detokenizer: Arc<dyn Detokenizer>) -> Self {
        self.detokenizer = Some(detokenizer);
        self
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn model_config(&self) -> &HfModelConfig {
        &self.model_config
    }

    /// The model, unless its weights were released by `sleep(All)`.
    pub fn model(&self) -> Option<&CausalLm<B>> {
        self.model.as_ref()
    }

    /// Sequences the KV budget lets the engine decode at once.
    pub fn max_slots(&self) -> usize {
        self.max_slots
    }

    /// Bytes the KV cache holds now (0 when freed).
    pub fn kv_cache_bytes(&self) -> usize {
        self.cache.as_ref().map_or(0, SlotKvCache::bytes)
    }

    /// Statistics of the last [`Self::generate`] call.
    pub fn last_stats(&self) -> GenerationStats {
        self.last_stats
    }

    pub(crate) fn free_cache(&mut self) {
        if let Some(c) = self.cache.take() {
            self.slots_before_sleep = c.slots();
        }
        self.prefixes = SlotPrefixes::default();
        *self.routing_mut() = None;
    }

    /// Forgets what the slots hold from finished requests: their keys and values came from
    /// weights that are being replaced.
    pub(crate) fn forget_prefixes(&mut self) {
        self.prefixes.clear();
        *self.routing_mut() = None;
    }

    /// `(num_hidden_layers, experts per token)` when the engine records each token's experts
    /// (`record_routing` on an MoE model): the shape of a position's routing.
    pub fn routing_shape(&self) -> Option<(usize, usize)> {
        let moe = self.model_config.moe.as_ref()?;
        self.config
            .record_routing
            .then_some((self.model_config.num_hidden_layers, moe.num_experts_per_tok))
    }

    fn routing_mut(&self) -> std::sync::MutexGuard<'_, Option<SlotRouting>> {
        self.routing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs one model call, recording its MoE layers' choices when the engine records
    /// routing; `place(i)` names where the call's token `i` goes (slot, position), if
    /// anywhere.
    fn run_model<T>(
        &self,
        call: impl FnOnce() -> T,
        tokens: usize,
        place: impl Fn(usize) -> Vec<(usize, usize)>,
    ) -> T {
        if self.routing_shape().is_none() {
            return call();
        }
        let (out, routing): (T, Routing) = record_routing(call);
        let targets: Vec<Vec<(usize, usize)>> = (0..tokens).map(place).collect();
        if let Some(r) = self.routing_mut().as_mut() {
            r.record(&routing, &targets);
        }
        out
    }

    /// The cache back after a sleep: as many slots as before, if the memory free now still
    /// allows them (resolved again, as [`Self::cache_for`] does).
    pub(crate) fn rebuild_cache(&mut self) {
        if self.slots_before_sleep > 0 {
            let now = self.slots_now();
            self.cache = Some(self.allocate(self.slots_before_sleep.min(now).max(1)));
        }
    }

    /// The slots the budget allows now, agreed over the tensor-parallel group.
    fn slots_now(&self) -> usize {
        let own = self.model.as_ref().map_or(0, weight_bytes);
        let (now, base, _) = slots_in_budget::<B>(
            &self.config,
            (&self.device, &self.tp),
            self.bytes_per_position(),
            own,
        );
        if now == 0 {
            tracing::warn!(
                "the KV budget ({:?} on {base:?}) holds no whole sequence of {} positions now; \
                 decoding one sequence at a time (lower the memory in use, or set \
                 actor_rollout_ref.rollout.kv_cache_tokens)",
                self.config.kv_budget,
                self.config.max_model_len()
            );
        }
        now
    }

    /// Bytes one cached position takes on this engine's rank.
    fn bytes_per_position(&self) -> usize {
        let m = &self.model_config;
        SlotKvCache::<B>::bytes_per_position(
            m.num_hidden_layers,
            m.num_key_value_heads / self.tp.size,
            m.head_dim,
            cache_dtype(self.compute_dtype),
        )
    }

    /// A cache for `requests` sequences, reusing `old` when it holds them all (or as many as the
    /// engine ever decodes at once). Otherwise `old` is freed first and the budget resolved
    /// again against the memory in use now: in a hybrid engine the actor's optimizer state and
    /// the other phases come and go, and a cache sized from the memory free when the engine was
    /// built can take what the actor now holds (an 8k-context 7B job's validation call asked
    /// for 53 GiB of cache on a card with 64 GiB already in use).
    /// Also says whether `old` was kept (what its slots hold is still there).
    fn cache_for(&self, old: Option<SlotKvCache<B>>, requests: usize) -> (SlotKvCache<B>, bool) {
        let enough = requests.min(self.max_slots).max(1);
        match old {
            Some(c) if c.slots() >= enough => (c, true),
            old => {
                drop(old);
                let now = self.slots_now();
                (self.allocate(enough.min(now).max(1)), false)
            }
        }
    }

    fn allocate(&self, slots: usize) -> SlotKvCache<B> {
        let m = &self.model_config;
        SlotKvCache::new_with_dtype(
            m.num_hidden_layers,
            m.num_key_value_heads / self.tp.size,
            m.head_dim,
            slots,
            self.config.max_model_len(),
            cache_dtype(self.compute_dtype),
            &self.device,
        )
    }

    /// Generates every request, returning completions in request order.
    pub fn generate(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>, RolloutError> {
        if self.sleeping {
            return Err(RolloutError::Asleep);
        }
        let model = self.model.as_ref().ok_or(RolloutError::WeightsReleased)?;
        let start = Instant::now();
        self.check_requests(&requests)?;
        let stop_strings = self.stop_strings()?;
        let stop_strings = stop_strings.as_ref();
        let mut stats = GenerationStats {
            requests: requests.len(),
            prompt_tokens: requests.iter().map(|r| r.prompt.len()).sum(),
            ..Default::default()
        };
        let old = self.cache.take();
        let (mut cache, kept) = self.cache_for(old, requests.len());
        let mut prefixes = std::mem::take(&mut self.prefixes);
        if !kept || prefixes.slots() != cache.slots() {
            prefixes = SlotPrefixes::new(cache.slots());
        }
        if let Some((layers, k)) = self.routing_shape() {
            let mut routing = self.routing_mut();
            if !kept || routing.as_ref().is_none_or(|r| r.slots() != cache.slots()) {
                *routing = Some(SlotRouting::new(cache.slots(), layers, k));
            }
        }
        let mut slots: Vec<Option<Active>> = (0..cache.slots()).map(|_| None).collect();
        let mut done: Vec<Option<Completion>> = (0..requests.len()).map(|_| None).collect();
        let mut waiting: VecDeque<(usize, Request)> = requests.into_iter().enumerate().collect();
        // Whether the response `tokens` ends with its last token.
        let stop = |cfg: &EngineConfig, tokens: &[u32]| {
            let tok = *tokens.last().expect("called after a token was added");
            (!cfg.ignore_eos && cfg.eos_token_ids.contains(&tok))
                || cfg.stop_token_ids.contains(&tok)
                || stop_strings.is_some_and(|s| s.completed_by_last(tokens))
        };
        self.trace_memory("start", 0);
        let mut steps = 0usize;
        loop {
            let plan = self.schedule(&mut slots, &mut waiting, &mut prefixes, &mut stats);
            if !plan.admitted.is_empty() || !plan.continued.is_empty() {
                let placed = (&mut slots[..], &mut done[..], &mut prefixes);
                let sampled = self.prefill(model, plan, &mut cache, placed, &stop, &mut stats);
                if sampled > 0 && stats.first_token_seconds == 0.0 {
                    stats.first_token_seconds = start.elapsed().as_secs_f64();
                }
                self.trace_memory("prefill", steps);
            }
            let busy = slots.iter().filter(|s| s.is_some()).count();
            if busy == 0 {
                if waiting.is_empty() {
                    break;
                }
                continue;
            }
            let decoding = slots
                .iter()
                .flatten()
                .filter(|a| a.pending.is_empty())
                .count();
            if decoding == 0 {
                // Only chunked prefills in flight: continue them.
                continue;
            }
            // Shrink the decode batch to the busy slots once nothing waits (unless finished
            // requests' prefixes are kept for the next call).
            if waiting.is_empty() && busy * 2 <= slots.len() && !self.config.keeps_prefixes() {
                let keep: Vec<usize> = (0..slots.len()).filter(|&s| slots[s].is_some()).collect();
                cache.retain(&keep);
                prefixes.keep(&keep);
                if let Some(r) = self.routing_mut().as_mut() {
                    r.keep(&keep);
                }
                slots.retain(|s| s.is_some());
            }
            stats.peak_batch = stats.peak_batch.max(decoding);
            self.decode(
                model,
                &mut cache,
                (&mut slots, &mut done, &mut prefixes),
                &stop,
                &mut stats,
            );
            steps += 1;
            if steps.is_multiple_of(64) {
                self.trace_memory("decode", steps);
            }
        }
        self.trace_memory("end", steps);
        self.cache = Some(cache);
        // Without `retain_prefixes` a call starts from no prefix: its tokens do not depend on
        // what earlier calls left.
        if !self.config.keeps_prefixes() {
            prefixes.clear();
            if let Some(r) = self.routing_mut().as_mut() {
                r.clear();
            }
        }
        self.prefixes = prefixes;
        self.calls += 1;
        let done: Vec<Completion> = done
            .into_iter()
            .map(|c| c.expect("every request completes"))
            .collect();
        stats.generated_tokens = done.iter().map(|c| c.tokens.len()).sum();
        stats.seconds = start.elapsed().as_secs_f64();
        self.last_stats = stats;
        Ok(done)
    }

    /// The device's memory at a point of a generation call, as a debug event of target
    /// `verl_rollout::memory` (`RUST_LOG=verl_rollout::memory=debug`): where a long-context
    /// rollout's memory goes, step by step. Nothing is read when the event is off.
    fn trace_memory(&self, at: &'static str, decode_steps: usize) {
        if !tracing::enabled!(target: "verl_rollout::memory", tracing::Level::DEBUG) {
            return;
        }
        if let Some(u) = B::memory_usage(&self.device) {
            let gib = verl_core::memory::gib;
            tracing::debug!(
                target: "verl_rollout::memory",
                at,
                decode_steps,
                call = self.calls,
                allocated_gib = gib(u.allocated),
                reserved_gib = gib(u.reserved),
                device_used_gib = gib(u.device_used),
            );
        }
    }

    /// Refuses a request the engine cannot serve, naming the row and the setting.
    fn check_requests(&self, requests: &[Request]) -> Result<(), RolloutError> {
        for (i, r) in requests.iter().enumerate() {
            if r.prompt.is_empty() {
                return Err(RolloutError::EmptyPrompt { row: i });
            }
            if r.max_new_tokens == 0 || r.max_new_tokens > self.config.response_length {
                return Err(RolloutError::Config {
                    field: "actor_rollout_ref.rollout.response_length",
                    value: r.max_new_tokens.to_string(),
                    message: format!(
                        "request {i} asks for {} new tokens; 1..={} fit",
                        r.max_new_tokens, self.config.response_length
                    ),
                });
            }
            // A prompt may be longer than prompt_length (an agent loop's later turns continue
            // the conversation) as long as it and its response fit a slot.
            let room = self.config.max_model_len() - r.max_new_tokens;
            if r.prompt.len() > room {
                return Err(RolloutError::PromptTooLong {
                    row: i,
                    len: r.prompt.len(),
                    limit: room,
                    field: "actor_rollout_ref.rollout.prompt_length",
                });
            }
        }
        Ok(())
    }

    /// The stop strings matched on the detokenized response, if any are set.
    fn stop_strings(&self) -> Result<Option<StopStrings>, RolloutError> {
        Ok(match (&self.detokenizer, self.config.stop.is_empty()) {
            (_, true) => None,
            (Some(d), false) => StopStrings::new(&self.config.stop, d.clone()),
            (None, false) => {
                return Err(RolloutError::Config {
                    field: "actor_rollout_ref.rollout.stop",
                    value: format!("{:?}", self.config.stop),
                    message: "stop strings are matched on text and this engine has no \
                          tokenizer; give it one (NativeRollout::with_detokenizer) or \
                          use stop_token_ids"
                        .into(),
                });
            }
        })
    }

    /// One step's prefill work: chunked prefills continue first, oldest slot first, within
    /// the token budget; then waiting requests take free slots, within what is left of the
    /// budget. With prefix caching, requests of one prompt admitted together (a prompt's n
    /// samples) share one prefill, and only its first counts against the budget; and a
    /// request takes the free slot holding the longest start of its prompt from a finished
    /// request ([`SlotPrefixes::choose`]), keeping those tokens and prefilling the rest as a
    /// continued chunk. With chunked prefill a prompt longer than what is left takes that much
    /// now and the rest in later steps; without, a prompt over the budget waits unless it is
    /// the step's only prefill.
    fn schedule(
        &self,
        slots: &mut [Option<Active>],
        waiting: &mut VecDeque<(usize, Request)>,
        prefixes: &mut SlotPrefixes,
        stats: &mut GenerationStats,
    ) -> StepPlan {
        let limit = self.config.max_num_batched_tokens;
        let caching = self.config.enable_prefix_caching;
        let mut budget = 0;
        let mut continued: Vec<(usize, usize, Vec<u32>)> = Vec::new();
        for (slot, state) in slots.iter_mut().enumerate() {
            let Some(a) = state.as_mut() else {
                continue;
            };
            if a.pending.is_empty() || budget >= limit {
                continue;
            }
            let take = a.pending.len().min(limit - budget);
            continued.push((slot, a.pos, a.pending.drain(..take).collect()));
            a.pos += take;
            budget += take;
        }
        let mut admitted: Vec<(usize, usize, Request, usize)> = Vec::new();
        let mut unique: Vec<Vec<u32>> = Vec::new();
        let mut seen: HashMap<Vec<u32>, usize> = HashMap::new();
        let mut free: Vec<usize> = (0..slots.len()).filter(|&s| slots[s].is_none()).collect();
        while let Some((_, next)) = waiting.front() {
            if free.is_empty() {
                break;
            }
            let shared = caching.then(|| seen.get(&next.prompt).copied()).flatten();
            let (slot, kept) = match (caching, shared) {
                (true, None) => {
                    let (slot, kept) = prefixes.choose(&free, &next.prompt);
                    // The samples of this prompt waiting with it would share one prefill of
                    // the whole prompt: resuming each from a slot is cheaper only when a slot
                    // holds most of it.
                    let siblings = waiting
                        .iter()
                        .take_while(|(_, r)| r.prompt == next.prompt)
                        .count();
                    match siblings * (next.prompt.len() - kept) < next.prompt.len() {
                        true => (slot, kept),
                        false => (prefixes.choose(&free, &[]).0, 0),
                    }
                }
                // A shared prefill's sample, or no caching: an empty slot, else the one whose
                // request finished longest ago.
                _ => (prefixes.choose(&free, &[]).0, 0),
            };
            let cost = match shared {
                Some(_) => 0,
                None => next.prompt.len() - kept,
            };
            let mut part = None;
            if budget + cost > limit {
                if self.config.enable_chunked_prefill && shared.is_none() && budget < limit {
                    part = Some(limit - budget);
                } else if !(admitted.is_empty() && continued.is_empty()) {
                    break;
                }
            }
            budget += part.unwrap_or(cost);
            let (id, req) = waiting.pop_front().expect("front exists");
            free.retain(|&s| s != slot);
            prefixes.take(slot);
            if kept > 0 {
                // The slot holds the prompt's first `kept` tokens: the rest (or this step's
                // part of it) continues from there.
                let take = part.unwrap_or(cost);
                continued.push((slot, kept, req.prompt[kept..kept + take].to_vec()));
                stats.reused_prefix_tokens += kept;
                slots[slot] = Some(Active::new(id, &req, kept + take));
            } else {
                let prompt = match (shared, part) {
                    (Some(p), _) => p,
                    // A first chunk: prefilled alone, not shared.
                    (None, Some(len)) => {
                        unique.push(req.prompt[..len].to_vec());
                        unique.len() - 1
                    }
                    (None, None) => {
                        seen.insert(req.prompt.clone(), unique.len());
                        unique.push(req.prompt.clone());
                        unique.len() - 1
                    }
                };
                admitted.push((slot, id, req, prompt));
            }
            if part.is_some() {
                break;
            }
        }
        StepPlan {
            continued,
            admitted,
            unique,
        }
    }

    /// Runs `plan`'s prefills (new prompts, shared where they are equal, and continued
    /// chunks) and samples the first token of each request whose whole prompt is now cached;
    /// returns how many sampled.
    fn prefill(
        &self,
        model: &CausalLm<B>,
        plan: StepPlan,
        cache: &mut SlotKvCache<B>,
        (slots, done, prefixes): Placed<'_>,
        stop: &impl Fn(&EngineConfig, &[u32]) -> bool,
        stats: &mut GenerationStats,
    ) -> usize {
        let StepPlan {
            continued,
            admitted,
            unique,
        } = plan;
        let prefill_start = Instant::now();
        let mut sampled = 0;
        if !admitted.is_empty() {
            let targets: Vec<(usize, usize)> =
                admitted.iter().map(|&(s, _, _, p)| (p, s)).collect();
            if let Some(r) = self.routing_mut().as_mut() {
                targets.iter().for_each(|&(_, slot)| r.truncate(slot, 0));
            }
            // The prompts right-padded to the longest: token j of prompt p feeds position j of
            // each of its slots.
            let width = unique.iter().map(Vec::len).max().unwrap_or(0);
            let place = |i: usize| {
                let (p, j) = (i / width, i % width);
                match j < unique[p].len() {
                    true => targets
                        .iter()
                        .filter(|t| t.0 == p)
                        .map(|t| (t.1, j))
                        .collect(),
                    false => Vec::new(),
                }
            };
            let logits = self.run_model(
                || {
                    device_span::<B, _>(&self.device, "prefill", || {
                        model.prefill_shared(&unique, &targets, cache)
                    })
                },
                unique.len() * width,
                place,
            );
            let logits = repeat_rows(logits, &targets);
            stats.prefilled_tokens += unique.iter().map(Vec::len).sum::<usize>();
            let mut fresh: Vec<Active> = admitted
                .iter()
                .map(|(_, id, req, p)| Active::new(*id, req, unique[*p].len()))
                .collect();
            // Only requests whose whole prompt is cached sample their first token.
            let rows = fresh
                .iter_mut()
                .map(|a| Some(a).filter(|a| a.pending.is_empty()))
                .collect();
            let picks = self.choose(logits, rows, stats);
            for (((slot, ..), active), pick) in admitted.into_iter().zip(fresh).zip(picks) {
                let placed = (&mut *slots, &mut *done, &mut *prefixes);
                sampled += self.settle(active, slot, pick, stop, placed) as usize;
            }
        }
        if !continued.is_empty() {
            let chunks: Vec<(usize, usize, &[u32])> = continued
                .iter()
                .map(|(slot, start, c)| (*slot, *start, c.as_slice()))
                .collect();
            if let Some(r) = self.routing_mut().as_mut() {
                chunks
                    .iter()
                    .for_each(|&(slot, start, _)| r.truncate(slot, start));
            }
            // Right-padded to the longest chunk: token j of chunk c is its slot's position
            // start + j.
            let width = chunks.iter().map(|c| c.2.len()).max().unwrap_or(0);
            let place = |i: usize| {
                let (slot, start, tokens) = chunks[i / width];
                match i % width < tokens.len() {
                    true => vec![(slot, start + i % width)],
                    false => Vec::new(),
                }
            };
            let logits = self.run_model(
                || model.prefill_chunks(&chunks, cache),
                chunks.len() * width,
                place,
            );
            stats.prefilled_tokens += continued.iter().map(|c| c.2.len()).sum::<usize>();
            let mut states: Vec<Option<Active>> =
                continued.iter().map(|c| slots[c.0].take()).collect();
            let rows = states
                .iter_mut()
                .map(|a| a.as_mut().filter(|a| a.pending.is_empty()))
                .collect();
            let picks = self.choose(logits, rows, stats);
            for ((&(slot, ..), state), pick) in continued.iter().zip(states).zip(picks) {
                let active = state.expect("a continued slot is busy");
                let placed = (&mut *slots, &mut *done, &mut *prefixes);
                sampled += self.settle(active, slot, pick, stop, placed) as usize;
            }
        }
        stats.prefill_steps += 1;
        stats.prefill_seconds += prefill_start.elapsed().as_secs_f64();
        sampled
    }

    /// One decode step for every busy slot: feeds each slot's last token, samples the next
    /// and retires the requests that finish.
    fn decode(
        &self,
        model: &CausalLm<B>,
        cache: &mut SlotKvCache<B>,
        (slots, done, prefixes): Placed<'_>,
        stop: &impl Fn(&EngineConfig, &[u32]) -> bool,
        stats: &mut GenerationStats,
    ) {
        let tokens: Vec<u32> = slots
            .iter()
            .map(|s| s.as_ref().map_or(0, |a| a.last))
            .collect();
        // An idle row writes past what its slot holds, so a kept prefix survives the step.
        let positions: Vec<usize> = slots
            .iter()
            .enumerate()
            .map(|(i, s)| s.as_ref().map_or_else(|| prefixes.held_len(i), |a| a.pos))
            .collect();
        let window = positions.iter().max().copied().unwrap_or(0) + 1;
        debug_assert!(window <= self.config.max_model_len());
        // Only rows that sample record their routing: idle rows and rows still prefilling
        // (whose next chunk rewrites the position) feed nothing kept.
        let fed: Vec<Vec<(usize, usize)>> = slots
            .iter()
            .enumerate()
            .map(|(i, s)| match s {
                Some(a) if a.pending.is_empty() => vec![(i, a.pos)],
                _ => Vec::new(),
            })
            .collect();
        let enqueue = Instant::now();
        let logits = self.run_model(
            || {
                device_span::<B, _>(&self.device, "decode_step", || {
                    model.decode_slots(&tokens, &positions, window, cache)
                })
            },
            fed.len(),
            |i| fed[i].clone(),
        );
        stats.decode_enqueue_seconds += enqueue.elapsed().as_secs_f64();
        stats.decode_steps += 1;
        // Slots still prefilling ran along (their step writes at the next chunk's first
        // position, which that chunk overwrites) and sample nothing.
        let picks = self.choose(
            logits,
            slots
                .iter_mut()
                .map(|s| s.as_mut().filter(|a| a.pending.is_empty()))
                .collect(),
            stats,
        );
        for (slot, (state, pick)) in slots.iter_mut().zip(picks).enumerate() {
            let (Some(active), Some((tok, log_prob))) = (state.as_mut(), pick) else {
                continue;
            };
            active.pos += 1;
            if let Some(c) = self.advance(active, tok, log_prob, stop) {
                self.retire(slot, active, c, (done, prefixes));
                *state = None;
            }
        }
    }

    /// The next token (and its log-prob, at the sampling temperature) of each busy row of
    /// `logits` `[rows, vocab / tp]` (this rank's vocabulary shard); `None` for idle rows. On
    /// the device where a sampling kernel exists (only ids and log-probs are read back), else
    /// from the logits read back, with each request's host sampler.
    fn choose(
        &self,
        logits: Tensor<B, 2>,
        mut rows: Vec<Option<&mut Active>>,
        stats: &mut GenerationStats,
    ) -> Vec<Option<(u32, f32)>> {
        let settings: Vec<RowSampling> = rows
            .iter()
            .map(|row| match row {
                Some(a) => {
                    let p = a.sampler.params();
                    RowSampling {
                        temperature: p.temperature as f32,
                        top_k: p.top_k.clamp(-1, i32::MAX as i64) as i32,
                        top_p: p.top_p as f32,
                        min_p: p.min_p as f32,
                        seed: a.sampler.stream_seed(),
                        step: a.tokens.len() as u32,
                    }
                }
                // Idle rows: the cheapest draw, ignored.
                None => RowSampling {
                    temperature: 0.0,
                    ..RowSampling::default()
                },
            })
            .collect();
        let vocab = self.model_config.vocab_size;
        let drawn = match self.tp.is_parallel() && B::samples_on_device() {
            // Each rank draws from its vocabulary shard; only a few numbers per row meet.
            true => {
                let shard = (self.tp.rank * logits.dims()[1], vocab);
                sample_vocab_parallel(logits, &settings, &self.tp, shard)
                    .or_else(|logits| sample_rows(self.full_vocabulary(logits), &settings))
            }
            false => sample_rows(self.full_vocabulary(logits), &settings),
        };
        let logits = match drawn {
            Ok(picks) => {
                stats.sampled_on_device = true;
                // The device sampler finds no token when a row has no finite logit; say so
                // here rather than fail later on an id past the vocabulary.
                for (row, pick) in rows.iter().zip(&picks) {
                    if let Some(active) = row {
                        assert!(
                            (pick.token as usize) < vocab,
                            "the rollout's logits for request {} at response token {} have no \
                             finite value (NaN or infinity in the model's forward)",
                            active.request,
                            active.tokens.len()
                        );
                    }
                }
                return rows
                    .iter()
                    .zip(picks)
                    .map(|(row, p)| row.as_ref().map(|_| (p.token, p.log_prob)))
                    .collect();
            }
            Err(logits) => logits,
        };
        rows.iter_mut()
            .zip(host_rows(logits))
            .map(|(row, logits)| {
                let active = row.as_mut()?;
                let (tok, _) = active.sampler.sample(&logits);
                let t = active.sampler.params().temperature;
                let log_prob = match self.config.calculate_log_probs {
                    true => log_prob_at(&logits, tok, if t > 0.0 { t } else { 1.0 }),
                    false => 0.0,
                };
                Some((tok, log_prob))
            })
            .collect()
    }

    /// The whole vocabulary's logits `[rows, vocab]` from this rank's vocabulary-parallel
    /// part (the identity at tp = 1): gathered over the tensor-parallel group, padding cut.
    fn full_vocabulary(&self, logits: Tensor<B, 2>) -> Tensor<B, 2> {
        if !self.tp.is_parallel() {
            return logits;
        }
        let full = self.tp.collective(logits, Collective::AllGather(1));
        full.narrow(1, 0, self.model_config.vocab_size)
    }

    /// After a prefill: `active`, bound for slot `slot`, takes its sampled token if it has one
    /// (`pick`); its completion goes to `done` when that token ends it, else it goes into its
    /// slot. Returns whether a token was sampled.
    fn settle(
        &self,
        mut active: Active,
        slot: usize,
        pick: Option<(u32, f32)>,
        stop: &impl Fn(&EngineConfig, &[u32]) -> bool,
        (slots, done, prefixes): Placed<'_>,
    ) -> bool {
        let Some((tok, log_prob)) = pick else {
            slots[slot] = Some(active);
            return false;
        };
        match self.advance(&mut active, tok, log_prob, stop) {
            Some(c) => self.retire(slot, &active, c, (done, prefixes)),
            None => slots[slot] = Some(active),
        }
        true
    }

    /// `active`, in slot `slot`, finished with `completion`: the completion goes to `done`,
    /// and with prefix caching the slot keeps what it cached.
    fn retire(
        &self,
        slot: usize,
        active: &Active,
        mut completion: Completion,
        (done, prefixes): (&mut [Option<Completion>], &mut SlotPrefixes),
    ) {
        if let Some(r) = self.routing_mut().as_ref() {
            let fed = active.prompt.len() + completion.tokens.len().saturating_sub(1);
            completion.routed_experts = r.positions(slot, fed);
        }
        if self.config.enable_prefix_caching {
            prefixes.record(slot, active.cached(&completion));
        }
        done[active.request] = Some(completion);
    }

    /// Appends the chosen token to `active`; returns the completion when the sequence ends.
    fn advance(
        &self,
        active: &mut Active,
        tok: u32,
        log_prob: f32,
        stop: &impl Fn(&EngineConfig, &[u32]) -> bool,
    ) -> Option<Completion> {
        if self.config.calculate_log_probs {
            active.log_probs.push(log_prob);
        }
        active.tokens.push(tok);
        active.last = tok;
        let finish = if stop(&self.config, &active.tokens) {
            Some(FinishReason::Stop)
        } else if active.tokens.len() >= active.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        finish.map(|finish| Completion {
            tokens: std::mem::take(&mut active.tokens),
            log_probs: std::mem::take(&mut active.log_probs),
            finish,
            routed_experts: Vec::new(),
        })
    }
}

/// `log softmax(logits / temperature)[token]`, in f64: what the actor recomputes as the old
/// log-prob (verl's actor divides logits by the rollout temperature too).
pub fn log_prob_at(logits: &[f32], token: u32, temperature: f64) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits
        .iter()
        .map(|&x| ((x as f64 - max) / temperature).exp())
        .sum::<f64>()
        .ln();
    ((logits[token as usize] as f64 - max) / temperature - lse) as f32
}

/// A `[rows, vocab]` tensor as host rows.
fn host_rows<B: Backend>(logits: Tensor<B, 2>) -> Vec<Vec<f32>> {
    let [_, vocab] = logits.dims();
    let flat: Vec<f32> = logits
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 after convert");
    flat.chunks(vocab).map(<[f32]>::to_vec).collect()
}

impl GenerationStats {
    /// Tokens per second of the decode steps (every generated token but each request's first,
    /// which comes from its prefill).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let tokens = self.generated_tokens.saturating_sub(self.requests);
        tokens as f64 / (self.seconds - self.prefill_seconds).max(1e-9)
    }
}

/// `logits` `[prompts, vocab]` as one row per target `(prompt, slot)` (samples sharing a
/// prompt's prefill get its row).
fn repeat_rows<B: Backend>(logits: Tensor<B, 2>, targets: &[(usize, usize)]) -> Tensor<B, 2> {
    let identity =
        targets.len() == logits.dims()[0] && targets.iter().enumerate().all(|(i, &(p, _))| i == p);
    if identity {
        return logits;
    }
    let rows: Vec<i64> = targets.iter().map(|&(p, _)| p as i64).collect();
    let n = rows.len();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [n]), &logits.device());
    logits.select(0, idx)
}

//! The engine's settings, and their derivation from verl's `actor_rollout_ref.rollout` and
//! `data` config.

use verl_core::config::{DataConfig, RolloutConfig, Truncation};

use crate::error::RolloutError;
use crate::sampling::SamplingParams;

/// How much memory the KV cache may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// At most this many cached token positions over all sequences.
    Tokens(usize),
    /// vLLM's `gpu_memory_utilization`: on a GPU, this fraction of the card's total memory
    /// for the rollout, its weights included, and never more than what is free when the cache
    /// is allocated, less [`ACTIVATION_RESERVE`] of the card (in a hybrid engine the actor's
    /// parameters and optimizer state share the card); on the CPU default, this fraction of
    /// the host's `MemAvailable`.
    MemoryFraction(f64),
}

/// The share of the card a KV cache leaves free beside what is in use, for the prefill's and
/// the decode step's activations.
pub const ACTIVATION_RESERVE: f64 = 0.05;

/// The memory a [`KvBudget::MemoryFraction`] is a fraction of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBase {
    /// A device with `total` bytes, `in_use` of them taken (by tensors of every pool and
    /// process; a pool's cached free pages do not count, the cache may reuse them), `own` of
    /// them the rollout's weights.
    Device { total: u64, in_use: u64, own: u64 },
    /// Host memory with `available` bytes free for new allocations.
    Host { available: u64 },
}

impl MemoryBase {
    /// The base for a backend's memory figures and the rollout's weights (`own_bytes`): the
    /// device where it reports its total, the host's `MemAvailable` (4 GiB if unknown)
    /// otherwise.
    pub fn of(usage: Option<verl_core::memory::MemoryUsage>, own_bytes: u64) -> Self {
        match usage {
            Some(u) if u.device_total > 0 => MemoryBase::Device {
                total: u.device_total,
                in_use: u
                    .device_used
                    .saturating_sub(u.reserved.saturating_sub(u.allocated)),
                own: own_bytes,
            },
            _ => MemoryBase::Host {
                available: available_memory_bytes().map_or(4 << 30, |b| b as u64),
            },
        }
    }
}

impl KvBudget {
    /// The bytes the budget allows on `base`.
    ///
    /// ```
    /// use verl_rollout::{KvBudget, MemoryBase};
    /// let gib = 1u64 << 30;
    /// // An 80 GiB card, 15 GiB of rollout weights, 30 GiB in use (weights and the actor):
    /// // half the card less the weights, 25 GiB, and that much is free.
    /// let card = MemoryBase::Device { total: 80 * gib, in_use: 30 * gib, own: 15 * gib };
    /// assert_eq!(KvBudget::MemoryFraction(0.5).bytes(card, 1), 25 * gib);
    /// // With the actor's optimizer state too (70 GiB in use): what is free less 5 % of the card.
    /// let full = MemoryBase::Device { total: 80 * gib, in_use: 70 * gib, own: 15 * gib };
    /// assert_eq!(KvBudget::MemoryFraction(0.5).bytes(full, 1), 6 * gib);
    /// assert_eq!(KvBudget::Tokens(100).bytes(card, 1024), 100 * 1024);
    /// ```
    pub fn bytes(self, base: MemoryBase, bytes_per_position: usize) -> u64 {
        match self {
            KvBudget::Tokens(n) => (n * bytes_per_position) as u64,
            KvBudget::MemoryFraction(f) => match base {
                MemoryBase::Device { total, in_use, own } => {
                    let share = ((total as f64 * f) as u64).saturating_sub(own);
                    let reserve = (total as f64 * ACTIVATION_RESERVE) as u64;
                    let free = total.saturating_sub(in_use).saturating_sub(reserve);
                    share.min(free)
                }
                MemoryBase::Host { available } => (available as f64 * f) as u64,
            },
        }
    }

    /// The number of token positions the budget allows on `base`, given the bytes one
    /// position takes.
    pub fn positions(self, base: MemoryBase, bytes_per_position: usize) -> usize {
        match self {
            KvBudget::Tokens(n) => n,
            KvBudget::MemoryFraction(_) => {
                (self.bytes(base, bytes_per_position) / bytes_per_position.max(1) as u64) as usize
            }
        }
    }
}

/// Bytes of memory available to new allocations (Linux `MemAvailable`), if known.
pub fn available_memory_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Everything the native engine needs besides the model.
///
/// ```
/// use verl_rollout::{EngineConfig, SamplingParams};
/// let cfg = EngineConfig {
///     prompt_length: 64,
///     response_length: 32,
///     sampling: SamplingParams { temperature: 0.0, ..Default::default() },
///     ..Default::default()
/// };
/// cfg.validate()?;
/// assert_eq!(cfg.max_model_len(), 96);
/// # Ok::<(), verl_rollout::RolloutError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Sequences decoded at once (slots); more requests wait and take freed slots.
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled in one step (at least one prompt is always admitted).
    pub max_num_batched_tokens: usize,
    /// Longest prompt accepted (`rollout.prompt_length` / `data.max_prompt_length`).
    pub prompt_length: usize,
    /// Most new tokens per response (`rollout.response_length` / `data.max_response_length`).
    pub response_length: usize,
    /// What to do with a longer prompt (`data.truncation`).
    pub truncation: Truncation,
    pub kv_budget: KvBudget,
    pub sampling: SamplingParams,
    /// Greedy, n = 1 sampling for validation (`rollout.val_kwargs`).
    pub val_sampling: SamplingParams,
    /// Samples per prompt.
    pub n: usize,
    /// Samples per prompt in validation (`rollout.val_kwargs.n`).
    pub val_n: usize,
    pub eos_token_ids: Vec<u32>,
    /// Extra ids that end a response (kept in it, as EOS is).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a response at the token completing one (kept in it); the engine needs
    /// a detokenizer for them ([`crate::NativeRollout::with_detokenizer`]).
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub pad_token_id: u32,
    /// Return each sampled token's log-prob (`rollout_log_probs`).
    pub calculate_log_probs: bool,
    /// Requests of one prompt admitted together (a prompt's `n` samples) share one prefill:
    /// its keys and values are written to each of their slots
    /// (`rollout.enable_prefix_caching`).
    pub enable_prefix_caching: bool,
    /// With prefix caching, what finished requests leave in their slots is kept for the next
    /// call (a multi-turn continuation prefills only its new turn): the tail of a call then
    /// decodes over the finished slots instead of shrinking the cache to the busy ones. Off,
    /// finished slots serve only requests waiting in the same call, and every call starts from
    /// none. The weights changing or the cache being allocated anew forgets them either way.
    /// Not a verl key: the multi-turn rollout sets it.
    pub retain_prefixes: bool,
    /// A prompt longer than what is left of `max_num_batched_tokens` is prefilled in chunks
    /// over several steps, decode steps of the other slots running in between
    /// (`rollout.enable_chunked_prefill`); off, it waits for a step of its own.
    pub enable_chunked_prefill: bool,
    /// Records the experts every MoE layer chose for each token and returns them with the
    /// completions (`routed_experts` in the batch), for the actor to replay (router replay R3,
    /// `rollout.enable_rollout_routing_replay`). Nothing is recorded for a dense model.
    pub record_routing: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            prompt_length: 512,
            response_length: 512,
            truncation: Truncation::Error,
            kv_budget: KvBudget::MemoryFraction(0.5),
            sampling: SamplingParams::default(),
            val_sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            n: 1,
            val_n: 1,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
            pad_token_id: 0,
            calculate_log_probs: false,
            enable_prefix_caching: true,
            retain_prefixes: false,
            enable_chunked_prefill: true,
            record_routing: false,
        }
    }
}

fn invalid(field: &'static str, value: impl ToString, message: &str) -> RolloutError {
    RolloutError::Config {
        field,
        value: value.to_string(),
        message: message.into(),
    }
}

impl EngineConfig {
    /// From verl's config. `eos_token_ids` and `pad_token_id` come from the model / tokenizer.
    pub fn from_verl(
        rollout: &RolloutConfig,
        data: &DataConfig,
        eos_token_ids: Vec<u32>,
        pad_token_id: u32,
    ) -> Result<Self, RolloutError> {
        let sampling = SamplingParams {
            temperature: if rollout.do_sample {
                rollout.temperature
            } else {
                0.0
            },
            top_k: rollout.top_k,
            top_p: rollout.top_p,
            min_p: rollout.min_p,
            seed: rollout.seed,
        };
        let val = &rollout.val_kwargs;
        let val_sampling = SamplingParams {
            temperature: if val.do_sample { val.temperature } else { 0.0 },
            top_k: val.top_k,
            top_p: val.top_p,
            min_p: 0.0,
            seed: rollout.seed,
        };
        let cfg = Self {
            max_num_seqs: rollout.max_num_seqs,
            max_num_batched_tokens: rollout.max_num_batched_tokens,
            prompt_length: rollout.prompt_length.unwrap_or(data.max_prompt_length),
            response_length: rollout.response_length.unwrap_or(data.max_response_length),
            truncation: data.truncation,
            kv_budget: match rollout.kv_cache_tokens {
                Some(t) => KvBudget::Tokens(t),
                None => KvBudget::MemoryFraction(rollout.gpu_memory_utilization),
            },
            sampling,
            val_sampling,
            n: rollout.n,
            val_n: rollout.val_kwargs.n,
            eos_token_ids,
            stop_token_ids: Vec::new(),
            stop: rollout.stop.clone(),
            ignore_eos: rollout.ignore_eos,
            pad_token_id,
            calculate_log_probs: rollout.calculate_log_probs,
            enable_prefix_caching: rollout.enable_prefix_caching,
            retain_prefixes: false,
            enable_chunked_prefill: rollout.enable_chunked_prefill,
            record_routing: rollout.enable_rollout_routing_replay,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Whether finished requests' prefixes are kept for the next call (prefix caching with
    /// `retain_prefixes`).
    pub fn keeps_prefixes(&self) -> bool {
        self.enable_prefix_caching && self.retain_prefixes
    }

    /// Positions one sequence may need: the longest prompt plus the longest response.
    pub fn max_model_len(&self) -> usize {
        self.prompt_length + self.response_length
    }

    /// Checks every setting, naming the verl key to fix.
    pub fn validate(&self) -> Result<(), RolloutError> {
        if self.max_num_seqs == 0 {
            return Err(invalid(
                "actor_rollout_ref.rollout.max_num_seqs",
                0,
                "must be at least 1",
            ));
        }
        if self.prompt_length == 0 {
            return Err(invalid(
                "actor_rollout_ref.rollout.prompt_length",
                0,
                "must be at least 1",
            ));
        }
        if self.response_length == 0 {
            return Err(invalid(
                "actor_rollout_ref.rollout.response_length",
                0,
                "must be at least 1",
            ));
        }
        if self.n == 0 {
            return Err(invalid(
                "actor_rollout_ref.rollout.n",
                0,
                "must be at least 1",
            ));
        }
        if self.val_n == 0 {
            return Err(invalid(
                "actor_rollout_ref.rollout.val_kwargs.n",
                0,
                "must be at least 1",
            ));
        }
        match self.kv_budget {
            KvBudget::Tokens(t) if t < self.max_model_len() => {
                return Err(invalid(
                    "actor_rollout_ref.rollout.kv_cache_tokens",
                    t,
                    &format!(
                        "must hold at least one sequence of prompt_length + response_length = {}",
                        self.max_model_len()
                    ),
                ))
            }
            KvBudget::MemoryFraction(f) if !(f > 0.0 && f <= 1.0) => {
                return Err(invalid(
                    "actor_rollout_ref.rollout.gpu_memory_utilization",
                    f,
                    "must be in (0, 1]",
                ))
            }
            _ => {}
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(invalid(
                "actor_rollout_ref.rollout.stop",
                format!("{:?}", self.stop),
                "an empty stop string would end every response at once; remove it",
            ));
        }
        self.sampling.validate()?;
        self.val_sampling.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_core::memory::MemoryUsage;

    const GIB: u64 = 1 << 30;

    /// On a GPU the fraction is of the card, the rollout's weights included, and never more
    /// than what is free less 5 % of the card: a pool's cached free pages count as free (the
    /// cache may take them), other processes' memory as taken.
    #[test]
    fn device_budget_is_the_fraction_of_the_card_within_the_free_memory() {
        let usage = MemoryUsage {
            allocated: 60 * GIB,
            reserved: 70 * GIB,
            device_used: 74 * GIB,
            device_total: 140 * GIB,
        };
        let base = MemoryBase::of(Some(usage), 10 * GIB);
        assert_eq!(
            base,
            MemoryBase::Device {
                total: 140 * GIB,
                in_use: 64 * GIB,
                own: 10 * GIB
            }
        );
        // 0.5 of 140 less 10 of weights = 60; free: 140 - 64 - 7 = 69.
        let budget = KvBudget::MemoryFraction(0.5);
        assert_eq!(budget.bytes(base, 1), 60 * GIB);
        assert_eq!(budget.positions(base, 1 << 20), 60 * 1024);
        // 0.9: 116 GiB of share, but only 69 free.
        assert_eq!(KvBudget::MemoryFraction(0.9).bytes(base, 1), 69 * GIB);
        // Less than the weights: nothing, not an underflow.
        assert_eq!(KvBudget::MemoryFraction(0.05).positions(base, 1 << 20), 0);
        // A card fuller than its reserve allows: nothing.
        let full = MemoryBase::Device {
            total: 80 * GIB,
            in_use: 79 * GIB,
            own: GIB,
        };
        assert_eq!(KvBudget::MemoryFraction(0.9).bytes(full, 1), 0);
        // A token budget ignores the memory.
        assert_eq!(KvBudget::Tokens(77).positions(base, 1 << 20), 77);
    }

    /// Without a device total (the CPU default), the fraction is of the host's free memory.
    #[test]
    fn without_a_device_total_the_base_is_host_memory() {
        let cpu = MemoryUsage {
            allocated: GIB,
            reserved: 2 * GIB,
            device_used: 0,
            device_total: 0,
        };
        for usage in [Some(cpu), None] {
            match MemoryBase::of(usage, GIB) {
                MemoryBase::Host { available } => assert!(available > 0),
                other => panic!("{other:?}"),
            }
        }
        let host = MemoryBase::Host { available: 8 * GIB };
        assert_eq!(KvBudget::MemoryFraction(0.25).bytes(host, 1), 2 * GIB);
    }
}

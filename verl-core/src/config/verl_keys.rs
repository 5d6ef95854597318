//! The keys of verl's own config (`ppo_megatron_trainer.yaml` and the keys its example
//! scripts set) that verl-rs's tree does not have, and what each one becomes here:
//!
//! - **inert**: it has no effect in verl-rs (Ray's and vLLM's knobs, torch.compile, NCCL
//!   timeouts). verl's default passes silently; another value is accepted with one startup
//!   line that says why it does nothing.
//! - **moved**: verl-rs reads the same setting under another key, and the value goes there.
//! - **not built**: the feature behind it does not exist here yet. verl's default (or an
//!   empty, false, zero or null value) passes; anything else is refused by key, with the reason.
//!
//! So a stock verl config loads, and a setting that would change what runs is never dropped
//! in silence.

use serde_json::{Map, Value};

use crate::error::ConfigError;

/// What a verl-only key becomes.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// No effect here; the text says why.
    Inert(&'static str),
    /// Read here under the given key.
    Moved(&'static str),
    /// Not built yet; the text says what is missing.
    NotBuilt(&'static str),
}

use Kind::{Inert, Moved, NotBuilt};

/// `(pattern, verl's default as YAML, kind)`. A pattern is a dotted key where `*` matches one
/// key and `**` any number (zero included).
const RULES: &[(&str, &str, Kind)] = &[
    // Optimizer and Megatron engine knobs of every role.
    // verl hands Megatron's scheduler start_wd = end_wd = weight_decay, so every style keeps
    // the decay constant (verl/utils/megatron/optimizer.py).
    ("**.optim.weight_decay_incr_style", "constant", Inert("verl starts and ends the schedule at weight_decay, so every style keeps it constant, as here")),
    ("**.optim.lr_wsd_decay_style", "exponential", Inert("it applies to lr_decay_style=wsd only, which is not offered")),
    ("**.optim.lr_wsd_decay_steps", "null", Inert("it applies to lr_decay_style=wsd only, which is not offered")),
    ("**.optim.use_checkpoint_opt_param_scheduler", "false", NotBuilt("the learning-rate schedule always follows the config, not the checkpoint")),
    ("**.optim.override_optimizer_config", "{}", NotBuilt("Megatron optimizer overrides are not read")),
    ("**.megatron.dist_checkpointing_prefix", "''", Inert("sharded checkpoints are verl-rs's own format")),
    ("**.megatron.override_ddp_config", "{}", NotBuilt("Megatron DDP overrides are not read (gradients are reduced in one bucket per step)")),
    ("**.megatron.override_mcore_model_config", "{}", NotBuilt("Megatron model-config overrides are not read")),
    ("**.megatron.vanilla_mbridge", "true", Inert("Hugging Face checkpoints are always read directly")),
    ("**.megatron.use_remove_padding", "true", Inert("packing follows actor_rollout_ref.model.use_remove_padding")),
    ("**.megatron.forward_only", "~any", Inert("each role knows whether it trains")),
    ("**.nccl_timeout", "600", Inert("a lost rank is detected by its process ending (and device collectives by VERL_COLLECTIVE_TIMEOUT_S)")),
    ("**.rollout_n", "~any", Inert("it is derived from actor_rollout_ref.rollout.n")),
    ("**.use_torch_compile", "true", Inert("there is no torch.compile; the kernels are compiled already")),
    ("**.router_replay.mode", "disabled", NotBuilt("router replay is the actor's (actor_rollout_ref.actor.router_replay.mode=R2 or R3)")),
    ("**.router_replay.record_file", "null", NotBuilt("routing is not dumped to files (R2 keeps it in memory between the old-log-prob pass and the update)")),
    ("**.router_replay.replay_file", "null", NotBuilt("routing is not read from files (R2 keeps it in memory between the old-log-prob pass and the update)")),
    ("critic.data_loader_seed", "~any", Inert("the critic's mini-batches are shuffled with actor_rollout_ref.actor.data_loader_seed")),
    ("**.profiler.tool_config", "null", Inert("each role's tool settings come from global_profiler.global_tool_config")),
    // The actor.
    ("actor_rollout_ref.actor.tau_pos", "1.0", Moved("actor_rollout_ref.actor.policy_loss.tau_pos")),
    ("actor_rollout_ref.actor.tau_neg", "1.05", Moved("actor_rollout_ref.actor.policy_loss.tau_neg")),
    ("actor_rollout_ref.actor.freeze_vision_tower", "false", NotBuilt("vision models are not built")),
    ("actor_rollout_ref.actor.calculate_entropy", "false", Inert("entropy is computed whenever entropy_coeff or a metric needs it")),
    ("actor_rollout_ref.actor.use_prefix_grouper", "false", NotBuilt("prefix grouping is not built (prompts are shared through the rollout's prefix cache)")),
    ("actor_rollout_ref.actor.use_fused_kernels", "~any", Inert("actor_rollout_ref.model.use_fused_kernels is the setting read")),
    // The rollout: vLLM / SGLang engine knobs that the native engine has no use for.
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", "null", Inert("the native engine does not capture CUDA graphs")),
    ("actor_rollout_ref.rollout.data_parallel_size", "1", NotBuilt("rollout replicas follow the actor's data-parallel size")),
    ("actor_rollout_ref.rollout.expert_parallel_size", "1", NotBuilt("rollout expert parallelism is not built")),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "1", NotBuilt("rollout pipeline parallelism is not built")),
    ("actor_rollout_ref.rollout.logprobs_mode", "processed_logprobs", NotBuilt("the rollout's log-probs are always of the processed (temperature-scaled) distribution")),
    ("actor_rollout_ref.rollout.scheduling_policy", "fcfs", NotBuilt("the engine schedules first come, first served")),
    ("actor_rollout_ref.rollout.load_format", "dummy", Inert("the rollout takes the actor's weights through the hybrid engine")),
    ("actor_rollout_ref.rollout.disable_log_stats", "true", Inert("vLLM's statistics log does not exist here")),
    ("actor_rollout_ref.rollout.over_sample_rate", "0", NotBuilt("over-sampling is not built")),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", "false", Inert("the engine's memory is freed and taken back by free_cache_engine")),
    ("actor_rollout_ref.rollout.engine_kwargs.**", "~any", Inert("they are vLLM's / SGLang's own arguments")),
    ("actor_rollout_ref.rollout.agent.num_workers", "8", Inert("there are no agent-loop workers")),
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", "false", NotBuilt("conversations are not re-tokenised with the inference chat template: the agent loop's tool turns are the embedder's tokens")),
    ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "strict", NotBuilt("nothing is re-tokenised, so there is no tokenisation check to relax")),
    ("actor_rollout_ref.rollout.agent.default_agent_loop", "single_turn_agent", NotBuilt("agent loops are not chosen by name: an embedding program sets its loop with PpoTrainerBuilder::agent (and rollout.multi_turn its limits)")),
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path", "null", NotBuilt("agent loops are not read from files: an embedding program sets its loop with PpoTrainerBuilder::agent")),
    ("actor_rollout_ref.rollout.agent.custom_async_server.path", "null", NotBuilt("custom rollout servers are not built")),
    ("actor_rollout_ref.rollout.agent.**", "~any", Inert("agent loops are not chosen by name, so these settings do nothing")),
    ("actor_rollout_ref.rollout.checkpoint_engine.**", "~any", Inert("weights reach the rollout through the hybrid engine's resharding")),
    ("actor_rollout_ref.rollout.trace.backend", "null", NotBuilt("rollout tracing is not built")),
    ("actor_rollout_ref.rollout.trace.**", "~any", Inert("it applies with trace.backend only")),
    ("actor_rollout_ref.rollout.skip_rollout", "false", NotBuilt("replaying dumped rollouts is not built")),
    ("actor_rollout_ref.rollout.skip_dump_dir", "/tmp/rollout_dump", Inert("it applies to skip_rollout only")),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", "true", Inert("the engine works on token ids")),
    ("actor_rollout_ref.rollout.prometheus.enable", "false", NotBuilt("a Prometheus endpoint is not built")),
    ("actor_rollout_ref.rollout.prometheus.**", "~any", Inert("it applies to prometheus.enable only")),
    ("actor_rollout_ref.rollout.quantization", "null", NotBuilt("quantized rollouts are not built")),
    ("actor_rollout_ref.rollout.quantization_config_file", "null", NotBuilt("quantized rollouts are not built")),
    ("actor_rollout_ref.rollout.use_block_quant_rollout", "true", Inert("it applies to quantized rollouts only")),
    ("actor_rollout_ref.rollout.mtp", "~any", Inert("actor_rollout_ref.model.mtp is the setting read")),
    ("actor_rollout_ref.rollout.layer_name_map.**", "~any", Inert("the engine's layers are verl-rs's own")),
    // The model.
    ("actor_rollout_ref.model.hf_config_path", "null", NotBuilt("the config is read from model.path")),
    ("actor_rollout_ref.model.use_shm", "false", Inert("checkpoints are read from disk with memory maps")),
    ("actor_rollout_ref.model.enable_activation_offload", "false", NotBuilt("activation offload is not built (param/optimizer offload is)")),
    ("actor_rollout_ref.model.lora_rank", "0", NotBuilt("LoRA is not built (issue: LoRA)")),
    ("actor_rollout_ref.model.lora_alpha", "16", Inert("it applies with lora_rank > 0 only")),
    ("actor_rollout_ref.model.target_modules", "all-linear", Inert("it applies with lora_rank > 0 only")),
    ("actor_rollout_ref.model.exclude_modules", "null", Inert("it applies with lora_rank > 0 only")),
    ("actor_rollout_ref.model.lora_adapter_path", "null", NotBuilt("LoRA is not built (issue: LoRA)")),
    ("actor_rollout_ref.model.use_liger", "false", Inert("Liger's torch kernels do not apply; verl-rs's own fused kernels run")),
    ("actor_rollout_ref.model.fused_kernel_options.**", "~any", Inert("the fused kernels are verl-rs's own")),
    ("actor_rollout_ref.model.tiled_mlp.enabled", "false", NotBuilt("tiled MLP is not built")),
    ("actor_rollout_ref.model.tiled_mlp.**", "~any", Inert("it applies with tiled_mlp.enabled only")),
    ("actor_rollout_ref.model.mtp.enable", "false", NotBuilt("multi-token prediction is not built")),
    ("actor_rollout_ref.model.mtp.enable_train", "false", NotBuilt("multi-token prediction is not built")),
    ("actor_rollout_ref.model.mtp.enable_rollout", "false", NotBuilt("multi-token prediction is not built")),
    ("actor_rollout_ref.model.mtp.**", "~any", Inert("it applies with mtp.enable only")),
    ("**.model.lora.rank", "0", NotBuilt("LoRA is not built (issue: LoRA)")),
    ("**.model.lora.adapter_path", "null", NotBuilt("LoRA is not built (issue: LoRA)")),
    ("**.model.lora.**", "~any", Inert("it applies with lora.rank > 0 only")),
    // Data.
    ("data.use_shm", "false", Inert("data files are read from disk")),
    ("data.tool_config_path", "null", NotBuilt("tool calling is not built (issue: agentic RL)")),
    ("data.image_patch_size", "14", Inert("it applies to vision models only")),
    ("data.validation_shuffle", "false", NotBuilt("validation rows are read in file order")),
    ("data.filter_overlong_prompts_workers", "1", Inert("filtering runs on one thread here")),
    ("data.image_key", "images", Inert("it applies to vision models only")),
    ("data.video_key", "videos", Inert("it applies to vision models only")),
    ("data.trust_remote_code", "false", Inert("no remote code runs here")),
    ("data.custom_cls.path", "null", NotBuilt("custom dataset classes are Python; not built")),
    ("data.custom_cls.**", "~any", Inert("it applies with custom_cls.path only")),
    ("data.return_multi_modal_inputs", "true", Inert("it applies to vision models only")),
    ("data.sampler.class_path", "null", NotBuilt("custom samplers are Python; not built")),
    ("data.sampler.**", "~any", Inert("it applies with sampler.class_path only")),
    ("data.datagen.path", "null", NotBuilt("dynamic data generation is not built")),
    ("data.datagen.**", "~any", Inert("it applies with datagen.path only")),
    ("data.apply_chat_template_kwargs", "{}", NotBuilt("chat-template arguments are not read")),
    // Rewards.
    ("reward_manager.source", "register", NotBuilt("only the registered reward managers exist")),
    ("reward_manager.name", "naive", Inert("reward_model.reward_manager is the setting read")),
    ("reward_manager.module.path", "null", NotBuilt("custom reward-manager modules are not built")),
    ("reward_manager.module.name", "custom_reward_manager", Inert("it applies with reward_manager.module.path only")),
    ("reward_model.enable_resource_pool", "false", NotBuilt("a separate reward-model resource pool is not built")),
    ("reward_model.n_gpus_per_node", "~any", Inert("it applies with enable_resource_pool only")),
    ("reward_model.nnodes", "~any", Inert("it applies with enable_resource_pool only")),
    ("reward_model.model.override_config", "{}", NotBuilt("reward-model config overrides are not read")),
    ("reward_model.reward_loop_source", "register", NotBuilt("only the registered reward loops exist")),
    ("reward_model.reward_loop_module_path", "null", NotBuilt("custom reward loops are not built")),
    ("reward_model.reward_loop_class_name", "null", NotBuilt("custom reward loops are not built")),
    ("reward_model.sandbox_fusion.url", "null", NotBuilt("sandboxed code execution is not built")),
    ("reward_model.sandbox_fusion.**", "~any", Inert("it applies with sandbox_fusion.url only")),
    ("reward_model.use_reward_loop", "true", Inert("rewards are computed in the trainer's process")),
    ("reward_model.num_workers", "1", Inert("rewards are computed in the trainer's process")),
    ("reward_model.rollout.**", "~any", Inert("it applies to generative reward models only, which are not built")),
    // The trainer and the rest.
    ("algorithm.pf_ppo.**", "~any", Inert("it applies with algorithm.use_pf_ppo only")),
    ("trainer.esi_redundant_time", "0", Inert("elastic-instance timing does not apply")),
    ("trainer.default_hdfs_dir", "null", NotBuilt("HDFS copies of checkpoints are not built")),
    ("trainer.ray_wait_register_center_timeout", "300", Inert("there is no Ray")),
    ("trainer.use_legacy_worker_impl", "auto", Inert("there is one worker implementation")),
    ("global_profiler.global_tool_config.torch_memory.context", "all", Inert("the memory timeline always records every phase")),
    ("global_profiler.global_tool_config.torch_memory.stacks", "all", Inert("the memory timeline always records span stacks")),
    ("global_profiler.global_tool_config.torch_memory.kw_args", "{}", Inert("torch's memory-recording arguments do not apply")),
    ("transfer_queue.enable", "false", NotBuilt("the transfer queue is not built")),
    ("ray_kwargs.**", "null", Inert("there is no Ray")),
];

/// Keys verl-rs has whose verl default asks for something verl-rs does differently in a way
/// that leaves the training's arithmetic as it is (loading, logging, memory): verl's default
/// is taken as `(what runs, why)` with a startup line. Any other value the key does not
/// support is still refused by the config check.
const VERL_DEFAULTS_RUN_AS: &[(&str, &str, &str, &str)] = &[
    ("data.return_raw_chat", "true", "false", "batches carry token ids; the chat template is applied when the data is read"),
    ("data.dataloader_num_workers", "8", "0", "data files are read by the trainer itself, with no loader workers"),
    ("actor_rollout_ref.rollout.name", "vllm", "native", "verl-rs's own engine generates (continuous batching, paged KV cache, the actor's weights resharded in place)"),
    ("actor_rollout_ref.rollout.name", "sglang", "native", "verl-rs's own engine generates (continuous batching, paged KV cache, the actor's weights resharded in place)"),
    ("actor_rollout_ref.rollout.mode", "async", "sync", "generation runs inside the training step, as the hybrid engine's synchronous mode"),
    ("global_profiler.global_tool_config.nsys.controller_nsight_options", "{trace: 'cuda,nvtx,cublas,ucx', cuda-memory-usage: 'true', cuda-graph-trace: graph}", "null", "`verl train` runs under an nsys you start; these options go on its command line"),
    ("global_profiler.global_tool_config.nsys.worker_nsight_options", "{trace: 'cuda,nvtx,cublas,ucx', cuda-memory-usage: 'true', cuda-graph-trace: graph, capture-range: cudaProfilerApi, capture-range-end: null, kill: none}", "null", "`verl train` runs under an nsys you start; these options go on its command line"),
    ("actor_rollout_ref.rollout.enforce_eager", "false", "true", "the native engine does not capture CUDA graphs"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "true", "false", "verl's Megatron workers do not read it either: activations are recomputed as megatron.override_transformer_config.recompute_granularity / recompute_method / recompute_num_layers say"),
    ("actor_rollout_ref.actor.megatron.use_mbridge", "false", "true", "Hugging Face checkpoints are always read and written directly, as mbridge does"),
    ("actor_rollout_ref.ref.megatron.use_mbridge", "false", "true", "Hugging Face checkpoints are always read and written directly, as mbridge does"),
    ("critic.megatron.use_mbridge", "false", "true", "Hugging Face checkpoints are always read and written directly, as mbridge does"),
    ("reward_model.megatron.use_mbridge", "false", "true", "Hugging Face checkpoints are always read and written directly, as mbridge does"),
    ("critic.model.enable_gradient_checkpointing", "true", "false", "verl's Megatron workers do not read it either: activations are recomputed as megatron.override_transformer_config.recompute_granularity / recompute_method / recompute_num_layers say"),
];

/// Keys verl-rs reads as optional numbers, where verl writes -1 for "not set".
const MINUS_ONE_IS_UNSET: &[&str] = &["**.optim.total_training_steps"];

/// A rule's default that takes every value quietly: the settings of a feature verl-rs does
/// not have, which the feature's own switch (a rule of its own) decides about.
const ANY: &str = "~any";

/// Whether dotted `key` matches `pattern` (`*` one key, `**` any number; a final `**` at least
/// one, so that a section's rule is its keys' and not the section's own).
fn matches(pattern: &[&str], key: &[&str]) -> bool {
    match (pattern.first(), key.first()) {
        (None, None) => true,
        (Some(&"**"), _) if pattern.len() == 1 => !key.is_empty(),
        (Some(&"**"), _) => {
            matches(&pattern[1..], key) || (!key.is_empty() && matches(pattern, &key[1..]))
        }
        (Some(&p), Some(&k)) => (p == "*" || p == k) && matches(&pattern[1..], &key[1..]),
        _ => false,
    }
}

fn rule(key: &str) -> Option<(&'static str, Kind)> {
    let parts: Vec<&str> = key.split('.').collect();
    RULES
        .iter()
        .find(|(p, _, _)| matches(&p.split('.').collect::<Vec<_>>(), &parts))
        .map(|(_, default, kind)| (*default, *kind))
}

/// Whether `key` is one of verl's keys that verl-rs's tree does not have (an override may name
/// it).
pub(crate) fn is_verl_key(key: &str) -> bool {
    rule(key).is_some()
}

/// A value that asks for nothing: null, false, 0, empty text, list or map, or verl's default.
fn asks_nothing(v: &Value, default: &str) -> bool {
    if default == ANY {
        return true;
    }
    let default: Value = serde_yaml::from_str(default).unwrap_or(Value::Null);
    // An "off" value asks for nothing only where verl's default is itself off: `false` where
    // verl says `true`, or a null `logprobs_mode`, would change what runs.
    *v == default || (off(v) && off(&default))
}

/// Null, false, zero, or empty text, list or map.
fn off(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || s == "null",
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => m.is_empty(),
    }
}

/// Takes verl's keys that the tree `defaults` does not have out of `tree` (file and overrides
/// merged, interpolations resolved), and verl's mandatory-value marks (`???`) left unset.
/// Returns one startup line per setting that does nothing here or went elsewhere; a setting
/// that asks for what is not built is an error naming its key.
pub(crate) fn take_verl_keys(
    tree: &mut Value,
    defaults: &Value,
) -> Result<Vec<String>, ConfigError> {
    let mut notes = run_verl_defaults_as(tree);
    let mut moved = Vec::new();
    take_in(tree, defaults, &mut Vec::new(), &mut notes, &mut moved)?;
    for (to, value) in moved {
        let mut node = &mut *tree;
        for part in to.split('.') {
            if !node.is_object() {
                *node = Value::Object(Map::new());
            }
            node = node
                .as_object_mut()
                .expect("made a map above")
                .entry(part.to_string())
                .or_insert(Value::Null);
        }
        *node = value;
    }
    Ok(notes)
}

/// verl's defaults of [`VERL_DEFAULTS_RUN_AS`] replaced by what runs, wherever the key is
/// (a role section that is unset in verl-rs's defaults included), one note each.
fn run_verl_defaults_as(tree: &mut Value) -> Vec<String> {
    let mut notes = Vec::new();
    for (key, verl, runs, why) in VERL_DEFAULTS_RUN_AS {
        let pointer = format!("/{}", key.replace('.', "/"));
        let verl: Value = serde_yaml::from_str(verl).unwrap_or(Value::Null);
        if let Some(slot) = tree.pointer_mut(&pointer) {
            if *slot == verl {
                *slot = serde_yaml::from_str(runs).unwrap_or(Value::Null);
                notes.push(format!(
                    "{key}={verl} (verl's default) runs as {slot}: {why}"
                ));
            }
        }
    }
    notes
}

fn take_in(
    node: &mut Value,
    defaults: &Value,
    at: &mut Vec<String>,
    notes: &mut Vec<String>,
    moved: &mut Vec<(&'static str, Value)>,
) -> Result<(), ConfigError> {
    let Value::Object(map) = node else {
        return Ok(());
    };
    // A free-form map of the defaults (an empty one: `override_config` and the like) takes
    // whatever it holds.
    if defaults.as_object().is_some_and(Map::is_empty) && !at.is_empty() {
        return Ok(());
    }
    let keys: Vec<String> = map.keys().cloned().collect();
    for k in keys {
        at.push(k.clone());
        let key = at.join(".");
        let known = defaults.get(&k);
        if map.get(&k).is_some_and(|v| v.as_str() == Some("???")) {
            // verl marks it mandatory and leaves it to the job; unset, verl-rs's default holds.
            map.remove(&k);
            if known.is_some() {
                notes.push(format!(
                    "{key}: verl leaves it mandatory (`???`); verl-rs's default applies"
                ));
            }
        } else if let Some(known) = known {
            if let Some(child) = map.get_mut(&k) {
                let parts: Vec<&str> = key.split('.').collect();
                let unset = MINUS_ONE_IS_UNSET
                    .iter()
                    .any(|p| matches(&p.split('.').collect::<Vec<_>>(), &parts));
                if unset && child.as_i64() == Some(-1) {
                    *child = Value::Null;
                }
                take_in(child, known, at, notes, moved)?;
            }
        } else if let Some((default, kind)) = rule(&key) {
            let value = map.remove(&k).unwrap_or(Value::Null);
            take(&key, value, default, kind, notes, moved)?;
        } else if map.get(&k).is_some_and(Value::is_object) {
            // A section verl-rs does not have at all: its keys are judged one by one.
            let mut child = map.remove(&k).unwrap_or(Value::Null);
            take_in(&mut child, &Value::Null, at, notes, moved)?;
            if child.as_object().is_some_and(|m| !m.is_empty()) {
                map.insert(k.clone(), child);
            }
        }
        at.pop();
    }
    Ok(())
}

fn take(
    key: &str,
    value: Value,
    default: &str,
    kind: Kind,
    notes: &mut Vec<String>,
    moved: &mut Vec<(&'static str, Value)>,
) -> Result<(), ConfigError> {
    if let (Value::Object(m), Inert(_) | Moved(_)) = (&value, kind) {
        // A section under a rule: each key inside by the same rule. (A feature that is not
        // built is judged on its whole value: any key inside asks for it.)
        for (k, v) in m {
            take(
                &format!("{key}.{k}"),
                v.clone(),
                default,
                kind,
                notes,
                moved,
            )?;
        }
        return Ok(());
    }
    let quiet = asks_nothing(&value, default);
    match kind {
        Inert(why) if !quiet => {
            notes.push(format!("{key}={value} has no effect in verl-rs: {why}"))
        }
        // verl's default stays out of the way of the key it moves to (which may be set).
        Moved(to) if !quiet => {
            notes.push(format!("{key}={value} is read as {to}"));
            moved.push((to, value));
        }
        NotBuilt(why) if !quiet => {
            return Err(ConfigError::Key {
                key: key.to_string(),
                message: format!(
                    "`{value}` asks for what verl-rs does not have yet: {why}. Fix: remove it \
                     or set it to verl's default `{default}`"
                ),
            })
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn patterns_match_one_and_many_keys() {
        let m = |p: &str, k: &str| {
            matches(
                &p.split('.').collect::<Vec<_>>(),
                &k.split('.').collect::<Vec<_>>(),
            )
        };
        assert!(m("**.optim.x", "critic.optim.x"));
        assert!(m("**.optim.x", "actor_rollout_ref.actor.optim.x"));
        assert!(m("a.**", "a.b.c"));
        assert!(!m("a.**", "a"), "a section's own key is not its keys' rule");
        assert!(m("a.*.c", "a.b.c"));
        assert!(!m("a.*.c", "a.b.d.c"));
        assert!(!m("**.optim.x", "critic.optim.y"));
    }

    #[test]
    fn defaults_pass_other_values_are_noted_moved_or_refused() {
        let defaults = json!({"trainer": {"seed": 1}, "actor_rollout_ref": {"actor": {"policy_loss": {"tau_pos": 1.0}}}});
        let mut tree = json!({
            "trainer": {"seed": 2, "ray_wait_register_center_timeout": 300},
            "ray_kwargs": {"ray_init": {"num_cpus": 8}},
            "actor_rollout_ref": {"actor": {"tau_pos": 2.0, "policy_loss": {"tau_pos": 1.0}}},
        });
        let notes = take_verl_keys(&mut tree, &defaults).unwrap();
        assert_eq!(
            tree,
            json!({"trainer": {"seed": 2}, "actor_rollout_ref": {"actor": {"policy_loss": {"tau_pos": 2.0}}}})
        );
        assert_eq!(notes.len(), 2, "{notes:?}");
        let said = |text: &str| notes.iter().any(|n| n.contains(text));
        assert!(
            said("ray_kwargs.ray_init.num_cpus=8 has no effect"),
            "{notes:?}"
        );
        assert!(
            said("is read as actor_rollout_ref.actor.policy_loss.tau_pos"),
            "{notes:?}"
        );

        let mut tree = json!({"actor_rollout_ref": {"model": {"lora_rank": 8}}});
        let e = take_verl_keys(&mut tree, &json!({})).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Key { key, .. } if key == "actor_rollout_ref.model.lora_rank"),
            "{e}"
        );
        assert!(e.to_string().contains("LoRA"), "{e}");

        let mut tree = json!({"actor_rollout_ref": {"model": {"lora_rank": 0}}, "x": {"y": 1}});
        take_verl_keys(&mut tree, &json!({})).unwrap();
        assert_eq!(
            tree,
            json!({"x": {"y": 1}}),
            "an unknown key stays for the reader to refuse"
        );
    }

    /// verl's weight-decay style changes nothing in verl (its schedule starts and ends at
    /// `weight_decay`), so another style is taken with a note, not refused.
    #[test]
    fn a_weight_decay_style_is_noted_as_verl_keeps_the_decay_constant() {
        let mut tree = json!({"actor_rollout_ref": {"actor": {"optim": {"weight_decay_incr_style": "linear"}}}});
        let notes = take_verl_keys(&mut tree, &json!({})).unwrap();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].contains("weight_decay_incr_style") && notes[0].contains("constant"),
            "{notes:?}"
        );
    }

    #[test]
    fn a_setting_inside_a_feature_not_built_is_refused_even_when_off() {
        // `{enable_thinking: false}` changes the prompts: not the same as verl's `{}`.
        let mut tree = json!({"data": {"apply_chat_template_kwargs": {"enable_thinking": false}}});
        let e = take_verl_keys(&mut tree, &json!({"data": {"seed": 1}})).unwrap_err();
        assert!(e.to_string().contains("apply_chat_template_kwargs"), "{e}");
        // Off where verl's default is on is a setting too.
        let mut tree = json!({"actor_rollout_ref": {"rollout": {"logprobs_mode": null}}});
        let e = take_verl_keys(&mut tree, &json!({})).unwrap_err();
        assert!(e.to_string().contains("logprobs_mode"), "{e}");
    }

    #[test]
    fn a_moved_default_leaves_the_key_it_moves_to_alone() {
        let defaults = json!({"actor_rollout_ref": {"actor": {"policy_loss": {"tau_pos": 1.0}}}});
        let mut tree = json!({"actor_rollout_ref": {"actor": {"tau_pos": 1.0, "policy_loss": {"tau_pos": 2.0}}}});
        let notes = take_verl_keys(&mut tree, &defaults).unwrap();
        assert_eq!(
            tree["actor_rollout_ref"]["actor"]["policy_loss"]["tau_pos"],
            2.0
        );
        assert!(notes.is_empty(), "{notes:?}");
    }

    #[test]
    fn verls_defaults_run_as_ours_in_sections_we_leave_unset() {
        let mut tree = json!({"actor_rollout_ref": {"ref": {"megatron": {"use_mbridge": false}}}});
        let notes = take_verl_keys(
            &mut tree,
            &json!({"actor_rollout_ref": {"ref": {"megatron": null}}}),
        )
        .unwrap();
        assert_eq!(
            tree["actor_rollout_ref"]["ref"]["megatron"]["use_mbridge"],
            true
        );
        assert_eq!(notes.len(), 1, "{notes:?}");
    }

    #[test]
    fn mandatory_marks_fall_back_to_the_defaults() {
        let defaults = json!({"rollout": {"name": "native"}});
        let mut tree = json!({"rollout": {"name": "???"}});
        let notes = take_verl_keys(&mut tree, &defaults).unwrap();
        assert_eq!(tree, json!({"rollout": {}}));
        assert!(notes[0].contains("rollout.name"), "{notes:?}");
    }
}

//! verl's configuration tree, with verl's key names.
//!
//! A config is built in layers: the defaults, then a file (YAML, TOML or JSON, by extension),
//! then dotted `key=value` overrides as on verl's command line. Keys that do not exist are refused
//! with the valid keys beside them, as is a key a file sets twice; a value of the wrong type
//! names its key. [`VerlConfig::validate`]
//! then checks the parallel layout and batch arithmetic before anything is allocated.
//!
//! ```
//! use verl_core::config::VerlConfig;
//!
//! let cfg = VerlConfig::from_layers(None, &[
//!     "actor_rollout_ref.rollout.n=4",
//!     "trainer.n_gpus_per_node=2",
//!     "data.train_batch_size=8",
//!     "actor_rollout_ref.actor.ppo_mini_batch_size=4",
//!     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
//!     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
//!     "algorithm.adv_estimator=grpo",
//! ])?;
//! assert_eq!(cfg.actor_rollout_ref.rollout.n, 4);
//! let checked = cfg.validate()?;
//! assert_eq!(checked.actor_dp, 2);
//!
//! let err = VerlConfig::from_layers(None, &["trainer.totl_epochs=3"]).unwrap_err();
//! assert!(err.to_string().contains("total_epochs"));
//! # Ok::<(), verl_core::error::ConfigError>(())
//! ```

mod actor_rollout_ref;
mod algorithm;
mod critic;
mod data;
mod interpolation;
mod megatron;
mod profiler;
mod trainer;
mod unsupported;
mod validate;
mod verl_keys;

use std::cell::RefCell;
use std::fmt;
use std::path::Path;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

pub use actor_rollout_ref::{
    ActorConfig, ActorRolloutRefConfig, ModelConfig, MultiTurnConfig, PolicyLossConfig, RefConfig,
    RolloutConfig, RouterReplayConfig, ValKwargs,
};
pub use algorithm::{AlgorithmConfig, KlCtrlConfig, RolloutCorrectionConfig};
pub use critic::{
    CriticConfig, CriticModelConfig, CustomRewardFunctionConfig, RewardModelConfig,
    RewardModelModelConfig,
};
pub use data::{DataConfig, StringOrList, Truncation};
pub use interpolation::resolve_interpolations;
pub use megatron::{CheckpointConfig, Dtype, LrDecayStyle, MegatronConfig, OptimConfig};
pub use profiler::{
    GlobalProfilerConfig, NpuToolConfig, NsysToolConfig, ProfilerTool, RoleProfilerConfig,
    ToolConfig, TorchMemoryToolConfig, TorchToolConfig,
};
pub use trainer::{Device, Launcher, ResumeMode, TrainerConfig, NATIVE_LOGGERS, PYTHON_LOGGERS};
pub use validate::{ValidatedConfig, ADV_ESTIMATORS, KL_TYPES, LOSS_AGG_MODES, POLICY_LOSSES};

use crate::error::ConfigError;

type Result<T> = std::result::Result<T, ConfigError>;

/// The whole run's configuration (verl's `ppo_megatron_trainer.yaml` tree).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VerlConfig {
    pub data: DataConfig,
    pub actor_rollout_ref: ActorRolloutRefConfig,
    pub critic: CriticConfig,
    pub reward_model: RewardModelConfig,
    pub custom_reward_function: CustomRewardFunctionConfig,
    pub algorithm: AlgorithmConfig,
    pub trainer: TrainerConfig,
    pub global_profiler: GlobalProfilerConfig,
    /// What the reader did with verl's keys that verl-rs has no use for or reads elsewhere,
    /// one line each, for the run's start-up log (not part of the tree).
    #[serde(skip)]
    pub notes: Vec<String>,
}

impl VerlConfig {
    /// Defaults, then `file` (if any), then `overrides` (`key=value`), then inherited values
    /// resolved (e.g. `rollout.response_length` from `data.max_response_length`).
    ///
    /// A verl config file loads as it is: OmegaConf interpolations (`${..}`, `${.x}`,
    /// `${oc.select:..}`) are resolved after the overrides, `_target_` keys are dropped, and
    /// verl's keys that verl-rs does not have are judged one by one (see [`Self::notes`]).
    pub fn from_layers(file: Option<&Path>, overrides: &[&str]) -> Result<Self> {
        let defaults = Self::default_tree();
        let mut tree = defaults.clone();
        if let Some(path) = file {
            let mut user = read_file(path)?;
            interpolation::strip_targets(&mut user);
            check_keys(&tree, &user, "")?;
            merge(&mut tree, user);
        }
        for text in overrides {
            apply_override(&mut tree, text)?;
        }
        resolve_interpolations(&mut tree)?;
        let notes = verl_keys::take_verl_keys(&mut tree, &defaults)?;
        inherit_reference_layout(&mut tree);
        let mut cfg = from_tree(tree)?;
        cfg.notes = notes;
        cfg.resolve();
        Ok(cfg)
    }

    /// The defaults as a JSON tree (every key present, unset options as null).
    pub fn default_tree() -> Value {
        serde_json::to_value(Self::default()).expect("the default config serializes")
    }

    /// Fills values that verl writes as interpolations (`${data.max_prompt_length}` and the like).
    pub fn resolve(&mut self) {
        let rollout = &mut self.actor_rollout_ref.rollout;
        rollout
            .prompt_length
            .get_or_insert(self.data.max_prompt_length);
        rollout
            .response_length
            .get_or_insert(self.data.max_response_length);
        let actor = &self.actor_rollout_ref.actor;
        self.critic
            .ppo_mini_batch_size
            .get_or_insert(actor.ppo_mini_batch_size);
        self.critic.ppo_epochs.get_or_insert(actor.ppo_epochs);
        if self.critic.enable.is_none() {
            self.critic.enable = Some(self.algorithm.adv_estimator == "gae");
        }
        if self.actor_rollout_ref.reference.megatron.is_none() {
            // The actor's layout; its offload switches are its own (verl's `ref.megatron`
            // keeps `param_offload: False` unless set).
            self.actor_rollout_ref.reference.megatron = Some(MegatronConfig {
                param_offload: false,
                grad_offload: false,
                optimizer_offload: false,
                ..actor.megatron.clone()
            });
        }
        let global = self.global_profiler.clone();
        for p in [
            &mut self.actor_rollout_ref.actor.profiler,
            &mut self.actor_rollout_ref.reference.profiler,
            &mut self.actor_rollout_ref.rollout.profiler,
            &mut self.critic.profiler,
            &mut self.reward_model.profiler,
        ] {
            p.inherit(&global);
        }
    }

    /// Whether the critic runs (after [`Self::resolve`]).
    pub fn critic_enabled(&self) -> bool {
        self.critic
            .enable
            .unwrap_or(self.algorithm.adv_estimator == "gae")
    }

    /// The resolved config as YAML (what `verl config --print` shows).
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# could not render config: {e}\n"))
    }
}

fn read_file(path: &Path) -> Result<Value> {
    let text = crate::files::read_text(path).map_err(|e| ConfigError::Read {
        path: path.into(),
        message: e.to_string(),
    })?;
    // Editors on Windows start files with a byte-order mark, which the JSON reader refuses; it
    // carries nothing.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text.as_str());
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase();
    // serde_yaml and serde_json keep the last of a key given twice in one map, silently, so a
    // stray copy of a key would override the intended one unseen: both are read through
    // `StrictTree`, which refuses it. The TOML reader refuses duplicates itself.
    let duplicate = RefCell::new(None);
    let parsed: std::result::Result<Value, String> = match ext.as_str() {
        "yaml" | "yml" => flow_depth_within(text, MAX_FLOW_DEPTH).and_then(|()| {
            StrictTree::new(&duplicate)
                .deserialize(serde_yaml::Deserializer::from_str(text))
                .map_err(|e| e.to_string())
        }),
        "toml" => toml::from_str(text).map_err(|e| e.to_string()),
        "json" => {
            let mut reader = serde_json::Deserializer::from_str(text);
            StrictTree::new(&duplicate)
                .deserialize(&mut reader)
                .and_then(|v| reader.end().map(|()| v))
                .map_err(|e| e.to_string())
        }
        other => Err(format!(
            "unknown config extension `.{other}`; use .yaml, .yml, .toml or .json"
        )),
    };
    let mut value = parsed.map_err(|message| match duplicate.take() {
        Some(key) => ConfigError::DuplicateKey {
            path: path.into(),
            key,
        },
        None => ConfigError::Read {
            path: path.into(),
            message,
        },
    })?;
    if matches!(ext.as_str(), "yaml" | "yml") {
        apply_merge_keys(&mut value).map_err(|message| ConfigError::Read {
            path: path.into(),
            message,
        })?;
    }
    match value {
        Value::Object(_) => Ok(value),
        Value::Null => Ok(Value::Object(Map::new())),
        _ => Err(ConfigError::Read {
            path: path.into(),
            message: "the top level must be a map of sections".into(),
        }),
    }
}

/// The deepest `[` / `{` nesting a YAML config may have. The YAML parser refuses nesting past
/// 128 levels, but only after scanning the whole flow, in time quadratic in its depth (100 000
/// brackets took 19 s): deeper flows are refused before it runs.
const MAX_FLOW_DEPTH: usize = 128;

/// `Err` naming the line when `text`'s flow collections (`[...]`, `{...}`, outside quotes and
/// comments) nest deeper than `limit`.
fn flow_depth_within(text: &str, limit: usize) -> std::result::Result<(), String> {
    let (mut depth, mut line) = (0usize, 1usize);
    let mut quote: Option<char> = None;
    let mut chars = text.chars().peekable();
    let mut previous = '\n';
    while let Some(c) = chars.next() {
        match (quote, c) {
            (_, '\n') => {
                line += 1;
                // Single-quoted and plain scalars may span lines; a comment ends here.
            }
            (Some('"'), '\\') => {
                chars.next();
            }
            (Some(q), c) if c == q => {
                // '' inside a single-quoted scalar is an escaped quote.
                if q == '\'' && chars.peek() == Some(&'\'') {
                    chars.next();
                } else {
                    quote = None;
                }
            }
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '#') if previous.is_whitespace() => {
                while chars.peek().is_some_and(|&n| n != '\n') {
                    chars.next();
                }
            }
            (None, '[' | '{') => {
                depth += 1;
                if depth > limit {
                    return Err(format!(
                        "line {line}: flow collections ([...] / {{...}}) nested more than {limit} \
                         levels deep"
                    ));
                }
            }
            (None, ']' | '}') => depth = depth.saturating_sub(1),
            _ => {}
        }
        previous = c;
    }
    Ok(())
}

/// YAML's merge keys (`<<: *anchor`, or `<<: [*a, *b]`), as verl's PyYAML reads them: the
/// merged maps' entries are added to the map that merges them, its own keys winning, and of
/// several merged maps the earlier winning; nested maps are merged first. (The parser has
/// already expanded the aliases; `<<` reaches here as an ordinary key.)
fn apply_merge_keys(value: &mut Value) -> std::result::Result<(), String> {
    match value {
        Value::Array(items) => items.iter_mut().try_for_each(apply_merge_keys),
        Value::Object(map) => {
            for v in map.values_mut() {
                apply_merge_keys(v)?;
            }
            let Some(merged) = map.remove("<<") else {
                return Ok(());
            };
            let sources = match merged {
                Value::Object(m) => vec![m],
                Value::Array(items) => items
                    .into_iter()
                    .map(|item| match item {
                        Value::Object(m) => Ok(m),
                        other => Err(format!("a merge key (`<<`) lists {other}, not a map")),
                    })
                    .collect::<std::result::Result<_, _>>()?,
                other => return Err(format!("a merge key (`<<`) names {other}, not a map")),
            };
            for source in sources {
                for (k, v) in source {
                    map.entry(k).or_insert(v);
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A JSON tree read from a self-describing format (YAML, JSON) that refuses a key given twice
/// in one map; otherwise it reads as `serde_json::Value` does. The first duplicate's dotted key
/// is left in `duplicate`, for a typed error (the parser's own error carries only a message,
/// and for YAML the line of the enclosing map rather than the key's).
struct StrictTree<'a> {
    /// The dotted key of the value being read (`""` at the top).
    at: String,
    duplicate: &'a RefCell<Option<String>>,
}

impl<'a> StrictTree<'a> {
    fn new(duplicate: &'a RefCell<Option<String>>) -> Self {
        Self {
            at: String::new(),
            duplicate,
        }
    }

    fn child(&self, at: String) -> Self {
        Self {
            at,
            duplicate: self.duplicate,
        }
    }
}

impl<'de> DeserializeSeed<'de> for StrictTree<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictTree<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a config value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }

    // As serde_json's own `Value` reads integers beyond 64 bits (YAML gives them).
    fn visit_i128<E: de::Error>(self, v: i128) -> std::result::Result<Value, E> {
        serde_json::Number::deserialize(de::value::I128Deserializer::<E>::new(v)).map(Value::Number)
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> std::result::Result<Value, E> {
        serde_json::Number::deserialize(de::value::U128Deserializer::<E>::new(v)).map(Value::Number)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_none<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E: de::Error>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let child = self.child(format!("{}[{}]", self.at, items.len()));
            match seq.next_element_seed(child)? {
                Some(item) => items.push(item),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let at = if self.at.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.at)
            };
            if out.contains_key(&key) {
                let message = format!("`{at}` is set twice");
                *self.duplicate.borrow_mut() = Some(at);
                return Err(de::Error::custom(message));
            }
            let value = map.next_value_seed(self.child(at))?;
            out.insert(key, value);
        }
        Ok(Value::Object(out))
    }
}

/// Edit distance, for "did you mean" hints.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push(
                (prev[j] + usize::from(ca != *cb))
                    .min(prev[j + 1] + 1)
                    .min(cur[j] + 1),
            );
        }
        prev = cur;
    }
    prev[b.len()]
}

fn unknown_key(path: &str, key: &str, valid: &Map<String, Value>) -> ConfigError {
    let full = if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    };
    let closest = valid
        .keys()
        .min_by_key(|k| distance(k, key))
        .filter(|k| distance(k, key) <= key.len().max(3) / 2 + 1);
    let hint = closest
        .map(|k| format!(" Did you mean `{k}`?"))
        .unwrap_or_default();
    let keys = valid
        .keys()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    ConfigError::Key {
        key: full,
        message: format!("unknown key.{hint} Valid keys here: {keys}"),
    }
}

/// Maps that take any keys, whatever a preset (such as the main job's) already put in them.
const FREE_FORM: &[&str] = &["override_config", "override_transformer_config"];

/// Refuses keys of `user` that the defaults tree does not have. An empty map in the defaults, or
/// one of the [`FREE_FORM`] maps, takes any keys.
fn check_keys(defaults: &Value, user: &Value, path: &str) -> Result<()> {
    let (Value::Object(d), Value::Object(u)) = (defaults, user) else {
        return Ok(());
    };
    if d.is_empty() {
        return Ok(());
    }
    for (k, v) in u {
        if FREE_FORM.contains(&k.as_str()) {
            continue;
        }
        let full = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        match d.get(k) {
            None if only_verl_keys(&full, v) => {}
            None => return Err(unknown_key(path, k, d)),
            Some(dv) => check_keys(
                dv,
                v,
                &if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                },
            )?,
        }
    }
    Ok(())
}

/// Whether `v` at `key` is one of verl's keys that verl-rs judges on its own
/// (`verl_keys`), or a section of nothing else.
fn only_verl_keys(key: &str, v: &Value) -> bool {
    verl_keys::is_verl_key(key)
        || v.as_object().is_some_and(|m| {
            !m.is_empty()
                && m.iter()
                    .all(|(k, child)| only_verl_keys(&format!("{key}.{k}"), child))
        })
}

/// verl's `ref.megatron` takes each unset layout key from `actor.megatron` (interpolations in
/// its YAML); the offload switches stay the reference's own.
fn inherit_reference_layout(tree: &mut Value) {
    let Some(actor) = tree
        .pointer("/actor_rollout_ref/actor/megatron")
        .and_then(Value::as_object)
        .cloned()
    else {
        return;
    };
    if let Some(Value::Object(r)) = tree.pointer_mut("/actor_rollout_ref/ref/megatron") {
        for (k, v) in actor {
            if !k.ends_with("_offload") && !r.contains_key(&k) {
                r.insert(k, v);
            }
        }
    }
}

/// Deep-merges `user` into `base`: maps merge key by key, anything else replaces.
fn merge(base: &mut Value, user: Value) {
    match (base, user) {
        (Value::Object(b), Value::Object(u)) => {
            for (k, v) in u {
                match b.get_mut(&k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

/// Parses an override's value as a YAML scalar or flow collection (`3`, `1e-6`, `true`, `null`,
/// `[1, 2]`, `{a: 1}`); anything else is a string.
fn parse_value(text: &str) -> Value {
    serde_yaml::from_str::<Value>(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// Applies one `a.b.c=value` override to the tree.
pub fn apply_override(tree: &mut Value, text: &str) -> Result<()> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| ConfigError::OverrideSyntax {
            text: text.to_string(),
        })?;
    // Hydra's `+key=value` adds a key the tree does not have yet.
    let append = key.trim().starts_with('+');
    let key = key.trim().trim_start_matches('+');
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(ConfigError::OverrideSyntax {
            text: text.to_string(),
        });
    }
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = tree;
    let mut path = String::new();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let free_form = matches!(node, Value::Object(m) if m.is_empty())
            || i.checked_sub(1)
                .is_some_and(|p| FREE_FORM.contains(&parts[p]));
        if node.is_null() {
            *node = Value::Object(Map::new());
        }
        let Value::Object(map) = node else {
            return Err(ConfigError::Key {
                key: key.to_string(),
                message: format!("`{path}` is not a section, so it has no key `{part}`"),
            });
        };
        if !map.contains_key(*part)
            && !free_form
            && !map.is_empty()
            && !append
            && !verl_keys::is_verl_key(key)
        {
            return Err(unknown_key(&path, part, map));
        }
        if last {
            map.insert(part.to_string(), parse_value(value.trim()));
            return Ok(());
        }
        path = if path.is_empty() {
            part.to_string()
        } else {
            format!("{path}.{part}")
        };
        node = map.entry(part.to_string()).or_insert(Value::Null);
    }
    Ok(())
}

fn from_tree(tree: Value) -> Result<VerlConfig> {
    serde_path_to_error::deserialize(tree).map_err(|e| {
        let key = e.path().to_string();
        ConfigError::Key {
            key,
            message: e.into_inner().to_string(),
        }
    })
}

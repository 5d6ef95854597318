//! Fuzzing of the configuration readers: config files in YAML, TOML and JSON, `key=value`
//! overrides as on the command line, the validation that follows them, and the
//! `VERL_COMM_TIMEOUT_S` setting.
//!
//! Each property builds malformed input — random bytes, or a valid document with random
//! mutations: truncation, a flipped byte, a spliced-in token, a duplicated line, huge or
//! negative numbers, wrong types, deep nesting, YAML aliases that multiply — and asserts that
//! the reader returns `Ok` or an error with a message, never a panic, and that validation
//! returns within seconds. Where the input is valid but for one known defect (a value of the
//! wrong type), the error must name the key.
//!
//! Bounded for CI: a fixed number of cases per property and a short shrink.

mod fuzz_support;
use fuzz_support::*;

use proptest::prelude::*;
use serde_json::{json, Value};
use verl_core::config::VerlConfig;
use verl_core::error::ConfigError;
use verl_core::traits::comm_timeout_from;

/// The Rust type behind a config key, for the values that are of the wrong type for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `usize`
    Size,
    /// `f64`
    Float,
    Bool,
    /// `String`
    Text,
    /// `i64`
    Signed,
    /// `u64`
    Seed,
    /// `Option<u64>`: a seed where null is verl's default (`data.seed`).
    NullableSeed,
}

/// Keys of every section, with their types (none optional but `data.seed`).
const KEYS: &[(&str, Kind)] = &[
    ("trainer.total_epochs", Kind::Size),
    ("trainer.nnodes", Kind::Size),
    ("trainer.n_gpus_per_node", Kind::Size),
    ("data.train_batch_size", Kind::Size),
    ("data.max_prompt_length", Kind::Size),
    ("data.max_response_length", Kind::Size),
    ("actor_rollout_ref.rollout.n", Kind::Size),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", Kind::Size),
    ("actor_rollout_ref.actor.ppo_epochs", Kind::Size),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        Kind::Size,
    ),
    (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
        Kind::Size,
    ),
    ("actor_rollout_ref.actor.optim.lr", Kind::Float),
    ("actor_rollout_ref.rollout.temperature", Kind::Float),
    ("actor_rollout_ref.rollout.top_p", Kind::Float),
    ("actor_rollout_ref.actor.clip_ratio", Kind::Float),
    ("algorithm.gamma", Kind::Float),
    ("algorithm.lam", Kind::Float),
    ("trainer.val_before_train", Kind::Bool),
    ("actor_rollout_ref.actor.use_kl_loss", Kind::Bool),
    ("data.shuffle", Kind::Bool),
    ("algorithm.use_kl_in_reward", Kind::Bool),
    ("trainer.project_name", Kind::Text),
    ("trainer.experiment_name", Kind::Text),
    ("algorithm.adv_estimator", Kind::Text),
    ("actor_rollout_ref.actor.loss_agg_mode", Kind::Text),
    ("trainer.save_freq", Kind::Signed),
    ("trainer.test_freq", Kind::Signed),
    ("trainer.seed", Kind::Seed),
    ("data.seed", Kind::NullableSeed),
];

/// The dotted names of [`KEYS`], and keys that do not exist or take any key below them.
const KEY_PATHS: &[&str] = &[
    "trainer.total_epochs",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "data.train_batch_size",
    "data.train_files",
    "data.truncation",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.ref.megatron",
    "actor_rollout_ref.model.override_config.hidden_size",
    "actor_rollout_ref.actor.megatron.override_transformer_config.x.y",
    "algorithm.adv_estimator",
    "algorithm.kl_ctrl.type",
    "critic.enable",
    "trainer.totl_epochs",
    "nonsense",
    "trainer",
    "",
];

/// A valid value of `kind`.
fn valid_value(kind: Kind) -> BoxedStrategy<Value> {
    match kind {
        Kind::Size => (1u64..64).prop_map(Value::from).boxed(),
        Kind::Float => (0.0f64..1.0).prop_map(Value::from).boxed(),
        Kind::Bool => any::<bool>().prop_map(Value::from).boxed(),
        Kind::Text => "[a-z_]{1,10}".prop_map(Value::from).boxed(),
        Kind::Signed => (-5i64..100).prop_map(Value::from).boxed(),
        Kind::Seed => any::<u64>().prop_map(Value::from).boxed(),
        Kind::NullableSeed => {
            prop_oneof![any::<u64>().prop_map(Value::from), Just(Value::Null)].boxed()
        }
    }
}

/// Values of the wrong type (or out of range) for a key of `kind`.
fn wrong_values(kind: Kind) -> Vec<Value> {
    match kind {
        Kind::Size => vec![
            json!(-1),
            json!(1.5),
            json!(1e12),
            json!("3"),
            json!("abc"),
            json!(true),
            json!([1]),
            json!({ "a": 1 }),
            Value::Null,
        ],
        Kind::Float => vec![
            json!("abc"),
            json!("0.5"),
            json!(true),
            json!([1.0]),
            json!({ "a": 1 }),
            Value::Null,
        ],
        Kind::Bool => vec![
            json!(1),
            json!("true"),
            json!("yes"),
            json!([true]),
            json!(0.5),
            Value::Null,
        ],
        Kind::Text => vec![
            json!(3),
            json!(1.5),
            json!(true),
            json!(["a"]),
            json!({ "a": "b" }),
            Value::Null,
        ],
        Kind::Signed => vec![
            json!("3"),
            json!(1.5),
            json!(u64::MAX),
            json!(true),
            json!([1]),
            Value::Null,
        ],
        Kind::Seed => vec![json!(-1), json!(1.5), json!("3"), json!(true), Value::Null],
        Kind::NullableSeed => vec![json!(-1), json!(1.5), json!("3"), json!(true)],
    }
}

/// The same as [`wrong_values`], as override text (a YAML scalar or flow collection).
fn wrong_override_values(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Size => &[
            "-1", "1.5", "1e12", "abc", "'3'", "true", "[1]", "{a: 1}", "null",
        ],
        Kind::Float => &["abc", "'0.5'", "true", "[1.0]", "{a: 1}", "null"],
        Kind::Bool => &["1", "'true'", "abc", "[true]", "0.5", "null"],
        Kind::Text => &["3", "1.5", "true", "[a]", "{a: b}", "null"],
        Kind::Signed => &["'3'", "1.5", "18446744073709551615", "true", "[1]", "null"],
        Kind::Seed => &["-1", "1.5", "'3'", "true", "null"],
        Kind::NullableSeed => &["-1", "1.5", "'3'", "true"],
    }
}

/// A config file's format, chosen by its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Yaml,
    Toml,
    Json,
    /// An extension no reader takes.
    Other,
}

impl Format {
    fn file_name(self) -> &'static str {
        match self {
            Format::Yaml => "run.yaml",
            Format::Toml => "run.toml",
            Format::Json => "run.json",
            Format::Other => "run.ini",
        }
    }
}

fn formats() -> impl Strategy<Value = Format> {
    prop_oneof![
        3 => Just(Format::Yaml),
        2 => Just(Format::Toml),
        2 => Just(Format::Json),
        1 => Just(Format::Other),
    ]
}

/// `tree` in `format`, or `None` when the format cannot hold it (TOML has no null, and no
/// integer beyond i64).
fn render(format: Format, tree: &Value) -> Option<Vec<u8>> {
    match format {
        Format::Yaml => serde_yaml::to_string(tree).ok().map(String::into_bytes),
        Format::Toml => toml::to_string(tree).ok().map(String::into_bytes),
        Format::Json | Format::Other => serde_json::to_vec_pretty(tree).ok(),
    }
}

/// The tree holding `value` at the dotted `key`.
fn tree_with(key: &str, value: Value) -> Value {
    let mut tree = json!({});
    apply_json(&mut tree, &JsonEdit::Set(path_of(key), value));
    tree
}

/// YAML whose aliases multiply into 9⁸ strings ("a billion laughs").
fn billion_laughs() -> String {
    let mut text = String::from(
        "x: &a0 [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for i in 1..9 {
        let p = i - 1;
        text += &format!("x{i}: &a{i} [*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p},*a{p}]\n");
    }
    text
}

/// A config file: valid keys with valid values, then some set to [`nasty_value`]s or
/// removed, rendered, then byte-level edits (a byte-order mark in front, sometimes);
/// or random bytes, or YAML built to exhaust a reader.
fn config_files() -> impl Strategy<Value = (Format, Vec<u8>)> {
    let key = prop::sample::select(KEYS);
    let settings = prop::collection::vec(
        key.prop_flat_map(|(k, kind)| (Just(k), valid_value(kind))),
        0..6,
    );
    let edit = prop_oneof![
        3 => (prop::sample::select(KEY_PATHS), nasty_value())
            .prop_map(|(k, v)| JsonEdit::Set(path_of(k), v)),
        1 => prop::sample::select(KEY_PATHS).prop_map(|k| JsonEdit::Remove(path_of(k))),
    ];
    let document = (
        formats(),
        settings,
        prop::collection::vec(edit, 0..3),
        prop::collection::vec(byte_edit(), 0..2),
        any::<bool>(),
    )
        .prop_map(|(format, settings, edits, byte_edits, bom)| {
            let mut tree = json!({});
            for (k, v) in settings {
                apply_json(&mut tree, &JsonEdit::Set(path_of(k), v));
            }
            for e in &edits {
                apply_json(&mut tree, e);
            }
            let mut bytes = if bom {
                "\u{feff}".as_bytes().to_vec()
            } else {
                Vec::new()
            };
            bytes.extend(render(format, &tree).unwrap_or_else(|| tree.to_string().into_bytes()));
            (format, apply_all(bytes, &byte_edits))
        });
    prop_oneof![
        8 => document,
        1 => (formats(), prop::collection::vec(any::<u8>(), 0..256)),
        1 => Just((Format::Yaml, billion_laughs().into_bytes())),
        1 => (1usize..2000).prop_map(|depth| {
            let nested = format!("trainer: {}1{}", "[".repeat(depth), "]".repeat(depth));
            (Format::Yaml, nested.into_bytes())
        }),
    ]
}

/// A runnable GRPO config on 2 simulated ranks (as `tests/config.rs` uses).
const GOOD: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
];

/// Override values that parse as YAML in unusual ways, or not at all.
const NASTY_OVERRIDE_VALUES: &[&str] = &[
    "18446744073709551616",
    "18446744073709551615",
    "-1",
    "1e999",
    ".inf",
    ".nan",
    "null",
    "~",
    "[",
    "{a: [1, {b: 2}]}",
    "&a [*a]",
    "*a",
    "!!binary aGVsbG8=",
    "0x10",
    "0o7",
    "1_000",
    "'quoted'",
    "\"x",
    "a=b=c",
    "",
    " ",
    "\u{feff}3",
];

fn override_value() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(NASTY_OVERRIDE_VALUES).prop_map(str::to_string),
        1 => (1usize..400).prop_map(|d| format!("{}1{}", "[".repeat(d), "]".repeat(d))),
        2 => any::<String>(),
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|x| x.to_string()),
    ]
}

fn override_key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(KEY_PATHS).prop_map(str::to_string),
        1 => prop::sample::select(KEY_PATHS).prop_map(|k| format!("+{k}")),
        1 => "[a-z_.+ ]{0,30}",
        1 => (1usize..300).prop_map(|n| vec!["a"; n].join(".")),
    ]
}

/// One `key=value` override: built from keys and values, or any string at all.
fn overrides() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (override_key(), override_value()).prop_map(|(k, v)| format!("{k}={v}")),
        1 => any::<String>(),
    ]
}

/// Keys whose sizes are multiplied, divided and compared by validation.
const SIZE_KEYS: &[&str] = &[
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "actor_rollout_ref.actor.megatron.context_parallel_size",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
    "critic.ppo_mini_batch_size",
    "critic.ppo_micro_batch_size_per_gpu",
];

const EXTREME_SIZES: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "7",
    "4294967296",
    "8589934592",
    "1000000000000",
    "1000000000001",
    "9223372036854775807",
    "18446744073709551615",
];

/// Loads `path` with `overrides`, then validates what loads (on a thread, within 5 s).
fn load_and_validate(
    path: Option<&std::path::Path>,
    overrides: &[String],
) -> Result<(), TestCaseError> {
    let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
    let loaded = no_panic("VerlConfig::from_layers", || {
        VerlConfig::from_layers(path, &refs)
    })?;
    if let Ok(cfg) = loaded {
        let _validated = no_panic_within("VerlConfig::validate", 5, move || {
            cfg.validate().map(drop).map_err(|e| e.to_string())
        })?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any file as `--config` (YAML, TOML, JSON or another extension; mutated, random, deeply
    /// nested, aliases that multiply) loads or is refused with a message, never panicking;
    /// a config that loads validates (or is refused) within seconds, never panicking.
    #[test]
    fn config_files_never_panic((format, bytes) in config_files()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format.file_name());
        std::fs::write(&path, bytes).unwrap();
        load_and_validate(Some(&path), &[])?;
    }

    /// A key of a config file set to a value of the wrong type (a string or a list for a
    /// number, a fraction or a negative number for a count, a number for a name, null) is
    /// refused, naming the key, in every format.
    #[test]
    fn a_wrong_typed_value_in_a_config_file_names_its_key(
        format in prop_oneof![Just(Format::Yaml), Just(Format::Toml), Just(Format::Json)],
        (key, value) in prop::sample::select(KEYS)
            .prop_flat_map(|(key, kind)| (Just(key), prop::sample::select(wrong_values(kind)))),
    ) {
        let rendered = render(format, &tree_with(key, value.clone()));
        prop_assume!(rendered.is_some());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format.file_name());
        std::fs::write(&path, rendered.unwrap_or_default()).unwrap();
        match no_panic("VerlConfig::from_layers", || VerlConfig::from_layers(Some(&path), &[]))? {
            Ok(_) => {
                return Err(TestCaseError::fail(format!(
                    "`{key}` = {value} in {format:?} was accepted"
                )))
            }
            Err(message) => prop_assert!(
                message.contains(key),
                "`{key}` = {value} in {format:?}: the error does not name the key: {message}"
            ),
        }
    }

    /// Any list of overrides (keys real, unknown, appended with `+`, hundreds of parts deep;
    /// values huge, infinite, deeply nested, YAML aliases, tags, any string) loads or is
    /// refused with a message, never panicking; what loads validates within seconds.
    #[test]
    fn overrides_never_panic(list in prop::collection::vec(overrides(), 0..6)) {
        load_and_validate(None, &list)?;
    }

    /// An override giving a key a value of the wrong type is refused, naming the key.
    #[test]
    fn a_wrong_typed_override_names_its_key(
        (key, value) in prop::sample::select(KEYS).prop_flat_map(|(key, kind)| {
            (Just(key), prop::sample::select(wrong_override_values(kind)))
        }),
    ) {
        let text = format!("{key}={value}");
        let outcome = no_panic("VerlConfig::from_layers", || {
            VerlConfig::from_layers(None, &[text.as_str()])
        })?;
        match outcome {
            Ok(_) => return Err(TestCaseError::fail(format!("`{text}` was accepted"))),
            Err(message) => prop_assert!(
                message.contains(key),
                "`{text}`: the error does not name the key: {message}"
            ),
        }
    }

    /// An override that is not `key=value` with a dotted key of non-empty parts is refused as
    /// such, quoting the text.
    #[test]
    fn a_malformed_override_is_refused_quoting_it(
        text in prop_oneof![
            "[^=]{0,30}",
            prop::sample::select(vec![
                "=1", ".a=1", "a.=1", "a..b=1", "+=1", " =1", "trainer..total_epochs=3", "+.x=1",
            ])
            .prop_map(str::to_string),
        ],
    ) {
        let outcome = caught("VerlConfig::from_layers", || {
            VerlConfig::from_layers(None, &[text.as_str()])
        })?;
        match outcome {
            Err(e @ ConfigError::OverrideSyntax { .. }) => prop_assert!(
                e.to_string().contains(&text),
                "the error does not quote `{text}`: {e}"
            ),
            Err(other) => {
                return Err(TestCaseError::fail(format!(
                    "`{text}`: expected a syntax error, got {other}"
                )))
            }
            Ok(_) => return Err(TestCaseError::fail(format!("`{text}` was accepted"))),
        }
    }

    /// Sizes of 0, 1, small primes, 2³², 10¹², 2⁶³ − 1 and 2⁶⁴ − 1 for the keys that
    /// validation multiplies and divides (world size, parallel sizes, batch sizes, samples
    /// per prompt) are accepted or refused by validation within seconds, never overflowing.
    #[test]
    fn extreme_sizes_validate_without_overflow_or_hang(
        sizes in prop::collection::vec(
            (prop::sample::select(SIZE_KEYS), prop::sample::select(EXTREME_SIZES)),
            1..4,
        ),
        critic in any::<bool>(),
    ) {
        let mut list: Vec<String> = GOOD.iter().map(|s| s.to_string()).collect();
        if critic {
            list.push("critic.enable=true".into());
            list.push("critic.ppo_micro_batch_size_per_gpu=2".into());
        }
        list.extend(sizes.iter().map(|(k, v)| format!("{k}={v}")));
        load_and_validate(None, &list)?;
    }

    /// `VERL_COMM_TIMEOUT_S` is a whole number of seconds ≥ 1 (as `str::parse::<u64>` reads
    /// it after trimming) or refused naming the variable, whatever the text.
    #[test]
    fn comm_timeout_is_whole_seconds_or_refused_by_name(
        text in prop_oneof![
            any::<String>(),
            prop::sample::select(vec![
                "0", "1", "600", "-5", "abc", " 30 ", "+5", "1e3", "", "18446744073709551615",
                "18446744073709551616",
            ])
            .prop_map(str::to_string),
            any::<u64>().prop_map(|n| n.to_string()),
        ],
    ) {
        match no_panic("comm_timeout_from", || comm_timeout_from(Some(&text)))? {
            Ok(d) => prop_assert!(
                d.as_secs() >= 1 && text.trim().parse::<u64>() == Ok(d.as_secs()),
                "{text:?} read as {d:?}"
            ),
            Err(message) => prop_assert!(
                message.contains("VERL_COMM_TIMEOUT_S"),
                "the error does not name the variable: {message}"
            ),
        }
    }
}

/// Guards the tables above against drifting from the config: every key of [`KEYS`] and
/// [`SIZE_KEYS`] is in the defaults tree.
#[test]
fn the_fuzzed_keys_are_config_keys() {
    let defaults = VerlConfig::default_tree();
    for key in KEYS
        .iter()
        .map(|(k, _)| *k)
        .chain(SIZE_KEYS.iter().copied())
    {
        let pointer = format!("/{}", key.replace('.', "/"));
        assert!(
            defaults.pointer(&pointer).is_some(),
            "{key} is not a config key"
        );
    }
}

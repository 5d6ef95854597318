//! Fuzzing of verl-megatron's readers of outside bytes: safetensors headers and data,
//! `config.json`, the tokenizer files, `model.safetensors.index.json`, the dist checkpoint's
//! `extra.json` with its tensor files, and the launcher's environment variables.
//!
//! Each property builds malformed input — random bytes, or a valid document (a committed
//! fixture, or one built here) with random mutations: truncation, a flipped byte, a spliced-in
//! token, huge or negative numbers, wrong types, deep nesting, missing keys, names that leave
//! the directory — and asserts that the reader returns `Ok` or an error with a message, never
//! a panic. Where the input is a valid document with one known defect, the error must name
//! the field (or the tensor) at fault.
//!
//! Bounded for CI: a fixed number of cases per property ([`fuzz_config`]) and a short shrink.
//! The generators and checks shared with the other crates' fuzzing tests are in
//! `verl-core/tests/fuzz_support`.

mod common;
use common::fixture;

#[path = "../../verl-core/tests/fuzz_support/mod.rs"]
mod fuzz_support;
use fuzz_support::*;

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Value};
use verl_core::backend::CpuBackend as B;
use verl_core::traits::{CheckpointBackend, CheckpointContents, CheckpointState};
use verl_core::weights::ShardSlice;
use verl_megatron::checkpoint::{DistCheckpoint, ShardTarget, ShardedCheckpoint};
use verl_megatron::hf::{read_config_json, ChatMessage, HfCheckpoint, HfModelConfig, HfTokenizer};
use verl_megatron::parallel::LaunchEnv;

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A committed fixture's JSON file, mutated; sometimes random bytes instead.
fn mutated_fixture(
    fixtures: &[&str],
    file: &str,
    fields: &'static [&'static str],
) -> impl Strategy<Value = Vec<u8>> {
    let docs: Vec<Value> = fixtures
        .iter()
        .map(|name| read_json(&fixture(name).join(file)))
        .collect();
    prop_oneof![
        8 => (
            prop::sample::select(docs),
            prop::collection::vec(json_edit(fields), 0..4),
            prop::collection::vec(byte_edit(), 0..2),
        )
            .prop_map(|(doc, json_edits, byte_edits)| mutated(doc, &json_edits, &byte_edits)),
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ]
}

// ---------------------------------------------------------------------------------------------
// safetensors files.

/// Bytes per element of the dtypes generated here.
fn width(dtype: &str) -> usize {
    match dtype {
        "F64" | "I64" => 8,
        "F32" | "I32" => 4,
        "F16" | "BF16" => 2,
        _ => 1,
    }
}

const DTYPES: &[&str] = &[
    "F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "I8",
];

/// Tensor names, among them ones whose layer index is absurd.
const TENSOR_NAMES: &[&str] = &[
    "model.norm.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.experts.3.up_proj.weight",
    "model.layers.99999999999999999999.input_layernorm.weight",
    "model.layers.18446744073709551615.input_layernorm.weight",
    "model.layers.0.mlp.experts.18446744073709551615.up_proj.weight",
    "",
    "../evil",
];

/// A tensor of a generated safetensors file: name, (dtype, shape).
type StTensor = (String, (&'static str, Vec<usize>));

/// A valid safetensors header and data for `tensors` (name → dtype, shape), offsets in order.
fn st_parts(tensors: &[StTensor]) -> (Value, Vec<u8>) {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut data = Vec::new();
    for (name, (dtype, shape)) in tensors {
        let start = data.len();
        let len = shape.iter().product::<usize>() * width(dtype);
        data.extend((0..len).map(|i| (i % 251) as u8));
        header.insert(
            name.clone(),
            json!({ "dtype": dtype, "shape": shape, "data_offsets": [start, data.len()] }),
        );
    }
    (Value::Object(header), data)
}

fn st_tensors() -> impl Strategy<Value = Vec<StTensor>> {
    let name = prop_oneof![
        prop::sample::select(TENSOR_NAMES).prop_map(str::to_string),
        "[a-z.]{1,12}",
    ];
    let tensor = (
        prop::sample::select(DTYPES),
        prop::collection::vec(0usize..5, 0..4),
    );
    prop::collection::btree_map(name, tensor, 0..5).prop_map(|m| m.into_iter().collect())
}

/// A change to a safetensors file.
#[derive(Debug, Clone)]
enum StEdit {
    /// Sets (or, with `None`, removes) field `dtype`, `shape` or `data_offsets` of one tensor.
    Field(Index, &'static str, Option<Value>),
    /// Replaces the 8-byte header length.
    HeaderLength(u64),
    /// A byte-level change to the whole file.
    Bytes(ByteEdit),
}

const ST_FIELDS: &[&str] = &["dtype", "shape", "data_offsets"];

fn st_edit() -> impl Strategy<Value = StEdit> {
    let field = prop::sample::select(ST_FIELDS);
    prop_oneof![
        3 => (any::<Index>(), field, prop_oneof![sizes().prop_map(Some), Just(None)])
            .prop_map(|(i, f, v)| StEdit::Field(i, f, v)),
        1 => prop_oneof![
            Just(u64::MAX),
            Just(1_000_000_000_000),
            Just(100_000_001),
            any::<u64>(),
            0u64..64,
        ]
        .prop_map(StEdit::HeaderLength),
        2 => byte_edit().prop_map(StEdit::Bytes),
    ]
}

/// A safetensors file built from generated tensors with `edits`, or random bytes.
fn safetensors_files() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => (st_tensors(), prop::collection::vec(st_edit(), 0..3)).prop_map(|(tensors, edits)| {
            let (mut header, data) = st_parts(&tensors);
            let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
            for e in &edits {
                if let (StEdit::Field(i, field, value), false) = (e, names.is_empty()) {
                    let path = vec![names[i.index(names.len())].clone(), field.to_string()];
                    match value {
                        Some(v) => apply_json(&mut header, &JsonEdit::Set(path, v.clone())),
                        None => apply_json(&mut header, &JsonEdit::Remove(path)),
                    }
                }
            }
            let mut bytes = encode_st(&header, &data);
            for e in &edits {
                match e {
                    StEdit::HeaderLength(n) if bytes.len() >= 8 => {
                        bytes[..8].copy_from_slice(&n.to_le_bytes())
                    }
                    StEdit::Bytes(b) => bytes = apply_bytes(bytes, b),
                    _ => {}
                }
            }
            bytes
        }),
        1 => prop::collection::vec(any::<u8>(), 0..128),
    ]
}

/// A defect in the sizes of one tensor `model.norm.weight` (F32 `[2, 3]`, 24 bytes of data).
#[derive(Debug, Clone)]
enum SizeDefect {
    /// Dimension `k` of the shape is `n`.
    ShapeDim(usize, u64),
    /// `data_offsets` are `[0, n]`.
    OffsetsEnd(u64),
    /// Shape `[n]` with the matching `data_offsets` `[0, 4n]`, but 24 bytes of data.
    PastTheEnd(u64),
    /// `count` dimensions, each `n`.
    ManyDims(usize, u64),
}

/// One F32 tensor whose sizes have `defect`, as a file.
fn with_size_defect(defect: &SizeDefect) -> Vec<u8> {
    let (shape, end): (Vec<u64>, u64) = match *defect {
        SizeDefect::ShapeDim(k, n) => {
            let mut shape = vec![2, 3];
            shape[k] = n;
            (shape, 24)
        }
        SizeDefect::OffsetsEnd(n) => (vec![2, 3], n),
        SizeDefect::PastTheEnd(n) => (vec![n], 4 * n),
        SizeDefect::ManyDims(count, n) => (vec![n; count], 24),
    };
    let header = json!({
        "model.norm.weight": { "dtype": "F32", "shape": shape, "data_offsets": [0, end] }
    });
    encode_st(&header, &[0u8; 24])
}

fn size_defects() -> impl Strategy<Value = SizeDefect> {
    let huge = 1_000_000u64..=u64::MAX;
    prop_oneof![
        (0usize..2, huge.clone()).prop_map(|(k, n)| SizeDefect::ShapeDim(k, n)),
        huge.clone().prop_map(SizeDefect::OffsetsEnd),
        (1_000_000u64..=u64::MAX / 4).prop_map(SizeDefect::PastTheEnd),
        (2usize..=4, huge).prop_map(|(count, n)| SizeDefect::ManyDims(count, n)),
    ]
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any file in place of `model.safetensors` opens or is refused with a message; every
    /// tensor of one that opens reads (or is refused), and checking it against a model's
    /// tensor table returns, never panicking.
    #[test]
    fn safetensors_files_never_panic(bytes in safetensors_files()) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        if let Ok(ckpt) = no_panic("HfCheckpoint::open", || HfCheckpoint::open(dir.path()))? {
            let names: Vec<String> = ckpt.names().map(str::to_string).collect();
            for name in &names {
                returns("HfCheckpoint::read_f32", || ckpt.read_f32(name))?;
            }
            for model in ["qwen2", "qwen2_moe"] {
                let cfg = HfModelConfig::from_dir(fixture(model)).unwrap();
                returns("HfCheckpoint::verify", || ckpt.verify(&cfg))?;
            }
        }
    }

    /// A header whose sizes cannot match the data (a dimension or an offset of 10⁶ up to
    /// u64::MAX, several huge dimensions, a tensor past the end of the file) is refused
    /// before anything of that size is allocated, and the error names the tensor; a header
    /// length beyond the file is refused naming the header.
    #[test]
    fn huge_sizes_in_a_safetensors_header_are_refused_by_name(
        defect in size_defects(),
        header_length in prop_oneof![Just(None), (25u64..=u64::MAX).prop_map(Some)],
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut bytes = with_size_defect(&defect);
        let needle = match header_length {
            Some(n) => {
                let header_len = n.max(bytes.len() as u64 - 7);
                bytes[..8].copy_from_slice(&header_len.to_le_bytes());
                "header"
            }
            None => "`model.norm.weight`",
        };
        std::fs::write(&path, bytes).unwrap();
        match no_panic("HfCheckpoint::open_file", || HfCheckpoint::open_file(&path))? {
            Ok(_) => return Err(TestCaseError::fail(format!("{defect:?} was accepted"))),
            Err(message) => prop_assert!(
                message.contains(needle),
                "{defect:?}: the error does not name {needle}: {message}"
            ),
        }
    }

    /// A tensor with a zero dimension holds no data whatever its other dimensions say
    /// (safetensors accepts `[0, 2³², 2³²]` with no bytes): it reads as empty, without the
    /// product of the other dimensions overflowing.
    #[test]
    fn zero_length_tensors_with_huge_dimensions_read_as_empty(
        dims in prop::collection::vec(
            prop_oneof![Just(1u64 << 32), Just(u64::MAX), 1u64..=u64::MAX],
            1..4,
        ),
        zero_at in any::<Index>(),
    ) {
        let mut shape = dims;
        let at = zero_at.index(shape.len() + 1);
        shape.insert(at, 0);
        let header = json!({
            "model.norm.weight": { "dtype": "F32", "shape": shape, "data_offsets": [0, 0] }
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        std::fs::write(&path, encode_st(&header, &[])).unwrap();
        if let Ok(ckpt) = no_panic("HfCheckpoint::open_file", || HfCheckpoint::open_file(&path))? {
            if let Ok((values, _)) =
                no_panic("HfCheckpoint::read_f32", || ckpt.read_f32("model.norm.weight"))?
            {
                let n = values.len();
                prop_assert!(n == 0, "{n} values from a zero-length tensor");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// config.json.

const CONFIG_FIXTURES: &[&str] = &[
    "qwen2",
    "llama3",
    "qwen3",
    "qwen2_moe",
    "qwen2_value",
    "qwen2_reward",
    "qwen3_moe",
    "mixtral",
    "mistral",
    "qwen3_yarn",
];

/// The keys of `config.json` verl-rs reads, and a few it must not trip on.
const CONFIG_FIELDS: &[&str] = &[
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_parameters.rope_theta",
    "rope_parameters.rope_type",
    "rope_scaling",
    "rope_scaling.rope_type",
    "rope_scaling.factor",
    "rope_scaling.low_freq_factor",
    "rope_scaling.original_max_position_embeddings",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "use_sliding_window",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "num_labels",
    "id2label",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "num_local_experts",
    "sliding_window",
    "router_jitter_noise",
    "rope_parameters.factor",
    "rope_parameters.original_max_position_embeddings",
    "rope_parameters.attention_factor",
    "rope_parameters.mscale",
    "rope_parameters.mscale_all_dim",
    "rope_parameters.beta_fast",
    "rope_parameters.truncate",
];

/// A wrong value for a field of the `qwen2` fixture's `config.json`, and the name its error
/// must carry.
const CONFIG_DEFECTS: &[(&str, &str)] = &[
    ("hidden_size", "-1"),
    ("hidden_size", "\"32\""),
    ("hidden_size", "1.5"),
    ("hidden_size", "0"),
    ("hidden_size", "null"),
    ("hidden_size", "1e12"),
    ("hidden_size", "[32]"),
    ("num_attention_heads", "-4"),
    ("num_attention_heads", "0"),
    ("num_attention_heads", "{}"),
    ("num_key_value_heads", "0"),
    ("num_key_value_heads", "3"),
    ("num_key_value_heads", "\"2\""),
    ("vocab_size", "0"),
    ("vocab_size", "-320"),
    ("vocab_size", "1e12"),
    ("intermediate_size", "0"),
    ("intermediate_size", "true"),
    ("num_hidden_layers", "0"),
    ("num_hidden_layers", "1e12"),
    ("num_hidden_layers", "-2"),
    ("num_hidden_layers", "null"),
    ("head_dim", "-8"),
    ("head_dim", "8.5"),
    ("rms_norm_eps", "-1e-6"),
    ("rms_norm_eps", "0"),
    ("rms_norm_eps", "\"small\""),
    ("tie_word_embeddings", "\"yes\""),
    ("tie_word_embeddings", "1"),
    ("attention_bias", "\"no\""),
    ("mlp_bias", "true"),
    ("use_sliding_window", "\"yes\""),
    ("hidden_act", "\"gelu\""),
    ("dtype", "\"int8\""),
    ("max_position_embeddings", "-1"),
    ("max_position_embeddings", "\"4k\""),
    ("bos_token_id", "-1"),
    ("eos_token_id", "\"</s>\""),
    ("eos_token_id", "[2, \"x\"]"),
    ("num_labels", "-1"),
    ("architectures", "\"Qwen2ForCausalLM\""),
    ("architectures", "[]"),
    ("rope_parameters", "7"),
];

/// A size grown to 10⁶ … u64::MAX in a fixture's `config.json` (fixture, field), and what the
/// checkpoint check's error must name: the field, or the tensor the size shapes.
const HUGE_FIELDS: &[(&str, &str, &str)] = &[
    ("qwen2", "num_hidden_layers", "num_hidden_layers"),
    ("qwen2_moe", "num_hidden_layers", "num_hidden_layers"),
    ("qwen2", "hidden_size", "embed_tokens"),
    ("qwen2", "vocab_size", "embed_tokens"),
    ("qwen2", "intermediate_size", "gate_proj"),
    ("qwen2", "head_dim", "q_proj"),
    ("qwen2_moe", "num_experts", "num_experts"),
    ("qwen2_moe", "moe_intermediate_size", "gate_proj"),
];

fn config_json_files() -> impl Strategy<Value = Vec<u8>> {
    mutated_fixture(CONFIG_FIXTURES, "config.json", CONFIG_FIELDS)
}

/// The sizes the layout checks try: (tp, ep, etp).
const LAYOUTS: &[(usize, usize, usize)] = &[(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 2, 2)];

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any `config.json` reads to a config or is refused with a message; a config that reads
    /// is checked against a few parallel layouts, returning within seconds, never panicking.
    #[test]
    fn config_json_never_panics(bytes in config_json_files()) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), bytes).unwrap();
        returns("read_config_json", || read_config_json(dir.path()))?;
        let cfg = no_panic("HfModelConfig::from_dir", || HfModelConfig::from_dir(dir.path()))?;
        if let Ok(cfg) = cfg {
            let messages = no_panic_within("HfModelConfig::check_layout", 5, move || {
                let mut messages = Vec::new();
                for &(tp, ep, etp) in LAYOUTS {
                    if let Err(e) = cfg.check_layout(tp, ep, etp) {
                        messages.push(e.to_string());
                    }
                }
                Ok(messages)
            })?;
            for m in messages.unwrap_or_default() {
                prop_assert!(!m.trim().is_empty(), "a layout error with an empty message");
            }
        }
    }

    /// A size in `config.json` far beyond what the weights hold (10⁶ up to u64::MAX) is
    /// refused before anything of that size is built: written as a float (`1e12`) by
    /// `from_json`, naming the field; as an integer by the check against the checkpoint,
    /// naming the field or the tensor it shapes.
    #[test]
    fn huge_sizes_in_config_json_are_refused_against_the_weights(
        (name, field, needle) in prop::sample::select(HUGE_FIELDS),
        huge in 1_000_000u64..=u64::MAX,
        as_float in any::<bool>(),
    ) {
        let mut doc = read_json(&fixture(name).join("config.json"));
        let value = if as_float { json!(huge as f64) } else { json!(huge) };
        apply_json(&mut doc, &JsonEdit::Set(path_of(field), value));
        let text = doc.to_string();
        let cfg = no_panic("HfModelConfig::from_json", || {
            HfModelConfig::from_json(&text, Path::new("config.json"))
        })?;
        let cfg = match cfg {
            Err(message) => {
                prop_assert!(
                    message.contains(field) || !as_float,
                    "`{field}` = {huge} as a float: the error does not name it: {message}"
                );
                return Ok(());
            }
            Ok(cfg) => cfg,
        };
        prop_assert!(!as_float, "`{field}` = {huge} as a float was accepted");
        let ckpt = HfCheckpoint::open(fixture(name)).unwrap();
        match no_panic("HfCheckpoint::verify", || ckpt.verify(&cfg))? {
            Ok(()) => {
                return Err(TestCaseError::fail(format!(
                    "`{field}` = {huge} passed the checkpoint check"
                )))
            }
            Err(message) => prop_assert!(
                message.contains(needle),
                "`{field}` = {huge}: the error does not name {needle}: {message}"
            ),
        }
    }
}

/// Every field of [`CONFIG_DEFECTS`] set, one at a time, in the `qwen2` fixture's valid
/// `config.json` to a value of the wrong type, a negative or fractional number where a count
/// belongs, a zero size, or a value verl-rs cannot honour, is refused, and the error names the
/// field. (A table rather than a sampled property, so that every row is tried.)
#[test]
fn a_bad_config_json_field_is_refused_by_name() {
    let base = read_json(&fixture("qwen2").join("config.json"));
    let mut wrong = Vec::new();
    for &(field, value) in CONFIG_DEFECTS {
        let value: Value = serde_json::from_str(value).unwrap();
        let mut doc = base.clone();
        apply_json(&mut doc, &JsonEdit::Set(path_of(field), value.clone()));
        let text = doc.to_string();
        let read = caught("HfModelConfig::from_json", || {
            HfModelConfig::from_json(&text, Path::new("config.json"))
        });
        match read {
            Err(panic) => wrong.push(format!("`{field}` = {value}: {panic}")),
            Ok(Ok(_)) => wrong.push(format!("`{field}` = {value} was accepted")),
            Ok(Err(e)) if !e.to_string().contains(field) => wrong.push(format!(
                "`{field}` = {value}: the error does not name it: {e}"
            )),
            Ok(Err(_)) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Tokenizer files.

/// The parts of `tokenizer.json` the tokenizer is built from. (`padding` is left out: a
/// `Fixed` length of 10¹² would pad every encoding to that length, an allocation no test
/// survives; `HfTokenizer` should switch padding and truncation off instead.)
const TOKENIZER_FIELDS: &[&str] = &[
    "version",
    "truncation",
    "added_tokens",
    "added_tokens.0",
    "added_tokens.0.id",
    "added_tokens.0.content",
    "added_tokens.2.special",
    "normalizer",
    "pre_tokenizer",
    "pre_tokenizer.type",
    "post_processor",
    "post_processor.type",
    "decoder",
    "decoder.type",
    "model",
    "model.type",
    "model.vocab",
    "model.vocab.a",
    "model.merges",
    "model.merges.0",
    "model.unk_token",
    "model.dropout",
    "model.byte_fallback",
];

const TOKENIZER_CONFIG_FIELDS: &[&str] = &[
    "chat_template",
    "bos_token",
    "eos_token",
    "bos_token.content",
    "eos_token.content",
];

const GENERATION_CONFIG_FIELDS: &[&str] = &["eos_token_id", "bos_token_id"];

/// Chat templates: the fixture's, others that render, and broken ones.
fn templates() -> Vec<String> {
    let fixture_template =
        std::fs::read_to_string(fixture("qwen2").join("chat_template.jinja")).unwrap();
    vec![
        fixture_template,
        "{{ raise_exception('no system role') }}".into(),
        "{% for m in messages %}{{ m['role'] | upper }}: {{ m.content }}\n{% endfor %}".into(),
        "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}".into(),
        "{{ messages[7].content.x }}".into(),
        "{% if %}".into(),
        "{{".into(),
        "{% endfor %}".into(),
        "{{ 1 / 0 }}".into(),
        "{{ messages | length }}{{ add_generation_prompt }}".into(),
        format!("{{{{ {}1{} }}}}", "(".repeat(400), ")".repeat(400)),
        String::new(),
    ]
}

/// The files of a tokenizer directory; `None` leaves a file out.
#[derive(Debug, Clone)]
struct TokenizerDir {
    tokenizer_json: Vec<u8>,
    tokenizer_config: Option<Vec<u8>>,
    chat_template: Option<Vec<u8>>,
    generation_config: Option<Vec<u8>>,
}

fn tokenizer_dirs() -> impl Strategy<Value = TokenizerDir> {
    let template = (
        prop::sample::select(templates()),
        prop::collection::vec(byte_edit(), 0..2),
    )
        .prop_map(|(t, edits)| apply_all(t.into_bytes(), &edits));
    (
        mutated_fixture(&["qwen2", "llama3"], "tokenizer.json", TOKENIZER_FIELDS),
        prop::option::of(mutated_fixture(
            &["qwen2"],
            "tokenizer_config.json",
            TOKENIZER_CONFIG_FIELDS,
        )),
        prop::option::of(template),
        prop::option::of(mutated_fixture(
            &["qwen2"],
            "generation_config.json",
            GENERATION_CONFIG_FIELDS,
        )),
    )
        .prop_map(
            |(tokenizer_json, tokenizer_config, chat_template, generation_config)| TokenizerDir {
                tokenizer_json,
                tokenizer_config,
                chat_template,
                generation_config,
            },
        )
}

fn write_tokenizer_dir(dir: &Path, files: &TokenizerDir) {
    std::fs::write(dir.join("tokenizer.json"), &files.tokenizer_json).unwrap();
    for (name, bytes) in [
        ("tokenizer_config.json", &files.tokenizer_config),
        ("chat_template.jinja", &files.chat_template),
        ("generation_config.json", &files.generation_config),
    ] {
        if let Some(bytes) = bytes {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
}

fn chat() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop::sample::select(vec!["system", "user", "assistant", "tool", ""]);
    prop::collection::vec(
        (role, ".{0,24}").prop_map(|(role, content)| ChatMessage {
            role: role.to_string(),
            content,
        }),
        0..4,
    )
}

/// Everything a loaded tokenizer is asked in a run, each without panicking.
fn use_tokenizer(
    tok: &HfTokenizer,
    text: &str,
    ids: &[u32],
    messages: &[ChatMessage],
) -> Result<(), TestCaseError> {
    returns("HfTokenizer::encode", || tok.encode(text))?;
    returns("HfTokenizer::decode", || tok.decode(ids))?;
    for add_generation_prompt in [false, true] {
        returns("HfTokenizer::apply_chat_template", || {
            tok.apply_chat_template(messages, add_generation_prompt)
        })?;
    }
    Ok(())
}

fn token_ids() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(prop_oneof![0u32..400, Just(u32::MAX), any::<u32>()], 0..16)
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` and
    /// `generation_config.json` load or are refused with a message; a tokenizer that loads
    /// encodes, decodes any ids (unknown ones included) and renders its chat template (or
    /// refuses to), never panicking.
    #[test]
    fn tokenizer_files_never_panic(
        files in tokenizer_dirs(),
        text in ".{0,40}",
        ids in token_ids(),
        messages in chat(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer_dir(dir.path(), &files);
        if let Ok(tok) = no_panic("HfTokenizer::from_dir", || HfTokenizer::from_dir(dir.path()))? {
            use_tokenizer(&tok, &text, &ids, &messages)?;
        }
    }

    /// `truncation` in `tokenizer.json` (a setting transformers does not apply unless asked,
    /// and verl-rs truncates prompts itself by `data.truncation`) never makes encoding panic,
    /// whatever its `max_length` and `stride`.
    #[test]
    fn tokenizer_json_truncation_never_panics_encoding(
        max_length in 0usize..8,
        stride in 0usize..10,
        strategy in prop::sample::select(vec!["LongestFirst", "OnlyFirst", "OnlySecond"]),
        direction in prop::sample::select(vec!["Left", "Right"]),
        text in "[a-z ]{0,40}",
    ) {
        let mut doc = read_json(&fixture("qwen2").join("tokenizer.json"));
        doc["truncation"] = json!({
            "max_length": max_length,
            "stride": stride,
            "strategy": strategy,
            "direction": direction,
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), doc.to_string()).unwrap();
        if let Ok(tok) = no_panic("HfTokenizer::from_dir", || HfTokenizer::from_dir(dir.path()))? {
            returns("HfTokenizer::encode", || tok.encode(&text))?;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// model.safetensors.index.json.

const SHARDED: &str = "qwen2_sharded_tf4";

/// Shard names that lead out of the model directory (or are no file name at all).
const TRAVERSALS: &[&str] = &[
    "../model-00001-of-00003.safetensors",
    "../../../../etc/passwd",
    "/etc/passwd",
    "./../x.safetensors",
    "sub/../../x.safetensors",
    "..",
    ".",
    "",
];

const INDEX_FIELDS: &[&str] = &[
    "weight_map",
    "metadata",
    "metadata.total_size",
    // An extra entry of any value (a dotted tensor name would be split into nested keys).
    "weight_map.extra",
];

/// A change to the sharded fixture's index.
#[derive(Debug, Clone)]
enum IndexCase {
    /// One tensor's shard is a name from [`TRAVERSALS`].
    Traversal(Index, &'static str),
    /// One tensor's shard is a value of any type (names included).
    Entry(Index, Value),
    /// Edits anywhere, then bytes.
    Mutated(Vec<JsonEdit>, Vec<ByteEdit>),
    /// Random bytes.
    Random(Vec<u8>),
}

fn index_cases() -> impl Strategy<Value = IndexCase> {
    prop_oneof![
        2 => (any::<Index>(), prop::sample::select(TRAVERSALS))
            .prop_map(|(i, name)| IndexCase::Traversal(i, name)),
        1 => (any::<Index>(), nasty_value()).prop_map(|(i, v)| IndexCase::Entry(i, v)),
        2 => (
            prop::collection::vec(json_edit(INDEX_FIELDS), 0..3),
            prop::collection::vec(byte_edit(), 0..2),
        )
            .prop_map(|(j, b)| IndexCase::Mutated(j, b)),
        1 => prop::collection::vec(any::<u8>(), 0..128).prop_map(IndexCase::Random),
    ]
}

/// A copy of the sharded fixture's weights (not its index) in `dir`.
fn copy_shards(dir: &Path) {
    for entry in std::fs::read_dir(fixture(SHARDED)).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("model-") || name == "config.json" {
            std::fs::copy(&path, dir.join(&name)).unwrap();
        }
    }
}

/// The index with tensor `i`'s shard set to `value`.
fn index_with_entry(i: &Index, value: Value) -> Value {
    let mut doc = read_json(&fixture(SHARDED).join("model.safetensors.index.json"));
    let map = doc["weight_map"].as_object_mut().unwrap();
    let names: Vec<String> = map.keys().cloned().collect();
    map.insert(names[i.index(names.len())].clone(), value);
    doc
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any `model.safetensors.index.json` opens or is refused with a message, never panicking;
    /// a shard name that leaves the directory (`..`, an absolute path, no name) is refused
    /// naming it; every file of a checkpoint that opens lies inside the directory.
    #[test]
    fn shard_index_never_panics_nor_leaves_the_directory(case in index_cases()) {
        let dir = tempfile::tempdir().unwrap();
        copy_shards(dir.path());
        let (bytes, refused) = match &case {
            IndexCase::Traversal(i, name) => {
                (serde_json::to_vec(&index_with_entry(i, json!(name))).unwrap(), Some(*name))
            }
            IndexCase::Entry(i, value) => {
                (serde_json::to_vec(&index_with_entry(i, value.clone())).unwrap(), None)
            }
            IndexCase::Mutated(json_edits, byte_edits) => {
                let doc = read_json(&fixture(SHARDED).join("model.safetensors.index.json"));
                (mutated(doc, json_edits, byte_edits), None)
            }
            IndexCase::Random(bytes) => (bytes.clone(), None),
        };
        std::fs::write(dir.path().join("model.safetensors.index.json"), bytes).unwrap();
        match no_panic("HfCheckpoint::open", || HfCheckpoint::open(dir.path()))? {
            Ok(ckpt) => {
                prop_assert!(refused.is_none(), "shard {refused:?} was accepted");
                let inside = dir.path().canonicalize().unwrap();
                for name in ckpt.names() {
                    let file = ckpt.file_of(name).unwrap().canonicalize().unwrap();
                    let shown = file.display();
                    prop_assert!(file.starts_with(&inside), "{name} is read from {shown}");
                }
            }
            Err(message) => {
                if let Some(name) = refused {
                    prop_assert!(
                        message.contains(&format!("`{name}`")),
                        "shard `{name}`: the error does not name it: {message}"
                    );
                }
            }
        }
    }

    /// A shard that is a symbolic link to a file outside the model directory is refused,
    /// naming it.
    #[cfg(unix)]
    #[test]
    fn shard_symlinks_out_of_the_directory_are_refused(i in any::<Index>()) {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        copy_shards(dir.path());
        let target = outside.path().join("elsewhere.safetensors");
        std::fs::copy(fixture(SHARDED).join("model-00001-of-00003.safetensors"), &target).unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("linked.safetensors")).unwrap();
        let doc = index_with_entry(&i, json!("linked.safetensors"));
        std::fs::write(dir.path().join("model.safetensors.index.json"), doc.to_string()).unwrap();
        match no_panic("HfCheckpoint::open", || HfCheckpoint::open(dir.path()))? {
            Ok(_) => {
                return Err(TestCaseError::fail(
                    "a shard linked out of the directory was accepted".to_string(),
                ))
            }
            Err(message) => prop_assert!(
                message.contains("linked.safetensors"),
                "the error does not name the link: {message}"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dist checkpoints: extra.json with its tensor files.

const EXTRA_FIELDS: &[&str] = &[
    "shards",
    "shards.w",
    "shards.w.global_shape",
    "shards.w.dim",
    "shards.w.start",
    "shards.w.len",
    "layout",
    "layout.tp_size",
    "layout.ep_size",
    "optimizers",
    "optimizers.adam",
    "optimizers.adam.step",
    "optimizers.adam.moment_updates",
    "optimizers.adam.moment_updates.w",
];

/// A starting point, a length or a dimension as a saved rank may record it.
fn extent() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..8, Just(1 << 40), Just(u64::MAX)]
}

/// `extra.json` of rank 0, recording tensor `w` as a slice of a `[4, 6]` tensor (mostly).
fn extra_json() -> impl Strategy<Value = Vec<u8>> {
    let global = prop_oneof![
        4 => Just(vec![4u64, 6]),
        1 => prop::collection::vec(extent(), 0..4),
    ];
    let dim = prop_oneof![Just(None), (0u64..6).prop_map(Some), Just(Some(u64::MAX))];
    (
        global,
        dim,
        extent(),
        extent(),
        prop::collection::vec(json_edit(EXTRA_FIELDS), 0..3),
        prop::collection::vec(byte_edit(), 0..2),
    )
        .prop_map(|(global_shape, dim, start, len, json_edits, byte_edits)| {
            let doc = json!({
                "shards": {
                    "w": { "global_shape": global_shape, "dim": dim, "start": start, "len": len },
                },
                "layout": { "tp_rank": 0, "tp_size": 1, "pp_stage": 0, "pp_stages": 1 },
                "optimizers": { "adam": { "step": 3, "moment_updates": { "w": 3 } } },
            });
            mutated(doc, &json_edits, &byte_edits)
        })
}

/// A rank directory: its `extra.json`, and the shape of `w` in its tensor files.
#[derive(Debug, Clone)]
struct SavedRankFiles {
    extra: Vec<u8>,
    stored_shape: Vec<usize>,
}

fn saved_ranks() -> impl Strategy<Value = SavedRankFiles> {
    let stored_shape = prop_oneof![
        2 => Just(vec![4usize, 6]),
        1 => prop::collection::vec(0usize..7, 1..4),
    ];
    (extra_json(), stored_shape).prop_map(|(extra, stored_shape)| SavedRankFiles {
        extra,
        stored_shape,
    })
}

/// What this rank asks for: all of `w`, its first two rows, or its last three columns.
fn targets() -> impl Strategy<Value = ShardTarget> {
    let target = |dim: Option<usize>, start: usize, len: usize, shape: Vec<usize>| ShardTarget {
        name: "w".into(),
        slice: ShardSlice {
            global_shape: vec![4, 6],
            dim,
            start,
            len,
        },
        shape,
    };
    prop::sample::select(vec![
        target(None, 0, 4, vec![4, 6]),
        target(Some(0), 0, 2, vec![2, 6]),
        target(Some(1), 3, 3, vec![4, 3]),
    ])
}

/// Writes `rank_00000/` under `dir`: `extra.json`, and `w` (with its AdamW moments) in the
/// tensor files.
fn write_saved_rank(dir: &Path, files: &SavedRankFiles) {
    let rank = dir.join("rank_00000");
    std::fs::create_dir_all(&rank).unwrap();
    std::fs::write(rank.join("extra.json"), &files.extra).unwrap();
    let f32s = |names: &[&str]| {
        let tensors: Vec<StTensor> = names
            .iter()
            .map(|n| (n.to_string(), ("F32", files.stored_shape.clone())))
            .collect();
        let (header, data) = st_parts(&tensors);
        encode_st(&header, &data)
    };
    std::fs::write(rank.join("model.safetensors"), f32s(&["w"])).unwrap();
    std::fs::write(
        rank.join("optim.safetensors"),
        f32s(&["adam/w.exp_avg", "adam/w.exp_avg_sq"]),
    )
    .unwrap();
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any `extra.json` of a dist checkpoint (slices with huge or out-of-range starts,
    /// lengths and dimensions, a global shape that disagrees, tensor files whose shapes
    /// disagree with it) opens or is refused with a message; loading a rank's slices from it
    /// on a new layout, and loading it on its own layout, return without panicking.
    #[test]
    fn dist_checkpoint_extra_json_never_panics(files in saved_ranks(), target in targets()) {
        let dir = tempfile::tempdir().unwrap();
        write_saved_rank(dir.path(), &files);
        let device = Default::default();
        let opened = no_panic("ShardedCheckpoint::open", || ShardedCheckpoint::open(dir.path()))?;
        if let Ok(ckpt) = opened {
            let _ = (ckpt.layout_of(0), ckpt.is_indexed());
            returns("ShardedCheckpoint::read", || ckpt.read("w", false, &target))?;
            returns("ShardedCheckpoint::load_for", || {
                let targets = std::slice::from_ref(&target);
                ckpt.load_for::<B>(0, targets, CheckpointContents::ALL, &device)
            })?;
        }
        returns("DistCheckpoint::load", || {
            futures::executor::block_on(async {
                let loaded: verl_core::Result<CheckpointState<B>> = DistCheckpoint::new(0)
                    .load(dir.path(), CheckpointContents::ALL, &device)
                    .await;
                loaded
            })
        })?;
    }
}

// ---------------------------------------------------------------------------------------------
// The launcher's environment variables (torchrun's and Slurm's).

const LAUNCH_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_NODEID",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
];

const LAUNCH_VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "7",
    "8",
    "-1",
    " 3 ",
    "+2",
    "18446744073709551615",
    "18446744073709551616",
    "65535",
    "65536",
    "abc",
    "",
    "8(x2)",
    "8(x2),4",
    "(x2)",
    "gpu[007-008,010],cpu01",
    "[1-2]",
    "n[",
    "n[]",
    "a,b",
    "ü[1]",
    "10.0.0.1",
];

/// Some of the launcher variables, each set to a number, a Slurm list, or any text.
fn launch_vars() -> impl Strategy<Value = BTreeMap<&'static str, String>> {
    let value = prop_oneof![
        4 => prop::sample::select(LAUNCH_VALUES).prop_map(str::to_string),
        1 => any::<String>(),
    ];
    prop::collection::btree_map(prop::sample::select(LAUNCH_VARS), value, 0..8)
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any values of the torchrun and Slurm variables read to this process's place in the job
    /// (its rank below the world size, its local rank below the processes of a node), to no
    /// launcher, or to an error with a message, never panicking.
    #[test]
    fn launch_environment_never_panics(vars in launch_vars()) {
        let read = no_panic("LaunchEnv::from_vars", || {
            LaunchEnv::from_vars(|name| vars.get(name).cloned())
        })?;
        if let Ok(Some(env)) = read {
            prop_assert!(
                env.rank < env.world_size && env.local_rank < env.local_world_size,
                "{env:?}"
            );
            prop_assert!(env.nnodes() >= 1, "{env:?}");
        }
    }

    /// A `MASTER_PORT` beyond 16 bits is refused naming the variable (the rank processes
    /// would otherwise reach the port modulo 2¹⁶: `ranks.rs` casts it `as u16`).
    #[test]
    fn a_master_port_beyond_16_bits_is_refused_by_name(
        port in 65_536u64..=u64::MAX,
        slurm in any::<bool>(),
    ) {
        let port = port.to_string();
        let vars: BTreeMap<&str, &str> = if slurm {
            BTreeMap::from([
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
                ("SLURM_STEP_NODELIST", "node1"),
                ("MASTER_PORT", port.as_str()),
            ])
        } else {
            BTreeMap::from([("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", port.as_str())])
        };
        let read = no_panic("LaunchEnv::from_vars", || {
            LaunchEnv::from_vars(|name| vars.get(name).map(|v| v.to_string()))
        })?;
        match read {
            Ok(env) => {
                return Err(TestCaseError::fail(format!("MASTER_PORT={port} read as {env:?}")))
            }
            Err(message) => prop_assert!(
                message.contains("MASTER_PORT"),
                "the error does not name MASTER_PORT: {message}"
            ),
        }
    }
}

//! Generators of malformed input and the checks that a reader neither panics nor hangs, shared
//! by the fuzzing tests: `fuzz_config.rs` and `fuzz_wire.rs` here, and (through `#[path]`)
//! `verl-megatron/tests/fuzz_readers.rs` and the root crate's `tests/fuzz_inputs.rs`.
// Each test file uses a part of it.
#![allow(dead_code)]

use std::any::Any;
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Value};

/// Cases per property: enough to vary every generator's branches, small enough that the file
/// runs in seconds in a debug build.
pub(crate) fn fuzz_config() -> ProptestConfig {
    // 64 cases from a fixed seed keep CI's run bounded and repeatable; PROPTEST_CASES asks
    // for a longer fuzzing session, from a fresh random seed unless PROPTEST_RNG_SEED is set.
    let session = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    let seeded = std::env::var("PROPTEST_RNG_SEED").is_ok();
    let rng_seed = match (session, seeded) {
        (None, false) => proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        _ => ProptestConfig::default().rng_seed,
    };
    ProptestConfig {
        cases: session.unwrap_or(64),
        rng_seed,
        max_shrink_iters: 16,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Running a reader.

pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".to_string())
}

/// Runs the reader `what`: its value, or its error's message (which must not be empty); a
/// panic fails the case.
pub(crate) fn no_panic<T, E: Display>(
    what: &str,
    read: impl FnOnce() -> Result<T, E>,
) -> Result<Result<T, String>, TestCaseError> {
    match catch_unwind(AssertUnwindSafe(read)) {
        Ok(Ok(value)) => Ok(Ok(value)),
        Ok(Err(e)) => {
            let message = e.to_string();
            prop_assert!(
                !message.trim().is_empty(),
                "{what} returned an error with an empty message"
            );
            Ok(Err(message))
        }
        Err(panic) => Err(TestCaseError::fail(format!(
            "{what} panicked: {}",
            panic_message(panic.as_ref())
        ))),
    }
}

/// `read`'s own outcome (for a reader that returns no `Result`, or whose error type the
/// property matches on); a panic fails the case.
pub(crate) fn caught<T>(what: &str, read: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    catch_unwind(AssertUnwindSafe(read)).map_err(|panic| {
        TestCaseError::fail(format!(
            "{what} panicked: {}",
            panic_message(panic.as_ref())
        ))
    })
}

/// [`no_panic`] for a reader whose value the property does not look at.
pub(crate) fn returns<T, E: Display>(
    what: &str,
    read: impl FnOnce() -> Result<T, E>,
) -> Result<(), TestCaseError> {
    let _outcome = no_panic(what, read)?;
    Ok(())
}

/// [`no_panic`] on a thread of its own, failing the case when `read` has not returned after
/// `secs` seconds (a loop bounded by a number read from the input). The thread is left behind.
pub(crate) fn no_panic_within<T: Send + 'static>(
    what: &str,
    secs: u64,
    read: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<Result<T, String>, TestCaseError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let outcome = catch_unwind(AssertUnwindSafe(read)).map_err(|p| panic_message(p.as_ref()));
        let _ = tx.send(outcome);
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(Ok(value))) => Ok(Ok(value)),
        Ok(Ok(Err(message))) => {
            prop_assert!(
                !message.trim().is_empty(),
                "{what} returned an error with an empty message"
            );
            Ok(Err(message))
        }
        Ok(Err(panic)) => Err(TestCaseError::fail(format!("{what} panicked: {panic}"))),
        Err(_) => Err(TestCaseError::fail(format!(
            "{what} was still running after {secs} s"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Mutations shared by the generators.

/// Tokens readers trip on, spliced into documents at random places.
pub(crate) const NASTY_TOKENS: &[&str] = &[
    "18446744073709551616",
    "-1",
    "1e999",
    "1e12",
    "NaN",
    "null",
    "[[[[[[[[",
    "}}}}",
    "\"",
    "\\",
    "\u{0}",
    "\u{feff}",
    "../../etc/passwd",
    ",",
    ":",
    "{{",
    "{%",
];

/// A byte-level change to a document.
#[derive(Debug, Clone)]
pub(crate) enum ByteEdit {
    /// Cut at a point (a torn write).
    Truncate(Index),
    /// XOR one byte with a non-zero mask (a flipped bit or byte on disk).
    Flip(Index, u8),
    /// Splice in one of [`NASTY_TOKENS`].
    Insert(Index, &'static str),
    /// Repeat one line (a key given twice).
    DuplicateLine(Index),
}

pub(crate) fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        any::<Index>().prop_map(ByteEdit::Truncate),
        (any::<Index>(), 1u8..=255).prop_map(|(i, mask)| ByteEdit::Flip(i, mask)),
        (any::<Index>(), prop::sample::select(NASTY_TOKENS))
            .prop_map(|(i, token)| ByteEdit::Insert(i, token)),
        any::<Index>().prop_map(ByteEdit::DuplicateLine),
    ]
}

pub(crate) fn apply_bytes(mut bytes: Vec<u8>, edit: &ByteEdit) -> Vec<u8> {
    if bytes.is_empty() {
        if let ByteEdit::Insert(_, token) = edit {
            bytes.extend_from_slice(token.as_bytes());
        }
        return bytes;
    }
    match edit {
        ByteEdit::Truncate(i) => {
            bytes.truncate(i.index(bytes.len()));
            bytes
        }
        ByteEdit::Flip(i, mask) => {
            let at = i.index(bytes.len());
            bytes[at] ^= *mask;
            bytes
        }
        ByteEdit::Insert(i, token) => {
            let tail = bytes.split_off(i.index(bytes.len() + 1));
            bytes.extend_from_slice(token.as_bytes());
            bytes.extend_from_slice(&tail);
            bytes
        }
        ByteEdit::DuplicateLine(i) => {
            let lines: Vec<&[u8]> = bytes.split_inclusive(|&b| b == b'\n').collect();
            let k = i.index(lines.len());
            let mut out = Vec::with_capacity(bytes.len() + lines[k].len());
            for (j, line) in lines.iter().enumerate() {
                out.extend_from_slice(line);
                if j == k {
                    out.extend_from_slice(line);
                }
            }
            out
        }
    }
}

pub(crate) fn apply_all(bytes: Vec<u8>, edits: &[ByteEdit]) -> Vec<u8> {
    edits.iter().fold(bytes, apply_bytes)
}

/// A change to a JSON document at a path of object keys (or array indices).
#[derive(Debug, Clone)]
pub(crate) enum JsonEdit {
    /// Sets the value at the path, making the objects on the way.
    Set(Vec<String>, Value),
    /// Removes the key at the end of the path.
    Remove(Vec<String>),
}

pub(crate) fn path_of(dotted: &str) -> Vec<String> {
    dotted.split('.').map(str::to_string).collect()
}

/// The child `key` of `node`: an element of an array when `key` is an index in it, else a
/// key of an object (`node` becomes one if it is not).
pub(crate) fn child<'a>(node: &'a mut Value, key: &str) -> &'a mut Value {
    let element = match (&*node, key.parse::<usize>()) {
        (Value::Array(items), Ok(i)) if i < items.len() => Some(i),
        _ => None,
    };
    match element {
        Some(i) => &mut node[i],
        None => {
            if !node.is_object() {
                *node = Value::Object(Map::new());
            }
            node.as_object_mut()
                .expect("made an object above")
                .entry(key.to_string())
                .or_insert(Value::Null)
        }
    }
}

pub(crate) fn apply_json(doc: &mut Value, edit: &JsonEdit) {
    let (path, value) = match edit {
        JsonEdit::Set(path, value) => (path, Some(value.clone())),
        JsonEdit::Remove(path) => (path, None),
    };
    let Some((last, parents)) = path.split_last() else {
        if let Some(value) = value {
            *doc = value;
        }
        return;
    };
    let mut node = doc;
    for key in parents {
        node = child(node, key);
    }
    match value {
        Some(value) => *child(node, last) = value,
        None => {
            if let Some(map) = node.as_object_mut() {
                map.remove(last.as_str());
            }
        }
    }
}

/// A nested array `depth` levels deep (serde_json refuses more than 128).
pub(crate) fn deeply_nested(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = json!([v]);
    }
    v
}

/// Values a reader may not expect where it reads a field: huge, negative and fractional
/// numbers, strings that are paths out of a directory, every JSON type, deep nesting.
pub(crate) fn nasty_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        prop::sample::select(vec![
            json!(0),
            json!(-1),
            json!(i64::MIN),
            json!(u64::MAX),
            json!(1_u64 << 32),
            json!(1_000_000_000_000_u64),
            json!(1e12),
            json!(1e308),
            json!(-1e12),
            json!(1.5),
            json!(""),
            json!("../../etc/passwd"),
            json!("/etc/passwd"),
            json!("\u{0}"),
            json!("x".repeat(10_000)),
            json!(true),
            json!(false),
            Value::Null,
            json!([]),
            json!({}),
        ]),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|x| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)),
        ".{0,12}".prop_map(Value::String),
    ];
    prop_oneof![
        4 => leaf.clone(),
        1 => prop::collection::vec(leaf.clone(), 0..4).prop_map(Value::Array),
        1 => prop::collection::btree_map("[a-z_]{1,8}", leaf, 0..3)
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        1 => (1usize..300).prop_map(deeply_nested),
    ]
}

/// Sets or removes one of `fields` (dotted paths) with a [`nasty_value`].
pub(crate) fn json_edit(fields: &'static [&'static str]) -> impl Strategy<Value = JsonEdit> {
    let field = prop::sample::select(fields).prop_map(path_of);
    prop_oneof![
        3 => (field.clone(), nasty_value()).prop_map(|(p, v)| JsonEdit::Set(p, v)),
        1 => field.prop_map(JsonEdit::Remove),
    ]
}

/// `doc` with `json_edits`, pretty-printed, then with `byte_edits`.
pub(crate) fn mutated(mut doc: Value, json_edits: &[JsonEdit], byte_edits: &[ByteEdit]) -> Vec<u8> {
    for e in json_edits {
        apply_json(&mut doc, e);
    }
    apply_all(
        serde_json::to_vec_pretty(&doc).expect("a JSON value serializes"),
        byte_edits,
    )
}

/// `[header length: u64 LE][header JSON][data]`: a safetensors buffer.
pub(crate) fn encode_st(header: &Value, data: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("a JSON value serializes");
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    out
}

/// The header and data of a valid safetensors buffer.
pub(crate) fn split_st(buffer: &[u8]) -> (Value, Vec<u8>) {
    let n = u64::from_le_bytes(buffer[..8].try_into().expect("8 bytes")) as usize;
    let header = serde_json::from_slice(&buffer[8..8 + n]).expect("a JSON header");
    (header, buffer[8 + n..].to_vec())
}

/// A size list with huge and zero entries, or any other value.
pub(crate) fn sizes() -> impl Strategy<Value = Value> {
    let size = prop_oneof![
        Just(0u64),
        Just(1),
        Just(1 << 32),
        Just(1_000_000_000_000),
        Just(u64::MAX),
        any::<u64>(),
    ];
    prop_oneof![
        2 => prop::collection::vec(size, 0..4).prop_map(|v| json!(v)),
        1 => nasty_value(),
    ]
}

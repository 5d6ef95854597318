//! Fuzzing of the trainer's readers of outside bytes: the data files (`data.train_files` as
//! parquet, JSONL or a JSON array), and what a resumed run reads back from its output
//! directory — the `latest_checkpointed_iteration.txt` marker and the `global_step_<N>`
//! directories, `checksums.json`, `trainer.json`, and `metrics.jsonl`.
//!
//! Each property builds malformed input — random bytes, or valid files with random mutations:
//! truncation, a flipped byte, a spliced-in token, huge or negative numbers, wrong types,
//! missing keys, names that leave the checkpoint — and asserts that the reader returns `Ok`
//! or an error with a message, never a panic. Where the input is valid but for one known
//! defect, the error must name the field (and the file and row), or the file at fault.
//!
//! Bounded for CI: a fixed number of cases per property and a short shrink. The generators
//! and checks shared with the other crates' fuzzing tests are in
//! `verl-core/tests/fuzz_support`.

mod common;

#[path = "../verl-core/tests/fuzz_support/mod.rs"]
mod fuzz_support;
use fuzz_support::*;

use std::path::{Path, PathBuf};

use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};
use verl::tasks::CharTokenizer;
use verl::trainer::checkpoint::{
    latest, read_loop_state, step_dir, verify, write_checksums, write_loop_state, LoopState,
};
use verl::trainer::data::{file_rows, Codec};
use verl::trainer::log::RunLog;

// ---------------------------------------------------------------------------------------------
// Data files.

use common::verl_rows::VerlRow as Row;

fn row_json(r: &Row) -> Value {
    r.to_json()
}

/// Rows whose prompts the character tokenizer may or may not take, with or without a user
/// turn or a ground truth.
fn rows() -> impl Strategy<Value = Vec<Row>> {
    let message = (
        prop::sample::select(vec!["system", "user", "assistant"]),
        "[0-9+= ]{0,8}",
    )
        .prop_map(|(role, content)| (role.to_string(), content));
    let row = (
        "[a-z_/]{0,16}",
        prop::collection::vec(message, 1..3),
        prop::option::of("[0-9]{1,3}"),
        any::<i64>(),
    )
        .prop_map(|(source, messages, truth, index)| Row {
            source,
            messages,
            truth,
            index,
        });
    prop::collection::vec(row, 1..4)
}

/// Rows every reader takes: a user turn the character tokenizer encodes, a ground truth.
fn valid_rows() -> impl Strategy<Value = Vec<Row>> {
    let row = (
        "[a-z_/]{1,16}",
        prop::option::of("[0-9 ]{0,8}"),
        "[0-9+=]{1,8}",
        "[0-9]{1,3}",
        any::<i64>(),
    )
        .prop_map(|(source, system, user, truth, index)| Row {
            source,
            messages: system
                .map(|s| ("system".to_string(), s))
                .into_iter()
                .chain([("user".to_string(), user)])
                .collect(),
            truth: Some(truth),
            index,
        });
    prop::collection::vec(row, 1..5)
}

/// Writes `rows` as pyarrow writes verl's columns. Uncompressed and without dictionary pages:
/// parquet sizes a dictionary by the count its page header claims, so a flipped byte there
/// could ask for 2³¹ entries.
fn write_parquet(path: &Path, rows: &[Row]) {
    let props = WriterProperties::builder()
        .set_compression(Compression::UNCOMPRESSED)
        .set_dictionary_enabled(false)
        .build();
    common::verl_rows::write_parquet(path, rows, props);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataFormat {
    Jsonl,
    JsonArray,
    Parquet,
}

/// The fields of a row that edits change.
const ROW_FIELDS: &[&str] = &[
    "prompt",
    "prompt.0",
    "prompt.0.role",
    "prompt.0.content",
    "reward_model",
    "reward_model.ground_truth",
    "data_source",
    "extra_info",
    "extra_info.index",
];

/// A data file to read.
#[derive(Debug, Clone)]
enum DataFile {
    /// `rows` in `format`: row `row` with `edits` (JSON formats only), then the file's bytes
    /// with `bytes`, and a byte-order mark in front when `bom`.
    Rows {
        format: DataFormat,
        rows: Vec<Row>,
        row: Index,
        edits: Vec<JsonEdit>,
        bytes: Vec<ByteEdit>,
        bom: bool,
    },
    /// Random bytes in a file named `train.<ext>`.
    Random { ext: &'static str, bytes: Vec<u8> },
}

fn data_files() -> impl Strategy<Value = DataFile> {
    let format = prop_oneof![
        Just(DataFormat::Jsonl),
        Just(DataFormat::JsonArray),
        Just(DataFormat::Parquet),
    ];
    prop_oneof![
        6 => (
            format,
            rows(),
            any::<Index>(),
            prop::collection::vec(json_edit(ROW_FIELDS), 0..3),
            prop::collection::vec(byte_edit(), 0..2),
            prop::bool::weighted(0.2),
        )
            .prop_map(|(format, rows, row, edits, bytes, bom)| DataFile::Rows {
                format,
                rows,
                row,
                edits,
                bytes,
                bom,
            }),
        1 => (
            prop::sample::select(vec!["jsonl", "json", "parquet", "csv", ""]),
            prop::collection::vec(any::<u8>(), 0..256),
        )
            .prop_map(|(ext, bytes)| DataFile::Random { ext, bytes }),
    ]
}

/// Writes `file` into `dir`; its path.
fn write_data_file(dir: &Path, file: &DataFile) -> PathBuf {
    match file {
        DataFile::Rows {
            format,
            rows,
            row,
            edits,
            bytes,
            bom,
        } => {
            let path = dir.join(match format {
                DataFormat::Jsonl => "train.jsonl",
                DataFormat::JsonArray => "train.json",
                DataFormat::Parquet => "train.parquet",
            });
            let body = if *format == DataFormat::Parquet {
                write_parquet(&path, rows);
                std::fs::read(&path).unwrap()
            } else {
                let mut values: Vec<Value> = rows.iter().map(row_json).collect();
                let k = row.index(values.len());
                for e in edits {
                    apply_json(&mut values[k], e);
                }
                if *format == DataFormat::Jsonl {
                    jsonl(&values).into_bytes()
                } else {
                    serde_json::to_vec_pretty(&values).unwrap()
                }
            };
            let mut out = if *bom {
                "\u{feff}".as_bytes().to_vec()
            } else {
                Vec::new()
            };
            out.extend(apply_all(body, bytes));
            std::fs::write(&path, out).unwrap();
            path
        }
        DataFile::Random { ext, bytes } => {
            let path = dir.join(format!("train.{ext}"));
            std::fs::write(&path, bytes).unwrap();
            path
        }
    }
}

/// `values` one per line.
fn jsonl(values: &[Value]) -> String {
    let lines: Vec<String> = values.iter().map(Value::to_string).collect();
    lines.join("\n") + "\n"
}

fn codec() -> Codec {
    Codec::Char(CharTokenizer::arithmetic())
}

/// One defect in an otherwise valid row.
#[derive(Debug, Clone, Copy)]
enum RowDefect {
    NoPrompt,
    PromptNumber,
    MessageNotObject,
    NoRole,
    NoContent,
    RoleNotString,
    NoUserTurn,
    Untokenizable,
    RewardModelString,
    NoGroundTruth,
    NoRewardModel,
    DataSourceNumber,
    NotAnObject,
}

const ROW_DEFECTS: &[RowDefect] = &[
    RowDefect::NoPrompt,
    RowDefect::PromptNumber,
    RowDefect::MessageNotObject,
    RowDefect::NoRole,
    RowDefect::NoContent,
    RowDefect::RoleNotString,
    RowDefect::NoUserTurn,
    RowDefect::Untokenizable,
    RowDefect::RewardModelString,
    RowDefect::NoGroundTruth,
    RowDefect::NoRewardModel,
    RowDefect::DataSourceNumber,
    RowDefect::NotAnObject,
];

impl RowDefect {
    /// Gives `row` (valid, from [`valid_rows`]) this defect; what its error must say.
    fn apply(self, row: &mut Value) -> &'static str {
        let remove = |row: &mut Value, key: &str| {
            if let Some(map) = row.as_object_mut() {
                map.remove(key);
            }
        };
        match self {
            RowDefect::NoPrompt => {
                remove(row, "prompt");
                "`prompt`"
            }
            RowDefect::PromptNumber => {
                row["prompt"] = json!(7);
                "`prompt`"
            }
            RowDefect::MessageNotObject => {
                row["prompt"][0] = json!(7);
                "`prompt[0]`"
            }
            RowDefect::NoRole => {
                remove(&mut row["prompt"][0], "role");
                "`prompt[0].role`"
            }
            RowDefect::NoContent => {
                remove(&mut row["prompt"][0], "content");
                "`prompt[0].content`"
            }
            RowDefect::RoleNotString => {
                row["prompt"][0]["role"] = json!(1);
                "`prompt[0].role`"
            }
            RowDefect::NoUserTurn => {
                if let Some(messages) = row["prompt"].as_array_mut() {
                    for m in messages {
                        m["role"] = json!("system");
                    }
                }
                "no user message"
            }
            RowDefect::Untokenizable => {
                if let Some(messages) = row["prompt"].as_array_mut() {
                    for m in messages {
                        if m["role"] == "user" {
                            m["content"] = json!("héllo");
                        }
                    }
                }
                "`prompt`"
            }
            RowDefect::RewardModelString => {
                row["reward_model"] = json!("42");
                "`reward_model`"
            }
            RowDefect::NoGroundTruth => {
                row["reward_model"] = json!({});
                "`reward_model.ground_truth`"
            }
            RowDefect::NoRewardModel => {
                remove(row, "reward_model");
                "`reward_model.ground_truth`"
            }
            RowDefect::DataSourceNumber => {
                row["data_source"] = json!(7);
                "`data_source`"
            }
            RowDefect::NotAnObject => {
                *row = json!([1, 2]);
                "a JSON object"
            }
        }
    }
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any data file (rows in parquet, JSONL or a JSON array with fields of any type or
    /// missing, bytes changed, a byte-order mark; or random bytes under any extension) reads
    /// to rows or is refused with a message, never panicking.
    #[test]
    fn data_files_never_panic(file in data_files()) {
        let dir = tempfile::tempdir().unwrap();
        let path = write_data_file(dir.path(), &file);
        returns("file_rows", || file_rows(&path, &codec(), "prompt", "data_source"))?;
    }

    /// A data file valid but for one field of one row is refused, and the error names the
    /// file, the row (JSONL's line, a JSON array's index) and the field.
    #[test]
    fn a_bad_row_field_is_refused_naming_file_row_and_field(
        rows in valid_rows(),
        at in any::<Index>(),
        defect in prop::sample::select(ROW_DEFECTS),
        array in any::<bool>(),
        bom in any::<bool>(),
    ) {
        let mut values: Vec<Value> = rows.iter().map(row_json).collect();
        let k = at.index(values.len());
        let needle = defect.apply(&mut values[k]);
        let (name, place, mut text) = if array {
            ("train.json", format!("row {k}"), serde_json::to_string_pretty(&values).unwrap())
        } else {
            ("train.jsonl", format!("line {}", k + 1), jsonl(&values))
        };
        if bom {
            text.insert(0, '\u{feff}');
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        match no_panic("file_rows", || file_rows(&path, &codec(), "prompt", "data_source"))? {
            Ok(_) => return Err(TestCaseError::fail(format!("{defect:?} in {place} was accepted"))),
            Err(message) => prop_assert!(
                message.contains(name) && message.contains(&place) && message.contains(needle),
                "{defect:?} in {place}: the error does not name {name}, {place} and {needle}: \
                 {message}"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checkpoint files.

/// The files of a checkpoint written by [`fill_step`], relative to its directory.
const STEP_FILES: &[&str] = &[
    "trainer.json",
    "actor/dist_ckpt/rank_00000/model.safetensors",
    "actor/dist_ckpt/rank_00000/extra.json",
];

/// How complete a `global_step_<N>` directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepState {
    /// Every file, `trainer.json` and `checksums.json` last.
    Complete,
    /// A save cut before `trainer.json`.
    NoTrainerJson,
    /// Complete, then `trainer.json` changed after its checksum was taken.
    Damaged,
    /// An empty directory.
    Empty,
}

/// Fills the checkpoint directory `d` to `state`.
fn fill_step(d: &Path, state: StepState) {
    std::fs::create_dir_all(d).unwrap();
    if state == StepState::Empty {
        return;
    }
    let rank = d.join("actor/dist_ckpt/rank_00000");
    std::fs::create_dir_all(&rank).unwrap();
    std::fs::write(rank.join("model.safetensors"), [7u8; 64]).unwrap();
    std::fs::write(rank.join("extra.json"), r#"{"step": 3}"#).unwrap();
    if state == StepState::NoTrainerJson {
        return;
    }
    // The loop state of the directory's own step (verify checks they agree).
    let mut loop_state = LoopState::fresh(4, 0.1);
    loop_state.step = d
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("global_step_"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    write_loop_state(d, &loop_state).unwrap();
    write_checksums(d).unwrap();
    if state == StepState::Damaged {
        std::fs::write(d.join("trainer.json"), "{}").unwrap();
    }
}

/// Entries of `checksums.json` that lead out of the checkpoint (or are no path at all).
const OUTSIDE: &[&str] = &[
    "../trainer.json",
    "../../../../etc/passwd",
    "/etc/passwd",
    "actor/../../x",
    "..",
    "a//b",
    "",
];

/// A change to a complete checkpoint.
#[derive(Debug, Clone)]
enum ChecksumCase {
    /// `checksums.json` gains an entry naming a path outside the checkpoint.
    Outside(&'static str),
    /// A listed file has a byte flipped.
    Flipped(&'static str, Index, u8),
    /// A listed file is cut short.
    Truncated(&'static str, Index),
    /// `checksums.json` with entries' sizes and CRCs set to any value or removed, then its
    /// bytes changed.
    Edited(Vec<JsonEdit>, Vec<ByteEdit>),
    /// Random bytes as `checksums.json`.
    Random(Vec<u8>),
}

fn checksum_cases() -> impl Strategy<Value = ChecksumCase> {
    let entry_edit = (
        prop::sample::select(STEP_FILES),
        prop::option::of(prop::sample::select(vec!["bytes", "crc32"])),
        prop::option::of(prop_oneof![sizes(), nasty_value()]),
    )
        .prop_map(|(file, field, value)| {
            let mut path = vec![file.to_string()];
            path.extend(field.map(str::to_string));
            match value {
                Some(v) => JsonEdit::Set(path, v),
                None => JsonEdit::Remove(path),
            }
        });
    prop_oneof![
        2 => prop::sample::select(OUTSIDE).prop_map(ChecksumCase::Outside),
        2 => (prop::sample::select(STEP_FILES), any::<Index>(), 1u8..=255)
            .prop_map(|(f, i, mask)| ChecksumCase::Flipped(f, i, mask)),
        1 => (prop::sample::select(STEP_FILES), any::<Index>())
            .prop_map(|(f, i)| ChecksumCase::Truncated(f, i)),
        3 => (
            prop::collection::vec(entry_edit, 0..3),
            prop::collection::vec(byte_edit(), 0..2),
        )
            .prop_map(|(j, b)| ChecksumCase::Edited(j, b)),
        1 => prop::collection::vec(any::<u8>(), 0..128).prop_map(ChecksumCase::Random),
    ]
}

/// Applies `case` to the complete checkpoint `d`; what `verify`'s error must name, if the
/// case is a known defect.
fn damage(d: &Path, case: &ChecksumCase) -> Option<String> {
    let sums = d.join("checksums.json");
    match case {
        ChecksumCase::Outside(name) => {
            let mut doc: Value = serde_json::from_slice(&std::fs::read(&sums).unwrap()).unwrap();
            doc[*name] = json!({ "bytes": 0, "crc32": 0 });
            std::fs::write(&sums, doc.to_string()).unwrap();
            Some(format!("`{name}`"))
        }
        ChecksumCase::Flipped(file, at, mask) => {
            let path = d.join(file);
            let mut bytes = std::fs::read(&path).unwrap();
            let i = at.index(bytes.len());
            bytes[i] ^= *mask;
            std::fs::write(&path, bytes).unwrap();
            Some(file.to_string())
        }
        ChecksumCase::Truncated(file, at) => {
            let path = d.join(file);
            let mut bytes = std::fs::read(&path).unwrap();
            bytes.truncate(at.index(bytes.len()));
            std::fs::write(&path, bytes).unwrap();
            Some(file.to_string())
        }
        ChecksumCase::Edited(json_edits, byte_edits) => {
            let doc: Value = serde_json::from_slice(&std::fs::read(&sums).unwrap()).unwrap();
            std::fs::write(&sums, mutated(doc, json_edits, byte_edits)).unwrap();
            None
        }
        ChecksumCase::Random(bytes) => {
            std::fs::write(&sums, bytes).unwrap();
            None
        }
    }
}

/// Names `global_step_<name>` directories may have.
const STEP_NAMES: &[&str] = &[
    "1",
    "2",
    "3",
    "10",
    "007",
    "+3",
    "abc",
    "-1",
    "18446744073709551615",
    "99999999999999999999",
    "3.aside-1",
    "",
];

/// Texts the `latest_checkpointed_iteration.txt` marker may hold.
const MARKERS: &[&str] = &[
    "3",
    "2",
    "10",
    "0",
    "abc",
    "-1",
    "18446744073709551615",
    "18446744073709551616",
    " 2\n",
    "",
    "2.0",
    "+3",
];

/// An output directory: the marker (absent for `None`) and step directories.
#[derive(Debug, Clone)]
struct RunDir {
    marker: Option<Vec<u8>>,
    steps: Vec<(&'static str, StepState)>,
}

fn run_dirs() -> impl Strategy<Value = RunDir> {
    let state = prop_oneof![
        3 => Just(StepState::Complete),
        1 => Just(StepState::NoTrainerJson),
        1 => Just(StepState::Damaged),
        1 => Just(StepState::Empty),
    ];
    let marker = prop::option::of(prop_oneof![
        4 => prop::sample::select(MARKERS).prop_map(|m| m.as_bytes().to_vec()),
        1 => prop::collection::vec(any::<u8>(), 0..16),
    ]);
    (
        marker,
        prop::collection::vec((prop::sample::select(STEP_NAMES), state), 0..5),
    )
        .prop_map(|(marker, steps)| RunDir { marker, steps })
}

/// The fields of `trainer.json` (and one it does not have).
const LOOP_FIELDS: &[&str] = &[
    "step",
    "epoch",
    "cursor",
    "order",
    "order.0",
    "kl_coef",
    "val_before",
    "extra",
];

/// A `trainer.json`: a valid loop state with edits to its fields, then to its bytes; or
/// random bytes.
fn trainer_jsons() -> impl Strategy<Value = Vec<u8>> {
    let state = (
        0u64..100,
        0u64..10,
        0usize..6,
        0usize..7,
        0.0f64..1.0,
        prop::option::of(0.0f64..1.0),
    )
        .prop_map(
            |(step, epoch, rows, cursor, kl_coef, val_before)| LoopState {
                step,
                epoch,
                cursor: cursor.min(rows),
                order: (0..rows).rev().collect(),
                kl_coef,
                val_before,
            },
        );
    prop_oneof![
        6 => (
            state,
            prop::collection::vec(
                json_edit(LOOP_FIELDS),
                0..3,
            ),
            prop::collection::vec(byte_edit(), 0..2),
        )
            .prop_map(|(s, j, b)| mutated(serde_json::to_value(s).unwrap(), &j, &b)),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

/// A loop state that would index outside the data: an entry of `order` at or beyond its
/// length, or a `cursor` at the top of `usize` (where `cursor + batch` overflows).
#[derive(Debug, Clone)]
enum PositionDefect {
    OrderEntry(Index, u64),
    Cursor(usize),
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any `checksums.json` (entries of any type, sizes of u64::MAX, 10¹² or −1, random bytes)
    /// and any damage to the files it lists are checked without panicking; an entry that
    /// leads out of the checkpoint is refused naming it, and a flipped byte or a cut file is
    /// caught naming the file.
    #[test]
    fn checkpoint_verify_never_panics_and_names_the_damage(case in checksum_cases()) {
        let out = tempfile::tempdir().unwrap();
        let d = step_dir(out.path(), 3);
        fill_step(&d, StepState::Complete);
        let needle = damage(&d, &case);
        match no_panic("checkpoint::verify", || verify(&d))? {
            Ok(()) => prop_assert!(needle.is_none(), "{case:?} passed verification"),
            Err(message) => {
                if let Some(needle) = needle {
                    prop_assert!(
                        message.contains(&needle),
                        "{case:?}: the error does not name {needle}: {message}"
                    );
                }
            }
        }
    }

    /// Whatever the marker holds and whichever `global_step_*` directories exist (numbered
    /// or not, complete, cut, damaged or empty), the checkpoint a resumed run continues from
    /// is found without panicking: the marker's step when it verifies, else the newest step
    /// that does, else none; everything passed over says why.
    #[test]
    fn the_latest_checkpoint_is_the_newest_that_verifies(run in run_dirs()) {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path();
        if let Some(marker) = &run.marker {
            std::fs::write(dir.join("latest_checkpointed_iteration.txt"), marker).unwrap();
        }
        for (name, state) in &run.steps {
            fill_step(&dir.join(format!("global_step_{name}")), *state);
        }
        let found = caught("checkpoint::latest", || latest(dir))?;
        let good = |s: u64| verify(&step_dir(dir, s)).is_ok();
        let marker = run
            .marker
            .as_deref()
            .and_then(|m| std::str::from_utf8(m).ok())
            .and_then(|t| t.trim().parse::<u64>().ok());
        let expected = match marker {
            Some(m) if good(m) => Some(m),
            _ => run
                .steps
                .iter()
                .filter_map(|(n, _)| n.parse::<u64>().ok())
                .filter(|&s| good(s))
                .max(),
        };
        prop_assert_eq!(found.as_ref().map(|f| f.step), expected, "found {:?}", found);
        if let Some(f) = &found {
            prop_assert_eq!(&f.dir, &step_dir(dir, f.step));
            for why in &f.passed_over {
                prop_assert!(!why.trim().is_empty(), "an empty reason in {:?}", f.passed_over);
            }
        }
    }

    /// Any `trainer.json` reads to a loop state or is refused with a message naming the file,
    /// never panicking.
    #[test]
    fn trainer_json_never_panics(bytes in trainer_jsons()) {
        let out = tempfile::tempdir().unwrap();
        let d = step_dir(out.path(), 3);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("trainer.json"), bytes).unwrap();
        if let Err(message) = no_panic("checkpoint::read_loop_state", || read_loop_state(&d))? {
            prop_assert!(
                message.contains("trainer.json"),
                "the error does not name the file: {message}"
            );
        }
    }

    /// A `trainer.json` whose data order names a row beyond the data, or whose cursor is at
    /// the top of `usize`, is refused naming the field (the fit loop would index out of
    /// bounds, or overflow, with it).
    #[test]
    fn trainer_json_positions_outside_the_data_are_refused(
        rows in 1usize..6,
        defect in prop_oneof![
            (any::<Index>(), prop_oneof![0u64..8, Just(u64::MAX)])
                .prop_map(|(i, beyond)| PositionDefect::OrderEntry(i, beyond)),
            (0usize..4).prop_map(PositionDefect::Cursor),
        ],
    ) {
        let mut state = LoopState::fresh(rows, 0.1);
        state.cursor = 0;
        let field = match &defect {
            PositionDefect::OrderEntry(i, beyond) => {
                let at = i.index(rows);
                let beyond = usize::try_from(*beyond).unwrap_or(usize::MAX);
                state.order[at] = rows.saturating_add(beyond);
                "order"
            }
            PositionDefect::Cursor(k) => {
                state.cursor = usize::MAX - *k;
                "cursor"
            }
        };
        let out = tempfile::tempdir().unwrap();
        let d = step_dir(out.path(), 3);
        write_loop_state(&d, &state).unwrap();
        match no_panic("checkpoint::read_loop_state", || read_loop_state(&d))? {
            Ok(_) => return Err(TestCaseError::fail(format!("{state:?} was accepted"))),
            Err(message) => prop_assert!(
                message.contains(field),
                "{defect:?}: the error does not name `{field}`: {message}"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// metrics.jsonl.

/// A `metrics.jsonl` as runs write it (step lines, warm-up lines, non-finite values left
/// out), then with byte edits: a torn last line, a flipped byte, a spliced-in token.
fn metrics_files() -> impl Strategy<Value = Vec<u8>> {
    let value = any::<f64>()
        .prop_map(|x| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number));
    let line = (
        prop::option::of(0u64..12),
        any::<bool>(),
        prop::collection::btree_map("[a-z/_]{1,12}", value, 0..4),
    )
        .prop_map(|(step, sft, metrics)| {
            let mut obj: serde_json::Map<String, Value> = metrics.into_iter().collect();
            if let Some(s) = step {
                let key = if sft { "sft_step" } else { "step" };
                obj.insert(key.to_string(), json!(s));
            }
            format!("{}\n", Value::Object(obj))
        });
    (
        prop::collection::vec(line, 0..8),
        prop::collection::vec(byte_edit(), 0..3),
    )
        .prop_map(|(lines, edits)| apply_all(lines.concat().into_bytes(), &edits))
}

/// Whether `line` is one a run resumed after `step` keeps: a JSON object whose `step`, if it
/// has one, is not later.
fn kept(line: &str, step: u64) -> bool {
    match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(obj)) => obj
            .get("step")
            .and_then(Value::as_u64)
            .is_none_or(|s| s <= step),
        _ => false,
    }
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Resuming after step N keeps exactly the whole lines of `metrics.jsonl` that are JSON
    /// objects of step N or earlier (a torn or damaged line is dropped, invalid UTF-8
    /// included), never panicking.
    #[test]
    fn metrics_log_resume_keeps_exactly_the_whole_earlier_lines(
        bytes in metrics_files(),
        step in 0u64..12,
    ) {
        let out = tempfile::tempdir().unwrap();
        let path = out.path().join("metrics.jsonl");
        std::fs::write(&path, &bytes).unwrap();
        let expected = String::from_utf8_lossy(&bytes).lines().filter(|l| kept(l, step)).count();
        let log = no_panic("RunLog::resume", || RunLog::resume(out.path(), 12, "fuzz", step))?;
        if let Err(message) = &log {
            return Err(TestCaseError::fail(format!("resume failed: {message}")));
        }
        drop(log);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        prop_assert_eq!(lines.len(), expected, "kept {:?}", lines);
        for line in lines {
            prop_assert!(kept(line, step), "kept {line:?}");
        }
    }
}

//! The prompt dataset of a run and the batches the trainer feeds the workers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::prelude::*;
use burn::tensor::{Int, TensorData};
use serde_json::Value;
use verl_core::DataProto;
use verl_megatron::hf::{ChatMessage, HfTokenizer};
use verl_rollout::Detokenizer;

use crate::tasks::{ArithmeticTask, CharTokenizer};

/// How text becomes ids for the run's model.
pub enum Codec {
    /// The built-in tasks' character tokenizer (models trained from scratch).
    Char(CharTokenizer),
    /// A Hugging Face tokenizer; prompts are chat messages rendered with the chat template,
    /// with the agent loop's tool schemas where it runs one (as verl's `ToolAgentLoop` renders
    /// its prompts: Qwen's template lists them in the system turn).
    Hf {
        tokenizer: Box<HfTokenizer>,
        tools: Vec<Value>,
    },
}

impl Codec {
    /// A Hugging Face tokenizer's codec, with no tools.
    pub fn hf(tokenizer: HfTokenizer) -> Self {
        Codec::Hf {
            tokenizer: Box::new(tokenizer),
            tools: Vec::new(),
        }
    }

    /// The codec with `schemas` as the tools its chat prompts list (a character codec has no
    /// template to list them in).
    pub fn with_tools(self, schemas: Vec<Value>) -> Self {
        match self {
            Codec::Hf { tokenizer, .. } => Codec::Hf {
                tokenizer,
                tools: schemas,
            },
            other => other,
        }
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self {
            Codec::Char(_) => vec![CharTokenizer::EOS],
            Codec::Hf { tokenizer: t, .. } => t.eos_token_ids.clone(),
        }
    }

    pub fn pad_token_id(&self) -> u32 {
        match self {
            Codec::Char(_) => CharTokenizer::PAD,
            Codec::Hf { tokenizer: t, .. } => t.eos_token_ids.first().copied().unwrap_or(0),
        }
    }

    /// What the rollout engine reads stop strings with (`actor_rollout_ref.rollout.stop`).
    pub fn detokenizer(&self) -> Arc<dyn Detokenizer> {
        match self {
            Codec::Char(t) => Arc::new(t.clone()),
            Codec::Hf { tokenizer: t, .. } => Arc::new(t.as_ref().clone()),
        }
    }

    /// Ids of a prompt given as plain text (the chat template wraps it for HF models).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_chat(&[ChatMessage::user(text)])
    }

    /// Ids of a prompt given as chat messages: HF models render the whole conversation with
    /// their chat template (and the codec's tools, [`Self::with_tools`]) as verl does; the
    /// character tokenizer takes the last user turn.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
        match self {
            Codec::Char(t) => {
                let user = messages
                    .iter()
                    .rev()
                    .find(|m| m.role == "user")
                    .ok_or("the chat messages have no user turn")?;
                t.encode(&user.content)
            }
            Codec::Hf {
                tokenizer: t,
                tools,
            } => {
                let chat = t
                    .apply_chat_template_with_tools(messages, tools, true)
                    .map_err(|e| e.to_string())?;
                t.encode(&chat).map_err(|e| e.to_string())
            }
        }
    }

    /// Ids of a response text (no template), for supervised warm-up.
    pub fn encode_response(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Codec::Char(t) => t.encode(text),
            Codec::Hf { tokenizer: t, .. } => t.encode(text).map_err(|e| e.to_string()),
        }
    }

    /// Text of `ids`, every one of them (special tokens skipped by an HF tokenizer): a
    /// prompt's text for the generation dumps.
    pub fn decode_all(&self, ids: &[u32]) -> String {
        match self {
            Codec::Char(t) => t.decode(ids),
            Codec::Hf { tokenizer: t, .. } => t.decode(ids).unwrap_or_default(),
        }
    }

    /// Text of response ids up to the first EOS.
    pub fn decode(&self, ids: &[u32]) -> String {
        let eos = self.eos_token_ids();
        let end = ids
            .iter()
            .position(|t| eos.contains(t))
            .unwrap_or(ids.len());
        match self {
            Codec::Char(t) => t.decode(&ids[..end]),
            Codec::Hf { tokenizer: t, .. } => t.decode(&ids[..end]).unwrap_or_default(),
        }
    }
}

/// One prompt with what its reward needs (verl's parquet row).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRow {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub data_source: String,
    pub ground_truth: String,
    pub extra_info: Value,
}

impl PromptRow {
    /// A prompt as text, scored against `ground_truth` by the reward of `data_source`. Its
    /// token ids are filled in by the trainer that takes it
    /// ([`PpoTrainerBuilder::data`](super::builder::PpoTrainerBuilder::data)), with the run's
    /// tokenizer.
    pub fn new(prompt: impl Into<String>, data_source: &str, ground_truth: &str) -> Self {
        Self {
            prompt: prompt.into(),
            prompt_ids: Vec::new(),
            data_source: data_source.to_string(),
            ground_truth: ground_truth.to_string(),
            extra_info: Value::Null,
        }
    }
}

/// Rows of the built-in arithmetic task.
pub fn arithmetic_rows(
    task: &ArithmeticTask,
    codec: &Codec,
    count: usize,
    seed: u64,
) -> Result<Vec<PromptRow>, String> {
    task.problems(count, seed)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            Ok(PromptRow {
                prompt_ids: codec.encode_prompt(&p.prompt)?,
                prompt: p.prompt,
                data_source: ArithmeticTask::DATA_SOURCE.into(),
                ground_truth: p.answer,
                extra_info: serde_json::json!({ "index": i }),
            })
        })
        .collect()
}

/// Where a row sits in its data file, as its errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowAt {
    /// A JSONL line, 1-based as editors count.
    Line(usize),
    /// A parquet row or an element of a JSON array, 0-based as pandas counts.
    Row(usize),
}

impl std::fmt::Display for RowAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowAt::Line(n) => write!(f, "line {n}"),
            RowAt::Row(i) => write!(f, "row {i}"),
        }
    }
}

/// Why a data file (`data.train_files` / `data.val_files`) could not be read: each names the
/// file, and a bad row also its place and field.
#[derive(Debug, thiserror::Error)]
pub enum DataFileError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: line {line}: not UTF-8 text")]
    NotUtf8 { path: PathBuf, line: usize },
    #[error("{path}: unknown data file type `.{ext}`: data.train_files / data.val_files take .parquet, .jsonl or .json files")]
    UnknownType { path: PathBuf, ext: String },
    #[error("{path}: {source}")]
    Parquet {
        path: PathBuf,
        source: parquet::errors::ParquetError,
    },
    #[error("{path}: the file is damaged ({why}); write it again")]
    Damaged { path: PathBuf, why: String },
    #[error("{path}: {at}: {source}")]
    ParquetRow {
        path: PathBuf,
        at: RowAt,
        source: parquet::errors::ParquetError,
    },
    #[error("{path}: {at}: {bytes} bytes, over the {limit}-byte limit of one row; split the row or shorten it")]
    RowTooLong {
        path: PathBuf,
        at: RowAt,
        bytes: usize,
        limit: usize,
    },
    #[error("{path}: {at}: not JSON: {source}")]
    NotJson {
        path: PathBuf,
        at: RowAt,
        source: serde_json::Error,
    },
    #[error("{path}: not a JSON array of row objects: {source}")]
    NotJsonArray {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: no rows")]
    Empty { path: PathBuf },
    #[error("{path}: {at}: a row must be a JSON object of columns, found {found}")]
    NotAnObject {
        path: PathBuf,
        at: RowAt,
        found: String,
    },
    /// A column (or a part of one, such as `prompt[1].role`) is missing or of the wrong type.
    #[error("{path}: {at}: `{field}` {problem}")]
    Field {
        path: PathBuf,
        at: RowAt,
        field: String,
        problem: String,
    },
}

/// Rows of a data file in verl's layout, chosen by extension: `.parquet` (what verl's
/// preprocessing scripts write) or `.jsonl` / `.json` (one row object per line, or a JSON
/// array of row objects).
pub fn file_rows(
    path: &Path,
    codec: &Codec,
    prompt_key: &str,
    reward_fn_key: &str,
) -> Result<Vec<PromptRow>, DataFileError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let values = match ext {
        "parquet" => parquet_values(path)?,
        "jsonl" => json_values(path, false)?,
        "json" => json_values(path, true)?,
        _ => {
            return Err(DataFileError::UnknownType {
                path: path.into(),
                ext: ext.to_string(),
            })
        }
    };
    if values.is_empty() {
        return Err(DataFileError::Empty { path: path.into() });
    }
    values
        .iter()
        .map(|(at, v)| row_from_value(v, path, *at, codec, prompt_key, reward_fn_key))
        .collect()
}

/// The text of a JSON data file, without a leading byte-order mark: editors on Windows and
/// pandas' `to_json(encoding="utf-8-sig")` write one, and JSON parsers refuse it.
fn json_text(path: &Path) -> Result<String, DataFileError> {
    // Regular files only (a FIFO or /dev/zero would never end); no size bound: datasets are
    // as large as they are.
    let bytes =
        verl_core::files::read_regular(path, u64::MAX).map_err(|source| DataFileError::Read {
            path: path.into(),
            source,
        })?;
    let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
    match std::str::from_utf8(body) {
        Ok(text) => Ok(text.to_string()),
        Err(e) => Err(DataFileError::NotUtf8 {
            path: path.into(),
            line: 1 + body[..e.valid_up_to()]
                .iter()
                .filter(|&&b| b == b'\n')
                .count(),
        }),
    }
}

/// Each row object of a JSON data file, labelled with its place: JSONL's line number, or, for
/// a `.json` file (`may_be_array`), the index in a JSON array (`json.dump(rows, f)`, which verl
/// users also keep datasets as; a row line cannot start with `[`, so the first character tells
/// the two apart). A `.jsonl` file is always read line by line, so a stray array line is named
/// by its line.
/// The longest JSONL row read (a 128k-token prompt is well under 1 MiB).
pub const MAX_ROW_BYTES: usize = 64 << 20;

fn json_values(path: &Path, may_be_array: bool) -> Result<Vec<(RowAt, Value)>, DataFileError> {
    let text = json_text(path)?;
    if may_be_array && text.trim_start().starts_with('[') {
        let rows: Vec<Value> =
            serde_json::from_str(&text).map_err(|source| DataFileError::NotJsonArray {
                path: path.into(),
                source,
            })?;
        return Ok(rows
            .into_iter()
            .enumerate()
            .map(|(i, v)| (RowAt::Row(i), v))
            .collect());
    }
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let at = RowAt::Line(i + 1);
            // A parsed row takes several times its text: one enormous line would fill memory.
            if line.len() > MAX_ROW_BYTES {
                return Err(DataFileError::RowTooLong {
                    path: path.into(),
                    at,
                    bytes: line.len(),
                    limit: MAX_ROW_BYTES,
                });
            }
            serde_json::from_str(line)
                .map(|v| (at, v))
                .map_err(|source| DataFileError::NotJson {
                    path: path.into(),
                    at,
                    source,
                })
        })
        .collect()
}

/// Each parquet row as a JSON object (nested lists and structs included), labelled with its
/// row index. Parquet's record reader does the nesting, so files written by pandas/pyarrow
/// (verl's `examples/data_preprocess`) read as they are.
fn parquet_values(path: &Path) -> Result<Vec<(RowAt, Value)>, DataFileError> {
    // The parquet crate asserts on some damaged files (definition levels, byte ranges)
    // instead of returning an error: a panic there is a damaged file, named as such.
    std::panic::catch_unwind(|| parquet_values_unguarded(path)).unwrap_or_else(|panic| {
        Err(DataFileError::Damaged {
            path: path.into(),
            why: verl_core::error::panic_message(panic),
        })
    })
}

fn parquet_values_unguarded(path: &Path) -> Result<Vec<(RowAt, Value)>, DataFileError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let err = |source| DataFileError::Parquet {
        path: path.into(),
        source,
    };
    let file = verl_core::files::open_regular(path).map_err(|source| DataFileError::Read {
        path: path.into(),
        source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(err)?;
    let rows = reader.get_row_iter(None).map_err(err)?;
    rows.enumerate()
        .map(|(i, row)| {
            let at = RowAt::Row(i);
            let row = row.map_err(|source| DataFileError::ParquetRow {
                path: path.into(),
                at,
                source,
            })?;
            Ok((at, row.to_json_value()))
        })
        .collect()
}

/// `v`'s JSON type and a short excerpt, for errors about a field of the wrong type.
fn described(v: &Value) -> String {
    // A whole conversation would bury the message.
    const SHOWN: usize = 40;
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    };
    let text = v.to_string();
    let shown: String = if text.chars().count() > SHOWN {
        text.chars().take(SHOWN).chain("…".chars()).collect()
    } else {
        text
    };
    format!("{kind} ({shown})")
}

/// One row of verl's layout: `prompt` (chat messages, or a string; the column `prompt_key`),
/// `data_source` (the column `reward_fn_key`, which picks the scorer), `reward_model.ground_truth`,
/// `extra_info`. Errors name `path`, the row's place `at` and the field.
fn row_from_value(
    v: &Value,
    path: &Path,
    at: RowAt,
    codec: &Codec,
    prompt_key: &str,
    reward_fn_key: &str,
) -> Result<PromptRow, DataFileError> {
    let bad = |field: &str, problem: String| DataFileError::Field {
        path: path.into(),
        at,
        field: field.to_string(),
        problem,
    };
    let Value::Object(row) = v else {
        return Err(DataFileError::NotAnObject {
            path: path.into(),
            at,
            found: described(v),
        });
    };
    let messages = chat_messages(row.get(prompt_key), prompt_key, &bad)?;
    let prompt = messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.clone())
        .ok_or_else(|| bad(prompt_key, "has no user message".into()))?;
    let ground_truth = ground_truth_of(row.get("reward_model"), &bad)?;
    let data_source = match row.get(reward_fn_key) {
        Some(Value::String(s)) => s.clone(),
        // A row without the column reads as `unknown`, which setup refuses unless the run's
        // reward function takes it (a builder-given scorer may take any source).
        None | Some(Value::Null) => "unknown".to_string(),
        Some(other) => {
            let found = described(other);
            let why = "naming the row's scorer (data.reward_fn_key names this column)";
            return Err(bad(
                reward_fn_key,
                format!("is {found}; it must be a string {why}"),
            ));
        }
    };
    Ok(PromptRow {
        prompt_ids: codec
            .encode_chat(&messages)
            .map_err(|e| bad(prompt_key, format!("cannot be tokenized: {e}")))?,
        prompt,
        data_source,
        ground_truth,
        extra_info: row.get("extra_info").cloned().unwrap_or(Value::Null),
    })
}

/// The chat messages of a row's prompt column `prompt_key` (a string is one user message).
fn chat_messages(
    value: Option<&Value>,
    prompt_key: &str,
    bad: &dyn Fn(&str, String) -> DataFileError,
) -> Result<Vec<ChatMessage>, DataFileError> {
    Ok(match value {
        Some(Value::String(s)) => vec![ChatMessage::user(s.clone())],
        Some(Value::Array(msgs)) => msgs
            .iter()
            .enumerate()
            .map(|(j, m)| -> Result<ChatMessage, DataFileError> {
                if !m.is_object() {
                    return Err(bad(
                        &format!("{prompt_key}[{j}]"),
                        format!(
                            "is {}; chat messages are objects with `role` and `content`",
                            described(m)
                        ),
                    ));
                }
                let field = |k: &str| match m.get(k) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    None | Some(Value::Null) => Err(bad(
                        &format!("{prompt_key}[{j}].{k}"),
                        "is missing: chat messages need `role` and `content`".into(),
                    )),
                    Some(other) => Err(bad(
                        &format!("{prompt_key}[{j}].{k}"),
                        format!(
                            "is {}; chat messages need string `role` and `content`",
                            described(other)
                        ),
                    )),
                };
                Ok(ChatMessage {
                    role: field("role")?,
                    content: field("content")?,
                })
            })
            .collect::<Result<_, DataFileError>>()?,
        None | Some(Value::Null) => {
            let fix = "set data.prompt_key to the prompt column";
            let problem = format!("is missing (a string or chat messages); {fix}");
            return Err(bad(prompt_key, problem));
        }
        Some(other) => {
            let found = described(other);
            let problem = format!(
                "is {found}; it must be a string or chat messages ({{role, content}} objects)"
            );
            return Err(bad(prompt_key, problem));
        }
    })
}

/// `reward_model.ground_truth` of a row (numbers and lists of accepted answers as their JSON
/// text).
fn ground_truth_of(
    reward_model: Option<&Value>,
    bad: &dyn Fn(&str, String) -> DataFileError,
) -> Result<String, DataFileError> {
    let ground_truth = match reward_model {
        None | Some(Value::Null) => None,
        Some(Value::Object(rm)) => rm.get("ground_truth"),
        Some(other) => {
            return Err(bad(
                "reward_model",
                format!(
                    "is {}; it must be an object with `ground_truth`",
                    described(other)
                ),
            ))
        }
    };
    Ok(match ground_truth {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => {
            return Err(bad("reward_model.ground_truth", "is missing".into()));
        }
        // Numbers and lists (several accepted answers) are kept as their JSON text.
        Some(other) => other.to_string(),
    })
}

fn left_padded<B: Backend>(
    seqs: &[Vec<u32>],
    pad: u32,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let (b, w) = (seqs.len(), seqs.iter().map(Vec::len).max().unwrap_or(1));
    let (mut ids, mut mask, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for s in seqs {
        let p = w - s.len();
        ids.extend(std::iter::repeat_n(pad as i64, p).chain(s.iter().map(|&t| t as i64)));
        mask.extend(std::iter::repeat_n(0i64, p).chain(std::iter::repeat_n(1, s.len())));
        pos.extend(std::iter::repeat_n(0i64, p).chain(0..s.len() as i64));
    }
    let t = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [b, w]), device);
    (t(ids), t(mask), t(pos))
}

/// The rollout input for `rows`: left-padded `input_ids`, `attention_mask`, `position_ids`, and
/// the non-tensor columns the reward needs, with a `uid` per prompt.
pub fn prompt_batch<B: Backend>(
    rows: &[&PromptRow],
    pad: u32,
    uid_prefix: &str,
    device: &B::Device,
) -> verl_core::Result<DataProto<B>> {
    let seqs: Vec<Vec<u32>> = rows.iter().map(|r| r.prompt_ids.clone()).collect();
    let (ids, mask, pos) = left_padded::<B>(&seqs, pad, device);
    let mut d = DataProto::new();
    d.insert_int("input_ids", ids)?;
    d.insert_int("attention_mask", mask)?;
    d.insert_int("position_ids", pos)?;
    let col = |f: &dyn Fn(&PromptRow) -> Value| rows.iter().map(|r| f(r)).collect::<Vec<_>>();
    d.insert_non_tensor(
        "data_source",
        col(&|r| Value::String(r.data_source.clone())),
    )?;
    d.insert_non_tensor(
        "reward_model",
        col(&|r| serde_json::json!({ "ground_truth": r.ground_truth })),
    )?;
    d.insert_non_tensor("extra_info", col(&|r| r.extra_info.clone()))?;
    d.insert_non_tensor(
        "uid",
        (0..rows.len())
            .map(|i| Value::String(format!("{uid_prefix}-{i}")))
            .collect(),
    )?;
    // The rollout seeds each prompt's samples by its place in the whole batch, so the samples
    // do not depend on how the batch is split over data-parallel ranks.
    d.insert_non_tensor(
        verl_rollout::PROMPT_INDEX_KEY,
        (0..rows.len()).map(Value::from).collect(),
    )?;
    Ok(d)
}

/// A supervised batch: each prompt followed by its ground-truth answer and EOS, in the same
/// layout the rollout produces (so the actor's loss code reads it unchanged).
pub fn sft_batch<B: Backend>(
    rows: &[&PromptRow],
    codec: &Codec,
    device: &B::Device,
) -> Result<DataProto<B>, String> {
    let pad = codec.pad_token_id();
    let eos = codec.eos_token_ids().first().copied().unwrap_or(pad);
    let prompts: Vec<Vec<u32>> = rows.iter().map(|r| r.prompt_ids.clone()).collect();
    let mut responses = Vec::new();
    for r in rows {
        let mut ids = codec.encode_response(&r.ground_truth)?;
        ids.push(eos);
        responses.push(ids);
    }
    let (p_ids, p_mask, p_pos) = left_padded::<B>(&prompts, pad, device);
    let b = rows.len();
    let pw = p_ids.dims()[1];
    let rw = responses.iter().map(Vec::len).max().unwrap_or(1);
    let mut r_ids = Vec::new();
    let mut r_mask = Vec::new();
    for r in &responses {
        r_ids.extend(
            r.iter()
                .map(|&t| t as i64)
                .chain(std::iter::repeat_n(pad as i64, rw - r.len())),
        );
        r_mask.extend((0..rw).map(|j| (j < r.len()) as i64));
    }
    let t =
        |v: Vec<i64>, w: usize| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [b, w]), device);
    let responses_t = t(r_ids, rw);
    let response_mask = t(r_mask, rw);
    let last_pos = p_pos.clone().slice([0..b, pw - 1..pw]);
    let r_pos = last_pos + Tensor::<B, 1, Int>::arange(1..rw as i64 + 1, device).unsqueeze_dim(0);
    let mut d = DataProto::new();
    let err = |e: verl_core::error::DataProtoError| e.to_string();
    d.insert_int(
        "input_ids",
        Tensor::cat(vec![p_ids, responses_t.clone()], 1),
    )
    .map_err(err)?;
    d.insert_int(
        "attention_mask",
        Tensor::cat(vec![p_mask, response_mask.clone()], 1),
    )
    .map_err(err)?;
    d.insert_int("position_ids", Tensor::cat(vec![p_pos, r_pos], 1))
        .map_err(err)?;
    d.insert_int("responses", responses_t).map_err(err)?;
    d.insert_int("response_mask", response_mask).map_err(err)?;
    Ok(d)
}

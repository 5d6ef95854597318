//! The prompt dataset of a run and the batches the trainer feeds the workers.

use std::path::Path;
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
    /// A Hugging Face tokenizer; prompts are chat messages rendered with the chat template.
    Hf(Box<HfTokenizer>),
}

impl Codec {
    pub fn eos_token_ids(&self) -> Vec<u32> {
        match self {
            Codec::Char(_) => vec![CharTokenizer::EOS],
            Codec::Hf(t) => t.eos_token_ids.clone(),
        }
    }

    pub fn pad_token_id(&self) -> u32 {
        match self {
            Codec::Char(_) => CharTokenizer::PAD,
            Codec::Hf(t) => t.eos_token_ids.first().copied().unwrap_or(0),
        }
    }

    /// What the rollout engine reads stop strings with (`actor_rollout_ref.rollout.stop`).
    pub fn detokenizer(&self) -> Arc<dyn Detokenizer> {
        match self {
            Codec::Char(t) => Arc::new(t.clone()),
            Codec::Hf(t) => Arc::new(t.as_ref().clone()),
        }
    }

    /// Ids of a prompt given as plain text (the chat template wraps it for HF models).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_chat(&[ChatMessage::user(text)])
    }

    /// Ids of a prompt given as chat messages: HF models render the whole conversation with
    /// their chat template (as verl does); the character tokenizer takes the last user turn.
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
            Codec::Hf(t) => {
                let chat = t
                    .apply_chat_template(messages, true)
                    .map_err(|e| e.to_string())?;
                t.encode(&chat).map_err(|e| e.to_string())
            }
        }
    }

    /// Ids of a response text (no template), for supervised warm-up.
    pub fn encode_response(&self, text: &str) -> Result<Vec<u32>, String> {
        match self {
            Codec::Char(t) => t.encode(text),
            Codec::Hf(t) => t.encode(text).map_err(|e| e.to_string()),
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
            Codec::Hf(t) => t.decode(&ids[..end]).unwrap_or_default(),
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

/// Rows of a data file in verl's layout, chosen by extension: `.parquet` (what verl's
/// preprocessing scripts write) or `.jsonl` / `.json` (one row object per line).
pub fn file_rows(
    path: &Path,
    codec: &Codec,
    prompt_key: &str,
    reward_fn_key: &str,
) -> Result<Vec<PromptRow>, String> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let values = match ext {
        "parquet" => parquet_values(path)?,
        "jsonl" | "json" => jsonl_values(path)?,
        _ => {
            return Err(format!(
                "{}: unknown data file type `.{ext}`: data.train_files / data.val_files take .parquet or .jsonl files",
                path.display()
            ))
        }
    };
    if values.is_empty() {
        return Err(format!("{}: no rows", path.display()));
    }
    values
        .iter()
        .map(|(at, v)| {
            row_from_value(v, codec, prompt_key, reward_fn_key)
                .map_err(|e| format!("{}: {at}: {e}", path.display()))
        })
        .collect()
}

/// Each JSONL line's object, labelled with its line number.
fn jsonl_values(path: &Path) -> Result<Vec<(String, Value)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let at = format!("line {}", i + 1);
            serde_json::from_str(line)
                .map(|v| (at.clone(), v))
                .map_err(|e| format!("{}: {at}: not JSON: {e}", path.display()))
        })
        .collect()
}

/// Each parquet row as a JSON object (nested lists and structs included), labelled with its
/// row index. Parquet's record reader does the nesting, so files written by pandas/pyarrow
/// (verl's `examples/data_preprocess`) read as they are.
fn parquet_values(path: &Path) -> Result<Vec<(String, Value)>, String> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let err = |e: parquet::errors::ParquetError| format!("{}: {e}", path.display());
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let reader = SerializedFileReader::new(file).map_err(err)?;
    let rows = reader.get_row_iter(None).map_err(err)?;
    rows.enumerate()
        .map(|(i, row)| {
            let row = row.map_err(|e| format!("{}: row {i}: {e}", path.display()))?;
            Ok((format!("row {i}"), row.to_json_value()))
        })
        .collect()
}

/// One row of verl's layout: `prompt` (chat messages, or a string; the column `prompt_key`),
/// `data_source` (the column `reward_fn_key`, which picks the scorer), `reward_model.ground_truth`,
/// `extra_info`.
fn row_from_value(
    v: &Value,
    codec: &Codec,
    prompt_key: &str,
    reward_fn_key: &str,
) -> Result<PromptRow, String> {
    let messages: Vec<ChatMessage> = match v.get(prompt_key) {
        Some(Value::String(s)) => vec![ChatMessage::user(s.clone())],
        Some(Value::Array(msgs)) => msgs
            .iter()
            .enumerate()
            .map(|(j, m)| {
                let field = |k: &str| {
                    m.get(k).and_then(Value::as_str).map(str::to_string).ok_or_else(|| {
                        format!("`{prompt_key}[{j}].{k}` is missing: chat messages need `role` and `content`")
                    })
                };
                Ok(ChatMessage {
                    role: field("role")?,
                    content: field("content")?,
                })
            })
            .collect::<Result<_, String>>()?,
        _ => {
            return Err(format!(
                "`{prompt_key}` is missing (a string or chat messages); set data.prompt_key to the prompt column"
            ))
        }
    };
    let prompt = messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.clone())
        .ok_or_else(|| format!("`{prompt_key}` has no user message"))?;
    let ground_truth = match v.pointer("/reward_model/ground_truth") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => {
            return Err("`reward_model.ground_truth` is missing".into());
        }
        Some(other) => other.to_string(),
    };
    Ok(PromptRow {
        prompt_ids: codec.encode_chat(&messages)?,
        prompt,
        data_source: v
            .get(reward_fn_key)
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string(),
        ground_truth,
        extra_info: v.get("extra_info").cloned().unwrap_or(Value::Null),
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

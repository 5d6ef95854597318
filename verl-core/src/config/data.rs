use serde::{Deserialize, Serialize};

/// `data.*`: the prompt dataset and its batching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Tokenizer path; `None` uses the model's.
    pub tokenizer: Option<String>,
    /// Parquet or JSONL files of training prompts (`None`: the built-in synthetic task).
    pub train_files: Option<StringOrList>,
    pub val_files: Option<StringOrList>,
    pub prompt_key: String,
    pub reward_fn_key: String,
    pub max_prompt_length: usize,
    pub max_response_length: usize,
    /// Prompts per training step (each expands to `rollout.n` samples).
    pub train_batch_size: usize,
    /// `None`: the whole validation set in one batch.
    pub val_batch_size: Option<usize>,
    pub return_raw_input_ids: bool,
    pub return_raw_chat: bool,
    pub return_full_prompt: bool,
    pub shuffle: bool,
    pub seed: u64,
    pub filter_overlong_prompts: bool,
    /// What to do with a prompt longer than `max_prompt_length`: `error`, `left`, `right`, `middle`.
    pub truncation: Truncation,
    pub dataloader_num_workers: usize,
}

/// One path or a list of paths, as verl accepts for `train_files`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn paths(&self) -> Vec<&str> {
        match self {
            StringOrList::One(s) => vec![s.as_str()],
            StringOrList::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// `data.truncation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncation {
    Error,
    Left,
    Right,
    Middle,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            train_files: None,
            val_files: None,
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            max_prompt_length: 512,
            max_response_length: 512,
            train_batch_size: 1024,
            val_batch_size: None,
            return_raw_input_ids: false,
            return_raw_chat: false,
            return_full_prompt: false,
            shuffle: true,
            seed: 1,
            filter_overlong_prompts: false,
            truncation: Truncation::Error,
            dataloader_num_workers: 0,
        }
    }
}

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
    /// The shuffling seed; `null` (verl's default) is 1.
    pub seed: Option<u64>,
    /// At most this many training / validation rows of the files (≤ 0: all), taken before
    /// overlong prompts are filtered, as verl's dataset takes them: the first rows, or with
    /// `shuffle` a random subset drawn with `seed` (verl draws with numpy, so its subset is
    /// another one).
    pub train_max_samples: i64,
    pub val_max_samples: i64,
    /// Drop prompts longer than `max_prompt_length` (in tokens, chat template applied) from the
    /// training and validation sets, as verl's dataset does, instead of truncating them.
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

impl Truncation {
    /// `ids` cut to at most `limit` tokens as verl's dataset does: `left` keeps the last
    /// `limit`, `right` the first, `middle` the first `limit / 2` and the last
    /// `limit - limit / 2`. `error` returns `Err(len)` for a prompt that is too long.
    ///
    /// ```
    /// use verl_core::config::Truncation;
    /// let ids: Vec<u32> = (0..7).collect();
    /// assert_eq!(Truncation::Left.apply(ids.clone(), 4).unwrap(), vec![3, 4, 5, 6]);
    /// assert_eq!(Truncation::Right.apply(ids.clone(), 4).unwrap(), vec![0, 1, 2, 3]);
    /// assert_eq!(Truncation::Middle.apply(ids.clone(), 5).unwrap(), vec![0, 1, 4, 5, 6]);
    /// assert_eq!(Truncation::Error.apply(ids.clone(), 4), Err(7));
    /// assert_eq!(Truncation::Error.apply(ids, 7).unwrap().len(), 7);
    /// ```
    pub fn apply<T: Copy>(self, ids: Vec<T>, limit: usize) -> Result<Vec<T>, usize> {
        let len = ids.len();
        if len <= limit {
            return Ok(ids);
        }
        Ok(match self {
            Truncation::Error => return Err(len),
            Truncation::Left => ids[len - limit..].to_vec(),
            Truncation::Right => ids[..limit].to_vec(),
            Truncation::Middle => {
                let head = limit / 2;
                let mut kept = ids[..head].to_vec();
                kept.extend_from_slice(&ids[len - (limit - head)..]);
                kept
            }
        })
    }
}

impl DataConfig {
    /// The seed the training rows are shuffled with (`seed`, or 1 where it is null).
    pub fn shuffle_seed(&self) -> u64 {
        self.seed.unwrap_or(1)
    }
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
            seed: None,
            train_max_samples: -1,
            val_max_samples: -1,
            filter_overlong_prompts: false,
            truncation: Truncation::Error,
            dataloader_num_workers: 0,
        }
    }
}

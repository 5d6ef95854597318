//! The model's tokenizer (`tokenizer.json` through the `tokenizers` crate), its chat template
//! (rendered with minijinja, from `chat_template.jinja` or `tokenizer_config.json`), and the EOS
//! ids from `generation_config.json`.

use std::path::Path;

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use serde_json::Value;

use crate::error::MegatronError;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> Self {
        Self {
            role: "user".into(),
            content: content.into(),
        }
    }

    /// A tool's answer handed back to the model (role `tool`, as verl's agent loop writes it).
    pub fn tool(content: impl Into<String>) -> Self {
        Self {
            role: "tool".into(),
            content: content.into(),
        }
    }
}

/// Steps (minijinja's fuel) one chat-template rendering may take: Qwen's template with tools
/// over a long conversation takes well under 1 % of it.
pub const CHAT_TEMPLATE_FUEL: u64 = 50_000_000;

/// Tokenizer, chat template and stop ids of a Hugging Face model directory.
#[derive(Clone)]
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    chat_template: Option<String>,
    /// Ids that end generation (`generation_config.json`, else `config.json`).
    pub eos_token_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> MegatronError {
    MegatronError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, MegatronError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = verl_core::files::read_text(path).map_err(|e| io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| io(path, e))
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => Vec::new(),
    }
}

/// A special token as transformers stores it: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl HfTokenizer {
    /// Reads `dir/tokenizer.json` and the files around it.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, MegatronError> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let text = verl_core::files::read_text(&path).map_err(|e| io(&path, e))?;
        // The tokenizers crate panics on some malformed files (inside its deserialisers):
        // such a panic is a damaged tokenizer.json, reported as one.
        let parsed = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>());
        let mut tokenizer = match parsed {
            Ok(t) => t.map_err(|e| io(&path, e))?,
            Err(panic) => {
                let why = verl_core::error::panic_message(panic);
                return Err(io(&path, format!("not a tokenizer file ({why})")));
            }
        };
        // As transformers does: a tokenizer.json's truncation and padding blocks are training
        // leftovers that would cut or pad every prompt (and a bad stride panics inside
        // tokenizers); prompt lengths are data.max_prompt_length's business.
        tokenizer
            .with_truncation(None)
            .map_err(|e| io(&path, e))?
            .with_padding(None);
        let tok_cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(verl_core::files::read_text(&jinja).map_err(|e| io(&jinja, e))?)
        } else {
            tok_cfg
                .get("chat_template")
                .and_then(Value::as_str)
                .map(str::to_string)
        };
        let gen = read_json(&dir.join("generation_config.json"))?;
        let mut eos_token_ids = ids(gen.as_ref().and_then(|g| g.get("eos_token_id")));
        if eos_token_ids.is_empty() {
            eos_token_ids = ids(read_json(&dir.join("config.json"))?
                .as_ref()
                .and_then(|c| c.get("eos_token_id")));
        }
        Ok(Self {
            tokenizer,
            chat_template,
            eos_token_ids,
            bos_token: token_text(tok_cfg.get("bos_token")),
            eos_token: token_text(tok_cfg.get("eos_token")),
        })
    }

    /// Token ids of `text` (no special tokens added: chat templates write their own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, MegatronError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| MegatronError::Io {
                path: "tokenizer.json".into(),
                message: e.to_string(),
            })
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, MegatronError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| MegatronError::Io {
                path: "tokenizer.json".into(),
                message: e.to_string(),
            })
    }

    /// Whether the model ships a chat template (base models often do not).
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template over `messages`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, MegatronError> {
        self.apply_chat_template_with_tools(messages, &[], add_generation_prompt)
    }

    /// Renders the chat template over `messages` with the tools' JSON schemas as the
    /// template's `tools` (transformers' `apply_chat_template(..., tools=...)`: Qwen's template
    /// lists them in the system turn); none is the same as [`Self::apply_chat_template`].
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String, MegatronError> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| MegatronError::Config {
                path: "tokenizer_config.json".into(),
                field: "chat_template".into(),
                message: "the model has no chat template; pass the prompt as plain text".into(),
            })?;
        let mut env = Environment::new();
        // A template is code from the model's files: bound the steps it may take, so a loop
        // that never ends (or one of 10^10 steps) is an error naming the template, not a hang.
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let render_err = |e: JinjaError| MegatronError::Config {
            path: "chat_template".into(),
            field: "chat_template".into(),
            message: if e.kind() == ErrorKind::OutOfFuel {
                format!(
                    "the template ran past {CHAT_TEMPLATE_FUEL} steps for {} messages (a loop \
                     that does not end?); fix the template in tokenizer_config.json or \
                     chat_template.jinja",
                    messages.len()
                )
            } else {
                e.to_string()
            },
        };
        env.add_template("chat", template).map_err(render_err)?;
        env.get_template("chat")
            .map_err(render_err)?
            .render(context! {
                messages => messages,
                tools => (!tools.is_empty()).then_some(tools),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            })
            .map_err(render_err)
    }
}

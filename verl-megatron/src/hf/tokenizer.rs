//! The model's tokenizer (`tokenizer.json` through the `tokenizers` crate), its chat template
//! (rendered with minijinja, from `chat_template.jinja` or `tokenizer_config.json`), and the EOS
//! ids from `generation_config.json`.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};
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
    /// The chat template compiled on first use and shared by clones (an agent loop renders
    /// it every turn): the environment, or the template's syntax error.
    compiled: Arc<OnceLock<Result<Environment<'static>, String>>>,
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
            compiled: Arc::default(),
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
        self.decode_inner(ids, true)
    }

    /// Text of `ids` with the special tokens written out (verl reads a model turn's tool calls
    /// so: a tokenizer may mark `<tool_call>` special).
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, MegatronError> {
        self.decode_inner(ids, false)
    }

    fn decode_inner(&self, ids: &[u32], skip_special: bool) -> Result<String, MegatronError> {
        self.tokenizer
            .decode(ids, skip_special)
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
        let env = self
            .compiled
            .get_or_init(|| compile_chat_template(template).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|message| MegatronError::Config {
                path: "chat_template".into(),
                field: "chat_template".into(),
                message: message.clone(),
            })?;
        env.get_template("chat")
            .map_err(render_err)?
            .render(context! {
                messages => messages,
                tools => (!tools.is_empty()).then(|| tools.iter().map(verl_tool_schema).collect::<Vec<_>>()),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            })
            .map_err(render_err)
    }
}

/// The chat template compiled into an environment of its own, as `apply_chat_template` renders
/// it.
fn compile_chat_template(template: &str) -> Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    // A template is code from the model's files: bound the steps it may take, so a loop that
    // never ends (or one of 10^10 steps) is an error naming the template, not a hang.
    env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    // transformers' `tojson` (Python's json.dumps: ", " and ": ", non-ASCII kept, keys in their
    // order) in place of minijinja's compact, sorted, HTML-escaping one, so tool schemas and
    // call arguments are written as transformers writes them.
    env.add_filter("tojson", python_tojson);
    env.add_template_owned("chat", template.to_string())?;
    Ok(env)
}

/// A tool schema as verl's agent loop hands it to the chat template: pydantic's
/// `model_dump(exclude_unset=True, exclude_none=True)` of its `OpenAIFunctionToolSchema`, that is
/// the fields in their declaration order (`type`, `function`; `name`, `description`,
/// `parameters`, `strict`; `type`, `properties`, `required`; each property's `type`,
/// `description`, `enum`), absent and null ones left out, unknown keys dropped. Property names
/// come in the order serde_json keeps them (sorted), where verl keeps the file's.
fn verl_tool_schema(tool: &Value) -> JinjaValue {
    fn plain(v: &Value) -> JinjaValue {
        JinjaValue::from_serialize(v)
    }
    fn ordered(v: &Value, keys: &[&str], inner: &dyn Fn(&str, &Value) -> JinjaValue) -> JinjaValue {
        match v {
            Value::Object(map) => keys
                .iter()
                .filter_map(|&k| {
                    map.get(k)
                        .filter(|x| !x.is_null())
                        .map(|x| (k, inner(k, x)))
                })
                .collect(),
            other => plain(other),
        }
    }
    let property =
        |_: &str, p: &Value| ordered(p, &["type", "description", "enum"], &|_, x| plain(x));
    let properties = |_: &str, ps: &Value| match ps {
        Value::Object(map) => map
            .iter()
            .map(|(name, p)| (name.as_str(), property(name, p)))
            .collect(),
        other => plain(other),
    };
    let parameters = |_: &str, p: &Value| {
        ordered(p, &["type", "properties", "required"], &|k, x| match k {
            "properties" => properties(k, x),
            _ => plain(x),
        })
    };
    let function = |_: &str, f: &Value| {
        ordered(
            f,
            &["name", "description", "parameters", "strict"],
            &|k, x| match k {
                "parameters" => parameters(k, x),
                _ => plain(x),
            },
        )
    };
    ordered(tool, &["type", "function"], &|k, x| match k {
        "function" => function(k, x),
        _ => plain(x),
    })
}

/// transformers' `tojson` filter: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn python_tojson(value: &JinjaValue, kwargs: Kwargs) -> Result<String, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // transformers' other arguments, at the values this writes.
    for unused in ["ensure_ascii", "separators", "sort_keys"] {
        let _: Option<JinjaValue> = kwargs.get(unused)?;
    }
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(out)
}

fn write_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a float as json.dumps writes it (`1.0`, `0.5`, `1e+20`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if f != 0.0 && (f.abs() >= 1e16 || f.abs() < 1e-4) {
        let e = format!("{f:e}");
        match e.split_once('e') {
            Some((m, exp)) if !exp.starts_with('-') => format!("{m}e+{exp:0>2}"),
            Some((m, exp)) => format!("{m}e-{:0>2}", &exp[1..]),
            None => e,
        }
    } else if f.fract() == 0.0 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

fn write_json(
    out: &mut String,
    v: &JinjaValue,
    indent: Option<usize>,
    depth: usize,
) -> Result<(), JinjaError> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    // json.dumps: items joined by ", " (by "," before a newline when indenting).
    let separator = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        // Integers as written (u64 and i128 too); floats as Python writes them.
        ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
        ValueKind::Number => {
            out.push_str(&python_float(f64::try_from(v.clone()).unwrap_or(f64::NAN)))
        }
        ValueKind::String => write_json_string(out, v.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<JinjaValue> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json_string(out, &key.to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(key)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JinjaValue> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => write_json_string(out, &v.to_string()),
    }
    Ok(())
}

#[cfg(test)]
mod tojson_tests {
    use super::*;
    use serde_json::json;

    fn dumps(v: &Value, indent: Option<usize>) -> String {
        let kwargs: Kwargs = match indent {
            Some(n) => Kwargs::from_iter([("indent", JinjaValue::from(n))]),
            None => Kwargs::from_iter(std::iter::empty::<(&str, JinjaValue)>()),
        };
        python_tojson(&JinjaValue::from_serialize(v), kwargs).unwrap()
    }

    /// Python's `json.dumps(x, ensure_ascii=False)` output for each value, written by hand.
    #[test]
    fn writes_what_pythons_json_dumps_writes() {
        assert_eq!(
            dumps(&json!({"a": [1, 2.5, true, null]}), None),
            r#"{"a": [1, 2.5, true, null]}"#
        );
        assert_eq!(
            dumps(&json!("it's <b> & \"q\" é\n\t\u{1}"), None),
            r#""it's <b> & \"q\" é\n\t\u0001""#
        );
        assert_eq!(
            dumps(&json!([1.0, 1e20, 0.00001, -3]), None),
            "[1.0, 1e+20, 1e-05, -3]"
        );
        assert_eq!(dumps(&json!({}), Some(2)), "{}");
        assert_eq!(
            dumps(&json!({"a": [1, {"b": []}]}), Some(2)),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ]\n}"
        );
    }

    /// verl's field order (pydantic's model_dump), unknown and null keys dropped.
    #[test]
    fn tool_schemas_come_in_verls_field_order() {
        let schema = json!({
            "function": {
                "parameters": {"required": ["x"], "type": "object", "additionalProperties": false,
                               "properties": {"x": {"description": "d", "type": "string", "enum": null}}},
                "description": "desc", "name": "f"
            },
            "type": "function"
        });
        let rendered = python_tojson(
            &verl_tool_schema(&schema),
            Kwargs::from_iter(std::iter::empty::<(&str, JinjaValue)>()),
        )
        .unwrap();
        assert_eq!(
            rendered,
            r#"{"type": "function", "function": {"name": "f", "description": "desc", "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "d"}}, "required": ["x"]}}}"#
        );
    }
}

#[cfg(test)]
mod compiled_template_tests {
    use super::*;

    #[test]
    fn the_template_compiles_once_and_clones_share_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen2");
        let tok = HfTokenizer::from_dir(&dir).unwrap();
        assert!(tok.compiled.get().is_none(), "compiled on first use only");
        let messages = [ChatMessage::user("What is 12 + 7?")];
        let first = tok.apply_chat_template(&messages, true).unwrap();
        let twin = tok.clone();
        assert!(Arc::ptr_eq(&tok.compiled, &twin.compiled));
        assert_eq!(twin.apply_chat_template(&messages, true).unwrap(), first);
        // The fixture's template, rendered by hand.
        assert_eq!(
            first,
            "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}

//! Tool calls in the Hermes format that Qwen2.5, Qwen3 and Hermes models write (verl's
//! `HermesToolParser`): each call is a JSON object `{"name": ..., "arguments": {...}}` between
//! `<tool_call>` and `</tool_call>`; the rest of the turn is its text content.

use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One call the model wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object (arguments a model wrote as a JSON string holding an object are decoded).
    pub arguments: Value,
}

/// A model turn split into its text and its tool calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParsedTurn {
    /// The text outside the calls, trimmed.
    pub content: String,
    /// The well-formed calls, in order.
    pub calls: Vec<ToolCall>,
    /// What was wrong with each malformed call (not JSON, no name, arguments not an object, no
    /// closing tag), in order: the agent loop tells the model.
    pub errors: Vec<String>,
}

/// Splits a model turn written in the Hermes format.
///
/// ```
/// use verl_rollout::agent::parse_hermes;
/// let turn = parse_hermes(
///     "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"6*7\"}}\n</tool_call>",
/// );
/// assert_eq!(turn.content, "Let me compute.");
/// assert_eq!(turn.calls[0].name, "calculator");
/// assert_eq!(turn.calls[0].arguments["expression"], "6*7");
/// assert!(turn.errors.is_empty());
/// ```
pub fn parse_hermes(text: &str) -> ParsedTurn {
    let mut turn = ParsedTurn::default();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        content.push_str(&rest[..start]);
        let body_start = start + OPEN.len();
        let Some(len) = rest[body_start..].find(CLOSE) else {
            turn.errors
                .push(format!("a {OPEN} without {CLOSE}: the call was cut off"));
            rest = "";
            break;
        };
        match call_of(rest[body_start..body_start + len].trim()) {
            Ok(call) => turn.calls.push(call),
            Err(e) => turn.errors.push(e),
        }
        rest = &rest[body_start + len + CLOSE.len()..];
    }
    content.push_str(rest);
    turn.content = content.trim().to_string();
    turn
}

fn call_of(body: &str) -> Result<ToolCall, String> {
    let value: Value =
        serde_json::from_str(body).map_err(|e| format!("a tool call that is not JSON ({e})"))?;
    let name = value
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or("a tool call without a \"name\" string")?
        .to_string();
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => return Err(format!("tool {name}: \"arguments\" must be a JSON object")),
        },
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err(format!("tool {name}: \"arguments\" must be a JSON object")),
    };
    Ok(ToolCall { name, arguments })
}

/// `calls` written as a model writes them in the Hermes format (one per block, each on its
/// own lines), after `content`: what [`parse_hermes`] reads back.
pub fn render_hermes(content: &str, calls: &[ToolCall]) -> String {
    let mut out = content.to_string();
    for call in calls {
        let body = serde_json::json!({"name": call.name, "arguments": call.arguments});
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&format!("{OPEN}\n{body}\n{CLOSE}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn malformed_calls_are_reported_and_the_good_ones_kept() {
        let text =
            "a <tool_call>{\"name\": \"calc\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call> b \
                    <tool_call>not json</tool_call> c <tool_call>{\"arguments\": {}}</tool_call>\
                    <tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>\
                    <tool_call>{\"name\": \"g\"}</tool_call> d <tool_call>{\"name\": ";
        let turn = parse_hermes(text);
        assert_eq!(turn.content, "a  b  c  d");
        assert_eq!(
            turn.calls,
            [
                ToolCall {
                    name: "calc".into(),
                    arguments: json!({"x": 1})
                },
                ToolCall {
                    name: "g".into(),
                    arguments: json!({})
                }
            ]
        );
        assert_eq!(turn.errors.len(), 4, "{:?}", turn.errors);
        assert!(turn.errors[0].contains("not JSON"));
        assert!(turn.errors[1].contains("\"name\""));
        assert!(turn.errors[2].contains("JSON object"));
        assert!(turn.errors[3].contains("cut off"));
    }

    fn argument() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<i64>().prop_map(Value::from),
            "[ -~]{0,12}".prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
        ]
    }

    proptest! {
        /// Whatever calls and text a turn holds, rendering it and parsing it back gives the
        /// same calls and the text.
        #[test]
        fn rendered_calls_parse_back(
            content in "[a-zA-Z0-9 .,!?]{0,40}",
            calls in proptest::collection::vec(
                ("[a-z_]{1,12}", proptest::collection::btree_map("[a-z]{1,6}", argument(), 0..4)),
                0..4,
            ),
        ) {
            let calls: Vec<ToolCall> = calls
                .into_iter()
                .map(|(name, args)| ToolCall {
                    name,
                    arguments: Value::Object(args.into_iter().collect()),
                })
                .collect();
            let turn = parse_hermes(&render_hermes(&content, &calls));
            prop_assert_eq!(turn.calls, calls);
            prop_assert_eq!(turn.content, content.trim());
            prop_assert!(turn.errors.is_empty());
        }

        /// Text without the opening tag is all content.
        #[test]
        fn text_without_tags_is_content(text in "[^<]{0,60}") {
            let turn = parse_hermes(&text);
            prop_assert!(turn.calls.is_empty() && turn.errors.is_empty());
            prop_assert_eq!(turn.content, text.trim());
        }
    }
}

//! Tools an agent loop lets the model call (verl's `BaseTool`): a name and a JSON schema the
//! chat template shows the model, and an async call on the arguments the model wrote.

use async_trait::async_trait;
use serde_json::Value;

use crate::error::ToolError;

/// What a tool call gives back: the text the model reads as the tool's turn, and a reward the
/// trajectory may add (verl's tools return one too; `None` when the tool does not score).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutput {
    pub text: String,
    pub reward: Option<f64>,
}

impl ToolOutput {
    /// A tool's text with no reward.
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            reward: None,
        }
    }
}

/// A tool the model can call by name.
///
/// ```
/// use async_trait::async_trait;
/// use serde_json::{json, Value};
/// use verl_core::error::ToolError;
/// use verl_core::traits::{Tool, ToolOutput};
///
/// /// Echoes its `text` argument.
/// struct Echo;
///
/// #[async_trait(?Send)]
/// impl Tool for Echo {
///     fn name(&self) -> &str {
///         "echo"
///     }
///     fn schema(&self) -> Value {
///         json!({"type": "function", "function": {"name": "echo", "description": "Echoes text",
///                "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
///                               "required": ["text"]}}})
///     }
///     async fn call(&self, arguments: &Value) -> Result<ToolOutput, ToolError> {
///         let text = arguments["text"].as_str().ok_or_else(|| ToolError::Arguments {
///             tool: "echo".into(),
///             message: "`text` must be a string".into(),
///         })?;
///         Ok(ToolOutput::text(text))
///     }
/// }
///
/// let out = futures::executor::block_on(Echo.call(&json!({"text": "hi"})))?;
/// assert_eq!(out.text, "hi");
/// # Ok::<(), ToolError>(())
/// ```
#[async_trait(?Send)]
pub trait Tool {
    /// The name the model calls it by.
    fn name(&self) -> &str;

    /// Its description in OpenAI's function format (`{"type": "function", "function": {"name",
    /// "description", "parameters"}}`), which chat templates render into the system prompt.
    fn schema(&self) -> Value;

    /// Runs one call on the JSON arguments the model wrote. Bad arguments are an error the
    /// agent loop shows the model as the tool's answer, not a failure of the rollout.
    async fn call(&self, arguments: &Value) -> Result<ToolOutput, ToolError>;

    /// Runs one call for a trajectory whose data row gave this tool `create_kwargs` (verl's
    /// `extra_info.tools_kwargs.<tool name>.create_kwargs`, which verl's agent loop hands to
    /// `BaseTool.create` before each call: a GSM8K tool's ground truth, for instance; `Null`
    /// when the row gives none). By default the kwargs are not read.
    async fn call_with(
        &self,
        arguments: &Value,
        create_kwargs: &Value,
    ) -> Result<ToolOutput, ToolError> {
        let _ = create_kwargs;
        self.call(arguments).await
    }
}

/// The schema of a tool taking one string argument, in OpenAI's function format.
///
/// ```
/// use verl_core::traits::tool::one_string_schema;
/// let s = one_string_schema("echo", "Echoes text", "text", "what to echo");
/// assert_eq!(s["function"]["parameters"]["required"][0], "text");
/// ```
pub fn one_string_schema(
    name: &str,
    description: &str,
    argument: &str,
    argument_description: &str,
) -> Value {
    serde_json::json!({
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    argument: {"type": "string", "description": argument_description}
                },
                "required": [argument]
            }
        }
    })
}

/// The string `argument` of a call to `tool`, or the error the model reads: give the `what`
/// as a string, with `example` as its value.
///
/// ```
/// use serde_json::json;
/// use verl_core::traits::tool::string_argument;
/// assert_eq!(string_argument("echo", &json!({"text": "hi"}), "text", "text", "hi").unwrap(), "hi");
/// let e = string_argument("echo", &json!({"text": 3}), "text", "text", "hi").unwrap_err();
/// assert!(e.to_string().contains(r#"{"text": "hi"}"#));
/// ```
pub fn string_argument<'a>(
    tool: &str,
    arguments: &'a Value,
    argument: &str,
    what: &str,
    example: &str,
) -> Result<&'a str, ToolError> {
    arguments
        .get(argument)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::Arguments {
            tool: tool.into(),
            message: format!("give the {what} as a string: {{\"{argument}\": \"{example}\"}}"),
        })
}

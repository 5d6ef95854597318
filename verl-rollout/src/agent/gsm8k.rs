//! verl's GSM8K tool (`verl.tools.gsm8k_tool.Gsm8kTool`): the model submits its answer and
//! reads back how it scored against the row's ground truth.
//!
//! Its behaviour follows verl's `Gsm8kTool`:
//! - The answer is prefixed `#### ` unless it already is.
//! - It is scored by verl's GSM8K scorer in flexible mode (1 right, 0 wrong or not found;
//!   the match keeps commas, as verl's does).
//! - The model reads `Current parsed answer='…' reward=…`, with Python's reprs: `reward=0` when no
//!   number was found, `0.0` when wrong, `1.0` when right.
//! - The call's reward is 0 when it scored, else −0.05. verl makes a fresh instance for each
//!   call, so "improved" means better than 0.
//! - The ground truth comes from the row's `extra_info.tools_kwargs.<name>.create_kwargs
//!   .ground_truth`.

use async_trait::async_trait;
use serde_json::Value;
use verl_core::error::ToolError;
use verl_core::reward_score::gsm8k::{extract_solution, Method};
use verl_core::traits::tool::one_string_schema;
use verl_core::traits::{Tool, ToolOutput};

/// The name and schema verl's GSM8K tool config gives it.
pub const GSM8K_TOOL_NAME: &str = "calc_gsm8k_reward";

/// verl's GSM8K answer-checking tool.
///
/// ```
/// use serde_json::json;
/// use verl_core::traits::Tool;
/// use verl_rollout::agent::Gsm8kTool;
/// let tool = Gsm8kTool::default();
/// let out = futures::executor::block_on(
///     tool.call_with(&json!({"answer": "72"}), &json!({"ground_truth": "72"})),
/// )?;
/// assert_eq!(out.text, "Current parsed answer='72' reward=1.0");
/// assert_eq!(out.reward, Some(0.0));
/// # Ok::<(), verl_core::error::ToolError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Gsm8kTool {
    schema: Value,
    name: String,
}

impl Default for Gsm8kTool {
    fn default() -> Self {
        Self::with_schema(one_string_schema(
            GSM8K_TOOL_NAME,
            "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 \
             if parsed answer is incorrect or not correctly parsed)",
            "answer",
            "The model's answer to the GSM8K math problem, must be a digits",
        ))
    }
}

impl Gsm8kTool {
    /// The tool under a config file's schema (its `function.name` is the name the model
    /// calls; [`GSM8K_TOOL_NAME`] when absent).
    pub fn with_schema(schema: Value) -> Self {
        let name = schema["function"]["name"]
            .as_str()
            .unwrap_or(GSM8K_TOOL_NAME)
            .to_string();
        Self { schema, name }
    }
}

/// Python's `repr` of a string: single quotes unless the text holds one and no double quote
/// (characters Python counts as unprintable past U+007F are kept as they are).
fn python_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::from(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[async_trait(?Send)]
impl Tool for Gsm8kTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> Value {
        self.schema.clone()
    }

    /// Without a row's ground truth every answer scores as wrong.
    async fn call(&self, arguments: &Value) -> Result<ToolOutput, ToolError> {
        self.call_with(arguments, &Value::Null).await
    }

    async fn call_with(
        &self,
        arguments: &Value,
        create_kwargs: &Value,
    ) -> Result<ToolOutput, ToolError> {
        // verl reads `answer` as given, Python's str() of it when it is not a string, "" when
        // absent (lists and objects are written as JSON here, not as Python's reprs).
        let answer = match arguments.get("answer") {
            None => String::new(),
            Some(Value::Null) => "None".into(),
            Some(Value::Bool(b)) => if *b { "True" } else { "False" }.into(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
        };
        let response = if answer.starts_with("#### ") {
            answer.clone()
        } else {
            format!("#### {answer}")
        };
        let ground_truth = create_kwargs.get("ground_truth").and_then(Value::as_str);
        if ground_truth.is_none() {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "{}: a row gave no string ground_truth in extra_info.tools_kwargs.{}.\
                     create_kwargs; its answers score as wrong (warned once)",
                    self.name,
                    self.name
                )
            });
        }
        // verl's scorer: 0 (an int) when no answer is found, format_score 0.0 when it differs,
        // 1.0 when it matches.
        let (reward, shown) = match extract_solution(&response, Method::Flexible) {
            None => (0.0, "0"),
            Some(found) if Some(found.as_str()) == ground_truth => (1.0, "1.0"),
            Some(_) => (0.0, "0.0"),
        };
        Ok(ToolOutput {
            text: format!(
                "Current parsed answer={} reward={shown}",
                python_repr(&answer)
            ),
            reward: Some(if reward > 0.0 { 0.0 } else { -0.05 }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use serde_json::json;

    fn run(args: Value, kwargs: Value) -> ToolOutput {
        block_on(Gsm8kTool::default().call_with(&args, &kwargs)).unwrap()
    }

    #[test]
    fn scores_as_verls_gsm8k_tool() {
        let truth = json!({"ground_truth": "1200"});
        let right = run(json!({"answer": "1200"}), truth.clone());
        assert_eq!(right.text, "Current parsed answer='1200' reward=1.0");
        assert_eq!(right.reward, Some(0.0));
        // verl's flexible match keeps the comma: "1,200" is not "1200".
        let comma = run(json!({"answer": "1,200"}), truth.clone());
        assert_eq!(comma.text, "Current parsed answer='1,200' reward=0.0");
        assert_eq!(comma.reward, Some(-0.05));
        let wrong = run(json!({"answer": "#### 7"}), truth.clone());
        assert_eq!(wrong.text, "Current parsed answer='#### 7' reward=0.0");
        assert_eq!(wrong.reward, Some(-0.05));
        // No number: verl's scorer returns the int 0.
        let none = run(json!({"answer": "no idea"}), truth.clone());
        assert_eq!(none.text, "Current parsed answer='no idea' reward=0");
        // A number argument is read as its text; a missing one as "".
        assert_eq!(
            run(json!({"answer": 1200}), truth.clone()).text,
            "Current parsed answer='1200' reward=1.0"
        );
        assert_eq!(
            run(json!({}), truth.clone()).text,
            "Current parsed answer='' reward=0"
        );
        // Python's str() of null and booleans.
        let none = run(json!({"answer": null}), truth.clone());
        assert_eq!(none.text, "Current parsed answer='None' reward=0");
        let yes = run(json!({"answer": true}), truth);
        assert_eq!(yes.text, "Current parsed answer='True' reward=0");
        // Without the row's ground truth nothing scores.
        assert_eq!(run(json!({"answer": "5"}), Value::Null).reward, Some(-0.05));
    }

    #[test]
    fn answers_are_shown_with_pythons_repr() {
        assert_eq!(python_repr("it's"), "\"it's\"");
        assert_eq!(python_repr("a'b\"c"), "'a\\'b\"c'");
        assert_eq!(python_repr("x\ny\\"), "'x\\ny\\\\'");
    }

    #[test]
    fn a_config_schema_renames_it() {
        let tool = Gsm8kTool::with_schema(one_string_schema("check", "d", "answer", "a"));
        assert_eq!(tool.name(), "check");
        assert_eq!(Gsm8kTool::default().name(), GSM8K_TOOL_NAME);
    }
}

//! A calculator tool: integer and decimal arithmetic (`+ - * / % ^`, parentheses) on one
//! expression, evaluated by the `evalexpr` crate; the agent loop's example tool and the one
//! the built-in multi-turn task needs.

use async_trait::async_trait;
use serde_json::Value;
use verl_core::error::ToolError;
use verl_core::traits::tool::{one_string_schema, string_argument};
use verl_core::traits::{Tool, ToolOutput};

/// Evaluates `{"expression": "..."}` of at most 256 characters. Anything but arithmetic
/// (variables, assignments, strings, functions) is refused. Integers stay integers (`/` and `%`
/// truncate toward zero, as in Rust); a decimal point makes a float; `^` is a float power.
///
/// ```
/// use serde_json::json;
/// use verl_core::traits::Tool;
/// use verl_rollout::agent::Calculator;
/// let out = futures::executor::block_on(Calculator.call(&json!({"expression": "(12 + 30) * 2"})))?;
/// assert_eq!(out.text, "84");
/// # Ok::<(), verl_core::error::ToolError>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Calculator;

const NAME: &str = "calculator";
/// Longest expression evaluated.
const MAX_LEN: usize = 256;

impl Calculator {
    fn refuse(message: impl Into<String>) -> ToolError {
        ToolError::Arguments {
            tool: NAME.into(),
            message: message.into(),
        }
    }
}

#[async_trait(?Send)]
impl Tool for Calculator {
    fn name(&self) -> &str {
        NAME
    }

    fn schema(&self) -> Value {
        one_string_schema(
            NAME,
            "Evaluates an arithmetic expression (+ - * / % ^ and parentheses).",
            "expression",
            "for example (12 + 30) * 2",
        )
    }

    async fn call(&self, arguments: &Value) -> Result<ToolOutput, ToolError> {
        let expression = string_argument(NAME, arguments, "expression", "expression", "1 + 2")?;
        // Bounded: the evaluator parses and drops its tree recursively.
        if expression.len() > MAX_LEN {
            return Err(Self::refuse(format!(
                "the expression has {} characters; at most {MAX_LEN}",
                expression.len()
            )));
        }
        // Arithmetic only: no identifiers (variables, functions), assignments or strings.
        if let Some(c) = expression
            .chars()
            .find(|c| !(c.is_ascii_digit() || " \t+-*/%^().".contains(*c)))
        {
            return Err(Self::refuse(format!(
                "{c:?} is not arithmetic: use digits, + - * / % ^ and parentheses"
            )));
        }
        let value = evalexpr::eval(expression).map_err(|e| Self::refuse(e.to_string()))?;
        let text = match value {
            evalexpr::Value::Int(i) => i.to_string(),
            evalexpr::Value::Float(f) if f.is_finite() => f.to_string(),
            other => {
                return Err(Self::refuse(format!(
                    "the result {other} is not a finite number"
                )))
            }
        };
        Ok(ToolOutput::text(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use serde_json::json;

    fn calc(expression: &str) -> Result<String, ToolError> {
        block_on(Calculator.call(&json!({ "expression": expression }))).map(|o| o.text)
    }

    #[test]
    fn arithmetic_evaluates_and_anything_else_is_refused() {
        assert_eq!(
            calc("123456789 * 987").unwrap(),
            (123456789i64 * 987).to_string()
        );
        assert_eq!(calc("(7 - 10) % 4").unwrap(), "-3");
        assert_eq!(calc("7 / 2.0").unwrap(), "3.5");
        for bad in [
            "a = 3",
            "x + 1",
            "\"s\"",
            "1 / 0",
            "9223372036854775807 + 1",
            "(1 + ",
        ] {
            let e = calc(bad).unwrap_err().to_string();
            assert!(e.contains("calculator"), "{bad}: {e}");
        }
        let e = block_on(Calculator.call(&json!({"expr": "1"}))).unwrap_err();
        assert!(e.to_string().contains("\"expression\""), "{e}");
        assert_eq!(Calculator.schema()["function"]["name"], "calculator");
    }
}

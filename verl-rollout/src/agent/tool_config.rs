//! verl's tool config file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`): a YAML
//! `tools:` list of `class_name`, `config` and `tool_schema` entries, read into the tools this
//! crate implements natively.
//!
//! | `class_name` | tool |
//! |---|---|
//! | `verl.tools.gsm8k_tool.Gsm8kTool` | [`Gsm8kTool`] under the entry's schema |
//! | `verl_rs.tools.Calculator` | [`Calculator`] |
//! | `verl_rs.tools.PythonCode` | [`PythonCode`] (a local `python3`, not a sandbox) |
//!
//! Anything else is refused naming the class. That includes verl's sandbox, search, MCP and
//! image tools, which call services or Python code this process does not have. An entry
//! without `config.type` counts as native, and a GSM8K entry without `tool_schema` takes verl's
//! example schema; verl itself requires both.

use std::path::Path;

use serde_json::Value;
use verl_core::traits::Tool;

use super::agent_loop::ToolSet;
use super::{Calculator, Gsm8kTool, PythonCode};
use crate::error::RolloutError;

const FIELD: &str = "actor_rollout_ref.rollout.multi_turn.tool_config_path";

/// The class names read, for messages.
const KNOWN: &str =
    "verl.tools.gsm8k_tool.Gsm8kTool, verl_rs.tools.Calculator, verl_rs.tools.PythonCode";

#[derive(Debug, Clone)]
enum Entry {
    Gsm8k(Value),
    Calculator,
    PythonCode,
}

/// The tools of a verl tool config file, checked; [`Self::tools`] makes a fresh set (one per
/// rank's engine).
///
/// ```
/// use verl_rollout::agent::ToolConfig;
/// let config = ToolConfig::from_yaml(
///     "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n",
///     "tools.yaml",
/// )?;
/// assert!(config.tools().get("calc_gsm8k_reward").is_some());
/// # Ok::<(), verl_rollout::RolloutError>(())
/// ```
#[derive(Debug, Clone)]
pub struct ToolConfig {
    entries: Vec<Entry>,
}

impl ToolConfig {
    /// Reads and checks the file at `path`.
    pub fn from_file(path: &str) -> Result<Self, RolloutError> {
        let text =
            verl_core::files::read_text(Path::new(path)).map_err(|e| RolloutError::Config {
                field: FIELD,
                value: path.into(),
                message: format!("cannot be read ({e})"),
            })?;
        Self::from_yaml(&text, path)
    }

    /// Checks a file's text (`path` names it in errors).
    pub fn from_yaml(text: &str, path: &str) -> Result<Self, RolloutError> {
        let refuse = |message: String| RolloutError::Config {
            field: FIELD,
            value: path.into(),
            message,
        };
        let doc: Value =
            serde_yaml::from_str(text).map_err(|e| refuse(format!("is not YAML: {e}")))?;
        let list = doc.get("tools").and_then(Value::as_array).ok_or_else(|| {
            refuse(
                "has no `tools:` list (verl's layout: tools: [{class_name, config, tool_schema}])"
                    .into(),
            )
        })?;
        let mut entries = Vec::new();
        let mut names = Vec::new();
        for (i, item) in list.iter().enumerate() {
            let class = item
                .get("class_name")
                .and_then(Value::as_str)
                .ok_or_else(|| refuse(format!("tools[{i}] has no class_name")))?;
            match item
                .get("config")
                .and_then(|c| c.get("type"))
                .and_then(Value::as_str)
            {
                None | Some("native") => {}
                Some(other) => {
                    return Err(refuse(format!(
                        "tools[{i}] ({class}) has config.type {other}; only native tools are built"
                    )))
                }
            }
            let schema = item.get("tool_schema").filter(|s| !s.is_null()).cloned();
            if let Some(s) = &schema {
                if s["function"]["name"].as_str().is_none() {
                    return Err(refuse(format!(
                        "tools[{i}] ({class}): tool_schema.function.name is missing"
                    )));
                }
            }
            let entry = match class {
                "verl.tools.gsm8k_tool.Gsm8kTool" => {
                    Entry::Gsm8k(schema.unwrap_or_else(|| Gsm8kTool::default().schema()))
                }
                "verl_rs.tools.Calculator" | "verl_rs.tools.PythonCode" if schema.is_some() => {
                    return Err(refuse(format!(
                        "tools[{i}]: {class} has its own schema; remove tool_schema"
                    )))
                }
                "verl_rs.tools.Calculator" => Entry::Calculator,
                "verl_rs.tools.PythonCode" => Entry::PythonCode,
                "verl.tools.sandbox_fusion_tools.SandboxFusionTool" => {
                    return Err(refuse(format!(
                        "tools[{i}]: {class} runs code on a remote sandbox service, which is not \
                         built; verl_rs.tools.PythonCode runs it in a local python3 process (not a \
                         sandbox)"
                    )))
                }
                other => {
                    return Err(refuse(format!(
                        "tools[{i}]: {other} is not built; the classes read are {KNOWN}"
                    )))
                }
            };
            let name = Self::tool_of(&entry).name().to_string();
            if names.contains(&name) {
                return Err(refuse(format!("tools[{i}]: a second tool named {name}")));
            }
            names.push(name);
            entries.push(entry);
        }
        Ok(Self { entries })
    }

    fn tool_of(entry: &Entry) -> Box<dyn Tool> {
        match entry {
            Entry::Gsm8k(schema) => Box::new(Gsm8kTool::with_schema(schema.clone())),
            Entry::Calculator => Box::new(Calculator),
            Entry::PythonCode => Box::new(PythonCode::default()),
        }
    }

    /// A fresh set of the file's tools.
    pub fn tools(&self) -> ToolSet {
        self.entries
            .iter()
            .fold(ToolSet::new(), |set, e| set.with_boxed(Self::tool_of(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// verl's own file (examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml).
    const GSM8K: &str = r#"tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"#;

    fn refused(text: &str) -> String {
        match ToolConfig::from_yaml(text, "t.yaml") {
            Err(RolloutError::Config {
                field,
                value,
                message,
            }) => {
                assert_eq!((field, value.as_str()), (FIELD, "t.yaml"));
                message
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn verls_gsm8k_file_and_our_tools_are_read() {
        let tools = ToolConfig::from_yaml(GSM8K, "t.yaml").unwrap().tools();
        let tool = tools.get("calc_gsm8k_reward").unwrap();
        assert_eq!(
            tool.schema()["function"]["description"],
            "A tool for calculating the reward of gsm8k."
        );
        // A renamed schema renames the tool; our classes sit beside it.
        let text = GSM8K.replace("calc_gsm8k_reward", "check")
            + "  - class_name: verl_rs.tools.Calculator\n  - class_name: verl_rs.tools.PythonCode\n";
        let tools = ToolConfig::from_yaml(&text, "t.yaml").unwrap().tools();
        assert!(tools.get("check").is_some() && tools.get("calculator").is_some());
        assert!(tools.get("code_interpreter").is_some());
        assert_eq!(tools.schemas().len(), 3);
    }

    #[test]
    fn what_is_not_built_is_refused_by_class() {
        let sandbox = GSM8K.replace(
            "verl.tools.gsm8k_tool.Gsm8kTool",
            "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
        );
        assert!(refused(&sandbox).contains("remote sandbox"));
        let search = GSM8K.replace(
            "verl.tools.gsm8k_tool.Gsm8kTool",
            "verl.tools.search_tool.SearchTool",
        );
        let m = refused(&search);
        assert!(
            m.contains("SearchTool") && m.contains("verl_rs.tools.Calculator"),
            "{m}"
        );
        assert!(refused(&GSM8K.replace("type: native", "type: mcp")).contains("config.type mcp"));
        assert!(refused("tools: 3").contains("no `tools:` list"));
        assert!(refused("tools: [{config: {}}]").contains("tools[0] has no class_name"));
        assert!(refused(": :\n- [").contains("is not YAML"));
        let twice = "tools:\n  - class_name: verl_rs.tools.Calculator\n  - class_name: verl_rs.tools.Calculator\n";
        assert!(refused(twice).contains("a second tool named calculator"));
        let schema_given = format!("{GSM8K}  - class_name: verl_rs.tools.Calculator\n    tool_schema: {{type: function, function: {{name: calculator}}}}\n");
        assert!(refused(&schema_given).contains("has its own schema"));
        let nameless = GSM8K.replace("name: \"calc_gsm8k_reward\"", "title: x");
        assert!(refused(&nameless).contains("function.name"));
        match ToolConfig::from_file("/nonexistent/tools.yaml") {
            Err(e) => assert!(e.to_string().contains("cannot be read"), "{e}"),
            Ok(_) => panic!("read"),
        }
    }
}

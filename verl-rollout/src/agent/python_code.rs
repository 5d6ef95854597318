//! A Python code tool: the model's snippet runs in a fresh `python3 -I` process (isolated mode:
//! no user site-packages, no `PYTHON*` variables, the working directory not on `sys.path`),
//! with a time limit, and the model reads what it printed. It answers as verl's
//! `code_interpreter` tools do (their code goes to a sandbox service), under the same name
//! and argument.
//!
//! It is not a sandbox: the code runs as this process's user, with its files and network. Use
//! it where running the model's code is acceptable (a container, a throwaway machine).

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::{json, Value};
use verl_core::error::ToolError;
use verl_core::traits::{Tool, ToolOutput};

const NAME: &str = "code_interpreter";
/// Longest snippet run.
const MAX_CODE: usize = 16 * 1024;

/// Runs `{"code": "..."}` with `python3 -I` (`VERL_PYTHON` names another interpreter, as for
/// the reward functions) and answers with its standard output, then its standard error (a
/// traceback), cut to `max_output` characters; a run past `timeout` is killed and says so.
///
/// ```no_run
/// use serde_json::json;
/// use verl_core::traits::Tool;
/// use verl_rollout::agent::PythonCode;
/// let tool = PythonCode::default();
/// let out = futures::executor::block_on(tool.call(&json!({"code": "print(6 * 7)"})))?;
/// assert_eq!(out.text, "42\n");
/// # Ok::<(), verl_core::error::ToolError>(())
/// ```
#[derive(Debug, Clone)]
pub struct PythonCode {
    interpreter: String,
    timeout: Duration,
    max_output: usize,
}

impl Default for PythonCode {
    /// `VERL_PYTHON` or `python3`, 5 seconds, 4 096 characters.
    fn default() -> Self {
        Self {
            interpreter: std::env::var("VERL_PYTHON").unwrap_or_else(|_| "python3".into()),
            timeout: Duration::from_secs(5),
            max_output: 4096,
        }
    }
}

impl PythonCode {
    /// The time a run may take before it is killed.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The characters of output the model reads (the rest is cut).
    pub fn with_max_output(mut self, max_output: usize) -> Self {
        self.max_output = max_output;
        self
    }

    fn error(kind: fn(String, String) -> ToolError, message: impl Into<String>) -> ToolError {
        kind(NAME.into(), message.into())
    }

    /// Runs `code`: (stdout, stderr, timed out).
    fn run(&self, code: &str) -> Result<(String, String, bool), ToolError> {
        let failed = |message: String| {
            Self::error(|tool, message| ToolError::Failed { tool, message }, message)
        };
        let mut child = Command::new(&self.interpreter)
            .args(["-I", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                failed(format!(
                    "cannot start `{}` ({e}); install python3 or set VERL_PYTHON",
                    self.interpreter
                ))
            })?;
        // Each stream is read to its end on its own thread (a full pipe would stall the
        // child), keeping the first `max_output` bytes.
        let keep = self.max_output;
        let reader = |stream: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                if let Some(mut stream) = stream {
                    let mut buf = [0u8; 8192];
                    while let Ok(n) = stream.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let room = (keep + 1).saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                    }
                }
                String::from_utf8_lossy(&kept).into_owned()
            })
        };
        let stdout = reader(
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        );
        let stderr = reader(
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        );
        if let Some(mut stdin) = child.stdin.take() {
            // A child that exits without reading its input closes the pipe: not our error.
            let _ = stdin.write_all(code.as_bytes());
        }
        let deadline = Instant::now() + self.timeout;
        let timed_out = loop {
            match child.try_wait() {
                Ok(Some(_)) => break false,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break true;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => return Err(failed(format!("waiting for python: {e}"))),
            }
        };
        let join = |h: std::thread::JoinHandle<String>| h.join().unwrap_or_default();
        Ok((join(stdout), join(stderr), timed_out))
    }
}

#[async_trait(?Send)]
impl Tool for PythonCode {
    fn name(&self) -> &str {
        NAME
    }

    fn schema(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": NAME,
                "description": "Runs a Python 3 program and returns what it prints (use print).",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string", "description": "the program, e.g. print(2 ** 10)"}
                    },
                    "required": ["code"]
                }
            }
        })
    }

    async fn call(&self, arguments: &Value) -> Result<ToolOutput, ToolError> {
        let arguments_error = |message: String| {
            Self::error(
                |tool, message| ToolError::Arguments { tool, message },
                message,
            )
        };
        let code = arguments
            .get("code")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                arguments_error("give the program as a string: {\"code\": \"print(1 + 2)\"}".into())
            })?;
        if code.len() > MAX_CODE {
            return Err(arguments_error(format!(
                "the program has {} bytes; at most {MAX_CODE}",
                code.len()
            )));
        }
        let (stdout, stderr, timed_out) = self.run(code)?;
        let mut text = stdout;
        text.push_str(&stderr);
        if text.chars().count() > self.max_output {
            text = text.chars().take(self.max_output).collect();
            text.push_str("\n[output cut]");
        }
        if timed_out {
            text.push_str(&format!("\n[stopped after {:?}]", self.timeout));
        }
        Ok(ToolOutput::text(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tool: &PythonCode, code: &str) -> String {
        futures::executor::block_on(tool.call(&json!({ "code": code })))
            .unwrap()
            .text
    }

    // These need a `python3` (or VERL_PYTHON), as the reward-function tests do.
    #[test]
    fn prints_come_back_and_errors_come_back_as_tracebacks() {
        let tool = PythonCode::default();
        assert_eq!(run(&tool, "print(sum(range(10)))"), "45\n");
        let traceback = run(&tool, "print('before')\n1 / 0");
        assert!(traceback.starts_with("before\n"), "{traceback}");
        assert!(traceback.contains("ZeroDivisionError"), "{traceback}");
        // Isolated mode: PYTHONPATH and the working directory are not on the path.
        assert!(run(&tool, "import sys; print(sys.flags.isolated)").starts_with('1'));
    }

    #[test]
    fn long_runs_are_stopped_and_long_output_is_cut() {
        let tool = PythonCode::default()
            .with_timeout(Duration::from_millis(300))
            .with_max_output(100);
        let start = Instant::now();
        let out = run(&tool, "print('started', flush=True)\nwhile True: pass");
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            out.starts_with("started\n") && out.ends_with("[stopped after 300ms]"),
            "{out}"
        );
        // 1 MB of output (more than a pipe holds): read while it runs, cut to 100 characters.
        let out = run(&tool, "print('x' * 1_000_000)");
        assert_eq!(out, format!("{}\n[output cut]", "x".repeat(100)));
    }

    #[test]
    fn bad_arguments_and_a_missing_interpreter_are_errors() {
        let tool = PythonCode::default();
        let err = futures::executor::block_on(tool.call(&json!({"source": "print(1)"})));
        assert!(matches!(err, Err(ToolError::Arguments { .. })));
        let long = "#".repeat(MAX_CODE + 1);
        let err = futures::executor::block_on(tool.call(&json!({ "code": long })));
        assert!(matches!(err, Err(ToolError::Arguments { .. })));
        let missing = PythonCode {
            interpreter: "/nonexistent/python3".into(),
            ..PythonCode::default()
        };
        match futures::executor::block_on(missing.call(&json!({"code": "print(1)"}))) {
            Err(ToolError::Failed { message, .. }) => assert!(message.contains("VERL_PYTHON")),
            other => panic!("{other:?}"),
        }
    }
}

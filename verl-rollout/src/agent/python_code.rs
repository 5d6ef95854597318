//! A Python code tool: the model's snippet runs in a fresh `python3 -I -u` process (isolated
//! mode: the interpreter ignores `PYTHON*` variables and the user's site-packages and keeps the
//! working directory off `sys.path`; unbuffered, so what it printed before a timeout is kept),
//! in a process group of its own that is killed when the snippet ends or runs out of time, and
//! the model reads what it printed. It answers as verl's `code_interpreter` tools do (their code
//! goes to a sandbox service), under the same name and argument.
//!
//! It is not a sandbox: the code runs as this process's user, with its files, its network and
//! its environment (any secret in it included). Use it where running the model's code is
//! acceptable (a container, a throwaway machine). A call blocks its thread while the snippet
//! runs (the agent loop runs a trajectory's calls one after another).

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;
use verl_core::error::ToolError;
use verl_core::traits::tool::{one_string_schema, string_argument};
use verl_core::traits::{Tool, ToolOutput};

const NAME: &str = "code_interpreter";
/// Longest snippet run.
const MAX_CODE: usize = 16 * 1024;

/// Runs `{"code": "..."}` with `python3` (`VERL_PYTHON` names another interpreter, as for the
/// reward functions) and answers with its standard output, then its standard error (a
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

/// One output stream as read: its text and whether it was longer than kept.
type Captured = (String, bool);

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

    fn failed(message: String) -> ToolError {
        ToolError::Failed {
            tool: NAME.into(),
            message,
        }
    }

    fn bad_arguments(message: String) -> ToolError {
        ToolError::Arguments {
            tool: NAME.into(),
            message,
        }
    }

    /// A thread reading `stream` to its end (a full pipe would stall the child), keeping
    /// enough bytes for `max_output` characters of up to 4 bytes each.
    fn reader(&self, stream: Option<impl Read + Send + 'static>) -> JoinHandle<Captured> {
        let keep = 4 * self.max_output + 4;
        std::thread::spawn(move || {
            let (mut kept, mut longer) = (Vec::new(), false);
            if let Some(mut stream) = stream {
                let mut buf = [0u8; 8192];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let room = keep.saturating_sub(kept.len());
                    longer |= n > room;
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
            }
            (String::from_utf8_lossy(&kept).into_owned(), longer)
        })
    }

    /// Runs `code`: its stdout and stderr, and whether it ran out of time.
    fn run(&self, code: &str) -> Result<(Captured, Captured, bool), ToolError> {
        let mut command = Command::new(&self.interpreter);
        command
            .args(["-I", "-u", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Its own process group, so the processes the snippet starts end with it (one left
        // running would hold the output pipes open, and the readers with them).
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command.spawn().map_err(|e| {
            Self::failed(format!(
                "cannot start `{}` ({e}); install python3 or set VERL_PYTHON",
                self.interpreter
            ))
        })?;
        let stdout = self.reader(child.stdout.take());
        let stderr = self.reader(child.stderr.take());
        if let Some(mut stdin) = child.stdin.take() {
            // A child that exits without reading its input closes the pipe: not our error.
            let _ = stdin.write_all(code.as_bytes());
        }
        let deadline = Instant::now() + self.timeout;
        let timed_out = loop {
            match child.try_wait() {
                Ok(Some(_)) => break false,
                Ok(None) if Instant::now() >= deadline => break true,
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => {
                    kill_group(&mut child);
                    return Err(Self::failed(format!("waiting for python: {e}")));
                }
            }
        };
        // The snippet's process group ends with it, or with its time.
        kill_group(&mut child);
        let join = |h: JoinHandle<Captured>| h.join().unwrap_or_default();
        Ok((join(stdout), join(stderr), timed_out))
    }
}

/// Kills `child` and, on Unix, every process of the group it leads, then reaps it.
fn kill_group(child: &mut Child) {
    #[cfg(unix)]
    if let Ok(group) = libc::pid_t::try_from(child.id()) {
        // SAFETY: killpg only takes integers; the group is the one the child leads (spawned
        // with process_group(0)), and a group with no process left just returns an error.
        unsafe {
            libc::killpg(group, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[async_trait(?Send)]
impl Tool for PythonCode {
    fn name(&self) -> &str {
        NAME
    }

    fn schema(&self) -> Value {
        one_string_schema(
            NAME,
            "Runs a Python 3 program and returns what it prints (use print).",
            "code",
            "the program, e.g. print(2 ** 10)",
        )
    }

    async fn call(&self, arguments: &Value) -> Result<ToolOutput, ToolError> {
        let code = string_argument(NAME, arguments, "code", "program", "print(1 + 2)")?;
        if code.len() > MAX_CODE {
            return Err(Self::bad_arguments(format!(
                "the program has {} bytes; at most {MAX_CODE}",
                code.len()
            )));
        }
        let ((stdout, out_longer), (stderr, err_longer), timed_out) = self.run(code)?;
        let mut text = stdout;
        text.push_str(&stderr);
        if out_longer || err_longer || text.chars().count() > self.max_output {
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
    use serde_json::json;

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
        // Isolated mode: the working directory ('' for a program read from stdin) is not on
        // the path.
        assert_eq!(
            run(
                &tool,
                "import sys; print(sys.flags.isolated, '' in sys.path)"
            ),
            "1 False\n"
        );
    }

    #[test]
    fn long_runs_are_stopped_and_long_output_is_cut() {
        let tool = PythonCode::default()
            .with_timeout(Duration::from_secs(1))
            .with_max_output(100);
        let start = Instant::now();
        // A child that would outlive the snippet holding the pipes, a print (unbuffered, so
        // kept), then an endless loop: the group is killed and the call returns.
        let out = run(
            &tool,
            "import subprocess, sys\n\
             subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n\
             print('started')\n\
             while True: pass",
        );
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{:?}",
            start.elapsed()
        );
        assert!(
            out.starts_with("started\n") && out.ends_with("[stopped after 1s]"),
            "{out}"
        );
        // 1 MB of output (more than a pipe holds): read while it runs, cut to 100 characters.
        let out = run(&tool, "print('x' * 1_000_000)");
        assert_eq!(out, format!("{}\n[output cut]", "x".repeat(100)));
        // The limit counts characters: 300 three-byte characters are cut to 100 of them.
        let out = run(&tool, "print('\\u4e2d' * 300)");
        assert_eq!(out, format!("{}\n[output cut]", "\u{4e2d}".repeat(100)));
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

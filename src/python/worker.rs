//! One `python3` worker process: started with a script and its arguments, sent requests and
//! answered in frames, with a deadline per answer. A worker that dies or misses its deadline
//! is killed; the caller starts another.

use std::io::{BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

/// The interpreter: `VERL_PYTHON`, else `python3`.
pub(crate) fn interpreter() -> String {
    std::env::var("VERL_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A running worker.
pub(crate) struct Worker {
    child: Child,
    stdin: ChildStdin,
    /// Frames read from the worker's stdout by a reader thread (an error ends them).
    frames: mpsc::Receiver<Result<Value, String>>,
}

/// Why a worker gave no answer.
#[derive(Debug)]
pub(crate) enum WorkerFailure {
    /// It did not answer within the deadline (it is killed).
    Timeout(Duration),
    /// It exited or closed its output (its exit status).
    Lost(String),
}

impl std::fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout(d) => write!(f, "no answer within {} s", d.as_secs_f64()),
            Self::Lost(status) => write!(f, "the worker process ended ({status})"),
        }
    }
}

fn read_frame(out: &mut impl Read) -> Result<Value, String> {
    let mut head = [0u8; 4];
    out.read_exact(&mut head).map_err(|e| e.to_string())?;
    let mut body = vec![0u8; u32::from_le_bytes(head) as usize];
    out.read_exact(&mut body).map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| format!("a frame that is not JSON: {e}"))
}

impl Worker {
    /// Starts `python3 -c script args...`; its stderr is the trainer's (what the user's code
    /// prints shows up there).
    pub(crate) fn start(script: &str, args: &[&str]) -> Result<Self, String> {
        let python = interpreter();
        let mut child = Command::new(&python)
            .arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                format!(
                    "could not start `{python}` ({e}): install Python 3, or point VERL_PYTHON \
                     at an interpreter"
                )
            })?;
        let stdin = child.stdin.take().ok_or("the worker has no stdin")?;
        let stdout = child.stdout.take().ok_or("the worker has no stdout")?;
        let (tx, frames) = mpsc::channel();
        std::thread::spawn(move || {
            let mut out = BufReader::new(stdout);
            loop {
                let frame = read_frame(&mut out);
                let end = frame.is_err();
                if tx.send(frame).is_err() || end {
                    return;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            frames,
        })
    }

    /// The next frame the worker sends, waiting at most `deadline`.
    pub(crate) fn receive(&mut self, deadline: Duration) -> Result<Value, WorkerFailure> {
        match self.frames.recv_timeout(deadline) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self
                    .child
                    .wait()
                    .map_or_else(|e| e.to_string(), |s| s.to_string());
                Err(WorkerFailure::Lost(status))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Err(WorkerFailure::Timeout(deadline))
            }
        }
    }

    /// Sends `message` and waits at most `deadline` for the answer.
    pub(crate) fn ask(
        &mut self,
        message: &Value,
        deadline: Duration,
    ) -> Result<Value, WorkerFailure> {
        let body = serde_json::to_vec(message).expect("a JSON value serializes");
        let sent = (body.len() as u32)
            .to_le_bytes()
            .iter()
            .copied()
            .chain(body)
            .collect::<Vec<u8>>();
        if self
            .stdin
            .write_all(&sent)
            .and_then(|()| self.stdin.flush())
            .is_err()
        {
            let status = self
                .child
                .wait()
                .map_or_else(|e| e.to_string(), |s| s.to_string());
            return Err(WorkerFailure::Lost(status));
        }
        self.receive(deadline)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! Messages between the single controller (the driver process) and rank worker processes.
//!
//! One TCP connection per worker, read by one thread and written by any. Each message is one
//! frame (an 8-byte length, then a 4-byte header length, a JSON header with the message kind
//! and its small fields, then the payload bytes as they are: a `DataProto`'s
//! [`crate::DataProto::to_wire`] form, say), so a batch is never re-encoded as JSON. A closed
//! connection reads as `None`: how the driver sees a worker that died, and a worker sees a
//! driver that went away.
//!
//! ```
//! use verl_core::wire::{connect, split, Message};
//! let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
//! let addr = listener.local_addr()?.to_string();
//! let worker = std::thread::spawn(move || {
//!     let (mut rx, tx) = split(connect(&addr, std::time::Duration::from_secs(5))?)?;
//!     tx.send(Message::Hello { rank: 3, pid: 42 })?;
//!     rx.recv()
//! });
//! let (mut rx, tx) = split(listener.accept()?.0)?;
//! assert_eq!(rx.recv()?, Some(Message::Hello { rank: 3, pid: 42 }));
//! tx.send(Message::Shutdown)?;
//! assert_eq!(worker.join().unwrap()?, Some(Message::Shutdown));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::error::CommError;

/// The largest frame accepted: a batch of a few GB is legitimate, a length of 2^40 is garbage.
pub const MAX_FRAME_BYTES: usize = 16 << 30;

/// A message of the driver ↔ worker protocol.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Worker → driver, first on a new connection: which rank this is.
    Hello { rank: usize, pid: u32 },
    /// Driver → worker: run the registered method `method` on `payload`; the reply carries `id`.
    Call {
        id: u64,
        method: String,
        payload: Vec<u8>,
    },
    /// Worker → driver: the outcome of call `id`.
    Reply {
        id: u64,
        result: Result<Vec<u8>, RemoteError>,
    },
    /// Either way: stop now; `reason` says which rank failed and how (fail fast).
    Abort { reason: String },
    /// Driver → worker: the run is over; exit cleanly.
    Shutdown,
    /// Worker → driver, every second from a thread of its own: this process still runs (a
    /// stopped or frozen rank falls silent long before a collective's timeout).
    Heartbeat,
}

/// A failure on a worker, as the driver reports it: the rank, the method and the message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("rank {rank}, method `{method}`: {message}")]
pub struct RemoteError {
    pub rank: usize,
    pub method: String,
    pub message: String,
}

/// The JSON header of a frame (everything but the payload).
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Header {
    Hello { rank: usize, pid: u32 },
    Call { id: u64, method: String },
    Reply { id: u64, error: Option<RemoteError> },
    Abort { reason: String },
    Shutdown,
    Heartbeat,
}

fn wire_err(message: impl Into<String>) -> CommError {
    CommError::Transport(message.into())
}

impl Message {
    /// `[header length: u32 LE][header JSON][payload]`.
    fn encode(self) -> Result<Bytes, CommError> {
        let (header, payload) = match self {
            Message::Hello { rank, pid } => (Header::Hello { rank, pid }, Vec::new()),
            Message::Call {
                id,
                method,
                payload,
            } => (Header::Call { id, method }, payload),
            Message::Reply { id, result } => match result {
                Ok(payload) => (Header::Reply { id, error: None }, payload),
                Err(e) => (Header::Reply { id, error: Some(e) }, Vec::new()),
            },
            Message::Abort { reason } => (Header::Abort { reason }, Vec::new()),
            Message::Shutdown => (Header::Shutdown, Vec::new()),
            Message::Heartbeat => (Header::Heartbeat, Vec::new()),
        };
        let json = serde_json::to_vec(&header).map_err(|e| wire_err(e.to_string()))?;
        let mut out = BytesMut::with_capacity(4 + json.len() + payload.len());
        out.put_u32_le(json.len() as u32);
        out.put_slice(&json);
        out.put_slice(&payload);
        Ok(out.freeze())
    }

    fn decode(mut frame: BytesMut) -> Result<Self, CommError> {
        if frame.len() < 4 {
            return Err(wire_err(format!(
                "a frame of {} bytes has no header",
                frame.len()
            )));
        }
        let len = frame.get_u32_le() as usize;
        if len > frame.len() {
            return Err(wire_err(format!(
                "header of {len} bytes in a frame of {}",
                frame.len()
            )));
        }
        let json = frame.split_to(len);
        let header: Header = serde_json::from_slice(&json)
            .map_err(|e| wire_err(format!("unreadable frame header: {e}")))?;
        let payload = frame.to_vec();
        Ok(match header {
            Header::Hello { rank, pid } => Message::Hello { rank, pid },
            Header::Call { id, method } => Message::Call {
                id,
                method,
                payload,
            },
            Header::Reply { id, error } => Message::Reply {
                id,
                result: match error {
                    None => Ok(payload),
                    Some(e) => Err(e),
                },
            },
            Header::Abort { reason } => Message::Abort { reason },
            Header::Shutdown => Message::Shutdown,
            Header::Heartbeat => Message::Heartbeat,
        })
    }
}

/// Connects to `addr` (`host:port`), retrying while nothing listens there yet (the driver may
/// still be starting) until `timeout`.
pub fn connect(addr: &str, timeout: std::time::Duration) -> Result<TcpStream, CommError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            Err(e) => return Err(wire_err(format!("connecting to {addr}: {e}"))),
        }
    }
}

/// The sending half of a connection; shared by the threads that send on it.
pub struct WireWriter {
    stream: Mutex<BufWriter<TcpStream>>,
}

/// The receiving half of a connection, owned by the one thread that reads it.
pub struct WireReader {
    stream: BufReader<TcpStream>,
}

/// Splits a connected stream into its halves (Nagle off: calls are small and latency-bound).
pub fn split(stream: TcpStream) -> Result<(WireReader, WireWriter), CommError> {
    let _ = stream.set_nodelay(true);
    let reader = stream
        .try_clone()
        .map_err(|e| wire_err(format!("cloning a connection: {e}")))?;
    Ok((
        WireReader {
            stream: BufReader::with_capacity(1 << 20, reader),
        },
        WireWriter {
            stream: Mutex::new(BufWriter::with_capacity(1 << 20, stream)),
        },
    ))
}

impl WireWriter {
    /// Sends one message: `[frame length: u64 LE][frame]`.
    pub fn send(&self, message: Message) -> Result<(), CommError> {
        let frame = message.encode()?;
        let mut w = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        w.write_all(&(frame.len() as u64).to_le_bytes())
            .and_then(|()| w.write_all(&frame))
            .and_then(|()| w.flush())
            .map_err(|e| wire_err(format!("sending: {e}")))
    }

    /// Closes both directions: the peer's reader sees the end at once.
    pub fn close(&self) {
        let w = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
    }
}

impl WireReader {
    /// The next message, or `None` once the peer closed the connection (or died: a reset
    /// connection is the same to callers).
    pub fn recv(&mut self) -> Result<Option<Message>, CommError> {
        let mut len = [0u8; 8];
        match self.stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(wire_err(format!("receiving: {e}"))),
        }
        let len = u64::from_le_bytes(len) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(wire_err(format!(
                "a frame of {len} bytes (the limit is {MAX_FRAME_BYTES}): not a verl peer?"
            )));
        }
        // Grown as the bytes arrive: a garbled length prefix costs what the peer really sends,
        // not a buffer of the claimed size up front.
        let mut frame = Vec::with_capacity(len.min(1 << 20));
        let read = Read::by_ref(&mut self.stream)
            .take(len as u64)
            .read_to_end(&mut frame);
        match read {
            Ok(n) if n < len => Ok(None),
            Ok(_) => Message::decode(BytesMut::from(&frame[..])).map(Some),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(wire_err(format!("receiving: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn messages() -> impl Strategy<Value = Message> {
        let bytes = proptest::collection::vec(any::<u8>(), 0..300);
        prop_oneof![
            (any::<usize>(), any::<u32>()).prop_map(|(rank, pid)| Message::Hello { rank, pid }),
            (any::<u64>(), "[a-z_]{0,20}", bytes.clone()).prop_map(|(id, method, payload)| {
                Message::Call {
                    id,
                    method,
                    payload,
                }
            }),
            (any::<u64>(), bytes).prop_map(|(id, p)| Message::Reply { id, result: Ok(p) }),
            (any::<u64>(), any::<usize>(), ".{0,40}").prop_map(|(id, rank, message)| {
                Message::Reply {
                    id,
                    result: Err(RemoteError {
                        rank,
                        method: "update_actor".into(),
                        message,
                    }),
                }
            }),
            ".{0,40}".prop_map(|reason| Message::Abort { reason }),
            Just(Message::Shutdown),
            Just(Message::Heartbeat),
        ]
    }

    proptest! {
        // A fixed seed: the same cases on every run (the fuzz tests explore).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Every message decodes to itself (payload bytes untouched, errors kept).
        #[test]
        fn frames_round_trip(m in messages()) {
            let frame = BytesMut::from(&m.clone().encode().unwrap()[..]);
            prop_assert_eq!(Message::decode(frame).unwrap(), m);
        }
    }

    #[test]
    fn garbage_frames_are_refused_with_the_reason() {
        let short = Message::decode(BytesMut::from(&[1u8, 0][..])).unwrap_err();
        assert!(short.to_string().contains("no header"), "{short}");
        let mut frame = BytesMut::new();
        frame.put_u32_le(100);
        frame.put_slice(b"{}");
        assert!(Message::decode(frame).is_err());
        let mut frame = BytesMut::new();
        frame.put_u32_le(2);
        frame.put_slice(b"{}");
        let bad = Message::decode(frame).unwrap_err();
        assert!(bad.to_string().contains("header"), "{bad}");
    }

    /// A worker that goes away is seen as `None` by the driver, at once.
    #[test]
    fn a_closed_peer_reads_as_none() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let worker = std::thread::spawn(move || {
            let (_rx, tx) =
                split(connect(&addr, std::time::Duration::from_secs(5)).unwrap()).unwrap();
            tx.send(Message::Hello { rank: 1, pid: 7 }).unwrap();
            // Dropped here: the process "dies".
        });
        let (mut driver, _tx) = split(listener.accept().unwrap().0).unwrap();
        assert_eq!(
            driver.recv().unwrap(),
            Some(Message::Hello { rank: 1, pid: 7 })
        );
        worker.join().unwrap();
        let start = std::time::Instant::now();
        assert_eq!(driver.recv().unwrap(), None);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }
}

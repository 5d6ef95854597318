//! Messages between the single controller (the driver process) and rank worker processes.
//!
//! One TCP connection per worker. Each message is one length-delimited frame (tokio-util's
//! codec): a 4-byte header length, a JSON header (the message kind and its small fields), then
//! the payload bytes as they are (a `DataProto`'s [`crate::DataProto::to_wire`] form, say), so a
//! batch is never re-encoded as JSON. A closed connection reads as `None`: how the driver sees a
//! worker that died, and a worker sees a driver that went away.
//!
//! ```
//! use verl_core::wire::{Message, WireConnection};
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let worker = tokio::spawn(async move {
//!     let mut c = WireConnection::connect(&addr.to_string()).await?;
//!     c.send(Message::Hello { rank: 3, pid: 42 }).await?;
//!     c.recv().await
//! });
//! let mut driver = WireConnection::new(listener.accept().await?.0);
//! assert_eq!(driver.recv().await?, Some(Message::Hello { rank: 3, pid: 42 }));
//! driver.send(Message::Shutdown).await?;
//! assert_eq!(worker.await.unwrap()?, Some(Message::Shutdown));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::{SinkExt, StreamExt};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

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
        })
    }
}

/// One end of a driver ↔ worker connection.
pub struct WireConnection {
    framed: Framed<TcpStream, LengthDelimitedCodec>,
}

impl WireConnection {
    /// Over an accepted or connected stream (Nagle off: calls are small and latency-bound).
    pub fn new(stream: TcpStream) -> Self {
        let _ = stream.set_nodelay(true);
        let codec = LengthDelimitedCodec::builder()
            .max_frame_length(MAX_FRAME_BYTES)
            .new_codec();
        Self {
            framed: Framed::new(stream, codec),
        }
    }

    /// Connects to `addr` (`host:port`).
    pub async fn connect(addr: &str) -> Result<Self, CommError> {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| wire_err(format!("connecting to {addr}: {e}")))?;
        Ok(Self::new(stream))
    }

    pub async fn send(&mut self, message: Message) -> Result<(), CommError> {
        let frame = message.encode()?;
        self.framed
            .send(frame)
            .await
            .map_err(|e| wire_err(format!("sending: {e}")))
    }

    /// The next message, or `None` once the peer closed the connection (or died).
    pub async fn recv(&mut self) -> Result<Option<Message>, CommError> {
        match self.framed.next().await {
            None => Ok(None),
            Some(Ok(frame)) => Message::decode(frame).map(Some),
            // A reset connection is a peer that died mid-frame: the same as a close to callers.
            Some(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(None),
            Some(Err(e)) => Err(wire_err(format!("receiving: {e}"))),
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
        ]
    }

    proptest! {
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
    #[tokio::test(flavor = "current_thread")]
    async fn a_closed_peer_reads_as_none() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let worker = tokio::spawn(async move {
            let mut c = WireConnection::connect(&addr).await.unwrap();
            c.send(Message::Hello { rank: 1, pid: 7 }).await.unwrap();
            // Dropped here: the process "dies".
        });
        let mut driver = WireConnection::new(listener.accept().await.unwrap().0);
        assert_eq!(
            driver.recv().await.unwrap(),
            Some(Message::Hello { rank: 1, pid: 7 })
        );
        worker.await.unwrap();
        let start = std::time::Instant::now();
        assert_eq!(driver.recv().await.unwrap(), None);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }
}

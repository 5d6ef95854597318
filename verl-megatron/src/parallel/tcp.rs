//! [`TcpCommunicator`]: the ranks of a process group as separate processes (on one host or
//! many), exchanging host copies over TCP. It is the CPU backend's communicator for
//! `trainer.launcher=processes`, and works on any burn backend (through host copies) where
//! NCCL is not available. Reductions fold the ranks' values in rank order, as
//! [`super::LocalCommunicator`] does, so a layout gives bit-identical results as threads or
//! as processes.
//!
//! The group is a full mesh: rank `j` connects to every lower rank `i` (addresses found
//! through the job's [`Rendezvous`]). Each connection has a reader thread, which always drains
//! the socket into this rank's inbox (so two ranks sending each other large tensors never both
//! block on full socket buffers), and a writer thread fed by a queue. A closed connection marks
//! its peer gone: a rank waiting on it fails at once with an error naming the peer, rather than
//! after a timeout.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::prelude::*;
use verl_core::error::CommError;
use verl_core::traits::{comm_timeout, reduce_scatter_chunk, Communicator, ReduceOp};

use super::local::{device_tensor, equal_lengths, host, reduce_in_rank_order};
use super::Rendezvous;

/// Frame kinds on a connection: a collective's part (with its sequence number) or a
/// point-to-point message.
const COLLECTIVE: u8 = 0;
const POINT_TO_POINT: u8 = 1;

#[derive(Default)]
struct InboxState {
    /// Per peer: collective parts in arrival order, with their sequence numbers.
    collective: Vec<VecDeque<(u64, Vec<f32>)>>,
    /// Per peer: point-to-point messages in order.
    p2p: Vec<VecDeque<Vec<f32>>>,
    /// Per peer: why its connection ended, once it has.
    gone: Vec<Option<String>>,
}

struct Inbox {
    state: Mutex<InboxState>,
    changed: Condvar,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One rank's handle on a process group whose members are processes.
///
/// ```
/// use burn::prelude::*;
/// use verl_core::traits::{Communicator, ReduceOp};
/// use verl_megatron::parallel::{Rendezvous, TcpCommunicator};
/// type B = verl_core::backend::CpuBackend;
///
/// // Two members (threads here; processes in a job) meet through one rendezvous table.
/// let table = Rendezvous::serve("127.0.0.1:0").unwrap();
/// let addr = table.addr().to_string();
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let handles: Vec<_> = (0..2)
///         .map(|rank| {
///             let addr = addr.clone();
///             s.spawn(move || {
///                 let r = Rendezvous::client(&addr);
///                 let c = TcpCommunicator::connect(&r, "doc", rank, 2, "127.0.0.1").unwrap();
///                 let mine = Tensor::<B, 1>::from_floats([rank as f32 + 1.0], &Default::default());
///                 let sum = Communicator::<B>::all_reduce(&c, mine, ReduceOp::Sum).unwrap();
///                 sum.into_data().to_vec::<f32>().unwrap()
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(sums, vec![vec![3.0], vec![3.0]]);
/// ```
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    /// The group's name in errors (`tp`, `dp/1`, ...).
    name: String,
    /// Per peer (`None` for this rank): the queue of its writer thread.
    outboxes: Vec<Option<mpsc::Sender<Vec<u8>>>>,
    inbox: Arc<Inbox>,
    seq: AtomicU64,
    /// Closing these ends the peers' readers (and so tells the peers this rank left).
    streams: Vec<TcpStream>,
    writers: Vec<std::thread::JoinHandle<()>>,
    /// Each member's rank in the whole job (errors name both; the group's own by default).
    members: Vec<usize>,
}

/// The largest frame a peer may send: 16 GiB of f32 values (a whole 4B-parameter model).
const MAX_FRAME_BYTES: u64 = 16 << 30;

fn io_err(what: impl std::fmt::Display, e: std::io::Error) -> CommError {
    CommError::Transport(format!("{what}: {e}"))
}

fn frame(kind: u8, seq: u64, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(17 + 4 * values.len());
    out.push(kind);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Reads frames from `peer` into the inbox until the connection ends.
fn read_loop(stream: TcpStream, peer: usize, inbox: Arc<Inbox>) {
    let mut r = BufReader::with_capacity(1 << 20, stream);
    let why = loop {
        let mut head = [0u8; 17];
        if let Err(e) = r.read_exact(&mut head) {
            break format!("its connection closed ({e})");
        }
        let seq = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
        let n = u64::from_le_bytes(head[9..17].try_into().expect("8 bytes"));
        if head[0] != COLLECTIVE && head[0] != POINT_TO_POINT {
            break format!("it sent a frame of unknown kind {}", head[0]);
        }
        // The length is the peer's word: bounded, and the payload buffer grows only as its
        // bytes arrive, so a frame that lies about its length costs no more than it sends.
        let Some(len) = n.checked_mul(4).filter(|&b| b <= MAX_FRAME_BYTES) else {
            break format!(
                "it announced a frame of {n} values, over the {} GiB a frame may carry",
                MAX_FRAME_BYTES >> 30
            );
        };
        let mut bytes = Vec::new();
        match (&mut r).take(len).read_to_end(&mut bytes) {
            Ok(got) if got as u64 == len => {}
            Ok(got) => break format!("its connection closed mid-message ({got} of {len} bytes)"),
            Err(e) => break format!("its connection closed mid-message ({e})"),
        }
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let mut st = inbox.lock();
        // The kind was checked with the header: one of the two.
        if head[0] == COLLECTIVE {
            st.collective[peer].push_back((seq, values));
        } else {
            st.p2p[peer].push_back(values);
        }
        drop(st);
        inbox.changed.notify_all();
    };
    inbox.lock().gone[peer] = Some(why);
    inbox.changed.notify_all();
}

fn write_loop(stream: TcpStream, frames: mpsc::Receiver<Vec<u8>>) {
    let mut w = BufWriter::with_capacity(1 << 20, stream);
    while let Ok(f) = frames.recv() {
        if w.write_all(&f).is_err() {
            return;
        }
        // Flush when the queue is drained, so back-to-back frames share a write.
        if frames.try_iter().try_for_each(|f| w.write_all(&f)).is_err() || w.flush().is_err() {
            return;
        }
    }
}

impl TcpCommunicator {
    /// Joins group `key` as `rank` of `world` members: publishes this rank's listening address
    /// (`host`: an address the peers can reach this process on) through `rendezvous`, connects
    /// to every lower rank and accepts every higher one. Every member must call it with the
    /// same `key` and `world`.
    pub fn connect(
        rendezvous: &Rendezvous,
        key: &str,
        rank: usize,
        world: usize,
        host: &str,
    ) -> Result<Self, CommError> {
        if rank >= world {
            return Err(CommError::BadRank { rank, world });
        }
        let inbox = Arc::new(Inbox {
            state: Mutex::new(InboxState {
                collective: vec![VecDeque::new(); world],
                p2p: vec![VecDeque::new(); world],
                gone: vec![None; world],
            }),
            changed: Condvar::new(),
        });
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world > 1 {
            let listener = TcpListener::bind(format!("{host}:0"))
                .or_else(|_| TcpListener::bind("0.0.0.0:0"))
                .map_err(|e| io_err(format!("group {key}: listening on {host}"), e))?;
            let port = listener
                .local_addr()
                .map_err(|e| io_err(format!("group {key}"), e))?
                .port();
            rendezvous.publish(
                &format!("{key}/{rank}"),
                format!("{host}:{port}").as_bytes(),
            )?;
            for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
                let addr = String::from_utf8(rendezvous.get(&format!("{key}/{peer}"))?)
                    .map_err(|_| CommError::Transport(format!("group {key}: bad address")))?;
                let mut s = TcpStream::connect(&addr)
                    .map_err(|e| io_err(format!("group {key}: rank {rank} to {addr}"), e))?;
                s.write_all(&(rank as u64).to_le_bytes())
                    .map_err(|e| io_err(format!("group {key}"), e))?;
                *slot = Some(s);
            }
            for _ in rank + 1..world {
                let (mut s, _) = listener
                    .accept()
                    .map_err(|e| io_err(format!("group {key}: accepting"), e))?;
                let mut hello = [0u8; 8];
                s.read_exact(&mut hello)
                    .map_err(|e| io_err(format!("group {key}: a peer's hello"), e))?;
                let peer = u64::from_le_bytes(hello) as usize;
                if peer <= rank || peer >= world || peers[peer].is_some() {
                    return Err(CommError::Transport(format!(
                        "group {key}: rank {rank} got a connection from rank {peer}"
                    )));
                }
                peers[peer] = Some(s);
            }
        }
        let mut outboxes = Vec::with_capacity(world);
        let (mut streams, mut writers) = (Vec::new(), Vec::new());
        for (peer, s) in peers.into_iter().enumerate() {
            let Some(s) = s else {
                outboxes.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let clone =
                |s: &TcpStream| s.try_clone().map_err(|e| io_err(format!("group {key}"), e));
            let (reader, writer) = (clone(&s)?, clone(&s)?);
            let (tx, rx) = mpsc::channel();
            let inbox = inbox.clone();
            std::thread::Builder::new()
                .name(format!("verl-comm-{key}-r{peer}"))
                .spawn(move || read_loop(reader, peer, inbox))
                .map_err(|e| io_err("starting a reader", e))?;
            writers.push(
                std::thread::Builder::new()
                    .name(format!("verl-comm-{key}-w{peer}"))
                    .spawn(move || write_loop(writer, rx))
                    .map_err(|e| io_err("starting a writer", e))?,
            );
            outboxes.push(Some(tx));
            streams.push(s);
        }
        Ok(Self {
            rank,
            world,
            name: key.to_string(),
            outboxes,
            inbox,
            seq: AtomicU64::new(0),
            streams,
            writers,
            members: (0..world).collect(),
        })
    }

    /// Names each member by its rank in the whole job too (`members[r]` for group rank `r`), so
    /// that a timeout or a lost peer names the process to look at. Ignored unless it lists
    /// every member.
    pub fn with_members(mut self, members: Vec<usize>) -> Self {
        if members.len() == self.world {
            self.members = members;
        }
        self
    }

    /// Group rank `r`, with its rank in the job where that differs.
    fn who(&self, r: usize) -> String {
        match self.members.get(r) {
            Some(&job) if job != r => format!("rank {r} (job rank {job})"),
            _ => format!("rank {r}"),
        }
    }

    fn check_rank(&self, r: usize) -> Result<(), CommError> {
        if r >= self.world {
            return Err(CommError::BadRank {
                rank: r,
                world: self.world,
            });
        }
        Ok(())
    }

    fn post(&self, peer: usize, bytes: Vec<u8>) -> Result<(), CommError> {
        let sent = self.outboxes[peer].as_ref().map(|tx| tx.send(bytes));
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(CommError::PeerGone(format!(
                "group {}: {}'s connection is closed",
                self.name,
                self.who(peer)
            ))),
        }
    }

    /// Waits until `take` finds what it needs from `peer` in the inbox.
    fn wait<T>(
        &self,
        peer: usize,
        what: impl Fn() -> String,
        mut take: impl FnMut(&mut InboxState) -> Option<T>,
    ) -> Result<T, CommError> {
        let (start, timeout) = (Instant::now(), comm_timeout()?);
        let mut st = self.inbox.lock();
        loop {
            if let Some(v) = take(&mut st) {
                return Ok(v);
            }
            if let Some(why) = &st.gone[peer] {
                return Err(CommError::PeerGone(format!(
                    "group {}: {} left while {} waited for {}: {why}",
                    self.name,
                    self.who(peer),
                    self.who(self.rank),
                    what()
                )));
            }
            if start.elapsed() > timeout {
                return Err(CommError::PeerGone(format!(
                    "group {}: {} waited {timeout:?} for {}",
                    self.name,
                    self.who(self.rank),
                    what()
                )));
            }
            st = self
                .inbox
                .changed
                .wait_timeout(st, Duration::from_millis(200))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// One collective round: `outgoing(j)` goes to rank `j`; returns what each rank sent to
    /// this one (this rank's own part for itself).
    fn exchange(&self, outgoing: impl Fn(usize) -> Vec<f32>) -> Result<Vec<Vec<f32>>, CommError> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            self.post(peer, frame(COLLECTIVE, seq, &outgoing(peer)))?;
        }
        let mut parts = Vec::with_capacity(self.world);
        for peer in 0..self.world {
            if peer == self.rank {
                parts.push(outgoing(peer));
                continue;
            }
            let (got, part) = self.wait(
                peer,
                || format!("{}'s part of collective #{seq}", self.who(peer)),
                |st| st.collective[peer].pop_front(),
            )?;
            if got != seq {
                return Err(CommError::Transport(format!(
                    "group {}: rank {peer} sent collective #{got} while rank {} was in #{seq} \
                     (do all ranks make the same calls?)",
                    self.name, self.rank
                )));
            }
            parts.push(part);
        }
        Ok(parts)
    }
}

impl Drop for TcpCommunicator {
    fn drop(&mut self) {
        // Closing the queues ends the writers once they have sent what is queued (a message
        // sent just before leaving still arrives); shutting the sockets then tells the peers.
        self.outboxes.clear();
        for w in self.writers.drain(..) {
            let _ = w.join();
        }
        for s in &self.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn same_lengths(parts: &[Vec<f32>]) -> Result<usize, CommError> {
    equal_lengths(parts.iter().map(Vec::len).collect())
}

impl<B: Backend> Communicator<B> for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let device = tensor.device();
        let mine = host(tensor);
        let parts = self.exchange(|_| mine.clone())?;
        same_lengths(&parts)?;
        Ok(device_tensor(
            reduce_in_rank_order(parts.into_iter(), op, self.world),
            &device,
        ))
    }

    fn all_gather(&self, tensor: Tensor<B, 1>) -> Result<Vec<Tensor<B, 1>>, CommError> {
        let device = tensor.device();
        let mine = host(tensor);
        let parts = self.exchange(|_| mine.clone())?;
        same_lengths(&parts)?;
        Ok(parts
            .into_iter()
            .map(|p| device_tensor(p, &device))
            .collect())
    }

    fn reduce_scatter(
        &self,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let device = tensor.device();
        let mine = host(tensor);
        let chunk = reduce_scatter_chunk(mine.len(), self.world)?;
        // Each rank sends rank j only the chunk j reduces.
        let parts = self.exchange(|j| mine[j * chunk..(j + 1) * chunk].to_vec())?;
        same_lengths(&parts)?;
        Ok(device_tensor(
            reduce_in_rank_order(parts.into_iter(), op, self.world),
            &device,
        ))
    }

    fn broadcast(&self, tensor: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.check_rank(root)?;
        let device = tensor.device();
        let mine = if self.rank == root {
            host(tensor)
        } else {
            Vec::new()
        };
        let mut parts = self.exchange(|_| mine.clone())?;
        Ok(device_tensor(parts.swap_remove(root), &device))
    }

    fn send(&self, tensor: Tensor<B, 1>, dst: usize) -> Result<(), CommError> {
        self.check_rank(dst)?;
        if dst == self.rank {
            return Err(CommError::BadRank {
                rank: dst,
                world: self.world,
            });
        }
        self.post(dst, frame(POINT_TO_POINT, 0, &host(tensor)))
    }

    fn recv(&self, src: usize, len: usize, device: &B::Device) -> Result<Tensor<B, 1>, CommError> {
        self.check_rank(src)?;
        let v = self.wait(
            src,
            || format!("a message from {}", self.who(src)),
            |st| st.p2p[src].pop_front(),
        )?;
        if v.len() != len {
            return Err(CommError::Shape(format!(
                "rank {src} sent {} elements, rank {} expected {len}",
                v.len(),
                self.rank
            )));
        }
        Ok(device_tensor(v, device))
    }

    fn all_to_all(
        &self,
        chunks: Vec<Tensor<B, 1>>,
        recv_lens: &[usize],
    ) -> Result<Vec<Tensor<B, 1>>, CommError> {
        let n = self.world;
        if chunks.len() != n || recv_lens.len() != n {
            return Err(CommError::Shape(format!(
                "all-to-all needs one chunk per rank ({n}), got {}",
                chunks.len()
            )));
        }
        let device = chunks[0].device();
        let mine: Vec<Vec<f32>> = chunks.into_iter().map(host).collect();
        let parts = self.exchange(|j| mine[j].clone())?;
        parts
            .into_iter()
            .zip(recv_lens)
            .enumerate()
            .map(|(i, (p, &len))| {
                if p.len() != len {
                    return Err(CommError::Shape(format!(
                        "rank {i} sent {} elements to rank {}, which expected {len}",
                        p.len(),
                        self.rank
                    )));
                }
                Ok(device_tensor(p, &device))
            })
            .collect()
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.exchange(|_| Vec::new()).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn one_peer_inbox() -> Arc<Inbox> {
        Arc::new(Inbox {
            state: Mutex::new(InboxState {
                collective: vec![VecDeque::new()],
                p2p: vec![VecDeque::new()],
                gone: vec![None],
            }),
            changed: Condvar::new(),
        })
    }

    /// Runs `read_loop` for one peer whose side of the connection sends `bytes` and closes;
    /// returns why the loop says the peer is gone.
    fn gone_after(bytes: &[u8]) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let inbox = one_peer_inbox();
        client.write_all(bytes).unwrap();
        drop(client);
        read_loop(server, 0, inbox.clone());
        let why = inbox.lock().gone[0].clone();
        why.expect("the peer is marked gone")
    }

    proptest::proptest! {
        // Fuzzing with a fixed seed in CI (PROPTEST_CASES for a longer session).
        #![proptest_config(proptest::prelude::ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Whatever a peer sends — arbitrary bytes, or a well-formed frame header followed by
        /// anything — the reader never panics and ends naming why the peer is gone.
        #[test]
        fn any_bytes_from_a_peer_end_in_a_named_reason(
            kind in proptest::prelude::prop_oneof![
                proptest::strategy::Just(COLLECTIVE),
                proptest::strategy::Just(POINT_TO_POINT),
                proptest::prelude::any::<u8>(),
            ],
            seq in proptest::prelude::any::<u64>(),
            len in proptest::prelude::prop_oneof![0u64..8, proptest::prelude::any::<u64>()],
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            raw in proptest::prelude::any::<bool>(),
        ) {
            let bytes = if raw {
                tail
            } else {
                let mut b = vec![kind];
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
                b.extend_from_slice(&tail);
                b
            };
            let why = gone_after(&bytes);
            proptest::prop_assert!(!why.trim().is_empty());
        }
    }

    #[test]
    fn a_frame_announcing_more_than_it_sends_allocates_nothing_and_names_it() {
        // A header claiming 2^62 values: over the bound, refused before any allocation.
        let mut huge = vec![COLLECTIVE];
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&(1u64 << 62).to_le_bytes());
        let why = gone_after(&huge);
        assert!(why.contains("over the 16 GiB"), "{why}");
        // Within the bound but cut short: the buffer held only what arrived.
        let mut short = vec![POINT_TO_POINT];
        short.extend_from_slice(&0u64.to_le_bytes());
        short.extend_from_slice(&(1u64 << 30).to_le_bytes());
        short.extend_from_slice(&[0u8; 12]);
        let why = gone_after(&short);
        assert!(why.contains("mid-message (12 of"), "{why}");
        // An unknown kind is named before its length is read.
        let why = gone_after(&[9u8; 17]);
        assert!(why.contains("unknown kind 9"), "{why}");
    }

    /// A group's errors name a lost peer by its rank in the job too (the process to look at),
    /// not only by its place in the group.
    #[test]
    fn a_lost_peer_is_named_by_its_job_rank() {
        use crate::parallel::Rendezvous;
        use verl_core::traits::{Communicator, ReduceOp};
        type B = verl_core::backend::CpuBackend;
        let table = Rendezvous::serve("127.0.0.1:0").unwrap();
        let addr = table.addr().to_string();
        let err = std::thread::scope(|s| {
            let leaver = s.spawn(|| {
                let r = Rendezvous::client(&addr);
                let c = TcpCommunicator::connect(&r, "tp3", 1, 2, "127.0.0.1").unwrap();
                drop(c.with_members(vec![4, 6]));
            });
            let r = Rendezvous::client(&addr);
            let c = TcpCommunicator::connect(&r, "tp3", 0, 2, "127.0.0.1")
                .unwrap()
                .with_members(vec![4, 6]);
            leaver.join().unwrap();
            let mine = Tensor::<B, 1>::from_floats([1.0], &Default::default());
            Communicator::<B>::all_reduce(&c, mine, ReduceOp::Sum).unwrap_err()
        });
        let message = err.to_string();
        assert!(message.contains("rank 1 (job rank 6)"), "{message}");
    }

    #[test]
    fn a_whole_frame_arrives() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let inbox = one_peer_inbox();
        client
            .write_all(&frame(COLLECTIVE, 7, &[1.5, -2.0]))
            .unwrap();
        drop(client);
        read_loop(server, 0, inbox.clone());
        let st = inbox.lock();
        assert_eq!(st.collective[0].front(), Some(&(7, vec![1.5, -2.0])));
        assert!(st.gone[0].as_deref().unwrap_or("").contains("closed"));
    }
}

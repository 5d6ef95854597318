//! [`Rendezvous`]: how the processes of a multi-process job find each other, from the
//! launcher's environment ([`LaunchEnv`]: torchrun's or Slurm's).
//!
//! The job's rank 0 serves a small key → value table over TCP on `MASTER_ADDR:MASTER_PORT`; a
//! member publishes a value (an NCCL group's unique id, say) under a key and the others wait for
//! it. The protocol is one line per connection: `SET key hex` → `OK`, `GET key` → `hex` (or
//! `NONE` after the timeout). It knows nothing of CUDA, so it is tested on the CPU.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use verl_core::error::CommError;

use super::LaunchEnv;

/// How long a member waits for a key (and for rank 0 to start listening).
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// One process's view of the job's rendezvous.
///
/// ```
/// use verl_megatron::parallel::Rendezvous;
/// // A one-process job: rank 0 serves and reads its own table.
/// let r = Rendezvous::new(0, 1, 0, "127.0.0.1:0").unwrap();
/// r.publish("tp0", &[1, 2, 3]).unwrap();
/// assert_eq!(r.get("tp0").unwrap(), vec![1, 2, 3]);
/// ```
pub struct Rendezvous {
    /// This process's rank in the job and the job's size.
    pub rank: usize,
    pub world_size: usize,
    /// The process's rank on its node (its GPU).
    pub local_rank: usize,
    /// Where rank 0 serves (for rank 0 itself, the address actually bound).
    addr: String,
    /// Rank 0 keeps its table in process.
    table: Option<Arc<Table>>,
    timeout: Duration,
}

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    added: Condvar,
}

impl Table {
    fn put(&self, key: String, value: Vec<u8>) {
        self.values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, value);
        self.added.notify_all();
    }

    fn get(&self, key: &str, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut values = self.values.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = values.get(key) {
                return Some(v.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            values = self
                .added
                .wait_timeout(values, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) || s == "NONE" {
        return None;
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

impl Rendezvous {
    /// From the launcher's environment ([`LaunchEnv`]: torchrun's `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, or Slurm's under `srun`). Rank 0 starts
    /// serving here.
    pub fn from_env() -> Result<Self, CommError> {
        let env = LaunchEnv::from_env()?.ok_or_else(|| {
            CommError::Backend(
                "no launcher environment: a multi-process job needs RANK, WORLD_SIZE, \
                 MASTER_ADDR and MASTER_PORT (as torchrun sets them) or srun's SLURM_* \
                 variables"
                    .into(),
            )
        })?;
        Self::new(env.rank, env.world_size, env.local_rank, &env.master)
    }

    /// As [`Self::from_env`] with explicit values. Rank 0 binds `addr` (port 0 picks a free
    /// one: [`Self::addr`] tells which).
    pub fn new(
        rank: usize,
        world_size: usize,
        local_rank: usize,
        addr: &str,
    ) -> Result<Self, CommError> {
        if rank >= world_size {
            return Err(CommError::BadRank {
                rank,
                world: world_size,
            });
        }
        let (table, addr) = if rank == 0 {
            let table = Arc::new(Table::default());
            let listener = TcpListener::bind(addr)
                .map_err(|e| CommError::Backend(format!("rendezvous on {addr}: {e}")))?;
            let bound = listener
                .local_addr()
                .map_err(|e| CommError::Backend(format!("rendezvous on {addr}: {e}")))?;
            let served = table.clone();
            std::thread::spawn(move || serve(listener, served));
            (Some(table), bound.to_string())
        } else {
            (None, addr.to_string())
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            addr,
            table,
            timeout: RENDEZVOUS_TIMEOUT,
        })
    }

    /// Serves a job's table on `addr` from this process (the driver of
    /// `trainer.launcher=processes`, which is none of the ranks); port 0 picks a free port.
    pub fn serve(addr: &str) -> Result<Self, CommError> {
        Self::new(0, 1, 0, addr)
    }

    /// A member of a job whose table another process serves on `addr`.
    pub fn client(addr: &str) -> Self {
        Self {
            rank: 1,
            world_size: 2,
            local_rank: 0,
            addr: addr.to_string(),
            table: None,
            timeout: RENDEZVOUS_TIMEOUT,
        }
    }

    /// How long [`Self::get`] waits (default [`RENDEZVOUS_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The address rank 0 serves on.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Publishes `value` under `key` for the other members.
    pub fn publish(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        check_key(key)?;
        match &self.table {
            Some(t) => {
                t.put(key.to_string(), value.to_vec());
                Ok(())
            }
            None => self
                .request(&format!("SET {key} {}\n", to_hex(value)))
                .map(|_| ()),
        }
    }

    /// The value of `key`, waiting until a member publishes it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        check_key(key)?;
        let got = match &self.table {
            Some(t) => t.get(key, self.timeout),
            None => from_hex(&self.request(&format!("GET {key}\n"))?),
        };
        got.ok_or_else(|| {
            CommError::PeerGone(format!(
                "nothing published under `{key}` within {}s: is every rank of the job running?",
                self.timeout.as_secs()
            ))
        })
    }

    fn request(&self, line: &str) -> Result<String, CommError> {
        let io =
            |e: std::io::Error| CommError::Backend(format!("rendezvous with {}: {e}", self.addr));
        // A name that does not resolve is a setting to fix, not a rank still starting: it
        // is retried briefly (a resolver may lag at a job's start), then named.
        let resolve_until = Instant::now() + self.timeout.min(RESOLVE_GRACE);
        loop {
            match self.addr.to_socket_addrs().map(|mut a| a.next()) {
                Ok(Some(_)) => break,
                failed if Instant::now() >= resolve_until => {
                    let why = match failed {
                        Err(e) => e.to_string(),
                        _ => "no address".into(),
                    };
                    return Err(CommError::Backend(format!(
                        "rendezvous address `{}` does not resolve ({why}); set MASTER_ADDR to \
                         rank 0's host name or IP and MASTER_PORT to a free port",
                        self.addr
                    )));
                }
                _ => std::thread::sleep(Duration::from_millis(200)),
            }
        }
        // Rank 0 may still be starting: retry the connection for a while.
        let deadline = Instant::now() + self.timeout;
        let mut stream = loop {
            match TcpStream::connect(&self.addr) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(io(e)),
            }
        };
        stream.write_all(line.as_bytes()).map_err(io)?;
        let mut reply = String::new();
        BufReader::new(stream)
            .take(MAX_LINE)
            .read_line(&mut reply)
            .map_err(io)?;
        Ok(reply)
    }
}

fn check_key(key: &str) -> Result<(), CommError> {
    if key.is_empty() || key.contains(char::is_whitespace) {
        return Err(CommError::Backend(format!(
            "rendezvous key `{key}`: must be non-empty with no spaces"
        )));
    }
    Ok(())
}

/// How long an address that does not resolve is retried before it is reported.
const RESOLVE_GRACE: Duration = Duration::from_secs(10);

/// The longest request or reply line: the table holds group ids (a few hundred bytes).
const MAX_LINE: u64 = 1 << 20;

/// Rank 0's server: one thread per connection.
fn serve(listener: TcpListener, table: Arc<Table>) {
    for conn in listener.incoming().flatten() {
        let table = table.clone();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(match conn.try_clone() {
                Ok(c) => c,
                Err(_) => return,
            });
            // Bounded: a peer (or anything else that connects) cannot grow this line without
            // end; a longer one is cut and answered ERR (no newline ends it).
            let mut line = String::new();
            if (&mut reader).take(MAX_LINE).read_line(&mut line).is_err() {
                return;
            }
            if !line.ends_with('\n') && line.len() as u64 == MAX_LINE {
                let mut conn = conn;
                let _ = conn.write_all(b"ERR\n");
                return;
            }
            let reply = answer(&line, &table, RENDEZVOUS_TIMEOUT);
            let mut conn = conn;
            let _ = conn.write_all(format!("{reply}\n").as_bytes());
        });
    }
}

/// The reply to one request line: `SET key hex` stores (`OK`, or `ERR` for bad hex), `GET key`
/// waits up to `timeout` for the key (its value in hex, or `NONE`), anything else is `ERR`.
fn answer(line: &str, table: &Table, timeout: Duration) -> String {
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next(), parts.next()) {
        (Some("SET"), Some(key), Some(hex)) => match from_hex(hex) {
            Some(v) => {
                table.put(key.to_string(), v);
                "OK".to_string()
            }
            None => "ERR".to_string(),
        },
        (Some("GET"), Some(key), None) => table
            .get(key, timeout)
            .map_or("NONE".to_string(), |v| to_hex(&v)),
        _ => "ERR".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // Fuzzing with a fixed seed in CI (PROPTEST_CASES for a longer session).
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
            ..ProptestConfig::default()
        })]

        /// Any request line gets one of the four replies and never a panic; what a SET stored
        /// a GET of the same key returns.
        #[test]
        fn any_request_line_gets_a_reply(line in prop_oneof![
            ".{0,80}",
            "(SET|GET) [a-z0-9.]{0,8}( [0-9a-fA-Fz]{0,12})?( x)?\\n?",
        ]) {
            let table = Table::default();
            let reply = answer(&line, &table, Duration::ZERO);
            let is_hex = !reply.is_empty()
                && reply.len().is_multiple_of(2)
                && reply.bytes().all(|b| b.is_ascii_hexdigit());
            prop_assert!(
                ["OK", "ERR", "NONE"].contains(&reply.as_str()) || is_hex,
                "{line:?} -> {reply:?}"
            );
            let mut parts = line.split_whitespace();
            if let (Some("SET"), Some(key), Some(hex), "OK") =
                (parts.next(), parts.next(), parts.next(), reply.as_str())
            {
                let back = answer(&format!("GET {key}"), &table, Duration::ZERO);
                prop_assert_eq!(back.to_ascii_lowercase(), hex.to_ascii_lowercase());
            }
        }
    }

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&bytes)).unwrap(), bytes);
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("NONE"), None);
        assert_eq!(from_hex("zz"), None);
    }

    #[test]
    fn three_processes_exchange_ids_through_rank_0() {
        let root = Rendezvous::new(0, 3, 0, "127.0.0.1:0").unwrap();
        let addr = root.addr().to_string();
        let id: Vec<u8> = (0..128).map(|i| (i * 7 % 256) as u8).collect();
        std::thread::scope(|s| {
            // Rank 2 asks before anyone has published: it waits.
            let early = s.spawn(|| {
                let r = Rendezvous::new(2, 3, 0, &addr).unwrap();
                (r.get("tp0").unwrap(), r.get("dp1").unwrap())
            });
            let r1 = Rendezvous::new(1, 3, 1, &addr).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            r1.publish("dp1", &[9, 9]).unwrap();
            root.publish("tp0", &id).unwrap();
            assert_eq!(r1.get("tp0").unwrap(), id);
            assert_eq!(root.get("dp1").unwrap(), vec![9, 9]);
            assert_eq!(early.join().unwrap(), (id.clone(), vec![9, 9]));
        });
    }

    /// A request line past the bound is cut and answered ERR; the table still serves the
    /// next request.
    #[test]
    fn an_endless_request_line_is_cut_and_refused() {
        use std::io::Write;
        let root = Rendezvous::new(0, 2, 0, "127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(root.addr()).unwrap();
        // A line longer than the bound, and no newline.
        let chunk = vec![b'a'; 1 << 16];
        for _ in 0..(MAX_LINE >> 16) + 1 {
            if s.write_all(&chunk).is_err() {
                break;
            }
        }
        let mut reply = String::new();
        BufReader::new(s).read_line(&mut reply).unwrap();
        assert_eq!(reply, "ERR\n");
        root.publish("ok", &[1, 2]).unwrap();
        assert_eq!(root.get("ok").unwrap(), vec![1, 2]);
    }

    #[test]
    fn a_missing_key_times_out_with_a_clear_error() {
        let root = Rendezvous::new(0, 2, 0, "127.0.0.1:0")
            .unwrap()
            .with_timeout(Duration::from_millis(50));
        let e = root.get("pp0").unwrap_err().to_string();
        assert!(e.contains("`pp0`") && e.contains("every rank"), "{e}");
        assert!(Rendezvous::new(2, 2, 0, "127.0.0.1:0").is_err());
        assert!(root.publish("has space", &[1]).is_err());
    }

    /// An address that does not resolve (`.invalid` never does) is reported by name after
    /// at most the resolver grace, not retried for the whole rendezvous timeout as a rank 0
    /// still starting is.
    #[test]
    fn an_address_that_does_not_resolve_is_named() {
        let member = Rendezvous::client("no-such-host.invalid:29500")
            .with_timeout(Duration::from_millis(300));
        let e = member.get("x").unwrap_err().to_string();
        assert!(
            e.contains("no-such-host.invalid:29500") && e.contains("does not resolve"),
            "{e}"
        );
        assert!(e.contains("MASTER_ADDR"), "{e}");
    }
}

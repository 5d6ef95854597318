//! [`LocalCommunicator`]: the ranks of a process group as threads of one process, exchanging
//! host copies through a shared hub. It is what CI proves every parallel layout with; results
//! are bit-identical on every rank (reductions run in rank order on each).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn::tensor::TensorData;
use verl_core::error::CommError;
use verl_core::traits::{comm_timeout, reduce_scatter_chunk, Communicator, ReduceOp};

type Payload = Arc<Vec<Vec<f32>>>;

#[derive(Default)]
struct HubState {
    /// Collective rounds in flight, by sequence number: each rank's payload.
    rounds: HashMap<u64, (Vec<Option<Payload>>, usize)>,
    /// Point-to-point messages by (source, destination), in order.
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
    /// Ranks whose handle was dropped (their thread ended or panicked).
    gone: Vec<bool>,
    /// Set by a rank that failed ([`Communicator::abort`]): why, naming it and its method.
    aborted: Option<String>,
}

struct Hub {
    world: usize,
    state: Mutex<HubState>,
    changed: Condvar,
}

/// One rank's handle on an in-process group. Build a group with [`LocalCommunicator::group`]
/// and move each handle to its rank's thread.
///
/// ```
/// use burn::prelude::*;
/// use verl_core::traits::{comm_timeout, reduce_scatter_chunk, Communicator, ReduceOp};
/// use verl_megatron::parallel::LocalCommunicator;
/// type B = verl_core::backend::CpuBackend;
///
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let handles: Vec<_> = LocalCommunicator::group(2)
///         .into_iter()
///         .map(|c| s.spawn(move || {
///             let rank = Communicator::<B>::rank(&c) as f32;
///             let mine = Tensor::<B, 1>::from_floats([rank + 1.0, 10.0], &Default::default());
///             let sum = Communicator::<B>::all_reduce(&c, mine, ReduceOp::Sum).unwrap();
///             sum.into_data().to_vec::<f32>().unwrap()
///         }))
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(sums, vec![vec![3.0, 20.0], vec![3.0, 20.0]]);
/// ```
pub struct LocalCommunicator {
    hub: Arc<Hub>,
    rank: usize,
    /// This rank's collective calls so far; every rank makes the same calls in order.
    seq: AtomicU64,
}

impl LocalCommunicator {
    /// The `world` handles of a new group, rank 0 first.
    pub fn group(world: usize) -> Vec<LocalCommunicator> {
        let hub = Arc::new(Hub {
            world,
            state: Mutex::new(HubState {
                gone: vec![false; world],
                ..Default::default()
            }),
            changed: Condvar::new(),
        });
        (0..world)
            .map(|rank| LocalCommunicator {
                hub: hub.clone(),
                rank,
                seq: AtomicU64::new(0),
            })
            .collect()
    }

    fn lock(&self) -> Result<MutexGuard<'_, HubState>, CommError> {
        self.hub
            .state
            .lock()
            .map_err(|_| CommError::PeerGone("a rank panicked inside a collective".into()))
    }

    /// Waits on the hub until `ready` answers (a value, or a departed peer's error), at most the
    /// peer timeout (then the error names `waiting_for`); returns the answer and the lock.
    fn wait_for<'a, T>(
        &'a self,
        mut st: MutexGuard<'a, HubState>,
        waiting_for: impl Fn() -> String,
        mut ready: impl FnMut(&mut HubState) -> Option<Result<T, CommError>>,
    ) -> Result<(T, MutexGuard<'a, HubState>), CommError> {
        // A rank waiting longer than the timeout reports its peers gone rather than hanging.
        let (start, timeout) = (Instant::now(), comm_timeout()?);
        loop {
            if let Some(why) = &st.aborted {
                return Err(CommError::Aborted(why.clone()));
            }
            if let Some(answer) = ready(&mut st) {
                return answer.map(|v| (v, st));
            }
            if start.elapsed() > timeout {
                return Err(CommError::PeerGone(format!(
                    "waited {timeout:?} for {}",
                    waiting_for()
                )));
            }
            st = self
                .hub
                .changed
                .wait_timeout(st, Duration::from_millis(200))
                .map_err(|_| CommError::PeerGone("a rank panicked".into()))?
                .0;
        }
    }

    /// Deposits this rank's payload for the next collective and returns every rank's.
    fn exchange(&self, payload: Vec<Vec<f32>>) -> Result<Vec<Payload>, CommError> {
        let n = self.hub.world;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let mut st = self.lock()?;
        st.rounds.entry(seq).or_insert_with(|| (vec![None; n], 0)).0[self.rank] =
            Some(Arc::new(payload));
        self.hub.changed.notify_all();
        let ((), mut st) = self.wait_for(
            st,
            || format!("the other ranks in collective #{seq} (do all ranks make the same calls?)"),
            |st| {
                let (slots, _) = &st.rounds[&seq];
                if slots.iter().all(Option::is_some) {
                    return Some(Ok(()));
                }
                (0..n).find(|&r| slots[r].is_none() && st.gone[r]).map(|r| {
                    Err(CommError::PeerGone(format!(
                        "rank {r} left before collective #{seq}"
                    )))
                })
            },
        )?;
        let round = st.rounds.get_mut(&seq).expect("round present");
        let all: Vec<Payload> = round.0.iter().map(|p| p.clone().expect("full")).collect();
        round.1 += 1;
        if round.1 == n {
            st.rounds.remove(&seq);
        }
        Ok(all)
    }

    fn check_rank(&self, r: usize) -> Result<(), CommError> {
        if r >= self.hub.world {
            return Err(CommError::BadRank {
                rank: r,
                world: self.hub.world,
            });
        }
        Ok(())
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        if let Ok(mut st) = self.hub.state.lock() {
            st.gone[self.rank] = true;
        }
        self.hub.changed.notify_all();
    }
}

/// The element-wise reduction of the ranks' values, folded in rank order (so every rank, and
/// every communicator that folds this way, gets bit-identical results).
pub(super) fn reduce_in_rank_order(
    parts: impl Iterator<Item = Vec<f32>>,
    op: ReduceOp,
    world: usize,
) -> Vec<f32> {
    let mut out: Option<Vec<f32>> = None;
    for p in parts {
        out = Some(match out {
            None => p,
            Some(mut acc) => {
                for (a, b) in acc.iter_mut().zip(p) {
                    *a = match op {
                        ReduceOp::Max => a.max(b),
                        _ => *a + b,
                    };
                }
                acc
            }
        });
    }
    let mut out = out.unwrap_or_default();
    if op == ReduceOp::Avg {
        out.iter_mut().for_each(|v| *v /= world as f32);
    }
    out
}

pub(super) fn host<B: Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 data")
}

pub(super) fn device_tensor<B: Backend>(v: Vec<f32>, device: &B::Device) -> Tensor<B, 1> {
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), device)
}

fn same_lengths(all: &[Payload]) -> Result<usize, CommError> {
    equal_lengths(all.iter().map(|p| p[0].len()).collect())
}

/// The ranks' common length, or the error naming every rank's when they differ.
pub(super) fn equal_lengths(lens: Vec<usize>) -> Result<usize, CommError> {
    let len = lens[0];
    if lens.iter().any(|&l| l != len) {
        return Err(CommError::Shape(format!("lengths by rank {lens:?}")));
    }
    Ok(len)
}

impl<B: Backend> Communicator<B> for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.hub.world
    }

    fn all_reduce(&self, tensor: Tensor<B, 1>, op: ReduceOp) -> Result<Tensor<B, 1>, CommError> {
        let device = tensor.device();
        let all = self.exchange(vec![host(tensor)])?;
        same_lengths(&all)?;
        let out = reduce_in_rank_order(all.iter().map(|p| p[0].clone()), op, self.hub.world);
        Ok(device_tensor(out, &device))
    }

    fn all_gather(&self, tensor: Tensor<B, 1>) -> Result<Vec<Tensor<B, 1>>, CommError> {
        let device = tensor.device();
        let all = self.exchange(vec![host(tensor)])?;
        same_lengths(&all)?;
        Ok(all
            .iter()
            .map(|p| device_tensor(p[0].clone(), &device))
            .collect())
    }

    fn reduce_scatter(
        &self,
        tensor: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let device = tensor.device();
        let n = self.hub.world;
        let all = self.exchange(vec![host(tensor)])?;
        let chunk = reduce_scatter_chunk(same_lengths(&all)?, n)?;
        let range = self.rank * chunk..(self.rank + 1) * chunk;
        let out = reduce_in_rank_order(all.iter().map(|p| p[0][range.clone()].to_vec()), op, n);
        Ok(device_tensor(out, &device))
    }

    fn broadcast(&self, tensor: Tensor<B, 1>, root: usize) -> Result<Tensor<B, 1>, CommError> {
        self.check_rank(root)?;
        let device = tensor.device();
        let mine = if self.rank == root {
            host(tensor)
        } else {
            Vec::new()
        };
        let all = self.exchange(vec![mine])?;
        Ok(device_tensor(all[root][0].clone(), &device))
    }

    fn send(&self, tensor: Tensor<B, 1>, dst: usize) -> Result<(), CommError> {
        self.check_rank(dst)?;
        let data = host(tensor);
        let mut st = self.lock()?;
        st.mail.entry((self.rank, dst)).or_default().push_back(data);
        self.hub.changed.notify_all();
        Ok(())
    }

    fn recv(&self, src: usize, len: usize, device: &B::Device) -> Result<Tensor<B, 1>, CommError> {
        self.check_rank(src)?;
        let st = self.lock()?;
        let me = self.rank;
        let (v, st) = self.wait_for(
            st,
            || format!("rank {src} to send"),
            |st| {
                if let Some(v) = st.mail.get_mut(&(src, me)).and_then(VecDeque::pop_front) {
                    return Some(Ok(v));
                }
                st.gone[src].then(|| {
                    Err(CommError::PeerGone(format!(
                        "rank {src} left without sending"
                    )))
                })
            },
        )?;
        drop(st);
        if v.len() != len {
            return Err(CommError::Shape(format!(
                "rank {src} sent {} elements, rank {me} expected {len}",
                v.len()
            )));
        }
        Ok(device_tensor(v, device))
    }

    fn all_to_all(
        &self,
        chunks: Vec<Tensor<B, 1>>,
        recv_lens: &[usize],
    ) -> Result<Vec<Tensor<B, 1>>, CommError> {
        let n = self.hub.world;
        if chunks.len() != n || recv_lens.len() != n {
            return Err(CommError::Shape(format!(
                "all-to-all needs one chunk per rank ({n}), got {}",
                chunks.len()
            )));
        }
        let device = chunks[0].device();
        let all = self.exchange(chunks.into_iter().map(host).collect())?;
        all.iter()
            .zip(recv_lens)
            .enumerate()
            .map(|(i, (p, &len))| {
                let chunk = &p[self.rank];
                if chunk.len() != len {
                    return Err(CommError::Shape(format!(
                        "rank {i} sent {} elements to rank {}, which expected {len}",
                        chunk.len(),
                        self.rank
                    )));
                }
                Ok(device_tensor(chunk.clone(), &device))
            })
            .collect()
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.exchange(vec![Vec::new()]).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        if let Ok(mut st) = self.hub.state.lock() {
            st.aborted.get_or_insert_with(|| reason.to_string());
        }
        self.hub.changed.notify_all();
    }
}

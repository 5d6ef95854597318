//! The single controller's handle on its rank workers, and the two ways ranks run.
//!
//! A [`Worker`] holds a role (actor, critic, rollout, ...) on one rank. A [`WorkerGroup`] runs
//! a role's ranks as threads of this process and calls closures on them; a [`MethodTable`]
//! names a role's methods so that a [`RoleGroup`] can call them by name on either transport:
//! the thread ranks of a `WorkerGroup`, or rank processes (one per GPU) reached through
//! [`ProcessRanks`], each of which serves its roles with [`serve_rank`]. `DataProto`s cross
//! process boundaries in their [`crate::DataProto::to_wire`] form, other arguments as JSON.

pub mod device_fault;
pub mod heartbeat;
mod methods;
mod processes;
pub mod reported_panics;
mod role_group;
mod serve;
mod threads;

use std::sync::{Arc, Mutex};

use futures::future::LocalBoxFuture;

use crate::dispatch::DispatchInfo;
use crate::error::Result;
use tokio::sync::watch;

pub use methods::MethodTable;
pub use methods::DISPATCH_INFO;
pub use processes::ProcessRanks;
pub use role_group::RoleGroup;
pub use serve::{serve_rank, RankLink, Roles, Served, ServedRole, EXIT_ABORTED, SETUP};
pub use threads::WorkerGroup;

/// `meta_info` key that turns on auto-padding for one call, as verl's `_verl_auto_padding`.
pub const AUTO_PADDING_KEY: &str = "_verl_auto_padding";

/// A rank worker. Implementations hold a role (actor, critic, rollout, ...) on one rank.
pub trait Worker: 'static {
    /// This rank's dispatch info for `mesh` (see [`crate::dispatch`]); `None` if it is not part
    /// of that mesh. Megatron workers usually answer with [`crate::dispatch::megatron_dispatch_info`].
    fn dispatch_info(&self, mesh: &str) -> Option<DispatchInfo>;
}

/// What a rank runs right after one of its methods failed: aborting its communicators, so
/// that peers blocked in a collective fail at once (see
/// [`crate::traits::Communicator::abort`]) instead of after the peer timeout.
type AbortFn = Arc<dyn Fn(&str) + Send + Sync>;

/// A rank's registered [`AbortFn`], shared by its contexts and its thread.
#[derive(Clone, Default)]
pub(crate) struct AbortHook(Arc<Mutex<Option<AbortFn>>>);

impl AbortHook {
    /// Runs the registered hook (if any) with `reason`.
    pub(crate) fn fire(&self, reason: &str) {
        let hook = self.0.lock().ok().and_then(|h| h.clone());
        if let Some(h) = hook {
            h(reason);
        }
    }
}

/// What a rank knows about itself while running a method.
#[derive(Clone)]
pub struct RankContext {
    pub rank: usize,
    pub world_size: usize,
    cancel: watch::Receiver<bool>,
    abort: AbortHook,
}

impl std::fmt::Debug for RankContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankContext")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("cancelled", &*self.cancel.borrow())
            .finish()
    }
}

impl RankContext {
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        cancel: watch::Receiver<bool>,
        abort: AbortHook,
    ) -> Self {
        Self {
            rank,
            world_size,
            cancel,
            abort,
        }
    }

    /// Registers what this rank runs when one of its methods fails, with a reason naming the
    /// rank and the method: typically aborting every communicator the worker holds, so that
    /// its peers stop waiting in their collectives at once. A worker factory calls it.
    pub fn on_failure(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        if let Ok(mut h) = self.abort.0.lock() {
            *h = Some(Arc::new(hook));
        }
    }

    /// A context that is never cancelled (a rank process: a failure elsewhere ends the
    /// process instead).
    pub fn detached(rank: usize, world_size: usize) -> Self {
        let (tx, cancel) = watch::channel(false);
        // Keep the sender alive for good: a dropped sender would read as cancelled.
        std::mem::forget(tx);
        Self::new(rank, world_size, cancel, AbortHook::default())
    }

    /// True once another rank failed and this call should stop.
    pub fn is_cancelled(&self) -> bool {
        *self.cancel.borrow()
    }

    /// Resolves when the call is cancelled. Long waits (collectives) race against it.
    pub async fn cancelled(&self) {
        let mut rx = self.cancel.clone();
        // An error means the controller dropped the call: treat it as cancelled.
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// The boxed async body of a worker method, as run on a rank.
pub type MethodFuture<'a, O> = LocalBoxFuture<'a, Result<O>>;

use crate::error::panic_message;

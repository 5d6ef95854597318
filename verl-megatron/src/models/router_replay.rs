//! MoE router replay at the block level (verl's `router_replay`, R2 / R3): a forward can
//! record the experts each MoE block chose for its tokens, and a later forward can replay
//! them in place of its router's top-k. Replay keeps a token on the same experts when the
//! router's scores have moved a little (after an optimizer step, or between the rollout's and
//! training's kernels), so a near tie cannot flip the choice between the passes that are
//! compared; the routing weights still come from the current router, which keeps its
//! gradient, as in Megatron's replay.
//!
//! A scope covers one closure on the calling thread ([`record_routing`], [`replay_routing`]).
//! Inside it, every [`super::sparse_moe::SparseMoe`] reports or takes the choices of its layer
//! (by Hugging Face layer index) for the `[tokens, k]` it routes, in the order the block sees
//! its tokens; one forward per scope (a layer recorded twice is refused). Activation
//! recompute keeps the replayed routing of the forward it records and replays it again when
//! it runs the layers anew. Mapping those token positions to a batch's rows and columns is
//! the caller's.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Each MoE layer's choices, by Hugging Face layer index: `[tokens, k]` global expert ids,
/// row-major. In a replayed routing, a row holding a negative id is left to the router.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing {
    pub layers: BTreeMap<usize, Vec<i64>>,
}

enum Scope {
    Record(Routing),
    Replay(Arc<Routing>),
}

thread_local! {
    static SCOPE: RefCell<Option<Scope>> = const { RefCell::new(None) };
    /// Tokens replayed (per MoE layer) and those whose router would have chosen other experts.
    static DISAGREEMENT: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Puts the previous scope back when the closure ends, even by a panic.
struct Restore(Option<Option<Scope>>);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(previous) = self.0.take() {
            SCOPE.with(|s| *s.borrow_mut() = previous);
        }
    }
}

fn enter(scope: Scope) -> Restore {
    Restore(Some(SCOPE.with(|s| s.borrow_mut().replace(scope))))
}

/// Runs `forward` recording the experts every MoE block it runs through chose.
///
/// ```
/// use verl_megatron::models::router_replay::record_routing;
/// let (out, routing) = record_routing(|| 2 + 2);
/// assert_eq!(out, 4);
/// assert!(routing.layers.is_empty()); // no MoE block ran
/// ```
pub fn record_routing<T>(forward: impl FnOnce() -> T) -> (T, Routing) {
    let restore = enter(Scope::Record(Routing::default()));
    let out = forward();
    let recorded = SCOPE.with(|s| match s.borrow_mut().take() {
        Some(Scope::Record(r)) => r,
        _ => Routing::default(),
    });
    drop(restore);
    (out, recorded)
}

/// Runs `forward` with every MoE block whose layer `routing` holds taking those choices
/// instead of its router's top-k (layers it lacks route themselves).
pub fn replay_routing<T>(routing: Arc<Routing>, forward: impl FnOnce() -> T) -> T {
    let _restore = enter(Scope::Replay(routing));
    forward()
}

/// Whether a recording scope is open on this thread.
pub(crate) fn recording() -> bool {
    SCOPE.with(|s| matches!(*s.borrow(), Some(Scope::Record(_))))
}

/// Records `layer`'s choices.
///
/// # Panics
/// If the scope recorded `layer` already: a second forward (another micro-batch) would
/// replace the first one's choices.
pub(crate) fn record(layer: usize, chosen: Vec<i64>) {
    SCOPE.with(|s| {
        if let Some(Scope::Record(r)) = s.borrow_mut().as_mut() {
            let earlier = r.layers.insert(layer, chosen);
            assert!(
                earlier.is_none(),
                "router replay: layer {layer} recorded twice in one scope (record one forward \
                 per scope)"
            );
        }
    });
}

/// The routing a replay scope open on this thread replays, if one is.
pub(crate) fn current_replay() -> Option<Arc<Routing>> {
    SCOPE.with(|s| match s.borrow().as_ref() {
        Some(Scope::Replay(r)) => Some(r.clone()),
        _ => None,
    })
}

/// Counts `replayed` tokens a block took from a replay, `differing` of them routed by the
/// replay to experts its router's own top-k does not hold.
pub(crate) fn note_replayed(replayed: usize, differing: usize) {
    DISAGREEMENT.with(|c| {
        let (t, d) = c.get();
        c.set((t + replayed as u64, d + differing as u64));
    });
}

/// The tokens MoE blocks replayed on this thread since the last call (counted once per layer
/// and forward), and how many of them their router would have sent to another set of experts;
/// resets both. Under R3 that is how often training's routers disagree with the rollout's;
/// under R2, how far the optimizer steps have moved them.
///
/// ```
/// use verl_megatron::models::router_replay::take_disagreement;
/// assert_eq!(take_disagreement(), (0, 0)); // nothing replayed on this thread
/// ```
pub fn take_disagreement() -> (u64, u64) {
    DISAGREEMENT.with(|c| c.replace((0, 0)))
}

/// `layer`'s replayed choices, when a replay scope holds them.
pub(crate) fn replayed(layer: usize) -> Option<Vec<i64>> {
    SCOPE.with(|s| match s.borrow().as_ref() {
        Some(Scope::Replay(r)) => r.layers.get(&layer).cloned(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_end_with_their_closure() {
        let (inner, outer) = record_routing(|| {
            record(3, vec![1, 2]);
            let replayed_inside = replay_routing(
                Arc::new(Routing {
                    layers: BTreeMap::from([(3, vec![0, 1])]),
                }),
                || (replayed(3), recording()),
            );
            // The recording scope is back after the replay.
            assert!(recording());
            record(5, vec![4]);
            replayed_inside
        });
        assert_eq!(inner, (Some(vec![0, 1]), false));
        assert_eq!(
            outer.layers,
            BTreeMap::from([(3, vec![1, 2]), (5, vec![4])])
        );
        assert!(!recording());
        assert_eq!(replayed(3), None);
    }

    #[test]
    fn a_panicking_forward_gives_the_outer_scope_back() {
        let routing = Arc::new(Routing {
            layers: BTreeMap::from([(1, vec![2])]),
        });
        replay_routing(routing, || {
            let r = std::panic::catch_unwind(|| record_routing(|| panic!("boom")));
            assert!(r.is_err());
            assert!(!recording());
            assert_eq!(replayed(1), Some(vec![2]));
            assert!(current_replay().is_some());
        });
        assert!(current_replay().is_none());
    }

    #[test]
    #[should_panic(expected = "layer 4 recorded twice")]
    fn a_layer_recorded_twice_is_refused() {
        let _ = record_routing(|| {
            record(4, vec![0]);
            record(4, vec![1]);
        });
    }
}

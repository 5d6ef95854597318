//! Each thread's stack of entered spans: [`crate::TraceLayer`] pushes and pops the frames, the
//! memory listener reads them to name a sample's role, rank and phase. A leaf, so the layer and
//! the memory timelines both read it without reading each other.

use std::cell::RefCell;
use std::sync::Arc;

use tracing::span::Id;

/// One entered span on a thread's stack.
#[derive(Clone)]
pub(crate) struct Frame {
    pub id: Id,
    pub name: Arc<str>,
    pub role: Option<Arc<str>>,
    pub rank: Option<u64>,
    /// Whether entering it opened an NVTX range (closed when it exits).
    pub nvtx: bool,
}

thread_local! {
    /// The spans entered on this thread, outermost first.
    static STACK: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// This thread's entered spans, outermost first (those entered while stacks were kept).
pub(crate) fn stack() -> Vec<Frame> {
    STACK.try_with(|s| s.borrow().clone()).unwrap_or_default()
}

/// Enters `frame` on this thread.
pub(crate) fn push(frame: Frame) {
    let _ = STACK.try_with(|s| s.borrow_mut().push(frame));
}

/// Takes the frame of span `id` off this thread's stack. Spans exit in the reverse order they
/// entered, except where a caller closes them out of order (`Profiler::range_pop`), so the frame
/// goes by its id; a span entered while no stack was kept has none.
pub(crate) fn remove(id: &Id) -> Option<Frame> {
    STACK
        .try_with(|s| {
            let mut s = s.borrow_mut();
            let at = s.iter().rposition(|f| f.id == *id)?;
            Some(s.remove(at))
        })
        .ok()
        .flatten()
}

//! Host spans into captures: [`TraceLayer`] is a `tracing` layer that, while a [`Capture`] is
//! open, turns every closed span of the capture's role and rank into a trace event. A span's
//! role and rank are its own `role` / `rank` fields or its nearest ancestor's, so a worker
//! method's span (`info_span!("update_actor", role = "actor", rank = 0)`) tags everything
//! under it (micro-batches, collectives).
//!
//! ```
//! use tracing_subscriber::prelude::*;
//! use verl_profiler::{Capture, TraceLayer};
//!
//! let subscriber = tracing_subscriber::registry().with(TraceLayer);
//! tracing::subscriber::with_default(subscriber, || {
//!     let capture = Capture::begin("actor", 0);
//!     {
//!         let _method = tracing::info_span!("update_actor", role = "actor", rank = 0).entered();
//!         let _micro = tracing::info_span!("micro_batch", index = 0).entered();
//!     }
//!     let trace = capture.finish();
//!     let names: Vec<_> = trace.events.iter().map(|e| e.name.as_str()).collect();
//!     assert_eq!(names, ["micro_batch", "update_actor"]);
//! });
//! ```

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::trace::{ChromeTrace, TraceEvent};

/// Open captures (the layer does nothing while there are none).
static OPEN: Mutex<Vec<Arc<Sink>>> = Mutex::new(Vec::new());
static OPEN_COUNT: AtomicUsize = AtomicUsize::new(0);

struct Sink {
    role: String,
    rank: u64,
    origin: Instant,
    events: Mutex<Vec<TraceEvent>>,
}

/// An open capture of one role on one rank; [`Capture::finish`] closes it.
pub struct Capture {
    sink: Arc<Sink>,
}

impl Capture {
    /// Starts collecting the spans of `role` on `rank`.
    pub fn begin(role: &str, rank: usize) -> Self {
        let sink = Arc::new(Sink {
            role: role.into(),
            rank: rank as u64,
            origin: Instant::now(),
            events: Mutex::new(Vec::new()),
        });
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.push(sink.clone());
        OPEN_COUNT.store(open.len(), Ordering::Release);
        Self { sink }
    }

    /// Stops collecting; the spans that closed meanwhile, in the order they closed.
    pub fn finish(self) -> ChromeTrace {
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|s| !Arc::ptr_eq(s, &self.sink));
        OPEN_COUNT.store(open.len(), Ordering::Release);
        drop(open);
        let events =
            std::mem::take(&mut *self.sink.events.lock().unwrap_or_else(|e| e.into_inner()));
        let mut other = Map::new();
        other.insert("role".into(), Value::from(self.sink.role.clone()));
        other.insert("rank".into(), Value::from(self.sink.rank));
        ChromeTrace { events, other }
    }
}

/// The `tracing` layer behind captures: add it to the program's subscriber
/// (`tracing_subscriber::registry().with(TraceLayer)`; the `verl` binary does).
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer;

/// What a span carries until it closes.
struct SpanData {
    start: Instant,
    /// The span's `otel.name` field when it has one (a name chosen at run time), else its
    /// static name.
    name: Option<String>,
    role: Option<String>,
    rank: Option<u64>,
    args: Map<String, Value>,
}

#[derive(Default)]
struct Fields {
    name: Option<String>,
    role: Option<String>,
    rank: Option<u64>,
    args: Map<String, Value>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "role" => self.role = Some(value.into()),
            "otel.name" => self.name = Some(value.into()),
            name => {
                self.args.insert(name.into(), Value::from(value));
            }
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "rank" => self.rank = Some(value),
            name => {
                self.args.insert(name.into(), Value::from(value));
            }
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        match (field.name(), u64::try_from(value)) {
            ("rank", Ok(v)) => self.rank = Some(v),
            (name, _) => {
                self.args.insert(name.into(), Value::from(value));
            }
        }
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.args.insert(field.name().into(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.args.insert(field.name().into(), Value::from(value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.args
            .insert(field.name().into(), Value::from(format!("{value:?}")));
    }
}

/// A small number per OS thread, for trace tracks.
fn thread_track() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TRACK: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    TRACK.with(|t| *t)
}

impl<S> Layer<S> for TraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        // Kept even while no capture is open: a capture that opens inside a span (a discrete
        // capture of one method, a step capture opened mid-method) still finds its tags.
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        // Role and rank come from the nearest ancestor that has them.
        if fields.role.is_none() || fields.rank.is_none() {
            for parent in span.scope().skip(1) {
                if let Some(data) = parent.extensions().get::<SpanData>() {
                    fields.role = fields.role.or_else(|| data.role.clone());
                    fields.rank = fields.rank.or(data.rank);
                }
                if fields.role.is_some() && fields.rank.is_some() {
                    break;
                }
            }
        }
        span.extensions_mut().insert(SpanData {
            start: Instant::now(),
            name: fields.name,
            role: fields.role,
            rank: fields.rank,
            args: fields.args,
        });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if OPEN_COUNT.load(Ordering::Acquire) == 0 {
            return;
        }
        let end = Instant::now();
        let Some(span) = ctx.span(&id) else {
            return;
        };
        let extensions = span.extensions();
        let Some(data) = extensions.get::<SpanData>() else {
            return;
        };
        let (Some(role), Some(rank)) = (&data.role, data.rank) else {
            return;
        };
        let open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        for sink in open.iter().filter(|s| &s.role == role && s.rank == rank) {
            // A span opened before the capture starts at the capture's start.
            let start = data.start.max(sink.origin);
            let event = TraceEvent {
                name: data.name.clone().unwrap_or_else(|| span.name().into()),
                cat: "host".into(),
                ph: "X".into(),
                ts: start.duration_since(sink.origin).as_secs_f64() * 1e6,
                dur: end.saturating_duration_since(start).as_secs_f64() * 1e6,
                pid: rank,
                tid: thread_track(),
                args: data.args.clone(),
            };
            sink.events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::prelude::*;

    #[test]
    fn only_the_captured_role_and_rank_are_kept_and_nesting_holds() {
        let subscriber = tracing_subscriber::registry().with(TraceLayer);
        tracing::subscriber::with_default(subscriber, || {
            // Before any capture: nothing is recorded.
            drop(tracing::info_span!("early", role = "actor", rank = 0u64).entered());
            let actor0 = Capture::begin("actor", 0);
            let critic0 = Capture::begin("critic", 0);
            {
                let _m = tracing::info_span!("update_actor", role = "actor", rank = 0u64).entered();
                for i in 0..3u64 {
                    let _mb = tracing::info_span!("micro_batch", index = i).entered();
                }
            }
            drop(tracing::info_span!("update_actor", role = "actor", rank = 1u64).entered());
            drop(tracing::info_span!("compute_values", role = "critic", rank = 0u64).entered());
            drop(tracing::info_span!("untagged").entered());
            let a = actor0.finish();
            let c = critic0.finish();
            let names: Vec<_> = a.events.iter().map(|e| e.name.as_str()).collect();
            assert_eq!(
                names,
                ["micro_batch", "micro_batch", "micro_batch", "update_actor"]
            );
            let outer = &a.events[3];
            for mb in &a.events[..3] {
                assert!(mb.ts >= outer.ts && mb.ts + mb.dur <= outer.ts + outer.dur + 1e-3);
                assert_eq!(mb.pid, 0);
            }
            assert_eq!(a.events[2].args["index"], 2);
            assert_eq!(c.events.len(), 1);
            assert_eq!(c.events[0].name, "compute_values");
            assert_eq!(a.other["role"], "actor");
        });
    }
}

//! Spans into captures: [`TraceLayer`] is a `tracing` layer that, while a [`Capture`] is
//! open, turns every closed span of the capture's role and rank into a trace event. A span's
//! role and rank are its own `role` / `rank` fields or its nearest ancestor's, so a worker
//! method's span (`info_span!("update_actor", role = "actor", rank = 0)`) tags everything
//! under it (micro-batches, collectives).
//!
//! What a capture keeps is its [`Contents`] (torch's `contents`): host spans on one track per
//! thread, device spans (spans marked `device = true`, timed between two waits for the device:
//! `verl_core::profiling`) on the rank's device track, and memory samples as a counter track.
//! The layer also keeps each thread's stack of entered spans, which names the phase of a memory
//! sample ([`crate::MemoryCapture`]) and, under the nsys tool, mirrors spans as NVTX ranges.
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
//!     let spans = trace.events.iter().filter(|e| e.ph == "X");
//!     let names: Vec<_> = spans.map(|e| e.name.as_str()).collect();
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

use crate::memory::{self as memory_capture};
use crate::spans::{self, Frame};
use crate::trace::{ChromeTrace, TraceEvent};

/// Open captures (the layer records nothing while there are none).
static OPEN: Mutex<Vec<Arc<Sink>>> = Mutex::new(Vec::new());
static OPEN_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Open NVTX mirrors (role, rank) of the nsys tool.
static NVTX: Mutex<Vec<(String, u64)>> = Mutex::new(Vec::new());
static NVTX_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The track device spans go on (host threads are numbered from 1).
pub const DEVICE_TRACK: u64 = 0;

/// What a capture records, as torch's `contents` list says it: `cpu` (host spans), `cuda`
/// (device spans), `memory` (memory samples as a counter track). An empty list means `cpu`
/// and `cuda`, as in verl.
///
/// ```
/// use verl_profiler::Contents;
/// assert_eq!(Contents::from_torch(&[]), Contents { host: true, device: true, memory: false });
/// let only_memory = Contents::from_torch(&["cpu".into(), "memory".into()]);
/// assert!(only_memory.host && only_memory.memory && !only_memory.device);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contents {
    pub host: bool,
    pub device: bool,
    pub memory: bool,
}

impl Contents {
    /// Host spans only.
    pub const HOST: Self = Self {
        host: true,
        device: false,
        memory: false,
    };

    /// From torch's `contents` (entries other than cpu / cuda / memory are the
    /// configuration check's business).
    pub fn from_torch(contents: &[String]) -> Self {
        if contents.is_empty() {
            return Self {
                host: true,
                device: true,
                memory: false,
            };
        }
        let has = |c: &str| contents.iter().any(|x| x == c);
        Self {
            host: has("cpu"),
            device: has("cuda"),
            memory: has("memory"),
        }
    }
}

struct Sink {
    role: String,
    rank: u64,
    origin: Instant,
    contents: Contents,
    events: Mutex<Vec<TraceEvent>>,
    /// Host threads that had spans in this capture (for track names).
    threads: Mutex<Vec<u64>>,
}

/// An open capture of one role on one rank; [`Capture::finish`] closes it.
pub struct Capture {
    sink: Arc<Sink>,
    _device: Option<verl_core::profiling::SwitchGuard>,
    _memory: Option<verl_core::profiling::SwitchGuard>,
}

impl Capture {
    /// Starts collecting the host spans of `role` on `rank`.
    pub fn begin(role: &str, rank: usize) -> Self {
        Self::begin_with(role, rank, Contents::HOST)
    }

    /// Starts collecting what `contents` names for `role` on `rank` (device spans and memory
    /// samples are switched on for the capture's life).
    pub fn begin_with(role: &str, rank: usize, contents: Contents) -> Self {
        let sink = Arc::new(Sink {
            role: role.into(),
            rank: rank as u64,
            origin: Instant::now(),
            contents,
            events: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
        });
        let device = contents.device.then(verl_core::profiling::time_device);
        let memory = contents
            .memory
            .then(|| memory_capture::listen_with_traces(memory_sample));
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.push(sink.clone());
        OPEN_COUNT.store(open.len(), Ordering::Release);
        Self {
            sink,
            _device: device,
            _memory: memory,
        }
    }

    fn close(&self) {
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|s| !Arc::ptr_eq(s, &self.sink));
        OPEN_COUNT.store(open.len(), Ordering::Release);
    }

    /// Stops collecting; the spans that closed meanwhile in the order they closed, then the
    /// tracks' names.
    pub fn finish(self) -> ChromeTrace {
        self.close();
        let sink = &self.sink;
        let mut events =
            std::mem::take(&mut *sink.events.lock().unwrap_or_else(|e| e.into_inner()));
        let name = |tid: u64, what: &str, value: String| TraceEvent {
            name: what.into(),
            cat: "__metadata".into(),
            ph: "M".into(),
            ts: 0.0,
            dur: 0.0,
            pid: sink.rank,
            tid,
            args: Map::from_iter([("name".to_string(), Value::from(value))]),
        };
        events.push(name(
            0,
            "process_name",
            format!("rank {} ({})", sink.rank, sink.role),
        ));
        if events.iter().any(|e| e.cat == "device") {
            events.push(name(
                DEVICE_TRACK,
                "thread_name",
                "device (between stream waits)".into(),
            ));
        }
        let threads = sink
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for tid in threads {
            events.push(name(tid, "thread_name", format!("host thread {tid}")));
        }
        let mut other = Map::new();
        other.insert("role".into(), Value::from(sink.role.clone()));
        other.insert("rank".into(), Value::from(sink.rank));
        ChromeTrace { events, other }
    }
}

/// A capture dropped unfinished (its worker method was cancelled or panicked) stops
/// collecting.
impl Drop for Capture {
    fn drop(&mut self) {
        self.close();
    }
}

/// Mirrors the spans of `role` on `rank` as NVTX ranges until the guard drops (the nsys
/// tool; ranges reach Nsight Systems when it runs the process). A range opens each time its
/// span is entered: a worker method's span (an async future) is entered once per poll, so in
/// Nsight a method that awaits shows as several ranges, its waits between them.
pub fn mirror_to_nvtx(role: &str, rank: usize) -> NvtxMirror {
    let mut open = NVTX.lock().unwrap_or_else(|e| e.into_inner());
    open.push((role.into(), rank as u64));
    NVTX_COUNT.store(open.len(), Ordering::Release);
    NvtxMirror {
        role: role.into(),
        rank: rank as u64,
    }
}

/// See [`mirror_to_nvtx`].
#[derive(Debug)]
pub struct NvtxMirror {
    role: String,
    rank: u64,
}

impl Drop for NvtxMirror {
    fn drop(&mut self) {
        let mut open = NVTX.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = open
            .iter()
            .position(|(r, k)| *r == self.role && *k == self.rank)
        {
            open.remove(i);
        }
        NVTX_COUNT.store(open.len(), Ordering::Release);
    }
}

fn mirrored(role: &str, rank: u64) -> bool {
    NVTX_COUNT.load(Ordering::Acquire) > 0
        && NVTX
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(r, k)| r == role && *k == rank)
}

/// Whether anything reads the span stacks (an NVTX mirror or a memory listener): they are
/// kept only then.
fn stacks_wanted() -> bool {
    NVTX_COUNT.load(Ordering::Acquire) > 0 || verl_core::memory::listening()
}

/// A memory sample taken on this thread: a counter event in the open captures of the thread's
/// role and rank that record memory.
pub(crate) fn memory_sample(role: &str, rank: u64, usage: verl_core::memory::MemoryUsage) {
    if OPEN_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let now = Instant::now();
    let open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    for sink in open
        .iter()
        .filter(|s| s.contents.memory && s.role == role && s.rank == rank)
    {
        let gib = |b: u64| Value::from(verl_core::memory::gib(b));
        sink.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(TraceEvent {
                name: "device memory (GiB)".into(),
                cat: "memory".into(),
                ph: "C".into(),
                ts: now.saturating_duration_since(sink.origin).as_secs_f64() * 1e6,
                dur: 0.0,
                pid: rank,
                tid: DEVICE_TRACK,
                args: Map::from_iter([
                    ("allocated".to_string(), gib(usage.allocated)),
                    ("reserved".to_string(), gib(usage.reserved)),
                ]),
            });
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
    name: Arc<str>,
    role: Option<Arc<str>>,
    rank: Option<u64>,
    /// A device span (`device = true`).
    device: bool,
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
        let mut role: Option<Arc<str>> = fields.role.map(Into::into);
        // Role and rank come from the nearest ancestor that has them.
        if role.is_none() || fields.rank.is_none() {
            for parent in span.scope().skip(1) {
                if let Some(data) = parent.extensions().get::<SpanData>() {
                    role = role.or_else(|| data.role.clone());
                    fields.rank = fields.rank.or(data.rank);
                }
                if role.is_some() && fields.rank.is_some() {
                    break;
                }
            }
        }
        let device = fields.args.remove("device") == Some(Value::Bool(true));
        span.extensions_mut().insert(SpanData {
            start: Instant::now(),
            name: fields.name.map_or_else(|| span.name().into(), Into::into),
            role,
            rank: fields.rank,
            device,
            args: fields.args,
        });
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if !stacks_wanted() {
            return;
        }
        let Some(span) = ctx.span(id) else {
            return;
        };
        let extensions = span.extensions();
        let Some(data) = extensions.get::<SpanData>() else {
            return;
        };
        let nvtx = match (&data.role, data.rank) {
            (Some(role), Some(rank)) if mirrored(role, rank) => {
                crate::nvtx::push(&data.name);
                true
            }
            _ => false,
        };
        let frame = Frame {
            id: id.clone(),
            name: data.name.clone(),
            role: data.role.clone(),
            rank: data.rank,
            nvtx,
        };
        spans::push(frame);
    }

    fn on_exit(&self, id: &Id, _ctx: Context<'_, S>) {
        let frame = spans::remove(id);
        if frame.is_some_and(|f| f.nvtx) {
            crate::nvtx::pop();
        }
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
        let wanted = |s: &&Arc<Sink>| {
            *s.role == **role
                && s.rank == rank
                && if data.device {
                    s.contents.device
                } else {
                    s.contents.host
                }
        };
        for sink in open.iter().filter(wanted) {
            // A span opened before the capture starts at the capture's start.
            let start = data.start.max(sink.origin);
            let tid = if data.device {
                DEVICE_TRACK
            } else {
                let tid = thread_track();
                let mut threads = sink.threads.lock().unwrap_or_else(|e| e.into_inner());
                if !threads.contains(&tid) {
                    threads.push(tid);
                }
                tid
            };
            let event = TraceEvent {
                name: data.name.to_string(),
                cat: if data.device { "device" } else { "host" }.into(),
                ph: "X".into(),
                ts: start.duration_since(sink.origin).as_secs_f64() * 1e6,
                dur: end.saturating_duration_since(start).as_secs_f64() * 1e6,
                pid: rank,
                tid,
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

    fn spans_only(mut t: ChromeTrace) -> ChromeTrace {
        t.events.retain(|e| e.ph == "X");
        t
    }

    #[test]
    fn a_capture_dropped_unfinished_stops_collecting() {
        let subscriber = tracing_subscriber::registry().with(TraceLayer);
        tracing::subscriber::with_default(subscriber, || {
            let lost = Capture::begin("critic", 21);
            drop(lost);
            let open = OPEN.lock().unwrap();
            assert!(!open.iter().any(|s| s.role == "critic" && s.rank == 21));
        });
    }

    #[test]
    fn device_spans_go_to_the_device_track_when_the_contents_ask() {
        let subscriber = tracing_subscriber::registry().with(TraceLayer);
        tracing::subscriber::with_default(subscriber, || {
            let run = |contents| {
                let capture = Capture::begin_with("actor", 3, contents);
                if contents.device {
                    assert!(verl_core::profiling::device_spans_on());
                }
                {
                    let _m =
                        tracing::info_span!("update_actor", role = "actor", rank = 3u64).entered();
                    let _d =
                        tracing::info_span!("device", otel.name = "mlp", device = true).entered();
                }
                capture.finish()
            };
            let both = run(Contents::from_torch(&[]));
            let device = both.events.iter().find(|e| e.cat == "device").unwrap();
            assert_eq!((device.name.as_str(), device.tid), ("mlp", DEVICE_TRACK));
            assert!(
                device.args.is_empty(),
                "the marker field is not an argument"
            );
            let host = both.events.iter().find(|e| e.cat == "host").unwrap();
            assert_eq!(host.name, "update_actor");
            assert_ne!(host.tid, DEVICE_TRACK);
            let names: Vec<_> = both
                .events
                .iter()
                .filter(|e| e.ph == "M")
                .map(|e| e.args["name"].as_str().unwrap().to_string())
                .collect();
            assert!(names.contains(&"rank 3 (actor)".to_string()), "{names:?}");
            assert!(names.iter().any(|n| n.starts_with("device")), "{names:?}");
            let cpu = spans_only(run(Contents::HOST));
            assert_eq!(cpu.events.len(), 1);
            assert_eq!(cpu.events[0].name, "update_actor");
            let cuda = spans_only(run(Contents::from_torch(&["cuda".into()])));
            assert_eq!(cuda.events.len(), 1);
            assert_eq!(cuda.events[0].cat, "device");
        });
    }

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
            let (a, c) = (spans_only(a), spans_only(c));
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

//! Chrome trace-event files (what `chrome://tracing` and Perfetto load, and what torch's
//! profiler exports): complete events (`"ph": "X"`) with microsecond start and duration,
//! counters (`"C"`, the memory track) and track names (`"M"`), one process per rank and one
//! track per thread (plus the device track), gzipped; and the per-span totals
//! `verl profile summarize` prints.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ProfilerError;

/// How much a gzipped trace may expand (JSON traces compress 10-30x), and the expansion always
/// allowed however small the file.
const MAX_GZIP_RATIO: u64 = 200;
const MIN_EXPANDED_LIMIT: u64 = 64 << 20;

/// One span: a host range, a device kernel, a micro-batch marker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    /// The event's category: `host` (a span on a host thread), `device` (the device's time
    /// for an operation), `memory` (a counter sample).
    pub cat: String,
    /// `X`: a complete event (start and duration); `C`: a counter sample (values in `args`);
    /// `M`: a track's name.
    pub ph: String,
    /// Start, µs since the capture began.
    pub ts: f64,
    /// Duration, µs.
    pub dur: f64,
    /// The rank (Perfetto shows one process per rank).
    pub pid: u64,
    /// The thread or stream the event ran on (one track each).
    pub tid: u64,
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub args: Map<String, Value>,
}

/// A capture's events and metadata (`traceEvents`, `otherData`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChromeTrace {
    #[serde(rename = "traceEvents")]
    pub events: Vec<TraceEvent>,
    #[serde(rename = "otherData", default, skip_serializing_if = "Map::is_empty")]
    pub other: Map<String, Value>,
}

/// The total time under one span name of one category.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanTotal {
    pub name: String,
    /// `host` or `device` (the same operation may appear as both).
    pub cat: String,
    pub count: usize,
    /// Summed durations, µs.
    pub total_us: f64,
    /// The longest single span, µs.
    pub max_us: f64,
}

impl ChromeTrace {
    /// Writes the trace as JSON, gzipped when the file name ends in `.gz`.
    pub fn write(&self, path: &Path) -> Result<(), ProfilerError> {
        let io = |e: std::io::Error| ProfilerError::Io {
            path: path.into(),
            message: e.to_string(),
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let json = serde_json::to_vec(self).map_err(|e| ProfilerError::Io {
            path: path.into(),
            message: e.to_string(),
        })?;
        let file = std::fs::File::create(path).map_err(io)?;
        if is_gz(path) {
            let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
            gz.write_all(&json).map_err(io)?;
            gz.finish().map_err(io)?;
        } else {
            let mut file = file;
            file.write_all(&json).map_err(io)?;
        }
        Ok(())
    }

    /// Reads a trace written by [`Self::write`] or by torch's profiler (gzipped or not; a bare
    /// array of events is accepted too).
    pub fn read(path: &Path) -> Result<Self, ProfilerError> {
        let bad = |message: String| ProfilerError::Trace {
            path: path.into(),
            message,
        };
        let mut bytes =
            verl_core::files::read_regular(path, u64::MAX).map_err(|e| ProfilerError::Io {
                path: path.into(),
                message: e.to_string(),
            })?;
        if bytes.starts_with(&[0x1f, 0x8b]) {
            // A few kilobytes of gzip can expand to gigabytes: the expansion is bounded.
            let limit = (bytes.len() as u64)
                .saturating_mul(MAX_GZIP_RATIO)
                .max(MIN_EXPANDED_LIMIT);
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(&bytes[..])
                .take(limit.saturating_add(1))
                .read_to_end(&mut out)
                .map_err(|e| bad(format!("not a valid gzip file: {e}")))?;
            if out.len() as u64 > limit {
                return Err(bad(format!(
                    "expands past {limit} bytes ({MAX_GZIP_RATIO}x its {} compressed bytes); \
                     a trace this verl-rs wrote never does",
                    bytes.len()
                )));
            }
            bytes = out;
        }
        let value: Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        let events = match &value {
            Value::Array(_) => value.clone(),
            Value::Object(o) => o
                .get("traceEvents")
                .cloned()
                .ok_or_else(|| bad("no `traceEvents` array".into()))?,
            _ => return Err(bad("neither an object nor an array".into())),
        };
        let Value::Array(events) = events else {
            return Err(bad("`traceEvents` is not an array".into()));
        };
        // Keep complete events, counters and track names (instant and flow events are not
        // summed or drawn here).
        let events = events
            .into_iter()
            .filter(|e| matches!(e.get("ph").and_then(Value::as_str), Some("X" | "C" | "M")))
            .map(|e| {
                serde_json::from_value::<TraceEvent>(with_defaults(e))
                    .map_err(|err| bad(format!("an event is malformed: {err}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let other = match value {
            Value::Object(mut o) => match o.remove("otherData") {
                Some(Value::Object(m)) => m,
                _ => Map::new(),
            },
            _ => Map::new(),
        };
        Ok(Self { events, other })
    }

    /// The `top` spans (complete events, by category and name) by total time, longest
    /// first (ties by name).
    pub fn summarize(&self, top: usize) -> Vec<SpanTotal> {
        let mut by_name: HashMap<(&str, &str), SpanTotal> = HashMap::new();
        for e in self.events.iter().filter(|e| e.ph == "X") {
            let t = by_name
                .entry((&e.cat, &e.name))
                .or_insert_with(|| SpanTotal {
                    name: e.name.clone(),
                    cat: e.cat.clone(),
                    count: 0,
                    total_us: 0.0,
                    max_us: 0.0,
                });
            t.count += 1;
            t.total_us += e.dur;
            t.max_us = t.max_us.max(e.dur);
        }
        let mut totals: Vec<SpanTotal> = by_name.into_values().collect();
        totals.sort_by(|a, b| {
            b.total_us
                .total_cmp(&a.total_us)
                .then_with(|| a.name.cmp(&b.name))
                .then_with(|| a.cat.cmp(&b.cat))
        });
        totals.truncate(top);
        totals
    }
}

/// Fills the fields torch's exports may leave out.
fn with_defaults(mut e: Value) -> Value {
    if let Value::Object(o) = &mut e {
        for (key, default) in [
            ("cat", Value::from("")),
            ("ts", Value::from(0.0)),
            ("dur", Value::from(0.0)),
            ("pid", Value::from(0)),
            ("tid", Value::from(0)),
        ] {
            o.entry(key).or_insert(default);
        }
        // torch writes pid/tid as strings for device streams at times.
        for key in ["pid", "tid"] {
            if let Some(Value::String(s)) = o.get(key) {
                let n = s.parse::<u64>().unwrap_or(0);
                o.insert(key.into(), Value::from(n));
            }
        }
    }
    e
}

fn is_gz(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gz")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str, ts: f64, dur: f64) -> TraceEvent {
        TraceEvent {
            name: name.into(),
            cat: "host".into(),
            ph: "X".into(),
            ts,
            dur,
            pid: 0,
            tid: 1,
            args: Map::new(),
        }
    }

    #[test]
    fn a_trace_survives_gzip_and_sums_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("actor/step1_prof_rank-0.json.gz");
        let trace = ChromeTrace {
            events: vec![
                event("update_actor", 0.0, 300.0),
                event("micro_batch", 10.0, 100.0),
                event("micro_batch", 120.0, 150.0),
            ],
            other: Map::new(),
        };
        trace.write(&path).unwrap();
        let back = ChromeTrace::read(&path).unwrap();
        assert_eq!(back, trace);
        let top = back.summarize(5);
        assert_eq!(top[0].name, "update_actor");
        assert_eq!((top[1].name.as_str(), top[1].count), ("micro_batch", 2));
        assert_eq!((top[1].total_us, top[1].max_us), (250.0, 150.0));
        assert_eq!(back.summarize(1).len(), 1);
    }

    #[test]
    fn torch_style_arrays_and_bad_files_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("torch.json");
        std::fs::write(
            &path,
            r#"[{"name":"aten::mm","ph":"X","ts":1,"dur":5,"pid":"0","tid":"7"},{"name":"thread_name","ph":"M","args":{"name":"stream 7"}},{"name":"flow","ph":"s","id":1}]"#,
        )
        .unwrap();
        let t = ChromeTrace::read(&path).unwrap();
        assert_eq!(t.events.len(), 2);
        assert_eq!(t.events[0].tid, 7);
        assert_eq!(t.summarize(5).len(), 1, "track names are not spans");
        std::fs::write(&path, "{\"x\": 1}").unwrap();
        let err = ChromeTrace::read(&path).unwrap_err().to_string();
        assert!(err.contains("no `traceEvents` array"), "{err}");
    }
}

#[cfg(test)]
mod bounded_tests {
    use super::*;

    /// A gzip file that expands past its bound is refused, naming the file, before it fills
    /// memory; a normal gzipped trace still reads.
    #[test]
    fn a_gzip_bomb_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let bomb = dir.path().join("bomb.json.gz");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![b' '; 1 << 20];
        for _ in 0..(MIN_EXPANDED_LIMIT >> 20) + 2 {
            gz.write_all(&zeros).unwrap();
        }
        std::fs::write(&bomb, gz.finish().unwrap()).unwrap();
        let e = ChromeTrace::read(&bomb)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bomb.json.gz") && e.contains("expands past"),
            "{e}"
        );
    }
}

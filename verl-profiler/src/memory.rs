//! The "torch_memory" tool: a device-memory timeline of one role on one rank. While a
//! [`MemoryCapture`] is open, every memory sample the workers take (after each heavy
//! operation, each micro-batch's forward pass, around the optimizer step, after reloads and
//! generation: `verl_core::memory`) is kept with its time, the phase it fell in (the worker
//! method: `update_actor`, `generate_sequences`, ...) and the stack of spans open at the time,
//! innermost last. [`MemoryTimeline`] writes it as JSON and draws it as a PNG (allocated and
//! reserved over time, phases shaded and named).
//!
//! torch's settings keep their meaning: `trace_alloc_max_entries` caps the samples kept (the
//! latest are kept, as torch keeps its latest allocator events) and `stack_depth` caps the
//! spans kept per sample.
//!
//! ```
//! use verl_profiler::{MemorySample, MemoryTimeline};
//! let sample = |t_us: f64, gib: u64, phase: &str| MemorySample {
//!     t_us,
//!     allocated: gib << 30,
//!     reserved: (gib + 1) << 30,
//!     phase: phase.into(),
//!     stack: vec![phase.into()],
//! };
//! let timeline = MemoryTimeline {
//!     role: "actor".into(),
//!     rank: 0,
//!     samples: vec![sample(0.0, 2, "generate_sequences"), sample(5.0, 6, "update_actor"),
//!                   sample(9.0, 3, "update_actor")],
//!     dropped: 0,
//! };
//! let phases = timeline.phases();
//! assert_eq!(phases[1].phase, "update_actor");
//! assert_eq!(phases[1].peak_allocated, 6 << 30);
//! let png = timeline.png(640, 360);
//! assert_eq!(&png[1..4], b"PNG");
//! ```

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use verl_core::memory::MemoryUsage;

use crate::spans::stack;
use crate::ProfilerError;

/// Open timelines.
static OPEN: Mutex<Vec<Arc<Sink>>> = Mutex::new(Vec::new());

struct Sink {
    role: String,
    rank: u64,
    origin: Instant,
    max_entries: usize,
    stack_depth: usize,
    samples: Mutex<(VecDeque<MemorySample>, u64)>,
}

/// One sample of a timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    /// µs since the capture began.
    pub t_us: f64,
    /// Bytes in use by tensors.
    pub allocated: u64,
    /// Bytes the allocator holds.
    pub reserved: u64,
    /// The worker method the sample fell in (`""` outside one).
    pub phase: String,
    /// The spans open at the time, outermost first (the innermost `stack_depth` of them).
    pub stack: Vec<String>,
}

/// One phase's share of a timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseMemory {
    pub phase: String,
    pub start_us: f64,
    pub end_us: f64,
    pub samples: usize,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

/// A finished capture's samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryTimeline {
    pub role: String,
    pub rank: u64,
    pub samples: Vec<MemorySample>,
    /// Samples dropped past `trace_alloc_max_entries` (the oldest).
    pub dropped: u64,
}

/// Turns on the sample listener (once per process) and keeps samples flowing while the guard
/// lives.
pub(crate) fn listen() -> verl_core::profiling::SwitchGuard {
    verl_core::memory::set_listener(on_sample);
    verl_core::memory::listen()
}

/// Where samples go besides the timelines: the trace captures' counter tracks. The capture
/// module hands its writer in when a capture first records memory, so neither module reads the
/// other's registry.
static TRACE_COUNTERS: OnceLock<fn(&str, u64, MemoryUsage)> = OnceLock::new();

/// [`listen`], also writing every sample through `counters` (the trace captures' counters).
pub(crate) fn listen_with_traces(
    counters: fn(&str, u64, MemoryUsage),
) -> verl_core::profiling::SwitchGuard {
    let _ = TRACE_COUNTERS.set(counters);
    listen()
}

/// Where every sample goes: the open timelines and trace captures of the role and rank whose
/// span is innermost on this thread.
fn on_sample(usage: MemoryUsage) {
    let frames = stack();
    let Some((role, rank)) = frames
        .iter()
        .rev()
        .find_map(|f| Some((f.role.clone()?, f.rank?)))
    else {
        return;
    };
    if let Some(counters) = TRACE_COUNTERS.get() {
        counters(&role, rank, usage);
    }
    let open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if open.is_empty() {
        return;
    }
    let now = Instant::now();
    for sink in open.iter().filter(|s| *s.role == *role && s.rank == rank) {
        // The phase is the outermost span of the role: its worker method.
        let phase = frames
            .iter()
            .find(|f| f.role.as_deref() == Some(&*role))
            .map(|f| f.name.to_string())
            .unwrap_or_default();
        let skip = frames.len().saturating_sub(sink.stack_depth);
        let sample = MemorySample {
            t_us: now.saturating_duration_since(sink.origin).as_secs_f64() * 1e6,
            allocated: usage.allocated,
            reserved: usage.reserved,
            phase,
            stack: frames[skip..].iter().map(|f| f.name.to_string()).collect(),
        };
        let mut samples = sink.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.0.push_back(sample);
        while samples.0.len() > sink.max_entries {
            samples.0.pop_front();
            samples.1 += 1;
        }
    }
}

/// An open memory timeline of one role on one rank; [`MemoryCapture::finish`] closes it.
pub struct MemoryCapture {
    sink: Arc<Sink>,
    _listen: verl_core::profiling::SwitchGuard,
}

impl MemoryCapture {
    /// Starts sampling `role` on `rank`, keeping the latest `max_entries` samples with
    /// `stack_depth` spans each (torch_memory's `trace_alloc_max_entries` / `stack_depth`).
    pub fn begin(role: &str, rank: usize, max_entries: usize, stack_depth: usize) -> Self {
        let sink = Arc::new(Sink {
            role: role.into(),
            rank: rank as u64,
            origin: Instant::now(),
            max_entries: max_entries.max(1),
            stack_depth,
            samples: Mutex::new((VecDeque::new(), 0)),
        });
        let listen = listen();
        OPEN.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(sink.clone());
        Self {
            sink,
            _listen: listen,
        }
    }

    fn close(&self) {
        OPEN.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|s| !Arc::ptr_eq(s, &self.sink));
    }

    pub fn finish(self) -> MemoryTimeline {
        self.close();
        let (samples, dropped) =
            std::mem::take(&mut *self.sink.samples.lock().unwrap_or_else(|e| e.into_inner()));
        MemoryTimeline {
            role: self.sink.role.clone(),
            rank: self.sink.rank,
            samples: samples.into(),
            dropped,
        }
    }
}

/// A timeline dropped unfinished (its worker method was cancelled or panicked) stops
/// sampling.
impl Drop for MemoryCapture {
    fn drop(&mut self) {
        self.close();
    }
}

impl MemoryTimeline {
    /// Consecutive samples of one phase, in order, with their peaks.
    pub fn phases(&self) -> Vec<PhaseMemory> {
        let mut out: Vec<PhaseMemory> = Vec::new();
        for s in &self.samples {
            match out.last_mut() {
                Some(p) if p.phase == s.phase => {
                    p.end_us = s.t_us;
                    p.samples += 1;
                    p.peak_allocated = p.peak_allocated.max(s.allocated);
                    p.peak_reserved = p.peak_reserved.max(s.reserved);
                }
                _ => out.push(PhaseMemory {
                    phase: s.phase.clone(),
                    start_us: s.t_us,
                    end_us: s.t_us,
                    samples: 1,
                    peak_allocated: s.allocated,
                    peak_reserved: s.reserved,
                }),
            }
        }
        out
    }

    /// Writes `<base>.json` (the samples and the phases) and `<base>.png` (the plot); the two
    /// paths.
    pub fn write(&self, base: &Path) -> Result<[std::path::PathBuf; 2], ProfilerError> {
        let json = base.with_extension("json");
        let png = base.with_extension("png");
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |e: std::io::Error| ProfilerError::Io {
                path: path.clone(),
                message: e.to_string(),
            }
        };
        if let Some(dir) = base.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        #[derive(Serialize)]
        struct File<'a> {
            #[serde(flatten)]
            timeline: &'a MemoryTimeline,
            phases: Vec<PhaseMemory>,
        }
        let body = serde_json::to_vec(&File {
            timeline: self,
            phases: self.phases(),
        })
        .map_err(|e| ProfilerError::Io {
            path: json.clone(),
            message: e.to_string(),
        })?;
        std::fs::write(&json, body).map_err(io(&json))?;
        std::fs::write(&png, self.png(1200, 600)).map_err(io(&png))?;
        Ok([json, png])
    }

    /// The plot as PNG bytes: allocated (blue) and reserved (orange) GiB over seconds, each
    /// phase a shaded band named at its top.
    pub fn png(&self, width: usize, height: usize) -> Vec<u8> {
        let mut c = Canvas::new(width.max(200), height.max(120));
        let (left, right, top, bottom) = (70, c.w - 20, 40, c.h - 40);
        let t_end = self.samples.last().map_or(1.0, |s| s.t_us).max(1.0);
        let y_max = self
            .samples
            .iter()
            .map(|s| s.reserved.max(s.allocated))
            .max()
            .unwrap_or(0)
            .max(1) as f64
            * 1.1;
        let x = |t: f64| left + ((t / t_end) * (right - left) as f64) as usize;
        let y = |b: u64| bottom - ((b as f64 / y_max) * (bottom - top) as f64) as usize;
        // Phases: alternating shades, named where they are wide enough.
        for (i, p) in self.phases().iter().enumerate() {
            let (x0, x1) = (x(p.start_us), x(p.end_us).max(x(p.start_us) + 1));
            let shade = if i % 2 == 0 {
                [236, 240, 246]
            } else {
                [246, 242, 232]
            };
            c.fill(x0, top, x1, bottom, shade);
            if x1 - x0 >= 16 {
                let room = (x1 - x0) / 8;
                let name: String = p.phase.chars().take(room).collect();
                c.text(x0 + 1, top + 2 + 10 * (i % 3), &name, [90, 90, 90]);
            }
        }
        // Axes and ticks.
        c.fill(left, top, left + 1, bottom, [0, 0, 0]);
        c.fill(left, bottom, right, bottom + 1, [0, 0, 0]);
        for k in 0..=4 {
            let b = (y_max / 1.1 * k as f64 / 4.0) as u64;
            let yy = y(b);
            c.fill(left - 4, yy, left, yy + 1, [0, 0, 0]);
            c.text(
                4,
                yy.saturating_sub(4),
                &format!("{:.3}", verl_core::memory::gib(b)),
                [0, 0, 0],
            );
            let t = t_end * k as f64 / 4.0;
            let xx = x(t);
            c.fill(xx, bottom, xx + 1, bottom + 4, [0, 0, 0]);
            c.text(
                xx.saturating_sub(16),
                bottom + 8,
                &format!("{:.2}s", t / 1e6),
                [0, 0, 0],
            );
        }
        c.text(4, top - 14, "GiB", [0, 0, 0]);
        c.text(
            left + 8,
            8,
            &format!(
                "device memory, {} rank {}: allocated (blue), reserved (orange)",
                self.role, self.rank
            ),
            [0, 0, 0],
        );
        // The two series.
        for (pick, color) in [
            (
                (|s: &MemorySample| s.reserved) as fn(&MemorySample) -> u64,
                [230, 120, 20],
            ),
            (|s: &MemorySample| s.allocated, [30, 90, 200]),
        ] {
            for pair in self.samples.windows(2) {
                c.line(
                    (x(pair[0].t_us), y(pick(&pair[0]))),
                    (x(pair[1].t_us), y(pick(&pair[1]))),
                    color,
                );
            }
            if let [only] = &self.samples[..] {
                c.fill(
                    x(only.t_us),
                    y(pick(only)),
                    x(only.t_us) + 2,
                    y(pick(only)) + 2,
                    color,
                );
            }
        }
        c.encode()
    }
}

/// An RGB raster with the few drawing operations the plot needs.
struct Canvas {
    w: usize,
    h: usize,
    rgb: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Self {
            w,
            h,
            rgb: vec![255; w * h * 3],
        }
    }

    fn put(&mut self, x: usize, y: usize, color: [u8; 3]) {
        if x < self.w && y < self.h {
            let i = (y * self.w + x) * 3;
            self.rgb[i..i + 3].copy_from_slice(&color);
        }
    }

    fn fill(&mut self, x0: usize, y0: usize, x1: usize, y1: usize, color: [u8; 3]) {
        for y in y0..y1.min(self.h) {
            for x in x0..x1.min(self.w) {
                self.put(x, y, color);
            }
        }
    }

    /// A two-pixel-thick line (Bresenham).
    fn line(&mut self, from: (usize, usize), to: (usize, usize), color: [u8; 3]) {
        let (mut x0, mut y0) = (from.0 as i64, from.1 as i64);
        let (x1, y1) = (to.0 as i64, to.1 as i64);
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        loop {
            self.put(x0 as usize, y0 as usize, color);
            self.put(x0 as usize, y0 as usize + 1, color);
            if x0 == x1 && y0 == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x0 += sx;
            }
            if e2 <= dx {
                err += dx;
                y0 += sy;
            }
        }
    }

    /// ASCII text in the 8x8 public-domain font (other characters show as `?`).
    fn text(&mut self, x: usize, y: usize, text: &str, color: [u8; 3]) {
        for (i, ch) in text.chars().enumerate() {
            let code = if ch.is_ascii() {
                ch as usize
            } else {
                '?' as usize
            };
            let glyph = font8x8::legacy::BASIC_LEGACY[code];
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits & (1 << col) != 0 {
                        self.put(x + i * 8 + col, y + row, color);
                    }
                }
            }
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut encoder = png::Encoder::new(&mut out, self.w as u32, self.h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        // Writing to memory cannot fail for a well-formed raster.
        let mut writer = encoder.write_header().expect("PNG header");
        writer.write_image_data(&self.rgb).expect("PNG data");
        writer.finish().expect("PNG end");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::prelude::*;

    #[test]
    fn samples_carry_their_phase_and_stack_and_the_cap_keeps_the_latest() {
        let subscriber = tracing_subscriber::registry().with(crate::TraceLayer);
        tracing::subscriber::with_default(subscriber, || {
            let capture = MemoryCapture::begin("actor", 1, 3, 2);
            let usage = |gib: u64| MemoryUsage {
                allocated: gib << 30,
                reserved: (gib + 1) << 30,
                device_used: 0,
                device_total: 0,
            };
            {
                let _m = tracing::info_span!(
                    "method",
                    otel.name = "update_actor",
                    role = "actor",
                    rank = 1u64
                )
                .entered();
                verl_core::memory::record(usage(1));
                let _mb = tracing::info_span!("micro_batch").entered();
                let _d = tracing::info_span!("device", otel.name = "mlp", device = true).entered();
                verl_core::memory::record(usage(4));
            }
            {
                let _m =
                    tracing::info_span!("compute_log_prob", role = "actor", rank = 1u64).entered();
                verl_core::memory::record(usage(2));
                verl_core::memory::record(usage(3));
            }
            // Other ranks' and untagged samples are not this timeline's.
            drop(tracing::info_span!("x", role = "actor", rank = 11u64).entered());
            verl_core::memory::record(usage(9));
            let t = capture.finish();
            assert_eq!(t.dropped, 1, "four samples, three kept");
            assert_eq!(t.samples.len(), 3);
            assert_eq!(t.samples[0].phase, "update_actor");
            assert_eq!(
                t.samples[0].stack,
                ["micro_batch", "mlp"],
                "the innermost two"
            );
            assert_eq!(t.samples[0].allocated, 4 << 30);
            let phases = t.phases();
            assert_eq!(phases.len(), 2);
            assert_eq!(
                (phases[1].phase.as_str(), phases[1].samples),
                ("compute_log_prob", 2)
            );
            assert_eq!(phases[1].peak_reserved, 4 << 30);
            let dir = tempfile::tempdir().unwrap();
            let [json, png] = t.write(&dir.path().join("step1_memory_rank-1")).unwrap();
            let back: serde_json::Value =
                serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
            assert_eq!(back["phases"][0]["phase"], "update_actor");
            assert_eq!(back["samples"].as_array().unwrap().len(), 3);
            let png = std::fs::read(png).unwrap();
            let decoder = png::Decoder::new(&png[..]);
            let reader = decoder.read_info().unwrap();
            assert_eq!((reader.info().width, reader.info().height), (1200, 600));
        });
    }
}

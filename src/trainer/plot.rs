//! `metrics.png`: score and response length against step, redrawn as training goes.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

/// One point per step of what the plot shows.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub score: Vec<(f64, f64)>,
    pub val_score: Vec<(f64, f64)>,
    pub response_length: Vec<(f64, f64)>,
}

/// Registers a system sans-serif font for labels, once; false when none is found (the plot
/// is then drawn without text rather than not at all).
fn font_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        const CANDIDATES: &[&str] = &[
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/System/Library/Fonts/Supplemental/Arial.ttf",
        ];
        CANDIDATES.iter().any(|p| {
            std::fs::read(p).ok().is_some_and(|bytes| {
                // The registry keeps fonts for the process's life.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            })
        })
    })
}

fn range(points: &[&[(f64, f64)]], pad_zero: bool) -> (f64, f64) {
    let ys = points.iter().flat_map(|p| p.iter().map(|&(_, y)| y));
    let (lo, hi) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    if lo > hi {
        return (0.0, 1.0);
    }
    let lo = if pad_zero { lo.min(0.0) } else { lo };
    let hi = if (hi - lo).abs() < 1e-9 { lo + 1.0 } else { hi };
    (lo, hi + (hi - lo) * 0.05)
}

/// One plotted line: its legend label, its (step, value) points and its colour.
type Line<'a> = (&'a str, &'a [(f64, f64)], RGBColor);

/// Draws `history` into `path` (PNG, 1000×700): score (train and validation) on top, response
/// length below.
pub fn draw(path: &Path, history: &History, title: &str) -> Result<(), String> {
    let text = font_available();
    let root = BitMapBackend::new(path, (1000, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((2, 1));
    let last_step = history
        .score
        .iter()
        .chain(&history.val_score)
        .map(|&(x, _)| x)
        .fold(1.0, f64::max);
    let series: [(&str, Vec<Line>); 2] = [
        (
            "score",
            vec![
                ("critic/score/mean", &history.score, BLUE),
                ("val/score/mean", &history.val_score, RED),
            ],
        ),
        (
            "response length",
            vec![("response_length/mean", &history.response_length, GREEN)],
        ),
    ];
    for (area, (name, lines)) in panels.iter().zip(series) {
        let all: Vec<&[(f64, f64)]> = lines.iter().map(|(_, p, _)| *p).collect();
        let (lo, hi) = range(&all, true);
        let mut builder = ChartBuilder::on(area);
        builder
            .margin(12)
            .x_label_area_size(if text { 30 } else { 0 });
        builder.y_label_area_size(if text { 50 } else { 0 });
        if text {
            builder.caption(format!("{title}: {name}"), ("sans-serif", 20));
        }
        let mut chart = builder
            .build_cartesian_2d(0.0..last_step, lo..hi)
            .map_err(|e| e.to_string())?;
        let mut mesh = chart.configure_mesh();
        mesh.x_desc("step");
        if !text {
            mesh.disable_x_axis().disable_y_axis();
        }
        mesh.draw().map_err(|e| e.to_string())?;
        for (label, points, color) in lines {
            let s = chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?;
            if text {
                s.label(label).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            }
            if points.len() < 40 {
                chart
                    .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| e.to_string())?;
            }
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::LowerRight)
                .draw()
                .map_err(|e| e.to_string())?;
        }
    }
    root.present().map_err(|e| e.to_string())
}

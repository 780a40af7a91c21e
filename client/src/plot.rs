//! `exactscore compare --plot`: perplexity (or mean KLD) vs bits per weight, and per-window
//! mean NLL.
//! `.svg` → SVG, anything else → PNG. Text uses a font compiled into the binary (Ubuntu Light from
//! `epaint_default_fonts`), so no system fonts are needed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use crate::report::Report;

#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {message}")]
pub struct PlotError {
    pub path: String,
    pub message: String,
}

static FONTS: Once = Once::new();

fn register_fonts() {
    FONTS.call_once(|| {
        for name in ["sans-serif", "serif", "monospace"] {
            // The font is valid: a failure here would only lose text, never panic.
            let _ = plotters::style::register_font(
                name,
                FontStyle::Normal,
                epaint_default_fonts::UBUNTU_LIGHT,
            );
        }
    });
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draw the comparison of `reports` (label, report) into `path`.
pub fn plot(reports: &[(String, Report)], path: &Path) -> Result<(), PlotError> {
    register_fonts();
    let perr = |e: String| PlotError {
        path: path.display().to_string(),
        message: e,
    };
    let is_svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let size = (1400, 560);
    if is_svg {
        let root = SVGBackend::new(path, size).into_drawing_area();
        draw(root, reports).map_err(perr)
    } else {
        let root = BitMapBackend::new(path, size).into_drawing_area();
        draw(root, reports).map_err(perr)
    }
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    reports: &[(String, Report)],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (left, right) = root.split_horizontally(560);

    // Left: perplexity (or, when every report is an `exactscore kld` one, the mean KLD from
    // the reference) vs bits per weight.
    let kld = reports.iter().all(|(_, r)| r.kld.is_some());
    let (caption, y_desc) = if kld {
        ("Mean KLD vs bits per weight", "mean KLD (nats/token)")
    } else {
        ("Perplexity vs bits per weight", "perplexity")
    };
    let pts: Vec<(usize, f64, f64, f64)> = reports
        .iter()
        .enumerate()
        .filter_map(|(i, (_, r))| {
            let bpw = r.server_info.as_ref()?.bits_per_weight;
            let (y, se) = match &r.kld {
                Some(k) if kld => (k.mean_kld, k.mean_kld_stderr),
                _ => (r.stats.perplexity, r.stats.perplexity_stderr),
            };
            Some((i, bpw, y, se.unwrap_or(0.0)))
        })
        .filter(|p| p.1.is_finite() && p.2.is_finite())
        .collect();
    let (x0, x1) = range(pts.iter().map(|p| p.1), 0.5);
    let (y0, y1) = range(
        pts.iter()
            .flat_map(|p| [p.2 - p.3, p.2 + p.3])
            .chain(pts.iter().map(|p| p.2)),
        0.05,
    );
    let mut chart = ChartBuilder::on(&left)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("bits per weight")
        .y_desc(y_desc)
        .draw()
        .map_err(e)?;
    for &(i, x, y, se) in &pts {
        let c = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(std::iter::once(Circle::new((x, y), 5, c.filled())))
            .map_err(e)?;
        if se > 0.0 {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(x, y - se), (x, y + se)],
                    c.stroke_width(2),
                )))
                .map_err(e)?;
        }
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((x, y))
                    + Text::new(
                        reports[i].0.clone(),
                        (8, -16),
                        ("sans-serif", 14).into_font().color(&c),
                    ),
            ))
            .map_err(e)?;
    }

    // Right: per-window mean NLL.
    let series: Vec<Vec<(f64, f64)>> = reports
        .iter()
        .map(|(_, r)| {
            r.per_window
                .iter()
                .filter(|w| w.count > 0)
                .map(|w| (w.window as f64, w.sum_nll / w.count as f64))
                .collect()
        })
        .collect();
    let (wx0, wx1) = range(series.iter().flatten().map(|p| p.0), 0.0);
    let (wy0, wy1) = range(series.iter().flatten().map(|p| p.1), 0.05);
    let mut chart = ChartBuilder::on(&right)
        .caption("Mean NLL per window", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(wx0..wx1, wy0..wy1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("window")
        .y_desc("mean NLL (nats/token)")
        .draw()
        .map_err(e)?;
    for (i, ((label, _), s)) in reports.iter().zip(&series).enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(s.iter().copied(), c.stroke_width(1)))
            .map_err(e)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

/// A non-empty axis range covering `values`, padded by `pad` (fraction of the span, or absolute
/// when the span is 0).
fn range(values: impl Iterator<Item = f64>, pad: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    if span <= 0.0 {
        let p = if lo.abs() > 0.0 { lo.abs() * 0.1 } else { 1.0 };
        return (lo - p, hi + p);
    }
    (lo - span * pad, hi + span * pad.max(0.0001))
}

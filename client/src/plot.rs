//! `exactscore compare --plot`: perplexity (or mean KLD) vs bits per weight, and per-window
//! mean NLL; with `exactscore kld` reports also a second row: the KLD spread band (median and
//! p25–p75 of the per-token KLD against bits per weight, a bf16 noise floor as a dashed line where
//! a report has one) and each report's per-token KLD histogram (log-spaced bins).
//! `exactscore diff --plot`: per layer, the cosine error and the SQNR of one or several reports.
//! Every figure has a title and a subtitle naming the dataset, method, ctx, windows and dtype, so
//! that the image alone says what it measured. `.svg` → SVG, `.png` → PNG. Text uses DejaVu Sans,
//! compiled into the binary (`client/fonts/`, with its licence), so no system fonts are needed.

use std::path::Path;
use std::sync::Once;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::diff::DiffReport;
use crate::report::Report;

#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {message}")]
pub struct PlotError {
    pub path: String,
    pub message: String,
}

static FONTS: Once = Once::new();

/// DejaVu Sans (Bitstream Vera licence: `client/fonts/LICENSE-DejaVu.txt`).
pub const FONT: &[u8] = include_bytes!("../fonts/DejaVuSans.ttf");

fn register_fonts() {
    FONTS.call_once(|| {
        for name in ["sans-serif", "serif", "monospace"] {
            // The font is valid: a failure here would only lose text, never panic.
            let _ = plotters::style::register_font(name, FontStyle::Normal, FONT);
        }
    });
}

/// Height of the title band above the charts, pixels.
const TITLE_HEIGHT: u32 = 64;

/// Draws `title` and `subtitle` at the top of `root`; returns the area below them.
fn titled<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    subtitle: &str,
) -> Result<DrawingArea<DB, plotters::coord::Shift>, String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (top, rest) = root.split_vertically(TITLE_HEIGHT);
    top.draw_text(
        title,
        &("sans-serif", 24).into_font().color(&BLACK),
        (16, 8),
    )
    .map_err(e)?;
    top.draw_text(
        subtitle,
        &("sans-serif", 16).into_font().color(&RGBColor(80, 80, 80)),
        (16, 38),
    )
    .map_err(e)?;
    Ok(rest)
}

/// The distinct values of `values`, in first-seen order, joined with ` / `.
fn distinct(values: impl Iterator<Item = String>) -> String {
    let mut seen: Vec<String> = vec![];
    for v in values {
        if !seen.contains(&v) {
            seen.push(v);
        }
    }
    seen.join(" / ")
}

/// `dataset wikitext2 · method exl3 · ctx 2048 · stride 512 · 40 windows · dtype f32`: what the
/// reports of a comparison measured (several values where they differ).
pub fn compare_subtitle(reports: &[(String, Report)]) -> String {
    let rs = || reports.iter().map(|(_, r)| r);
    let dtype = distinct(rs().map(|r| {
        r.server_info
            .as_ref()
            .map_or_else(|| "?".into(), |i| i.dtype.clone())
    }));
    format!(
        "dataset {} · method {} · ctx {} · stride {} · {} windows · dtype {}",
        distinct(rs().map(|r| r.dataset.name.clone())),
        distinct(rs().map(|r| r.method.to_string())),
        distinct(rs().map(|r| r.ctx.to_string())),
        distinct(rs().map(|r| r.stride.to_string())),
        distinct(rs().map(|r| r.stats.windows.to_string())),
        dtype
    )
}

/// The same for `exactscore diff` reports: dataset, ctx, windows, both dtypes.
pub fn diff_subtitle(reports: &[(String, DiffReport)]) -> String {
    let rs = || reports.iter().map(|(_, r)| r);
    let dtype = distinct(rs().map(|r| {
        let i = r.server_info.as_ref();
        format!(
            "{} vs reference {}",
            i.map_or("?", |i| i.dtype.as_str()),
            i.and_then(|i| i.reference.as_ref())
                .and_then(|r| r.dtype.as_deref())
                .unwrap_or("?")
        )
    }));
    format!(
        "dataset {} · /diff, disjoint windows · ctx {} · {} windows · dtype {}",
        distinct(rs().map(|r| r.dataset.clone())),
        distinct(rs().map(|r| r.ctx.to_string())),
        distinct(rs().map(|r| r.windows.to_string())),
        dtype
    )
}

/// A tick label with at most 4 significant digits and no trailing zeros: `33300`, `12.35`,
/// `0.004`.
pub fn tick(v: &f64) -> String {
    if *v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = (3 - v.abs().log10().floor() as i32).clamp(0, 8) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A log axis's range covering `lo..=hi` (both > 0): widened to whole decades (and 2 % beyond
/// them), so that at least two labelled powers of ten are on it however narrow the data.
pub fn decade_range(lo: f64, hi: f64) -> (f64, f64) {
    let (a, b) = (lo.max(f64::MIN_POSITIVE).log10(), hi.max(lo).log10());
    let (a, mut b) = (a.floor(), b.ceil());
    if b <= a {
        b = a + 1.0;
    }
    // A hair beyond the powers of ten, so that rounding cannot drop their ticks.
    (10f64.powf(a) * 0.98, 10f64.powf(b) * 1.02)
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

/// A picture that plotters can draw on any backend.
trait Picture {
    fn draw<DB: DrawingBackend>(
        &self,
        root: DrawingArea<DB, plotters::coord::Shift>,
    ) -> Result<(), String>
    where
        DB::ErrorType: 'static;
}

/// The file types a plot can be written as.
pub const EXTENSIONS: [&str; 2] = ["png", "svg"];

/// Refuses a plot path whose extension is not one of [`EXTENSIONS`] (checked before a run, so
/// that a typo does not cost one).
pub fn check_path(path: &Path) -> Result<(), PlotError> {
    let ext = path.extension().map(|e| e.to_string_lossy().to_lowercase());
    match ext.as_deref() {
        Some(e) if EXTENSIONS.contains(&e) => Ok(()),
        other => Err(PlotError {
            path: path.display().to_string(),
            message: format!(
                "cannot write {}: the supported plot formats are .png and .svg",
                other.map_or("a file without an extension".into(), |e| format!(".{e}"))
            ),
        }),
    }
}

/// Draws `picture` of `size` pixels into `path` (`.svg` or `.png`).
fn render(path: &Path, size: (u32, u32), picture: &impl Picture) -> Result<(), PlotError> {
    check_path(path)?;
    register_fonts();
    let perr = |e: String| PlotError {
        path: path.display().to_string(),
        message: e,
    };
    let is_svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    if is_svg {
        picture
            .draw(SVGBackend::new(path, size).into_drawing_area())
            .map_err(perr)
    } else {
        picture
            .draw(BitMapBackend::new(path, size).into_drawing_area())
            .map_err(perr)
    }
}

/// The charts of `exactscore compare`.
struct Comparison<'a>(&'a [(String, Report)]);

impl Picture for Comparison<'_> {
    fn draw<DB: DrawingBackend>(
        &self,
        root: DrawingArea<DB, plotters::coord::Shift>,
    ) -> Result<(), String>
    where
        DB::ErrorType: 'static,
    {
        draw(root, self.0)
    }
}

/// Draw the comparison of `reports` (label, report) into `path`.
pub fn plot(reports: &[(String, Report)], path: &Path) -> Result<(), PlotError> {
    let rows = if reports.iter().any(|(_, r)| r.kld.is_some()) {
        2
    } else {
        1
    };
    render(
        path,
        (1400, TITLE_HEIGHT + 560 * rows),
        &Comparison(reports),
    )
}

/// The charts of `exactscore diff`: per layer, the cosine error (log scale) and the SQNR of
/// every report.
struct LayerErrors<'a>(&'a [(String, DiffReport)]);

/// Draw the per-layer errors of `reports` (label, report) into `path`.
pub fn plot_diff(reports: &[(String, DiffReport)], path: &Path) -> Result<(), PlotError> {
    render(path, (1400, TITLE_HEIGHT + 560), &LayerErrors(reports))
}

impl Picture for LayerErrors<'_> {
    fn draw<DB: DrawingBackend>(
        &self,
        root: DrawingArea<DB, plotters::coord::Shift>,
    ) -> Result<(), String>
    where
        DB::ErrorType: 'static,
    {
        let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
        let models = distinct(self.0.iter().map(|(l, _)| l.clone()));
        let root = titled(
            &root,
            &format!("Where the error enters, layer by layer: {models}"),
            &diff_subtitle(self.0),
        )?;
        let (left, right) = root.split_horizontally(700);
        let layers = self
            .0
            .iter()
            .map(|(_, r)| r.layers.len())
            .max()
            .unwrap_or(1);
        let x = -0.5..layers as f64 - 0.5;
        let layer_ticks = (layers + 1).min(17);
        let cos = |l: &crate::diff::LayerSummary| l.mean_cos_error.max(1e-12);
        let sqnr = |l: &crate::diff::LayerSummary| l.mean_sqnr_db;
        let (c0, c1) = range(
            self.0.iter().flat_map(|(_, r)| r.layers.iter().map(cos)),
            0.0,
        );
        let (c0, c1) = decade_range(c0, c1);
        let (s0, s1) = range(
            self.0.iter().flat_map(|(_, r)| r.layers.iter().map(sqnr)),
            0.08,
        );
        let mut chart = ChartBuilder::on(&left)
            .caption("Cosine error per layer", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(x.clone(), (c0..c1).log_scale())
            .map_err(e)?;
        chart
            .configure_mesh()
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .x_desc("decoder layer")
            .x_labels(layer_ticks)
            .x_label_formatter(&whole_numbers)
            .y_desc("mean 1 − cos (log scale)")
            .y_label_formatter(&|v| format!("{v:.0e}"))
            .draw()
            .map_err(e)?;
        per_layer_lines(&mut chart, self.0, cos, SeriesLabelPosition::LowerRight)?;
        let mut chart = ChartBuilder::on(&right)
            .caption("SQNR per layer", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x, s0..s1)
            .map_err(e)?;
        chart
            .configure_mesh()
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .x_desc("decoder layer")
            .x_labels(layer_ticks)
            .x_label_formatter(&whole_numbers)
            .y_desc("mean SQNR (dB)")
            .y_label_formatter(&tick)
            .draw()
            .map_err(e)?;
        per_layer_lines(&mut chart, self.0, sqnr, SeriesLabelPosition::UpperRight)?;
        root.present().map_err(e)
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
    let kld_all = reports.iter().all(|(_, r)| r.kld.is_some());
    let title = if kld_all {
        "KL-divergence from the reference, by bits per weight"
    } else {
        "Perplexity by bits per weight"
    };
    let root = titled(&root, title, &compare_subtitle(reports))?;
    let (top, bottom) = root.split_vertically(560);
    if reports.iter().any(|(_, r)| r.kld.is_some()) {
        let (left, right) = bottom.split_horizontally(560);
        draw_kld_spread(&left, reports)?;
        draw_kld_histograms(&right, reports)?;
    }
    let (left, right) = top.split_horizontally(560);
    draw_by_bpw(&left, reports, kld_all)?;
    draw_window_nll(&right, reports)?;
    root.present().map_err(e)?;
    Ok(())
}

/// Perplexity (or, when every report is an `exactscore kld` one, the mean KLD from the
/// reference) against bits per weight, each report a labelled point with its ± SE.
fn draw_by_bpw<DB: DrawingBackend>(
    left: &DrawingArea<DB, plotters::coord::Shift>,
    reports: &[(String, Report)],
    kld: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    let (caption, y_desc) = if kld {
        ("Mean KLD vs bits per weight", "mean KLD (nats/token)")
    } else {
        ("Perplexity vs bits per weight", "perplexity")
    };
    let pts = bpw_points(reports, kld);
    let (x0, x1) = bpw_range(pts.iter().map(|p| p.1));
    let (y0, y1) = range(
        pts.iter()
            .flat_map(|p| [p.2 - p.3, p.2 + p.3])
            .chain(pts.iter().map(|p| p.2)),
        0.12,
    );
    let mut chart = ChartBuilder::on(left)
        .caption(caption, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_desc(BPW_AXIS)
        .y_desc(y_desc)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .draw()
        .map_err(e)?;
    for &(i, x, y, se) in &pts {
        let c = PALETTE[i % PALETTE.len()];
        let bar = vec![(x, y - se), (x, y + se)];
        chart
            .draw_series(std::iter::once(Circle::new((x, y), 5, c.filled())))
            .map_err(e)?;
        chart
            .draw_series((se > 0.0).then(|| PathElement::new(bar, c.stroke_width(2))))
            .map_err(e)?;
        let label = &reports[i].0;
        let font = ("sans-serif", 14).into_font().color(&c);
        let offset = label_offset(label, x > (x0 + x1) / 2.0);
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((x, y)) + Text::new(label.clone(), offset, font),
            ))
            .map_err(e)?;
    }
    Ok(())
}

/// Per report with a known bits per weight: (index, bpw, perplexity or mean KLD, its SE).
fn bpw_points(reports: &[(String, Report)], kld: bool) -> Vec<(usize, f64, f64, f64)> {
    reports
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
        .collect()
}

/// Each report's mean NLL per window.
fn draw_window_nll<DB: DrawingBackend>(
    right: &DrawingArea<DB, plotters::coord::Shift>,
    reports: &[(String, Report)],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
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
    let mut chart = ChartBuilder::on(right)
        .caption("Mean NLL per window", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(wx0..wx1, wy0..wy1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_desc("window")
        .y_desc("mean NLL (nats/token)")
        .x_label_formatter(&whole_numbers)
        .y_label_formatter(&tick)
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
    draw_legend(&mut chart, SeriesLabelPosition::MiddleRight)
}

/// The x axis of every bits-per-weight chart.
const BPW_AXIS: &str = "bits per weight (decoder Linears, scales included, lm_head excluded)";

/// A bits-per-weight range covering `values` with room for the point labels: at least 1 bit
/// wide, never below 0.
fn bpw_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = range(values, 0.0);
    let pad = ((hi - lo) * 0.15).max(0.5);
    ((lo - pad).max(0.0), hi + pad)
}

/// Where a report's name goes beside its point (pixels from it): right of it, or left of it in
/// the right half of a chart, so that it stays inside the frame.
fn label_offset(label: &str, left: bool) -> (i32, i32) {
    // DejaVu Sans at 14 px: digits and lower case are about 8 px wide.
    let width = 8 * label.chars().count() as i32;
    (if left { -(width + 8) } else { 8 }, -18)
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

/// One report's per-token KLD quartiles at its bits per weight.
#[derive(Debug, Clone, PartialEq)]
pub struct SpreadPoint {
    /// Index of the report (its colour).
    pub report: usize,
    pub bits_per_weight: f64,
    pub p25: f64,
    pub median: f64,
    pub p75: f64,
    /// The report's weight formats (`nvfp4`, `pack_quantized`, ...): a band and a median line
    /// join only points of one family, never two formats as if they were one curve.
    pub family: String,
}

/// The KLD spread of every `exactscore kld` report with a known bits per weight, by bits per
/// weight (reports from before p25/p75 existed have them 0 and are left out).
pub fn spread_points(reports: &[(String, Report)]) -> Vec<SpreadPoint> {
    let mut points: Vec<SpreadPoint> = reports
        .iter()
        .enumerate()
        .filter_map(|(report, (_, r))| {
            let k = r.kld.as_ref()?;
            let info = r.server_info.as_ref()?;
            let bits_per_weight = info.bits_per_weight;
            let mut formats: Vec<&str> = info.formats.values().map(String::as_str).collect();
            formats.sort_unstable();
            formats.dedup();
            let point = SpreadPoint {
                report,
                bits_per_weight,
                p25: k.p25_kld,
                median: k.median_kld,
                p75: k.p75_kld,
                family: formats.join("+"),
            };
            let known = [bits_per_weight, point.p25, point.median, point.p75]
                .iter()
                .all(|v| v.is_finite())
                && point.p75 >= point.p25
                && point.p75 > 0.0;
            known.then_some(point)
        })
        .collect();
    points.sort_by(|a, b| a.bits_per_weight.total_cmp(&b.bits_per_weight));
    points
}

/// The smallest KLD the log axes show: smaller values (a model against itself: 0) sit on it.
pub const KLD_FLOOR: f64 = 1e-6;

fn log_kld(k: f64) -> f64 {
    k.max(KLD_FLOOR).log10()
}

/// A KLD range for a log axis covering `values` (clamped at [`KLD_FLOOR`]), in whole decades
/// with a quarter of a decade of room on both sides.
fn log_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = range(values.map(log_kld), 0.0);
    decade_range(10f64.powf(lo - 0.25), 10f64.powf(hi + 0.25))
}

/// Bins of [`kld_histogram`]: per decade of KLD.
pub const BINS_PER_DECADE: usize = 8;

/// A histogram of per-token KLDs over log-spaced bins from [`KLD_FLOOR`] up: per bin, the
/// log10 of its lower edge and the share of the tokens in it, in percent (values at or below
/// the floor in the first bin). Empty for no values.
pub fn kld_histogram(values: &[f64]) -> Vec<(f64, f64)> {
    if values.is_empty() {
        return Vec::new();
    }
    let width = 1.0 / BINS_PER_DECADE as f64;
    let lowest = KLD_FLOOR.log10();
    let bin = |k: f64| ((log_kld(k) - lowest) / width).floor().max(0.0) as usize;
    let top = values.iter().map(|&k| bin(k)).max().unwrap_or(0);
    let mut counts = vec![0usize; top + 1];
    for &k in values {
        counts[bin(k)] += 1;
    }
    let n = values.len() as f64;
    counts
        .iter()
        .enumerate()
        .map(|(i, &c)| (lowest + i as f64 * width, 100.0 * c as f64 / n))
        .collect()
}

/// A report's KLD histogram: from its per-token values, or, when the report keeps none
/// (`exactscore kld --json` without `--per-token`), the one its statistics carry.
fn report_histogram(r: &Report) -> Vec<(f64, f64)> {
    let values: Vec<f64> = r
        .per_window
        .iter()
        .filter_map(|w| w.kld.as_ref())
        .flat_map(|k| k.kld.iter().copied())
        .collect();
    if !values.is_empty() {
        return kld_histogram(&values);
    }
    let width = 1.0 / BINS_PER_DECADE as f64;
    let stored = r.kld.as_ref().map_or(&[][..], |k| &k.histogram[..]);
    stored
        .iter()
        .enumerate()
        .map(|(i, &share)| (KLD_FLOOR.log10() + i as f64 * width, share))
        .collect()
}

/// A KLD as an axis label: `0.01`, `0.5`, `1`, or `1e-3` below 0.01.
fn kld_label(x: &f64) -> String {
    if (1e-2..1e3).contains(x) {
        format!("{}", (x * 1e4).round() / 1e4)
    } else {
        format!("{x:.0e}")
    }
}

/// A layer axis's label: its whole numbers only.
fn whole_numbers(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        String::new()
    }
}

/// One line with points per report: `value` of every layer, with a legend at `legend`.
fn per_layer_lines<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    reports: &[(String, DiffReport)],
    value: impl Fn(&crate::diff::LayerSummary) -> f64,
    legend: SeriesLabelPosition,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64>,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    for (i, (label, r)) in reports.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let points: Vec<(f64, f64)> = r
            .layers
            .iter()
            .map(|l| (l.layer as f64, value(l)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
            .map_err(e)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(e)?;
    }
    draw_legend(chart, legend)
}

/// Median KLD (line and points) with its p25–p75 band against bits per weight, log KLD axis;
/// a report's noise floor (median) as a dashed line.
fn draw_kld_spread<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    reports: &[(String, Report)],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    let points = spread_points(reports);
    let floors: Vec<(usize, f64)> = reports
        .iter()
        .enumerate()
        .filter_map(|(i, (_, r))| Some((i, r.noise_floor.as_ref()?.kld.median_kld)))
        .filter(|(_, m)| m.is_finite())
        .collect();
    let (x0, x1) = bpw_range(points.iter().map(|p| p.bits_per_weight));
    let (y0, y1) = log_range(
        points
            .iter()
            .flat_map(|p| [p.p25, p.p75])
            .chain(floors.iter().map(|f| f.1)),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(
            "KLD spread vs bits per weight (median, p25–p75)",
            ("sans-serif", 22),
        )
        .margin(12)
        .margin_right(24)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
        .map_err(e)?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_desc(BPW_AXIS)
        .y_desc("per-token KLD (nats, log scale)")
        .x_label_formatter(&tick)
        .y_label_formatter(&kld_label)
        .draw()
        .map_err(e)?;
    for (band, median) in family_bands(&points) {
        chart
            .draw_series(std::iter::once(Polygon::new(band, PALETTE[0].mix(0.18))))
            .map_err(e)?;
        chart
            .draw_series(LineSeries::new(median, BLACK.stroke_width(1)))
            .map_err(e)?;
    }
    spread_markers(&mut chart, &points, reports, (x0, x1))?;
    noise_floors(&mut chart, &floors, reports, (x0, x1))?;
    Ok(())
}

/// Points of a line or the corners of a polygon, in chart coordinates.
pub type Polyline = Vec<(f64, f64)>;

/// Per weight format with two or more points: the p25–p75 band (a polygon) and the median
/// line. Points of different formats are never joined.
pub fn family_bands(points: &[SpreadPoint]) -> Vec<(Polyline, Polyline)> {
    let mut families: Vec<&str> = points.iter().map(|p| p.family.as_str()).collect();
    families.sort_unstable();
    families.dedup();
    families
        .into_iter()
        .map(|family| {
            points
                .iter()
                .filter(|p| p.family == family)
                .collect::<Vec<_>>()
        })
        .filter(|group| group.len() >= 2)
        .map(|group| {
            let at = |p: &&SpreadPoint, v: f64| (p.bits_per_weight, v.max(KLD_FLOOR));
            let band = group
                .iter()
                .map(|p| at(p, p.p75))
                .chain(group.iter().rev().map(|p| at(p, p.p25)))
                .collect();
            let median = group.iter().map(|p| at(p, p.median)).collect();
            (band, median)
        })
        .collect()
}

/// Each report's median (a labelled point) and its p25–p75 bar.
fn spread_markers<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    points: &[SpreadPoint],
    reports: &[(String, Report)],
    (x0, x1): (f64, f64),
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64>,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    for p in points {
        let c = PALETTE[p.report % PALETTE.len()];
        let (x, y) = (p.bits_per_weight, p.median.max(KLD_FLOOR));
        let bar = vec![(x, p.p25.max(KLD_FLOOR)), (x, p.p75.max(KLD_FLOOR))];
        chart
            .draw_series(std::iter::once(PathElement::new(bar, c.stroke_width(3))))
            .map_err(e)?;
        chart
            .draw_series(std::iter::once(Circle::new((x, y), 5, c.filled())))
            .map_err(e)?;
        let label = &reports[p.report].0;
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((x, y))
                    + Text::new(
                        label.clone(),
                        label_offset(label, x > (x0 + x1) / 2.0),
                        ("sans-serif", 14).into_font().color(&c),
                    ),
            ))
            .map_err(e)?;
    }
    Ok(())
}

/// The reports' noise floors (median) as dashed lines across the chart, with their legend in
/// the lower left (the band runs from the upper left, few bits and a large KLD, to the lower
/// right).
fn noise_floors<'a, DB, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, Y>>,
    floors: &[(usize, f64)],
    reports: &[(String, Report)],
    (x0, x1): (f64, f64),
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    Y: Ranged<ValueType = f64>,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    if floors.is_empty() {
        return Ok(());
    }
    for &(i, median) in floors {
        let c = PALETTE[i % PALETTE.len()];
        let y = median.max(KLD_FLOOR);
        chart
            .draw_series(DashedLineSeries::new(
                [(x0, y), (x1, y)],
                8,
                6,
                c.stroke_width(2),
            ))
            .map_err(e)?
            .label(format!("bf16 noise floor (median), {}", reports[i].0))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    draw_legend(chart, SeriesLabelPosition::LowerLeft)
}

/// Each report's per-token KLD histogram ([`kld_histogram`]) as a step line.
fn draw_kld_histograms<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    reports: &[(String, Report)],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    let histograms: Vec<(usize, Vec<(f64, f64)>)> = reports
        .iter()
        .enumerate()
        .filter(|(_, (_, r))| r.kld.is_some())
        .map(|(i, (_, r))| (i, report_histogram(r)))
        .collect();
    let width = 1.0 / BINS_PER_DECADE as f64;
    // From the first bin that holds a token in any histogram to past the last.
    let filled = || {
        histograms
            .iter()
            .flat_map(|(_, h)| h.iter().filter(|b| b.1 > 0.0).map(|b| b.0))
    };
    let first = filled().fold(f64::INFINITY, f64::min);
    let last = filled().fold(f64::NEG_INFINITY, f64::max);
    let (x0, x1) = if first.is_finite() {
        decade_range(10f64.powf(first - width), 10f64.powf(last + 2.0 * width))
    } else {
        (KLD_FLOOR, 1.0)
    };
    let y1 = histograms
        .iter()
        .flat_map(|(_, h)| h.iter().map(|b| b.1))
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.08;
    let mut chart = ChartBuilder::on(area)
        .caption("Per-token KLD histogram", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1).log_scale(), 0.0..y1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .x_desc(format!(
            "per-token KLD (nats, log scale; {BINS_PER_DECADE} bins per decade)"
        ))
        .y_desc("tokens (% per bin)")
        .x_label_formatter(&kld_label)
        .y_label_formatter(&tick)
        .draw()
        .map_err(e)?;
    for (i, h) in &histograms {
        let c = PALETTE[i % PALETTE.len()];
        // A step line: each bin a flat segment over its width.
        let steps: Vec<(f64, f64)> = h
            .iter()
            .filter(|&&(x, _)| x >= first - width)
            .flat_map(|&(x, y)| [(10f64.powf(x), y), (10f64.powf(x + width), y)])
            .collect();
        chart
            .draw_series(LineSeries::new(steps, c.stroke_width(2)))
            .map_err(e)?
            .label(reports[*i].0.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

/// Every chart's legend: a light box with a black border and 14-pixel labels at `position`.
fn draw_legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: plotters::coord::CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bins_are_log_spaced_and_sum_to_all_tokens() {
        // 0 and 1e-7 fall in the floor's bin; 1e-3 starts bin 24; 0.0012 (log10 −2.92) is in
        // it too; 1.0 starts bin 48.
        let h = kld_histogram(&[0.0, 1e-7, 1e-3, 0.0012, 1.0]);
        assert_eq!(h.len(), 49);
        assert!((h[0].0 + 6.0).abs() < 1e-12 && (h[48].0 - 0.0).abs() < 1e-12);
        assert_eq!((h[0].1, h[24].1, h[48].1), (40.0, 40.0, 20.0));
        assert!((h.iter().map(|b| b.1).sum::<f64>() - 100.0).abs() < 1e-9);
        assert!(kld_histogram(&[]).is_empty());
    }

    #[test]
    fn labels_read_as_plain_numbers_or_powers_of_ten() {
        assert_eq!(kld_label(&1e-3), "1e-3");
        assert_eq!(kld_label(&1.0), "1");
        assert_eq!(kld_label(&0.1), "0.1");
    }
}

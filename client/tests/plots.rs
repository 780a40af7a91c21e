//! Issue 38: every plot kind rendered to SVG and checked for what a reader needs: a title and a
//! subtitle naming dataset, method, ctx, windows and dtype; text inside the frame; at least two
//! labelled ticks on a log axis spanning less than a decade; no band or line joining two weight
//! formats; tick labels without `.0`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use exactscore_client::diff::DiffReport;
use exactscore_client::report::{DatasetSummary, NoiseFloor};
use exactscore_client::{plot, KldStats, Method, Report, Stats, WindowResult};

/// One `<text>` of an SVG: its anchor point, how it hangs from it, its size and content.
#[derive(Debug)]
struct SvgText {
    x: f64,
    y: f64,
    anchor: String,
    size: f64,
    rotated: bool,
    text: String,
}

fn attr_str<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    let end = start + tag[start..].find('"')?;
    Some(&tag[start..end])
}

fn attr(tag: &str, name: &str) -> Option<f64> {
    attr_str(tag, name)?.parse().ok()
}

fn texts(svg: &str) -> Vec<SvgText> {
    svg.split("<text")
        .skip(1)
        .filter_map(|chunk| {
            let close = chunk.find('>')?;
            let body_end = chunk.find("</text>")?;
            let tag = &chunk[..close];
            Some(SvgText {
                x: attr(tag, "x")?,
                y: attr(tag, "y")?,
                anchor: attr_str(tag, "text-anchor").unwrap_or("start").to_string(),
                size: attr(tag, "font-size").unwrap_or(16.0),
                rotated: tag.contains("rotate("),
                text: chunk[close + 1..body_end].trim().to_string(),
            })
        })
        .collect()
}

fn size(svg: &str) -> (f64, f64) {
    let tag = &svg[svg.find("<svg").unwrap()..];
    (attr(tag, "width").unwrap(), attr(tag, "height").unwrap())
}

/// Every text lies inside the picture: its extent from its anchor, at DejaVu Sans's average
/// width of digits and lower case (≈ 0.6 em), between 0 and the width; its baseline between 0
/// and the height.
fn assert_inside(svg: &str) {
    let (w, h) = size(svg);
    for t in texts(svg) {
        let len = 0.6 * t.size * t.text.chars().count() as f64;
        let (start, end) = match (t.rotated, t.anchor.as_str()) {
            (true, _) => (t.x, t.x),
            (false, "middle") => (t.x - len / 2.0, t.x + len / 2.0),
            (false, "end") => (t.x - len, t.x),
            (false, _) => (t.x, t.x + len),
        };
        let ok = start >= 0.0 && end <= w && t.y >= 0.0 && t.y <= h;
        assert!(ok, "{t:?} outside {w}×{h} ({start}..{end})");
    }
}

fn report(model: &str, bpw: f64, format: &str, ppl: f64, kld_median: Option<f64>) -> Report {
    let mut info = common::model_info();
    info.model = model.into();
    info.bits_per_weight = bpw;
    info.formats = BTreeMap::from([("q_proj".into(), format.into())]);
    let per_window: Vec<WindowResult> = (0..8)
        .map(|w| WindowResult {
            window: w,
            sum_nll: ppl.ln() * 100.0 * (1.0 + 0.01 * w as f64),
            count: 100,
            kld: None,
            positions: Vec::new(),
        })
        .collect();
    let kld = kld_median.map(|m| KldStats {
        p25_kld: m / 2.0,
        median_kld: m,
        p75_kld: 2.0 * m,
        histogram: exactscore_client::plot::kld_histogram(&[m / 3.0, m, m, 3.0 * m])
            .into_iter()
            .map(|b| b.1)
            .collect(),
        ..kld_stats(m)
    });
    Report {
        method: Method::Exl3,
        ctx: 512,
        stride: 512,
        max_windows: Some(8),
        tokenize: exactscore_client::tokenize::TokenizeMode::Local,
        dataset: DatasetSummary {
            name: "wikitext2".into(),
            bytes: 1000,
            sha256: "ab".repeat(32),
            documents: 1,
            text_tokens: 800,
            sequence_tokens: 801,
            tokens_sha256: "cd".repeat(32),
        },
        stats: Stats::from_windows(&per_window),
        bits_per_byte: 1.0,
        stderr_method: String::new(),
        resumed_windows: 0,
        wall_time_s: 1.0,
        tokens_per_s: 1.0,
        servers: vec!["http://127.0.0.1:8000".into()],
        server_info: Some(info),
        kld,
        position_buckets: Vec::new(),
        per_window,
        noise_floor: None,
    }
}

fn kld_stats(mean: f64) -> KldStats {
    serde_json::from_value(serde_json::json!({
        "tokens": 800, "mean_kld": mean, "mean_kld_stderr": 0.001, "median_kld": mean,
        "p90_kld": mean, "p99_kld": mean, "p99_9_kld": mean, "max_kld": mean, "same_top": 0.9,
        "same_top_stderr": 0.01, "mean_delta_p": 0.0, "mean_delta_p_stderr": 0.0,
        "rms_delta_p": 0.1, "perplexity": 10.0, "reference_perplexity": 9.0,
        "perplexity_ratio": 1.1, "perplexity_ratio_stderr": 0.01, "ln_perplexity_ratio": 0.1,
        "ln_perplexity_ratio_stderr": 0.01, "p10_kld": mean / 4.0, "p25_kld": mean / 2.0,
        "p75_kld": mean * 2.0
    }))
    .unwrap()
}

fn render_compare(reports: &[(String, Report)], path: &Path) -> String {
    plot::plot(reports, path).unwrap();
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn a_perplexity_comparison_says_what_it_measured_and_keeps_its_labels_inside() {
    let dir = tempfile::tempdir().unwrap();
    let reports = vec![
        (
            "bf16".to_string(),
            report("bf16", 16.0, "dense bf16", 33_300.0, None),
        ),
        (
            "w4a16".to_string(),
            report("w4a16", 4.25, "int4 g128 sym", 33_420.0, None),
        ),
    ];
    let svg = render_compare(&reports, &dir.path().join("ppl.svg"));
    let t = texts(&svg);
    assert!(
        t.iter().any(|t| t.text == "Perplexity by bits per weight"),
        "{t:?}"
    );
    let subtitle = t.iter().find(|t| t.text.starts_with("dataset ")).unwrap();
    for part in [
        "wikitext2",
        "method exl3",
        "ctx 512",
        "8 windows",
        "dtype f32",
    ] {
        assert!(subtitle.text.contains(part), "{}", subtitle.text);
    }
    assert_inside(&svg);
    // Tick labels read as numbers, not `33300.0`; the bits-per-weight axis starts at 0 or above.
    assert!(!t.iter().any(|t| t.text.ends_with(".0")), "{t:?}");
    assert!(t.iter().any(|t| t.text.contains("lm_head excluded")));
}

#[test]
fn a_kld_comparison_joins_only_points_of_one_format() {
    let dir = tempfile::tempdir().unwrap();
    let one_family = vec![
        (
            "a".to_string(),
            report("a", 4.25, "int4 g128 sym", 40.0, Some(0.05)),
        ),
        (
            "b".to_string(),
            report("b", 8.25, "int8 channel sym", 39.0, Some(0.004)),
        ),
        ("c".to_string(), report("c", 4.5, "nvfp4", 40.5, Some(0.04))),
    ];
    let svg = render_compare(&one_family, &dir.path().join("mixed.svg"));
    assert!(!svg.contains("<polygon"), "a band joins two formats");
    assert_inside(&svg);
    let mut same = one_family.clone();
    same[1].1.server_info.as_mut().unwrap().formats =
        BTreeMap::from([("q_proj".into(), "int4 g128 sym".into())]);
    same[0].1.noise_floor = Some(NoiseFloor {
        servers: vec!["http://floor".into()],
        server_info: None,
        kld: kld_stats(0.001),
        wall_time_s: 1.0,
    });
    let svg = render_compare(&same, &dir.path().join("same.svg"));
    assert_eq!(
        svg.matches("<polygon").count(),
        1,
        "one band for the one family of two"
    );
    assert_inside(&svg);
    let t = texts(&svg);
    assert!(t
        .iter()
        .any(|t| t.text.starts_with("KL-divergence from the reference")));
    // The histogram comes from the reports' statistics: no per-token values are kept.
    assert!(t.iter().any(|t| t.text == "Per-token KLD histogram"));
    assert!(svg.matches("<polyline").count() >= 3, "no histogram lines");
}

#[test]
fn a_layer_plot_labels_a_narrow_log_axis_and_names_its_run() {
    let dir = tempfile::tempdir().unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs/bench/2026-11-26-cpu-smollm2-attribution.json");
    let mut r: DiffReport = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    // Cosine errors within 2e-3..5e-3: less than a decade.
    let n = r.layers.len() as f64;
    for (i, l) in r.layers.iter_mut().enumerate() {
        l.mean_cos_error = 2e-3 + 3e-3 * i as f64 / n;
    }
    let out = dir.path().join("layers.svg");
    plot::plot_diff(&[(r.label(), r)], &out).unwrap();
    let svg = std::fs::read_to_string(&out).unwrap();
    let t = texts(&svg);
    let powers = t
        .iter()
        .filter(|t| t.text.contains('e') && t.text.parse::<f64>().is_ok())
        .count();
    assert!(powers >= 2, "{t:?}");
    let subtitle = t.iter().find(|t| t.text.starts_with("dataset ")).unwrap();
    for part in [
        "wikitext2",
        "ctx 512",
        "4 windows",
        "dtype f32 vs reference f32",
    ] {
        assert!(subtitle.text.contains(part), "{}", subtitle.text);
    }
    assert_inside(&svg);
}

#[test]
fn only_png_and_svg_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let reports = vec![("a".to_string(), report("a", 4.25, "x", 40.0, None))];
    let e = plot::plot(&reports, &dir.path().join("out.pdf")).unwrap_err();
    assert!(e.to_string().contains(".png and .svg"), "{e}");
    assert!(!dir.path().join("out.pdf").exists());
}

#[test]
fn tick_labels_and_decades() {
    assert_eq!(plot::tick(&33_300.0), "33300");
    assert_eq!(plot::tick(&12.3456), "12.35");
    assert_eq!(plot::tick(&0.004), "0.004");
    let (a, b) = plot::decade_range(2e-3, 5e-3);
    assert!(a < 1e-3 && a > 0.9e-3 && b > 1e-2 && b < 1.1e-2, "{a} {b}");
    let (a, b) = plot::decade_range(1e-3, 1e-3);
    assert!(b / a >= 10.0);
}

//! `exactscore compare`: reports side by side, labelled, checked to measure the same thing.

use std::fmt::Write as _;

use crate::report::Report;

/// `(file stem, report)` pairs labelled by model, with the stem added where several reports
/// share a model (a report without server information is its stem).
pub fn labelled(reports: Vec<(String, Report)>) -> Vec<(String, Report)> {
    let models: Vec<Option<String>> = reports
        .iter()
        .map(|(_, r)| r.server_info.as_ref().map(|i| i.model.clone()))
        .collect();
    reports
        .into_iter()
        .zip(models.clone())
        .map(|((stem, r), m)| {
            let label = match m {
                Some(m) if models.iter().filter(|x| x.as_ref() == Some(&m)).count() == 1 => m,
                Some(m) => format!("{m} [{stem}]"),
                None => stem,
            };
            (label, r)
        })
        .collect()
}

/// Refuses reports that do not measure the same thing as the first (dataset, tokenizer,
/// method, ctx, stride, windows: [`Report::mismatches`]), naming each by `names`; with `allow`,
/// marks their labels with what differs instead (`(≠ windows 40 vs 834)`), which the table and
/// the plot then show.
pub fn check(
    reports: &mut [(String, Report)],
    names: &[String],
    allow: bool,
) -> Result<(), String> {
    let Some(first) = reports.first().map(|(_, r)| r.clone()) else {
        return Ok(());
    };
    let mut refused = vec![];
    for (i, (label, r)) in reports.iter_mut().enumerate().skip(1) {
        let d = r.mismatches(&first);
        if d.is_empty() {
            continue;
        }
        if allow {
            label.push_str(&format!(" (≠ {})", d.join(", ")));
        } else {
            let name = names.get(i).map_or("?", String::as_str);
            refused.push(format!("{name}: {}", d.join(", ")));
        }
    }
    if refused.is_empty() {
        return Ok(());
    }
    Err(format!(
        "these reports do not measure the same thing as {} (values: this report vs the first): \
         {}. Compare runs of one dataset, tokenizer, method, ctx and window count, or allow \
         the mismatch (--allow-mismatch, allow_mismatch=True) to show them marked",
        names.first().map_or("the first", String::as_str),
        refused.join("; ")
    ))
}

const HEADER: [&str; 11] = [
    "model",
    "bpw",
    "method",
    "ctx",
    "windows",
    "tokens",
    "ppl",
    "± se",
    "bits/byte",
    "mean KLD",
    "same top %",
];

fn row(label: &str, r: &Report) -> [String; 11] {
    let kld = |f: fn(&crate::KldStats) -> String| r.kld.as_ref().map_or("-".into(), f);
    [
        label.to_string(),
        r.server_info
            .as_ref()
            .map_or_else(|| "?".into(), |i| format!("{:.3}", i.bits_per_weight)),
        r.method.to_string(),
        r.ctx.to_string(),
        r.stats.windows.to_string(),
        r.stats.tokens_scored.to_string(),
        format!("{:.4}", r.stats.perplexity),
        r.stats
            .perplexity_stderr
            .map_or_else(|| "n/a".into(), |s| format!("{s:.4}")),
        format!("{:.4}", r.bits_per_byte),
        kld(|k| format!("{:.6}", k.mean_kld)),
        kld(|k| format!("{:.2}", 100.0 * k.same_top)),
    ]
}

/// The comparison table: a row per report, columns padded to their widest cell.
pub fn table(reports: &[(String, Report)]) -> String {
    let rows: Vec<[String; 11]> = reports.iter().map(|(l, r)| row(l, r)).collect();
    let widths: Vec<usize> = (0..HEADER.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].chars().count())
                .chain([HEADER[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<&str>| {
        let cells: Vec<String> = cells
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, w))| {
                let pad = " ".repeat(w.saturating_sub(c.chars().count()));
                if i == 0 {
                    format!("{c}{pad}")
                } else {
                    format!("{pad}{c}")
                }
            })
            .collect();
        cells.join("  ")
    };
    let mut out = String::new();
    let _ = writeln!(out, "{}", line(HEADER.to_vec()));
    for r in &rows {
        let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
    }
    out
}

//! Perplexity reports and their statistics.
//!
//! With windows `j = 1..W`, each with NLL sum `s_j` (nats, over its scored positions) and count
//! `c_j`: `S = Σ s_j`, `C = Σ c_j`, mean NLL `μ = S / C`, perplexity `exp(μ)`.
//!
//! **Standard error** is per window (windows, not tokens, are the independent units; tokens of
//! one window are correlated): the ratio-estimator standard error
//! `SE(μ) = sqrt(W / (W - 1) · Σ_j (s_j - μ·c_j)²) / C`, which for equal window lengths is the
//! standard deviation of the per-window mean NLLs divided by `√W`. The perplexity's standard error
//! is by the delta method `SE(ppl) = ppl · SE(μ)`. Undefined (`null`) for fewer than 2 windows.
//! Overlapping windows (`exl3` with stride < ctx) are not independent, so it is then optimistic.
//!
//! **Bits per token** `= μ / ln 2`. **Bits per byte** `= (μ / ln 2) · T / B`, with `B` the UTF-8
//! byte length of the dataset text and `T` the number of tokens it was tokenized into (a BOS added
//! by the tokenizer not counted): the mean bits per scored token spread over the text's bytes at
//! the text's token density. When every token of the text is predicted exactly once (`rolling`
//! without `--max-windows`) this is exactly lm-eval's `Σ NLL / (B · ln 2)`.

use std::fmt::Write as _;

use exactscore_api::ModelInfo;
use serde::{Deserialize, Serialize};

use crate::kld::{KldStats, KldWindow};
use crate::positions::{PositionBucket, PositionSums};
use crate::windows::Method;

/// One finished window (also one line of the partial file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowResult {
    pub window: usize,
    /// Σ −log p over the window's scored positions, nats, f64 accumulation of f32 log-probs.
    pub sum_nll: f64,
    pub count: usize,
    /// `exactscore kld`: the divergence from the reference model over the same positions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kld: Option<KldWindow>,
    /// Its scored positions by position bucket (see [`crate::positions`]); absent from older
    /// partial files.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub positions: Vec<PositionSums>,
}

/// Summary statistics of a set of windows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub windows: usize,
    pub tokens_scored: usize,
    pub total_nll: f64,
    pub mean_nll: f64,
    pub perplexity: f64,
    pub mean_nll_stderr: Option<f64>,
    pub perplexity_stderr: Option<f64>,
    pub bits_per_token: f64,
}

impl Stats {
    pub fn from_windows(results: &[WindowResult]) -> Stats {
        let w = results.len();
        let s: f64 = results.iter().map(|r| r.sum_nll).sum();
        let c: usize = results.iter().map(|r| r.count).sum();
        let mean = if c > 0 { s / c as f64 } else { f64::NAN };
        let ppl = mean.exp();
        let se = (w >= 2 && c > 0).then(|| {
            let ss: f64 = results
                .iter()
                .map(|r| (r.sum_nll - mean * r.count as f64).powi(2))
                .sum();
            (w as f64 / (w as f64 - 1.0) * ss).sqrt() / c as f64
        });
        Stats {
            windows: w,
            tokens_scored: c,
            total_nll: s,
            mean_nll: mean,
            perplexity: ppl,
            mean_nll_stderr: se,
            perplexity_stderr: se.map(|se| se * ppl),
            bits_per_token: mean / std::f64::consts::LN_2,
        }
    }
}

/// Dataset facts in a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetSummary {
    pub name: String,
    /// UTF-8 bytes of the evaluated text (`B`).
    pub bytes: usize,
    pub sha256: String,
    pub documents: usize,
    /// Tokens of the text, a tokenizer-added BOS excluded (`T`).
    pub text_tokens: usize,
    /// Tokens the windows were cut from (BOS included where added).
    pub sequence_tokens: usize,
    /// SHA-256 of those tokens (u32 little-endian); absent from older reports.
    #[serde(default)]
    pub tokens_sha256: String,
}

/// Result of `exactscore ppl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub method: Method,
    pub ctx: usize,
    pub stride: usize,
    pub max_windows: Option<usize>,
    pub tokenize: crate::tokenize::TokenizeMode,
    pub dataset: DatasetSummary,
    #[serde(flatten)]
    pub stats: Stats,
    pub bits_per_byte: f64,
    /// How the standard errors are computed.
    pub stderr_method: String,
    /// Windows already in the partial file when this run started.
    pub resumed_windows: usize,
    /// Wall time of this run (seconds), resumed windows not included.
    pub wall_time_s: f64,
    /// Tokens scored in this run / wall time.
    pub tokens_per_s: f64,
    pub servers: Vec<String>,
    pub server_info: Option<ModelInfo>,
    /// `exactscore kld`: divergence from the reference model (`server_info.reference`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kld: Option<KldStats>,
    /// NLL (and KLD) by position in the window: 0–2K, 2K–8K, 8K–32K, 32K–128K, 128K– (the
    /// non-empty buckets; see [`crate::positions`]). Absent from older reports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub position_buckets: Vec<PositionBucket>,
    /// Every window, by index.
    pub per_window: Vec<WindowResult>,
    /// `exactscore kld --noise-floor-server`: the same windows against a server whose served
    /// model and reference are one checkpoint in two dtypes (bf16 vs f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_floor: Option<NoiseFloor>,
}

/// The KL-divergence that the served dtype's arithmetic alone causes, measured on the same
/// windows as the report it belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoiseFloor {
    pub servers: Vec<String>,
    pub server_info: Option<ModelInfo>,
    pub kld: KldStats,
    pub wall_time_s: f64,
}

pub const STDERR_METHOD: &str =
    "per-window ratio estimator: SE(mean_nll) = sqrt(W/(W-1) * sum_j (s_j - mean_nll*c_j)^2) / C; \
     SE(ppl) = ppl * SE(mean_nll)";

/// A standard error with `digits` decimals, or two significant digits where those decimals
/// would show only zeros (`± 3.1e-8`, never `± 0.000000`).
fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    match v {
        None => "n/a".into(),
        Some(v) if v != 0.0 && v.abs() < 0.5 * 10f64.powi(-(digits as i32)) => format!("{v:.1e}"),
        Some(v) => format!("{v:.digits$}"),
    }
}

/// Why a file cannot be read as a report.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ReportFileError {
    pub path: String,
    pub message: String,
}

impl Report {
    /// Reads a report that `exactscore ppl/kld --json` wrote, telling apart the files that are
    /// often given instead: a partial file of a run (`--output`) and an `exactscore diff` report.
    pub fn from_path(path: &std::path::Path) -> Result<Report, ReportFileError> {
        let err = |message: String| ReportFileError {
            path: path.display().to_string(),
            message,
        };
        let text =
            std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        Report::from_json_text(&text).map_err(err)
    }

    /// [`Report::from_path`] on a text already read.
    pub fn from_json_text(text: &str) -> Result<Report, String> {
        if text.trim_start().starts_with("{\"exactscore_partial\"") {
            return Err(
                "a partial file of a run (--output), not a report: finish the run \
                        with --resume and --json REPORT.json, then use REPORT.json"
                    .into(),
            );
        }
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
        if v.get("layers").is_some() && v.get("per_window").is_none() {
            return Err(
                "an `exactscore diff` report: show or plot it with `exactscore diff \
                        --from FILE`; compare takes `exactscore ppl` and `kld` --json reports"
                    .into(),
            );
        }
        serde_json::from_value(v)
            .map_err(|e| format!("not an `exactscore ppl` or `kld` --json report ({e})"))
    }

    /// The report without its per-token values (each window's `kld` and `reference_top_p`):
    /// what `exactscore kld --json` writes unless `--per-token` (a WikiText-2 run's per-token
    /// values are ~100 MB of JSON). Every statistic, the histogram included, stays.
    pub fn without_per_token(&self) -> Report {
        let mut r = self.clone();
        for w in &mut r.per_window {
            if let Some(k) = w.kld.as_mut() {
                k.kld = Vec::new();
                k.reference_top_p = Vec::new();
            }
        }
        r
    }

    /// How this report differs from `first` in what makes their numbers comparable: dataset,
    /// tokens (the tokenizer), method, ctx, stride and windows. Empty when comparable.
    pub fn mismatches(&self, first: &Report) -> Vec<String> {
        let mut d = vec![];
        let mut cmp = |name: &str, a: String, b: String| {
            if a != b {
                d.push(format!("{name} {a} vs {b}"));
            }
        };
        cmp(
            "dataset",
            self.dataset.name.clone() + " " + &short(&self.dataset.sha256),
            first.dataset.name.clone() + " " + &short(&first.dataset.sha256),
        );
        // The same text tokenized for the same method (rolling adds no BOS) gives the same
        // tokens unless the tokenizers differ.
        let (a, b) = (&self.dataset.tokens_sha256, &first.dataset.tokens_sha256);
        let same_input = self.dataset.sha256 == first.dataset.sha256 && self.method == first.method;
        if same_input && !a.is_empty() && !b.is_empty() {
            cmp("tokens (tokenizer)", short(a), short(b));
        }
        cmp("method", self.method.to_string(), first.method.to_string());
        cmp("ctx", self.ctx.to_string(), first.ctx.to_string());
        cmp("stride", self.stride.to_string(), first.stride.to_string());
        cmp(
            "windows",
            self.stats.windows.to_string(),
            first.stats.windows.to_string(),
        );
        d
    }
}

fn short(sha: &str) -> String {
    format!("sha256 {}", &sha[..sha.len().min(12)])
}

impl Report {
    /// Human-readable table.
    pub fn to_table(&self) -> String {
        let mut rows: Vec<(String, String)> = vec![];
        let mut add = |k: &str, v: String| rows.push((k.to_string(), v));
        if let Some(i) = &self.server_info {
            add("model", i.model.clone());
            add("dtype", i.dtype.clone());
            if !i.attention.is_empty() {
                add("attention", i.attention.clone());
            }
            add("bits per weight", format!("{:.4}", i.bits_per_weight));
            let mut fm: Vec<&str> = i.formats.values().map(String::as_str).collect();
            fm.sort_unstable();
            fm.dedup();
            add("formats", fm.join(", "));
        }
        add("servers", self.servers.join(", "));
        add(
            "dataset",
            format!(
                "{} ({} bytes, {} tokens)",
                self.dataset.name, self.dataset.bytes, self.dataset.text_tokens
            ),
        );
        add(
            "method",
            format!(
                "{} ctx={}{}",
                self.method,
                self.ctx,
                if self.method == Method::Exl3 {
                    format!(" stride={}", self.stride)
                } else {
                    String::new()
                }
            ),
        );
        add(
            "perplexity",
            format!(
                "{:.6} ± {}",
                self.stats.perplexity,
                fmt_opt(self.stats.perplexity_stderr, 6)
            ),
        );
        add(
            "mean NLL",
            format!(
                "{:.6} ± {} nats",
                self.stats.mean_nll,
                fmt_opt(self.stats.mean_nll_stderr, 6)
            ),
        );
        add(
            "bits per token",
            format!("{:.6}", self.stats.bits_per_token),
        );
        add("bits per byte", format!("{:.6}", self.bits_per_byte));
        if let Some(k) = &self.kld {
            self.kld_rows(k, &mut add);
        }
        if let Some(floor) = &self.noise_floor {
            noise_floor_rows(floor, self.kld.as_ref(), &mut add);
        }
        if self.position_buckets.len() > 1 {
            for b in &self.position_buckets {
                add(&format!("positions {}", position_range(b)), position_row(b));
            }
        }
        add("windows", self.stats.windows.to_string());
        add("tokens scored", self.stats.tokens_scored.to_string());
        add(
            "wall time",
            format!(
                "{:.2} s ({} windows resumed)",
                self.wall_time_s, self.resumed_windows
            ),
        );
        add("tokens/s", format!("{:.1}", self.tokens_per_s));
        let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (k, v) in rows {
            let _ = writeln!(out, "{k:<w$}  {v}");
        }
        out
    }
}

/// `0–2K`, `128K–`: a bucket's positions.
fn position_range(b: &PositionBucket) -> String {
    let upper = b.upper.map(crate::positions::short).unwrap_or_default();
    format!("{}–{upper}", crate::positions::short(b.lower))
}

/// A bucket's tokens, perplexity, mean NLL and mean KLD.
fn position_row(b: &PositionBucket) -> String {
    let kld = b
        .mean_kld
        .map(|k| format!(", mean KLD {k:.6}"))
        .unwrap_or_default();
    format!(
        "{} tokens: perplexity {:.6}, mean NLL {:.6}{kld}",
        b.tokens, b.perplexity, b.mean_nll
    )
}

impl Report {
    /// The rows llama.cpp's `--kl-divergence` prints, plus both models' bits per weight.
    fn kld_rows(&self, k: &KldStats, add: &mut impl FnMut(&str, String)) {
        let reference = self.server_info.as_ref().and_then(|i| i.reference.as_ref());
        if let Some(r) = reference {
            add("reference", r.model.clone());
            add(
                "reference bits per weight",
                format!("{:.4}", r.bits_per_weight),
            );
        }
        add(
            "reference perplexity",
            format!("{:.6}", k.reference_perplexity),
        );
        add(
            "PPL ratio",
            format!(
                "{:.6} ± {}",
                k.perplexity_ratio,
                fmt_opt(k.perplexity_ratio_stderr, 6)
            ),
        );
        add(
            "ln(PPL ratio)",
            format!(
                "{:.6} ± {}",
                k.ln_perplexity_ratio,
                fmt_opt(k.ln_perplexity_ratio_stderr, 6)
            ),
        );
        add(
            "mean KLD",
            format!("{:.6} ± {}", k.mean_kld, fmt_opt(k.mean_kld_stderr, 6)),
        );
        add("median KLD", format!("{:.6}", k.median_kld));
        add("KLD p90", format!("{:.6}", k.p90_kld));
        add("KLD p99", format!("{:.6}", k.p99_kld));
        add("KLD p99.9", format!("{:.6}", k.p99_9_kld));
        add("max KLD", format!("{:.6}", k.max_kld));
        add(
            "same top token",
            format!(
                "{:.3} ± {} %",
                100.0 * k.same_top,
                fmt_opt(k.same_top_stderr.map(|e| 100.0 * e), 3)
            ),
        );
        add(
            "mean Δp",
            format!(
                "{:.4} ± {} %",
                100.0 * k.mean_delta_p,
                fmt_opt(k.mean_delta_p_stderr.map(|e| 100.0 * e), 4)
            ),
        );
        add("RMS Δp", format!("{:.4} %", 100.0 * k.rms_delta_p));
        add(
            "KLD p10 / p25 / p75",
            format!("{:.6} / {:.6} / {:.6}", k.p10_kld, k.p25_kld, k.p75_kld),
        );
        add(
            "reverse KLD",
            format!(
                "{:.6} ± {} (KL(model ‖ reference))",
                k.mean_reverse_kld,
                fmt_opt(k.mean_reverse_kld_stderr, 6)
            ),
        );
        if !k.top_k_agreement.is_empty() {
            let agreement: Vec<String> = k
                .top_k_agreement
                .iter()
                .enumerate()
                .map(|(i, a)| format!("K={} {:.2} %", i + 1, 100.0 * a))
                .collect();
            add("top-K agreement", agreement.join(", "));
        }
        for b in k.confidence_buckets.iter().filter(|b| b.tokens > 0) {
            add(
                &format!("KLD, top p [{:.2},{:.2})", b.lower, b.upper),
                format!(
                    "{:5.1} % of tokens, mean {:.6}, median {:.6}",
                    100.0 * b.share,
                    b.mean_kld.unwrap_or(f64::NAN),
                    b.median_kld.unwrap_or(f64::NAN)
                ),
            );
        }
    }
}

/// The noise floor's rows, and the quantization's KLD above it.
fn noise_floor_rows(
    floor: &NoiseFloor,
    kld: Option<&KldStats>,
    add: &mut impl FnMut(&str, String),
) {
    let k = &floor.kld;
    if let Some(i) = &floor.server_info {
        let reference = i.reference.as_ref();
        add(
            "noise floor",
            format!(
                "{} in {} vs {} in {} ({})",
                i.model,
                i.dtype,
                reference.map_or("?", |r| r.model.as_str()),
                reference.and_then(|r| r.dtype.as_deref()).unwrap_or("?"),
                floor.servers.join(", ")
            ),
        );
    }
    add(
        "noise floor mean KLD",
        format!(
            "{:.6} ± {}, median {:.6}, p99 {:.6}, same top {:.3} %",
            k.mean_kld,
            fmt_opt(k.mean_kld_stderr, 6),
            k.median_kld,
            k.p99_kld,
            100.0 * k.same_top
        ),
    );
    if let Some(q) = kld {
        add(
            "mean KLD above the floor",
            format!(
                "{:.6} ({:.1}x the floor)",
                q.mean_kld - k.mean_kld,
                q.mean_kld / k.mean_kld
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(window: usize, sum_nll: f64, count: usize) -> WindowResult {
        WindowResult {
            window,
            sum_nll,
            count,
            kld: None,
            positions: Vec::new(),
        }
    }

    #[test]
    fn equal_windows_stderr_is_sd_of_means_over_sqrt_w() {
        let r = [wr(0, 10.0, 10), wr(1, 20.0, 10), wr(2, 30.0, 10)];
        let s = Stats::from_windows(&r);
        assert!((s.mean_nll - 2.0).abs() < 1e-12);
        // means 1,2,3: sd = 1, / sqrt(3)
        let expected = 1.0 / 3f64.sqrt();
        assert!((s.mean_nll_stderr.unwrap() - expected).abs() < 1e-12);
        assert!((s.perplexity_stderr.unwrap() - expected * 2f64.exp()).abs() < 1e-9);
    }

    #[test]
    fn a_tiny_standard_error_keeps_its_digits() {
        assert_eq!(fmt_opt(Some(3.14e-8), 6), "3.1e-8");
        assert_eq!(fmt_opt(Some(0.00123), 6), "0.001230");
        assert_eq!(fmt_opt(Some(0.0), 6), "0.000000");
        assert_eq!(fmt_opt(None, 6), "n/a");
    }

    #[test]
    fn single_window_has_no_stderr() {
        let s = Stats::from_windows(&[wr(0, 5.0, 5)]);
        assert_eq!(s.mean_nll_stderr, None);
        assert!((s.perplexity - 1f64.exp()).abs() < 1e-12);
    }
}

//! The publishable parts of `exactscore report`: a model-card section (Markdown: the results
//! table, the plots, the commands) and the Hub's `model-index` metadata (YAML) for perplexity
//! and KL-divergence, both made from a [`Record`].
//!
//! `model-index` is the model card metadata format of the Hugging Face Hub (`name`, then per
//! result a `task`, a `dataset` and `metrics`); `client/schemas/model-index.schema.json`
//! describes the part of it written here. The Hub's newer `.eval_results/` files are not
//! written: they score a registered benchmark dataset, which WikiText-2 is not.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::record::Record;
use crate::windows::Method;

/// The card metadata: `model-index: [...]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelIndex {
    #[serde(rename = "model-index")]
    pub model_index: Vec<IndexedModel>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexedModel {
    pub name: String,
    pub results: Vec<EvalResult>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalResult {
    pub task: EvalTask,
    pub dataset: EvalDataset,
    pub metrics: Vec<Metric>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalTask {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalDataset {
    /// The Hub's dataset id, or a file's name.
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    #[serde(rename = "type")]
    pub kind: String,
    pub value: f64,
    pub name: String,
    /// Self-reported: only the Hub's own evaluations are verified.
    pub verified: bool,
    /// How it was computed (windows, reference, standard error).
    pub args: serde_json::Map<String, serde_json::Value>,
}

/// The Hub's dataset description of the record's dataset: WikiText-2 as `wikitext`'s raw
/// configuration, test split; a file by its name.
fn dataset(record: &Record) -> EvalDataset {
    let name = &record.dataset.name;
    if name == "wikitext2" {
        return EvalDataset {
            kind: "wikitext".into(),
            name: "WikiText-2 (raw)".into(),
            config: Some("wikitext-2-raw-v1".into()),
            split: Some("test".into()),
        };
    }
    let file = std::path::Path::new(name)
        .file_name()
        .map_or_else(|| name.clone(), |f| f.to_string_lossy().into_owned());
    EvalDataset {
        kind: file.clone(),
        name: file,
        config: None,
        split: None,
    }
}

/// `exl3 windows of 2048 tokens, stride 512, 8 windows`.
fn windows_phrase(record: &Record) -> String {
    let w = &record.windows;
    let stride = match w.method {
        Method::Exl3 => format!(", stride {}", w.stride),
        Method::Disjoint | Method::Rolling => String::new(),
    };
    format!(
        "{} windows of {} tokens{stride}, {} windows",
        w.method, w.ctx, w.windows
    )
}

fn args(pairs: Vec<(&str, serde_json::Value)>) -> serde_json::Map<String, serde_json::Value> {
    pairs
        .into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// The `model-index` of `record`, the model called `name` (its Hub id, or `/info`'s name).
pub fn model_index(record: &Record, name: &str) -> ModelIndex {
    let w = &record.windows;
    let window_args = || {
        vec![
            ("method", w.method.as_str().into()),
            ("ctx", w.ctx.into()),
            ("stride", w.stride.into()),
            ("windows", w.windows.into()),
            ("tokens_scored", w.tokens_scored.into()),
            ("dataset_sha256", record.dataset.sha256.clone().into()),
        ]
    };
    let mut ppl_args = window_args();
    ppl_args.push(("stderr", record.perplexity.stderr.into()));
    let mut metrics = vec![Metric {
        kind: "perplexity".into(),
        value: record.perplexity.value,
        name: format!("Perplexity ({})", windows_phrase(record)),
        verified: false,
        args: args(ppl_args),
    }];
    if let (Some(k), Some(r)) = (&record.kld, &record.reference) {
        let mut kld_args = window_args();
        kld_args.extend([
            ("reference", r.name.clone().into()),
            (
                "reference_checkpoint_sha256",
                r.checkpoint_sha256.clone().into(),
            ),
            ("stderr", k.mean_kld_stderr.into()),
            (
                "noise_floor_mean_kld",
                record.noise_floor.as_ref().map(|f| f.mean_kld).into(),
            ),
        ]);
        metrics.push(Metric {
            kind: "kl_divergence".into(),
            value: k.mean_kld,
            name: format!("Mean KL-divergence from {} (nats/token)", r.name),
            verified: false,
            args: args(kld_args),
        });
    }
    ModelIndex {
        model_index: vec![IndexedModel {
            name: name.to_string(),
            results: vec![EvalResult {
                task: EvalTask {
                    kind: "text-generation".into(),
                    name: "Text Generation".into(),
                },
                dataset: dataset(record),
                metrics,
            }],
        }],
    }
}

/// `model_index` as the YAML a model card's metadata block holds.
pub fn model_index_yaml(index: &ModelIndex) -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(index)
}

/// The first 16 characters of a sha256, for a table (the record keeps it whole).
fn prefix(sha: &str) -> String {
    sha.chars().take(16).collect()
}

fn short(sha: &Option<String>) -> String {
    match sha {
        Some(s) => format!("sha256 `{}…`", prefix(s)),
        None => "no checkpoint hash (older server)".into(),
    }
}

fn formats(f: &std::collections::BTreeMap<String, String>) -> String {
    let mut v: Vec<&str> = f.values().map(String::as_str).collect();
    v.sort_unstable();
    v.dedup();
    v.join(", ")
}

fn pm(v: f64, se: Option<f64>, digits: usize) -> String {
    match se {
        Some(se) => format!("{v:.digits$} ± {se:.digits$}"),
        None => format!("{v:.digits$}"),
    }
}

/// The model-card section of `record`: what was measured on what, the results, the plots
/// (`plots`: file name and caption, linked relative to the card) and the commands.
pub fn model_card(record: &Record, name: &str, plots: &[(String, String)]) -> String {
    let mut s = String::new();
    let m = &record.model;
    let title = match &record.reference {
        Some(r) => format!("{name} against {}", r.name),
        None => name.to_string(),
    };
    let _ = writeln!(s, "## Evaluation: {title} (ExactScore)\n");
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(
        s,
        "| Model | `{}` ({}, {}; {:.4} bits per weight), {} |",
        m.name,
        m.architecture,
        formats(&m.formats),
        m.bits_per_weight,
        short(&m.checkpoint_sha256)
    );
    // The numbers include the KV cache's quantization: the card says which.
    if let Some(kv) = &m.kv_cache {
        let _ = writeln!(s, "| KV cache | {kv} |");
    }
    if let Some(r) = &record.reference {
        let _ = writeln!(
            s,
            "| Reference | `{}` ({}; {:.4} bits per weight), {} |",
            r.name,
            formats(&r.formats),
            r.bits_per_weight,
            short(&r.checkpoint_sha256)
        );
    }
    let d = &record.dataset;
    let _ = writeln!(
        s,
        "| Dataset | {} ({} bytes, sha256 `{}…`): {}, {} tokens scored |",
        d.name,
        d.bytes,
        prefix(&d.sha256),
        windows_phrase(record),
        record.windows.tokens_scored
    );
    let reference_dtype = record
        .reference
        .as_ref()
        .and_then(|r| r.dtype.as_deref())
        .map(|d| format!(", reference in {d}"))
        .unwrap_or_default();
    let _ = writeln!(
        s,
        "| Computed | ExactScore server {} / client {}; {} on {}{reference_dtype}; {} |",
        record.versions.server,
        record.versions.client,
        m.dtype,
        record.hardware.devices.join(", "),
        record.created_utc
    );
    let _ = writeln!(s, "\n| Metric | Value |\n|---|---|");
    let p = &record.perplexity;
    let _ = writeln!(s, "| Perplexity | {} |", pm(p.value, p.stderr, 4));
    if let Some(k) = &record.kld {
        kld_rows(&mut s, record, k);
    }
    let _ = writeln!(s, "| Bits per byte | {:.4} |", p.bits_per_byte);
    let _ = writeln!(s);
    for (file, caption) in plots {
        let _ = writeln!(s, "![{caption}]({file})\n");
    }
    let r = &record.reproduce;
    let _ = writeln!(
        s,
        "Reproduce (the checkpoints named as the server names them; `report.json` has every \
         number, hash and version):\n\n```console"
    );
    for line in [
        Some(&r.server),
        r.noise_floor_server.as_ref(),
        Some(&r.report),
    ]
    .into_iter()
    .flatten()
    {
        let _ = writeln!(s, "{line}");
    }
    let _ = writeln!(s, "```");
    s
}

fn kld_rows(s: &mut String, record: &Record, k: &crate::kld::KldStats) {
    let _ = writeln!(
        s,
        "| Reference perplexity | {:.4} |",
        k.reference_perplexity
    );
    let _ = writeln!(
        s,
        "| PPL ratio | {} |",
        pm(k.perplexity_ratio, k.perplexity_ratio_stderr, 5)
    );
    let _ = writeln!(
        s,
        "| Mean KLD (nats/token) | {} |",
        pm(k.mean_kld, k.mean_kld_stderr, 6)
    );
    let _ = writeln!(
        s,
        "| KLD median / p99 / max | {:.6} / {:.6} / {:.6} |",
        k.median_kld, k.p99_kld, k.max_kld
    );
    let _ = writeln!(s, "| Same top token | {:.2} % |", 100.0 * k.same_top);
    if !k.top_k_agreement.is_empty() {
        let a: Vec<String> = k
            .top_k_agreement
            .iter()
            .map(|a| format!("{:.2}", 100.0 * a))
            .collect();
        let _ = writeln!(
            s,
            "| Top-K agreement, K = 1..{} | {} % |",
            a.len(),
            a.join(" / ")
        );
    }
    match &record.noise_floor {
        Some(f) => {
            let _ = writeln!(
                s,
                "| Noise floor: mean KLD of {} arithmetic alone | {} ({:.1}× below this model's) |",
                f.dtype,
                pm(f.mean_kld, f.mean_kld_stderr, 6),
                k.mean_kld / f.mean_kld
            );
        }
        None => {
            let _ = writeln!(s, "| Noise floor | not measured (`--noise-floor-server`) |");
        }
    }
    if let Some(l) = &record.layers {
        let worst = l
            .layers
            .iter()
            .max_by(|a, b| a.mean_cos_error.total_cmp(&b.mean_cos_error));
        if let Some(w) = worst {
            let _ = writeln!(
                s,
                "| Largest per-layer error (`/diff`, {} windows of {} tokens) | layer {}: 1 − cos {:.3e}, SQNR {:.2} dB |",
                l.windows, l.ctx, w.layer, w.mean_cos_error, w.mean_sqnr_db
            );
        }
    }
}

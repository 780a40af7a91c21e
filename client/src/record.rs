//! The record of `exactscore report` (`report.json`): what a published evaluation measured,
//! on which checkpoints, hardware and software, and the commands that reproduce it.
//!
//! It is built from the reports of the runs that `exactscore report` orchestrates (a `kld` run,
//! or a `ppl` run where the server has no reference model, and optionally a `diff` run) and is
//! described by `client/schemas/report.schema.json`, which a test holds it to.

use std::collections::BTreeMap;

use exactscore_api::ModelInfo;
use serde::{Deserialize, Serialize};

use crate::dataset::DatasetSpec;
use crate::diff::{DiffReport, FinalKld, LayerSummary};
use crate::kld::KldStats;
use crate::report::{DatasetSummary, Report};
use crate::report_dir::ReportOptions;
use crate::runner::{PplConfig, Task};
use crate::windows::Method;

/// `schema` of the records this client writes.
pub const SCHEMA: &str = "exactscore-report/1";

/// `report.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub schema: String,
    /// When the report was written, UTC, RFC 3339.
    pub created_utc: String,
    pub versions: Versions,
    pub reproduce: Reproduce,
    pub model: ModelFacts,
    /// The server's reference model; `null` for a perplexity-only report.
    pub reference: Option<ReferenceFacts>,
    pub hardware: Hardware,
    pub dataset: DatasetSummary,
    pub windows: WindowFacts,
    pub perplexity: Perplexity,
    /// The divergence from the reference (`exactscore kld`'s statistics).
    pub kld: Option<KldStats>,
    pub noise_floor: Option<NoiseFloorFacts>,
    /// `--diff`: where the error enters, per decoder layer.
    pub layers: Option<LayerFacts>,
    pub files: Files,
    /// Wall time of all the runs, seconds.
    pub wall_time_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Versions {
    pub client: String,
    pub server: String,
}

/// Command lines that give the same numbers. The checkpoints are named as `/info` names them
/// (their directory names unless the server was given `--served-model-name`); their
/// `checkpoint_sha256` tells whether a copy is the same checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reproduce {
    pub server: String,
    pub noise_floor_server: Option<String>,
    /// This report, all of it.
    pub report: String,
    /// The `exactscore kld` (or `ppl`) run alone.
    pub run: String,
    /// The `exactscore diff` run alone.
    pub diff: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    pub name: String,
    pub architecture: String,
    pub checkpoint_sha256: Option<String>,
    /// Weight format of each projection type.
    pub formats: BTreeMap<String, String>,
    /// `/info`'s definition: decoder Linears, scales and zero points included.
    pub bits_per_weight: f64,
    pub dtype: String,
    pub activation_quant: BTreeMap<String, String>,
    pub activation_quant_mode: String,
    /// `/info`'s `kv_cache`: the KV-cache quantization emulated or simulated, if any.
    pub kv_cache: Option<String>,
    /// `--kv-cache-quant` and `--kv-cache-dtype` as the server ran; `null` from servers that do
    /// not report them.
    pub kv_cache_quant_mode: Option<String>,
    pub kv_cache_dtype: Option<String>,
    pub attention: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReferenceFacts {
    pub name: String,
    pub architecture: String,
    pub checkpoint_sha256: Option<String>,
    pub formats: BTreeMap<String, String>,
    pub bits_per_weight: f64,
    pub dtype: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// The servers that computed the numbers.
    pub servers: Vec<String>,
    /// Their devices (`cpu`, `cuda:0`, ...) as `/info` lists them.
    pub devices: Vec<String>,
    pub reference_devices: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowFacts {
    pub method: Method,
    pub ctx: usize,
    /// `exl3` only (0 for `rolling`).
    pub stride: usize,
    pub max_windows: Option<usize>,
    pub windows: usize,
    pub tokens_scored: usize,
    pub tokenize: crate::tokenize::TokenizeMode,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Perplexity {
    pub value: f64,
    pub stderr: Option<f64>,
    pub mean_nll: f64,
    pub mean_nll_stderr: Option<f64>,
    pub bits_per_token: f64,
    pub bits_per_byte: f64,
    pub stderr_method: String,
}

/// The KL-divergence of bf16 arithmetic alone, on the same windows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoiseFloorFacts {
    pub servers: Vec<String>,
    pub model: String,
    pub checkpoint_sha256: Option<String>,
    pub dtype: String,
    pub reference_dtype: Option<String>,
    pub mean_kld: f64,
    pub mean_kld_stderr: Option<f64>,
    pub median_kld: f64,
    pub p99_kld: f64,
    pub same_top: f64,
    /// The quantization's mean KLD minus the floor's.
    pub mean_kld_above_floor: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerFacts {
    pub server: String,
    pub ctx: usize,
    pub windows: usize,
    pub tokens: usize,
    pub layers: Vec<LayerSummary>,
    pub kld: FinalKld,
}

/// The files of the report directory, relative to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Files {
    pub model_card: String,
    pub model_index: String,
    pub plots: Vec<String>,
    /// The run's `--json` report (for `exactscore compare`).
    pub run: String,
    pub diff: Option<String>,
}

/// Why the runs cannot be made into a record.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RecordError(pub String);

impl Record {
    /// The record of `run` (a `kld` or `ppl` report) and the optional `diff` run.
    pub fn new(
        run: &Report,
        diff: Option<&DiffReport>,
        reproduce: Reproduce,
        files: Files,
        wall_time_s: f64,
    ) -> Result<Record, RecordError> {
        let info = run
            .server_info
            .as_ref()
            .ok_or_else(|| RecordError("the run's report has no server /info".into()))?;
        let s = &run.stats;
        Ok(Record {
            schema: SCHEMA.into(),
            created_utc: utc_now(),
            versions: Versions {
                client: env!("CARGO_PKG_VERSION").into(),
                server: info.version.clone(),
            },
            reproduce,
            model: model_facts(info),
            reference: info.reference.as_ref().map(|r| ReferenceFacts {
                name: r.model.clone(),
                architecture: r.architecture.clone(),
                checkpoint_sha256: r.checkpoint_sha256.clone(),
                formats: r.formats.clone(),
                bits_per_weight: r.bits_per_weight,
                dtype: r.dtype.clone(),
            }),
            hardware: Hardware {
                servers: run.servers.clone(),
                devices: info.devices.clone(),
                reference_devices: info
                    .reference
                    .as_ref()
                    .map(|r| r.devices.clone())
                    .unwrap_or_default(),
            },
            dataset: run.dataset.clone(),
            windows: WindowFacts {
                method: run.method,
                ctx: run.ctx,
                stride: run.stride,
                max_windows: run.max_windows,
                windows: s.windows,
                tokens_scored: s.tokens_scored,
                tokenize: run.tokenize,
            },
            perplexity: Perplexity {
                value: s.perplexity,
                stderr: s.perplexity_stderr,
                mean_nll: s.mean_nll,
                mean_nll_stderr: s.mean_nll_stderr,
                bits_per_token: s.bits_per_token,
                bits_per_byte: run.bits_per_byte,
                stderr_method: run.stderr_method.clone(),
            },
            kld: run.kld.clone(),
            noise_floor: run.noise_floor.as_ref().map(|f| {
                let nf = f.server_info.as_ref();
                NoiseFloorFacts {
                    servers: f.servers.clone(),
                    model: nf.map_or_else(String::new, |i| i.model.clone()),
                    checkpoint_sha256: nf.and_then(|i| i.checkpoint_sha256.clone()),
                    dtype: nf.map_or_else(String::new, |i| i.dtype.clone()),
                    reference_dtype: nf
                        .and_then(|i| i.reference.as_ref())
                        .and_then(|r| r.dtype.clone()),
                    mean_kld: f.kld.mean_kld,
                    mean_kld_stderr: f.kld.mean_kld_stderr,
                    median_kld: f.kld.median_kld,
                    p99_kld: f.kld.p99_kld,
                    same_top: f.kld.same_top,
                    mean_kld_above_floor: run.kld.as_ref().map(|k| k.mean_kld - f.kld.mean_kld),
                }
            }),
            layers: diff.map(|d| LayerFacts {
                server: d.server.clone(),
                ctx: d.ctx,
                windows: d.windows,
                tokens: d.tokens,
                layers: d.layers.clone(),
                kld: d.kld.clone(),
            }),
            files,
            wall_time_s,
        })
    }
}

fn model_facts(i: &ModelInfo) -> ModelFacts {
    ModelFacts {
        name: i.model.clone(),
        architecture: i.architecture.clone(),
        checkpoint_sha256: i.checkpoint_sha256.clone(),
        formats: i.formats.clone(),
        bits_per_weight: i.bits_per_weight,
        dtype: i.dtype.clone(),
        activation_quant: i.activation_quant.clone(),
        activation_quant_mode: i.activation_quant_mode.clone(),
        kv_cache: i.kv_cache.clone(),
        kv_cache_quant_mode: reported(&i.kv_cache_quant_mode),
        kv_cache_dtype: reported(&i.kv_cache_dtype),
        attention: i.attention.clone(),
        num_layers: i.num_layers,
        hidden_size: i.hidden_size,
        vocab_size: i.vocab_size,
    }
}

/// A string field of `/info` that servers older than it leave empty.
fn reported(value: &str) -> Option<String> {
    (!value.is_empty()).then(|| value.to_string())
}

/// A word of a command line as a POSIX shell reads it back: as it is where that is safe, else
/// in single quotes.
pub fn shell_word(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./:=,@%+-".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `words` as one shell command line.
fn command_line(words: &[String]) -> String {
    words
        .iter()
        .map(|w| shell_word(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The options of `config` that choose the numbers (servers, dataset, windows, tokenization),
/// as `exactscore ppl/kld/report` take them; never the API key.
fn run_options(config: &PplConfig) -> Vec<String> {
    let mut w: Vec<String> = vec![];
    for s in &config.servers {
        w.extend(["--server".into(), s.clone()]);
    }
    w.extend(dataset_options(config));
    w.extend(["--method".into(), config.method.as_str().into()]);
    w.extend(["--ctx".into(), config.ctx.to_string()]);
    if config.method == Method::Exl3 {
        w.extend(["--stride".into(), config.stride.to_string()]);
    }
    if let Some(n) = config.max_windows {
        w.extend(["--max-windows".into(), n.to_string()]);
    }
    w.extend(["--tokenize".into(), tokenize_name(config.tokenize).into()]);
    w
}

fn dataset_options(config: &PplConfig) -> Vec<String> {
    let mut w = vec!["--dataset".into(), config.dataset.name()];
    if matches!(
        config.dataset,
        DatasetSpec::Jsonl(_) | DatasetSpec::Parquet(_)
    ) {
        if let Some(f) = &config.dataset_options.field {
            w.extend(["--field".into(), f.clone()]);
        }
    }
    if let (DatasetSpec::Wikitext2, Some(p)) =
        (&config.dataset, &config.dataset_options.wikitext_path)
    {
        w.extend(["--wikitext-path".into(), p.display().to_string()]);
    }
    w
}

fn tokenize_name(t: crate::tokenize::TokenizeMode) -> &'static str {
    match t {
        crate::tokenize::TokenizeMode::Local => "local",
        crate::tokenize::TokenizeMode::Server => "server",
    }
}

/// The server command line that `info` describes (the checkpoints by name).
pub fn server_command(info: &ModelInfo) -> String {
    let mut w: Vec<String> = vec![
        "exactscore-server".into(),
        "--model".into(),
        info.model.clone(),
    ];
    w.extend(["--dtype".into(), info.dtype.clone()]);
    w.extend(["--device".into(), info.devices.join(",")]);
    if !info.attention.is_empty() {
        w.extend(["--attention".into(), info.attention.clone()]);
    }
    w.extend([
        "--activation-quant".into(),
        info.activation_quant_mode.clone(),
    ]);
    // The defaults (`emulate`, `auto`) are left out: servers older than these flags take the
    // line too.
    if info.kv_cache_quant_mode == "off" {
        w.extend(["--kv-cache-quant".into(), "off".into()]);
    }
    if !matches!(info.kv_cache_dtype.as_str(), "" | "auto") {
        w.extend(["--kv-cache-dtype".into(), info.kv_cache_dtype.clone()]);
    }
    if let Some(r) = &info.reference {
        w.extend(["--reference-model".into(), r.model.clone()]);
        if let Some(d) = &r.dtype {
            w.extend(["--reference-dtype".into(), d.clone()]);
        }
    }
    command_line(&w)
}

/// The commands that reproduce a report of `config` and `options`, whose servers `info`
/// (and `noise_floor` for `--noise-floor-server`) describe.
pub fn reproduce(
    config: &PplConfig,
    options: &ReportOptions,
    info: &ModelInfo,
    noise_floor: Option<&ModelInfo>,
) -> Reproduce {
    let run = run_options(config);
    let nf: Vec<String> = config
        .noise_floor_server
        .iter()
        .flat_map(|u| ["--noise-floor-server".to_string(), u.clone()])
        .collect();
    let mut report = vec!["exactscore".to_string(), "report".into()];
    report.extend(run.iter().cloned());
    report.extend(nf.iter().cloned());
    if let Some(n) = options.diff_windows {
        report.extend(["--diff".into(), "--diff-windows".into(), n.to_string()]);
    }
    report.extend(["--plot-format".into(), options.plot_format.clone()]);
    if let Some(n) = &options.name {
        report.extend(["--name".into(), n.clone()]);
    }
    report.extend(["--out".into(), options.out.display().to_string()]);
    let task = match config.task {
        Task::Kld => "kld",
        Task::Ppl => "ppl",
    };
    let mut alone = vec!["exactscore".to_string(), task.into()];
    alone.extend(run);
    alone.extend(nf);
    alone.extend(["--json".into(), "run.json".into()]);
    let diff = options.diff_windows.map(|n| {
        let mut w = vec![
            "exactscore".to_string(),
            "diff".into(),
            "--server".into(),
            config.servers.first().cloned().unwrap_or_default(),
        ];
        w.extend(dataset_options(config));
        w.extend(["--ctx".into(), config.ctx.to_string()]);
        w.extend(["--windows".into(), n.to_string()]);
        w.extend(["--tokenize".into(), tokenize_name(config.tokenize).into()]);
        w.extend(["--json".into(), "diff.json".into()]);
        command_line(&w)
    });
    Reproduce {
        server: server_command(info),
        noise_floor_server: noise_floor.map(server_command),
        report: command_line(&report),
        run: command_line(&alone),
        diff,
    }
}

/// The time now, UTC, as RFC 3339 (`2026-11-28T00:41:07Z`).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

/// Seconds since the Unix epoch as RFC 3339, UTC (days to a civil date: H. Hinnant's
/// `civil_from_days`).
fn rfc3339(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        // `date -u -d @1772000000 +%FT%TZ`
        assert_eq!(rfc3339(1_772_000_000), "2026-02-25T06:13:20Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn shell_words_read_back() {
        assert_eq!(shell_word("--ctx"), "--ctx");
        assert_eq!(shell_word("http://h:8000"), "http://h:8000");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}

//! `exactscore diff`: where a quantized checkpoint's error enters, over a few windows of a
//! dataset, from the server's `/diff` (the served model against its reference, layer by layer).
//!
//! The windows are the first `windows` full, non-overlapping stretches of `ctx` tokens of the
//! dataset (as ExLlamaV3's `model_diff.py` cuts its rows), sent as one request so that the
//! server computes them (and the module attribution) in its batches. Per layer the report
//! averages the server's per-sequence means weighted by sequence length (so: over every
//! position of every window); the final divergence pools the windows' sums; the attribution is
//! the server's, over all positions.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use exactscore_api::{
    AttributeInput, DiffRequest, DiffResponse, ModelInfo, ModuleAttribution, TokensInput,
};
use serde::{Deserialize, Serialize};

use crate::dataset::{self, DatasetOptions, DatasetSpec};
use crate::http::{Client, ClientConfig, RetryPolicy};
use crate::runner::PplError;
use crate::tokenize::{self, TokenizeMode};
use crate::windows::{self, Method, WindowParams};

/// Everything a `diff` run needs. Build with [`DiffConfig::new`] and adjust the fields.
#[derive(Debug, Clone)]
pub struct DiffConfig {
    pub server: String,
    pub api_key: Option<String>,
    pub dataset: DatasetSpec,
    pub dataset_options: DatasetOptions,
    pub ctx: usize,
    pub windows: usize,
    pub reference_until: Option<usize>,
    pub attribute: Option<AttributeInput>,
    pub tokenize: TokenizeMode,
    pub timeout: Duration,
    pub retry: RetryPolicy,
}

impl DiffConfig {
    pub fn new(server: String, dataset: DatasetSpec) -> Self {
        Self {
            server,
            api_key: None,
            dataset,
            dataset_options: DatasetOptions::default(),
            ctx: 2048,
            windows: 4,
            reference_until: None,
            attribute: None,
            tokenize: TokenizeMode::Local,
            timeout: Duration::from_secs(3600),
            retry: RetryPolicy::default(),
        }
    }
}

/// One decoder layer over every position of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSummary {
    pub layer: usize,
    pub mean_cos_error: f64,
    pub mean_sqnr_db: f64,
    /// The served model went on from the reference's state after this layer.
    pub reference_state_after: bool,
}

/// The final divergence over every scored position of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinalKld {
    pub positions: usize,
    pub mean_kld: f64,
    /// KL(model ‖ reference).
    pub mean_reverse_kld: f64,
    /// Fraction of positions whose top-K sets agree, K = 1..=5.
    pub top_k_agreement: Vec<f64>,
}

/// The attribution of the run: each module's mean KLD over all its positions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttributionSummary {
    pub positions: usize,
    pub full_kld: f64,
    pub sum_module_kld: f64,
    pub additivity_ratio: Option<f64>,
    /// Largest KLD first.
    pub modules: Vec<ModuleAttribution>,
}

/// Result of `exactscore diff` (what `--json` writes and `--from` reads).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiffReport {
    pub server: String,
    pub server_info: Option<ModelInfo>,
    pub dataset: String,
    pub ctx: usize,
    pub windows: usize,
    /// Positions compared per layer (every token of every window).
    pub tokens: usize,
    pub reference_until: Option<usize>,
    pub layers: Vec<LayerSummary>,
    pub kld: FinalKld,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribution: Option<AttributionSummary>,
    /// Wall time of the request (the server's compute and queueing included).
    pub wall_time_s: f64,
}

/// Runs the windows of `config` through the server's `/diff` in one request.
pub async fn run_diff(config: DiffConfig) -> Result<DiffReport, PplError> {
    let client = Client::new(ClientConfig {
        api_key: config.api_key.clone(),
        timeout: config.timeout,
        retry: config.retry.clone(),
        ..ClientConfig::new(config.server.clone())
    })?;
    client.ready().await?;
    let info = client.info().await?;
    if info.reference.is_none() {
        return Err(PplError::Config(format!(
            "{} has no reference model: start it with --reference-model DIR (the unquantized \
             checkpoint) to compare the models layer by layer",
            client.base_url()
        )));
    }
    let (spec, opts) = (config.dataset.clone(), config.dataset_options.clone());
    let ds = tokio::task::spawn_blocking(move || dataset::load(&spec, &opts))
        .await
        .map_err(|e| PplError::Config(e.to_string()))??;
    let tokens = tokenize::tokenize(&client, &ds.text, true, config.tokenize).await?;
    let params = WindowParams {
        method: Method::Exl3,
        ctx: config.ctx,
        stride: config.ctx,
        prefix_token: None,
        max_windows: Some(config.windows),
    };
    let windows = windows::windows(tokens.len(), &params)?;
    if windows.is_empty() {
        return Err(PplError::Config(format!(
            "no window: {} tokens are fewer than --ctx {}",
            tokens.len(),
            config.ctx
        )));
    }
    let sequences: Vec<Vec<i64>> = windows
        .iter()
        .map(|w| w.sequence(&tokens).into_iter().map(i64::from).collect())
        .collect();
    let request = DiffRequest {
        tokens: Some(TokensInput::Batch(sequences)),
        reference_until: config.reference_until.map(|n| n as i64),
        attribute: config.attribute.clone(),
        ..DiffRequest::default()
    };
    let started = Instant::now();
    let response = client.diff(&request).await?;
    let wall_time_s = started.elapsed().as_secs_f64();
    let mut report = DiffReport::from_response(&response, wall_time_s);
    (report.server, report.server_info) = (client.label(), Some(info));
    (report.dataset, report.ctx, report.windows) = (ds.name, config.ctx, windows.len());
    report.reference_until = config.reference_until;
    Ok(report)
}

impl DiffReport {
    /// How charts and tables name the run: the served model, and the layer it took the
    /// reference's state after, if any.
    pub fn label(&self) -> String {
        let model = self
            .server_info
            .as_ref()
            .map_or_else(|| self.server.clone(), |i| i.model.clone());
        match self.reference_until {
            Some(n) => format!("{model}, reference state until layer {n}"),
            None => model,
        }
    }

    /// The run's summary of one `/diff` answer (the run's facts left empty).
    pub fn from_response(r: &DiffResponse, wall_time_s: f64) -> Self {
        let lens: Vec<usize> = r.sequences.iter().map(|s| s.kld.tokens.len()).collect();
        let tokens: usize = lens.iter().sum();
        let layers = (0..r.sequences.first().map_or(0, |s| s.layers.len()))
            .map(|layer| {
                let weighted = |value: fn(&exactscore_api::LayerDiff) -> f64| {
                    r.sequences
                        .iter()
                        .zip(&lens)
                        .map(|(s, &n)| value(&s.layers[layer]) * n as f64)
                        .sum::<f64>()
                        / tokens.max(1) as f64
                };
                LayerSummary {
                    layer,
                    mean_cos_error: weighted(|l| l.mean_cos_error),
                    mean_sqnr_db: weighted(|l| l.mean_sqnr_db),
                    reference_state_after: r.sequences[0].layers[layer].reference_state_after,
                }
            })
            .collect();
        let positions: usize = r.sequences.iter().map(|s| s.kld.num_scored).sum();
        let per_position = |sum: f64| sum / positions.max(1) as f64;
        let agreement = (0..exactscore_api::TOP_K_AGREEMENT_MAX)
            .map(|k| {
                let count: usize = r
                    .sequences
                    .iter()
                    .map(|s| s.kld.top_k_agreement_counts.get(k).copied().unwrap_or(0))
                    .sum();
                per_position(count as f64)
            })
            .collect();
        let kld = FinalKld {
            positions,
            mean_kld: per_position(r.sequences.iter().map(|s| s.kld.sum_kld).sum()),
            mean_reverse_kld: per_position(r.sequences.iter().map(|s| s.kld.sum_reverse_kld).sum()),
            top_k_agreement: agreement,
        };
        let attribution = r.attribution.as_ref().map(|a| AttributionSummary {
            positions: a.positions,
            full_kld: a.full_kld,
            sum_module_kld: a.sum_module_kld,
            additivity_ratio: a.additivity_ratio,
            modules: a.modules.clone(),
        });
        Self {
            server: String::new(),
            server_info: None,
            dataset: String::new(),
            ctx: 0,
            windows: r.sequences.len(),
            tokens,
            reference_until: None,
            layers,
            kld,
            attribution,
            wall_time_s,
        }
    }

    /// What `exactscore diff` prints: the run, the per-layer table, the final divergence and
    /// the top `top` modules of the attribution.
    pub fn to_table(&self, top: usize) -> String {
        let mut out = String::new();
        if let Some(i) = &self.server_info {
            let reference = i.reference.as_ref();
            let _ = writeln!(
                out,
                "{} ({:.3} bits/weight, {}) vs {} ({}), {}",
                i.model,
                i.bits_per_weight,
                i.dtype,
                reference.map_or("?", |r| r.model.as_str()),
                reference.and_then(|r| r.dtype.as_deref()).unwrap_or("?"),
                self.server
            );
        }
        let _ = writeln!(
            out,
            "{}: {} windows of {} tokens ({} positions), {:.2} s",
            self.dataset, self.windows, self.ctx, self.tokens, self.wall_time_s
        );
        let _ = writeln!(out);
        let _ = writeln!(out, "{:>5}  {:>12}  {:>9}", "layer", "cos error", "SQNR dB");
        for l in &self.layers {
            let _ = writeln!(
                out,
                "{:>5}  {:>12.4e}  {:>9.3}{}",
                l.layer,
                l.mean_cos_error,
                l.mean_sqnr_db,
                if l.reference_state_after {
                    "  (reference state after)"
                } else {
                    ""
                }
            );
        }
        let k = &self.kld;
        let agreement: Vec<String> = k
            .top_k_agreement
            .iter()
            .enumerate()
            .map(|(i, a)| format!("K={} {:.1} %", i + 1, 100.0 * a))
            .collect();
        let _ = writeln!(
            out,
            "\nfinal KLD {:.6} (reverse {:.6}) over {} positions; top-K agreement {}",
            k.mean_kld,
            k.mean_reverse_kld,
            k.positions,
            agreement.join(", ")
        );
        if let Some(a) = &self.attribution {
            let _ = writeln!(
                out,
                "\nmodule attribution: top {} of {} modules ({} positions)",
                top.min(a.modules.len()),
                a.modules.len(),
                a.positions
            );
            let width = a.modules.iter().map(|m| m.module.len()).max().unwrap_or(6);
            let _ = writeln!(
                out,
                "{:>4}  {:<width$}  {:<16}  {:>10}  {:>8}",
                "rank", "module", "format", "mean KLD", "of Σ"
            );
            for (rank, m) in a.modules.iter().take(top).enumerate() {
                let _ = writeln!(
                    out,
                    "{:>4}  {:<width$}  {:<16}  {:>10.6}  {:>7.1}%",
                    rank + 1,
                    m.module,
                    m.format,
                    m.mean_kld,
                    100.0 * m.mean_kld / a.sum_module_kld
                );
            }
            let ratio = a
                .additivity_ratio
                .map_or("n/a (no divergence)".into(), |r| format!("{r:.4}"));
            let _ = writeln!(
                out,
                "Σ module KLD {:.6} / full KLD {:.6}: additivity ratio {ratio}",
                a.sum_module_kld, a.full_kld
            );
        }
        out
    }
}

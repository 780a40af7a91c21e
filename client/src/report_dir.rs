//! `exactscore report`: runs a publishable evaluation with the existing runners and writes its
//! directory:
//! - `report.json`, the [`Record`] (schema `client/schemas/report.schema.json`);
//! - `README.md`, a model-card section with the results table and the plots;
//! - `model-index.yaml`, the Hub's card metadata for perplexity and KL-divergence;
//! - `run.json` (the `kld`, or `ppl`, run's `--json` report, which `exactscore compare` reads),
//!   `diff.json` with `--diff`, and the plots (`kld.png` or `ppl.png`, `layers.png`).
//!
//! A server with a reference model gives a `kld` run (both perplexities, the divergence, top-K
//! agreement, the noise floor with `--noise-floor-server`); one without gives a `ppl` run.
//! The run's partial file is `run.partial.jsonl` in the directory, so that `--resume` continues
//! an interrupted report; it is removed once the report is written.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::card;
use crate::diff::{run_diff, DiffConfig, DiffReport};
use crate::http::{Client, ClientConfig};
use crate::plot::{self, PlotError};
use crate::record::{self, Files, Record, RecordError};
use crate::report::Report;
use crate::runner::{run_ppl, PplConfig, PplError, Task};

/// What `exactscore report` does beyond the run of its [`PplConfig`].
#[derive(Debug, Clone)]
pub struct ReportOptions {
    /// The directory to write.
    pub out: PathBuf,
    /// `--diff`: the number of `/diff` windows.
    pub diff_windows: Option<usize>,
    /// `png` or `svg`.
    pub plot_format: String,
    /// The model's name in the card and model-index (default: `/info`'s).
    pub name: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportDirError {
    #[error(transparent)]
    Run(#[from] PplError),
    #[error(transparent)]
    Plot(#[from] PlotError),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("{0}")]
    Config(String),
    #[error("writing {path}: {message}")]
    Write { path: PathBuf, message: String },
}

pub const RECORD_FILE: &str = "report.json";
pub const MODEL_CARD_FILE: &str = "README.md";
pub const MODEL_INDEX_FILE: &str = "model-index.yaml";
pub const RUN_FILE: &str = "run.json";
pub const DIFF_FILE: &str = "diff.json";
pub const PARTIAL_FILE: &str = "run.partial.jsonl";

fn write(dir: &Path, name: &str, text: &str) -> Result<(), ReportDirError> {
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(|e| ReportDirError::Write {
        path,
        message: e.to_string(),
    })
}

fn to_json(value: &impl serde::Serialize) -> String {
    // Serializing these types cannot fail: their maps have string keys.
    serde_json::to_string_pretty(value).unwrap_or_default() + "\n"
}

/// Runs the evaluation of `config` (its task chosen by the server: `kld` where it has a
/// reference model) and writes the report directory `options.out`. Returns its record.
pub async fn run_report(
    mut config: PplConfig,
    options: ReportOptions,
) -> Result<Record, ReportDirError> {
    let started = Instant::now();
    let ext = options.plot_format.to_lowercase();
    // Refused before any work, as `--plot` is.
    plot::check_path(Path::new(&format!("plot.{ext}")))?;
    let server = config
        .servers
        .first()
        .cloned()
        .ok_or_else(|| ReportDirError::Config("no --server given".into()))?;
    let info = Client::new(ClientConfig {
        api_key: config.api_key.clone(),
        timeout: config.timeout,
        retry: config.retry.clone(),
        ..ClientConfig::new(server.clone())
    })
    .map_err(PplError::from)?
    .info()
    .await
    .map_err(PplError::from)?;
    config.task = match (
        &info.reference,
        &config.noise_floor_server,
        options.diff_windows,
    ) {
        (Some(_), ..) => Task::Kld,
        (None, None, None) => Task::Ppl,
        (None, ..) => {
            return Err(ReportDirError::Config(format!(
                "{server} has no reference model, which --noise-floor-server and --diff \
                 compare against: start it with --reference-model DIR (the unquantized \
                 checkpoint), or leave them out for a perplexity-only report"
            )))
        }
    };
    let dir = &options.out;
    std::fs::create_dir_all(dir).map_err(|e| ReportDirError::Write {
        path: dir.clone(),
        message: e.to_string(),
    })?;
    config.output = Some(dir.join(PARTIAL_FILE));
    let run = run_ppl(config.clone()).await?;
    let diff = match options.diff_windows {
        Some(windows) => Some(diff_run(&config, &server, windows).await?),
        None => None,
    };
    let name = options.name.clone().unwrap_or_else(|| info.model.clone());
    let plots = write_plots(dir, &ext, &name, &run, diff.as_ref())?;
    write(dir, RUN_FILE, &to_json(&run.without_per_token()))?;
    if let Some(d) = &diff {
        write(dir, DIFF_FILE, &to_json(d))?;
    }
    let floor_info = run
        .noise_floor
        .as_ref()
        .and_then(|f| f.server_info.as_ref());
    let files = Files {
        model_card: MODEL_CARD_FILE.into(),
        model_index: MODEL_INDEX_FILE.into(),
        plots: plots.iter().map(|(f, _)| f.clone()).collect(),
        run: RUN_FILE.into(),
        diff: diff.as_ref().map(|_| DIFF_FILE.into()),
    };
    let reproduce = record::reproduce(&config, &options, &info, floor_info);
    let elapsed = started.elapsed().as_secs_f64();
    let record = Record::new(&run, diff.as_ref(), reproduce, files, elapsed)?;
    let index = card::model_index(&record, &name);
    let yaml = card::model_index_yaml(&index)
        .map_err(|e| ReportDirError::Config(format!("model-index YAML: {e}")))?;
    write(dir, MODEL_INDEX_FILE, &yaml)?;
    write(
        dir,
        MODEL_CARD_FILE,
        &card::model_card(&record, &name, &plots),
    )?;
    write(dir, RECORD_FILE, &to_json(&record))?;
    // The run is in run.json now; its partial file would only make a rerun ask for --resume.
    let _ = std::fs::remove_file(dir.join(PARTIAL_FILE));
    Ok(record)
}

/// `/diff` over the first `windows` disjoint windows of `config.ctx` tokens.
async fn diff_run(
    config: &PplConfig,
    server: &str,
    windows: usize,
) -> Result<DiffReport, ReportDirError> {
    let mut d = DiffConfig::new(server.to_string(), config.dataset.clone());
    d.api_key = config.api_key.clone();
    d.dataset_options = config.dataset_options.clone();
    (d.ctx, d.windows, d.tokenize) = (config.ctx, windows, config.tokenize);
    d.timeout = config.timeout.max(Duration::from_secs(3600));
    d.retry = config.retry.clone();
    Ok(run_diff(d).await?)
}

/// The plots of the directory: the run's charts and, with `--diff`, the per-layer errors.
/// Returns (file name, caption) of each.
fn write_plots(
    dir: &Path,
    ext: &str,
    name: &str,
    run: &Report,
    diff: Option<&DiffReport>,
) -> Result<Vec<(String, String)>, ReportDirError> {
    let mut plots = vec![];
    let (file, caption) = match run.kld {
        Some(_) => (
            format!("kld.{ext}"),
            "KL-divergence from the reference: mean by bits per weight, mean NLL per window, \
             the spread of the per-token KLD and its histogram",
        ),
        None => (
            format!("ppl.{ext}"),
            "Perplexity by bits per weight and mean NLL per window",
        ),
    };
    plot::plot(&[(name.to_string(), run.clone())], &dir.join(&file))?;
    plots.push((file, caption.to_string()));
    if let Some(d) = diff {
        let file = format!("layers.{ext}");
        plot::plot_diff(&[(name.to_string(), d.clone())], &dir.join(&file))?;
        plots.push((
            file,
            "Where the error enters: cosine error and SQNR per decoder layer".into(),
        ));
    }
    Ok(plots)
}

//! `exactscore`: perplexity evaluations and per-token scores against ExactScore servers.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use exactscore_api::{AttributeInput, AttributeSelection, ReturnOptions, ScoreRequest, TextInput};
use exactscore_client::dataset::{DatasetOptions, DatasetSpec};
use exactscore_client::report_dir::{run_report, ReportOptions};
use exactscore_client::term::{self, ColorChoice};
use exactscore_client::tokenize::TokenizeMode;
use exactscore_client::{
    compare, plot, run_diff, run_ppl, Client, ClientConfig, DiffConfig, DiffReport, Method,
    PplConfig, PplError, Report, RetryPolicy, Task,
};

#[derive(Parser)]
#[command(name = "exactscore", version, about = "Client of ExactScore servers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Perplexity of a dataset, windows spread over one or more servers.
    Ppl(PplArgs),
    /// KL-divergence from the server's reference model (`--reference-model`) over a dataset,
    /// with both perplexities: llama.cpp's `--kl-divergence` statistics, top-K agreement, the
    /// reverse divergence and the KLD by reference confidence. Same options as `ppl`.
    Kld(KldArgs),
    /// Stored references: the reference's top-K log-probabilities and tail mass over a
    /// dataset's windows, for `exactscore kld --reference-file` (docs/stored-reference.md).
    #[command(subcommand)]
    Reference(ReferenceCommand),
    /// A publishable evaluation in one directory: `report.json` (every number, hash, version
    /// and the commands that reproduce it), a model-card section `README.md` with its plots,
    /// and the Hub's `model-index.yaml`. Runs `kld` (or `ppl` on a server without a reference
    /// model) and, with --diff, `diff`.
    Report(ReportArgs),
    /// Compare reports of `exactscore ppl/kld --json` (table, optional plot).
    Compare(CompareArgs),
    /// Where the quantization error enters: the server's `/diff` over a few windows (per
    /// layer: cosine error and SQNR against the reference; the final KLD; with --attribute,
    /// every quantized module's share of it).
    Diff(DiffArgs),
    /// Per-token log-probabilities of a text, as a table.
    Score(ScoreArgs),
    /// The server's /info as JSON.
    Info(ConnArgs),
}

#[derive(Args)]
struct ConnArgs {
    /// Server base URL.
    #[arg(long, env = "EXACTSCORE_SERVER", default_value = DEFAULT_SERVER)]
    server: String,
    /// Bearer API key.
    #[arg(long, env = "EXACTSCORE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Per-request timeout, seconds (at least 1).
    #[arg(long, default_value_t = 600, value_parser = seconds)]
    timeout: u64,
}

#[derive(Args)]
struct RunArgs {
    /// Server base URL; repeat to spread requests over several servers. A host name stands for
    /// every address it resolves to (e.g. a Kubernetes headless Service: one per pod).
    #[arg(
        long = "server",
        env = "EXACTSCORE_SERVER",
        value_delimiter = ',',
        default_value = DEFAULT_SERVER
    )]
    servers: Vec<String>,
    #[arg(long, env = "EXACTSCORE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// `wikitext2`, or a `.txt`, `.txt.gz`, `.jsonl` or `.parquet` file.
    #[arg(long)]
    dataset: String,
    /// Field (`.jsonl`) or column (`.parquet`) holding the text.
    #[arg(long, alias = "column", default_value = "text")]
    field: String,
    /// Where `wikitext-2-raw-test.txt.gz` is (default: tests/fixtures/corpus/ of the repository).
    #[arg(long, env = "EXACTSCORE_WIKITEXT_PATH")]
    wikitext_path: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Method::Exl3)]
    method: Method,
    /// Tokens per request.
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Offset between window starts (exl3 only).
    #[arg(long, default_value_t = 512)]
    stride: usize,
    /// Evaluate only the first N windows.
    #[arg(long)]
    max_windows: Option<usize>,
    /// Requests in flight over all servers together.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Where the text is tokenized.
    #[arg(long, value_enum, default_value_t = TokenizeMode::Local)]
    tokenize: TokenizeMode,
    /// Per-request timeout, seconds (at least 1).
    #[arg(long, default_value_t = 600, value_parser = seconds)]
    timeout: u64,
    /// Retries of a request on 429/503/connection errors.
    #[arg(long, default_value_t = 8)]
    retries: u32,
    /// No progress bar (and no progress lines).
    #[arg(long)]
    no_progress: bool,
    /// When stderr is not a terminal (a log file, nohup): seconds between two progress lines.
    #[arg(long, default_value_t = 10)]
    progress_every: u64,
}

#[derive(Args)]
struct PplArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Partial results (JSON lines, one per finished window).
    #[arg(long)]
    output: Option<PathBuf>,
    /// Continue the run recorded in --output.
    #[arg(long)]
    resume: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// `kld --json`: keep every token's KLD in the report (large: ~100 MB for WikiText-2); by
    /// default the report keeps the statistics and a histogram only.
    #[arg(long)]
    per_token: bool,
}

#[derive(Args)]
struct KldArgs {
    #[command(flatten)]
    run: PplArgs,
    /// Also run the same windows against this server, whose served model and reference are one
    /// checkpoint in two dtypes (`--dtype bf16 --reference-dtype f32`), and report the KLD that
    /// bf16 arithmetic alone causes beside the quantization's.
    #[arg(long)]
    noise_floor_server: Option<String>,
    /// Score against this stored reference (`exactscore reference save`) instead of the
    /// server's reference model: the top-K part exact, the rest bounded. Refused where its
    /// dataset, windows or tokenizer differ from this run's.
    #[arg(long, conflicts_with = "noise_floor_server")]
    reference_file: Option<PathBuf>,
    /// Score against a llama.cpp `--kl-divergence-base` file (llama.cpp's own windows: its
    /// chunks of n_ctx tokens, second halves scored; --dataset and --ctx are not used), each
    /// row kept as its --k likeliest tokens and the mass of the rest.
    #[arg(long, conflicts_with_all = ["noise_floor_server", "reference_file"])]
    llama_cpp_base: Option<PathBuf>,
    /// With --llama-cpp-base: tokens of each row scored exactly.
    #[arg(long, default_value_t = 64, requires = "llama_cpp_base")]
    k: usize,
}

#[derive(Args)]
struct ReportArgs {
    #[command(flatten)]
    run: RunArgs,
    /// The directory to write (created if missing; its files are replaced).
    #[arg(long)]
    out: PathBuf,
    /// Measure the noise floor on this server too (see `exactscore kld --noise-floor-server`).
    #[arg(long)]
    noise_floor_server: Option<String>,
    /// Also compare the models layer by layer (`exactscore diff`) over --diff-windows windows
    /// of --ctx tokens.
    #[arg(long)]
    diff: bool,
    /// With --diff: the first N non-overlapping windows.
    #[arg(long, default_value_t = 4, requires = "diff")]
    diff_windows: usize,
    /// Image format of the plots.
    #[arg(long, value_parser = plot::EXTENSIONS, default_value = "png")]
    plot_format: String,
    /// The model's name in the card and model-index (e.g. its Hub id `org/name`; default: the
    /// server's model name).
    #[arg(long)]
    name: Option<String>,
    /// Continue the run that an interrupted report left in the directory.
    #[arg(long)]
    resume: bool,
}

#[derive(Subcommand)]
enum ReferenceCommand {
    /// Run the server's model over the windows and write a stored reference file.
    Save(ReferenceSaveArgs),
}

#[derive(Args)]
struct ReferenceSaveArgs {
    #[command(flatten)]
    run: PplArgs,
    /// Where to write the stored reference.
    #[arg(long)]
    file: PathBuf,
    /// Most likely tokens kept per position.
    #[arg(long, default_value_t = 64)]
    k: usize,
    /// `exactscore`: the stored reference above; `llama-cpp`: llama.cpp's
    /// `--kl-divergence-base` file, with llama.cpp's windows (non-overlapping chunks of --ctx
    /// tokens, --max-windows as its --chunks, second halves scored) and every token of each row
    /// (--k unused).
    #[arg(long, value_enum, default_value_t = ReferenceFormat::Exactscore)]
    format: ReferenceFormat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ReferenceFormat {
    Exactscore,
    LlamaCpp,
}

#[derive(Args)]
struct DiffArgs {
    /// Server base URL; its `--reference-model` is the reference [default:
    /// http://127.0.0.1:8000 unless --from is given].
    #[arg(long, env = "EXACTSCORE_SERVER")]
    server: Option<String>,
    #[arg(long, env = "EXACTSCORE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// `wikitext2`, or a `.txt`, `.txt.gz`, `.jsonl` or `.parquet` file.
    #[arg(long, default_value = "wikitext2")]
    dataset: String,
    /// Field (`.jsonl`) or column (`.parquet`) holding the text.
    #[arg(long, alias = "column", default_value = "text")]
    field: String,
    /// Where `wikitext-2-raw-test.txt.gz` is (default: tests/fixtures/corpus/ of the repository).
    #[arg(long, env = "EXACTSCORE_WIKITEXT_PATH")]
    wikitext_path: Option<PathBuf>,
    /// Tokens per window.
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Windows: the first N non-overlapping stretches of --ctx tokens.
    #[arg(long, default_value_t = 4)]
    windows: usize,
    /// The served model goes on from the reference's state after this decoder layer (0-based).
    #[arg(long)]
    reference_until: Option<usize>,
    /// Attribute the KLD to every quantized module (one reference forward per module).
    #[arg(long)]
    attribute: bool,
    /// With --attribute: only the modules of decoder layers FIRST-LAST (inclusive).
    #[arg(long, requires = "attribute", value_name = "FIRST-LAST")]
    attribute_layers: Option<String>,
    /// With --attribute: only the modules whose name matches (`*`: any run of characters),
    /// e.g. `*.mlp.down_proj`.
    #[arg(long, requires = "attribute")]
    attribute_pattern: Option<String>,
    /// Modules shown in the attribution table.
    #[arg(long, default_value_t = 20)]
    top: usize,
    /// Where the text is tokenized.
    #[arg(long, value_enum, default_value_t = TokenizeMode::Local)]
    tokenize: TokenizeMode,
    /// Write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw cos error and SQNR per layer of this run and of every --from report (`.png` or
    /// `.svg`).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Reports of earlier `exactscore diff --json` runs: printed, and drawn with --plot.
    #[arg(long)]
    from: Vec<PathBuf>,
    /// Time limit of the request, seconds (at least 1).
    #[arg(long, default_value_t = 3600, value_parser = seconds)]
    timeout: u64,
}

#[derive(Args)]
struct CompareArgs {
    /// Report files (`exactscore ppl --json`).
    #[arg(required = true)]
    reports: Vec<PathBuf>,
    /// Write a plot (`.png` or `.svg`).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Show reports whose dataset, tokenizer, method, ctx, stride or window count differ from
    /// the first report's, each marked with what differs (refused without this flag).
    #[arg(long)]
    allow_mismatch: bool,
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Text to score (tokenized by the server).
    #[arg(long)]
    text: String,
    /// Show the k most likely tokens at each position.
    #[arg(long, default_value_t = 0)]
    top_k: i64,
    /// Let the tokenizer add its special tokens (BOS).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    add_special_tokens: bool,
    /// Colour surprising tokens (`auto`: on a terminal, unless NO_COLOR is set).
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    color: ColorChoice,
}

/// Where the client looks for a server unless told otherwise: what
/// `cargo run --release -p exactscore-server` listens on.
const DEFAULT_SERVER: &str = "http://127.0.0.1:8000";

/// A time limit in whole seconds, at least 1.
fn seconds(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("0 would fail every request at once: give at least 1 (seconds)".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(format!("{e}: expected whole seconds, e.g. 600")),
    }
}

/// `println!` that returns an error instead of panicking when stdout is closed (`| head`).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)?
    }};
}

/// `print!` that returns an error instead of panicking when stdout is closed.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)?
    }};
}

fn client(conn: &ConnArgs) -> anyhow::Result<Client> {
    Ok(Client::new(ClientConfig {
        base_url: conn.server.clone(),
        api_key: conn.api_key.clone(),
        timeout: Duration::from_secs(conn.timeout),
        connect_timeout: Duration::from_secs(10),
        retry: RetryPolicy::default(),
        connect_to: None,
    })?)
}

/// The run configuration of `args` (dataset, windows, servers, limits).
fn run_config(args: &RunArgs) -> anyhow::Result<PplConfig> {
    let mut cfg = PplConfig::new(args.servers.clone(), DatasetSpec::parse(&args.dataset)?);
    cfg.api_key = args.api_key.clone();
    cfg.dataset_options = DatasetOptions {
        field: Some(args.field.clone()),
        wikitext_path: args.wikitext_path.clone(),
    };
    cfg.method = args.method;
    cfg.ctx = args.ctx;
    cfg.stride = args.stride;
    cfg.max_windows = args.max_windows;
    cfg.tokenize = args.tokenize;
    cfg.timeout = Duration::from_secs(args.timeout);
    cfg.retry = RetryPolicy {
        max_retries: args.retries,
        ..RetryPolicy::default()
    };
    Ok(cfg)
}

/// [`run_config`] of a run that `exactscore` runs itself (`ppl`, `kld`, `report`): with the
/// concurrency and progress display of `args`, stopped by Ctrl-C.
fn live_run_config(args: &RunArgs) -> anyhow::Result<PplConfig> {
    let mut cfg = run_config(args)?;
    cfg.concurrency = args.concurrency;
    cfg.progress = !args.no_progress;
    cfg.progress_every = Duration::from_secs(args.progress_every);
    stop_on_ctrl_c(&cfg);
    Ok(cfg)
}

/// Ctrl-C stops dispatching `cfg`'s windows (those in flight finish into its partial file); a
/// second one quits at once.
fn stop_on_ctrl_c(cfg: &PplConfig) {
    let cancel = cfg.cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            cancel.store(true, Ordering::SeqCst);
            eprintln!("\nstopping: finishing requests in flight (Ctrl-C again to quit now)");
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
}

async fn reference_save(args: ReferenceSaveArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.k >= 1, "--k must be at least 1");
    let cfg = run_config(&args.run.run)?;
    if let ReferenceFormat::LlamaCpp = args.format {
        let file = exactscore_client::llamacpp::save_base(&cfg, &args.file).await?;
        outln!(
            "wrote {}: llama.cpp base, n_ctx {}, {} chunks, {} rows, {} bytes",
            args.file.display(),
            file.n_ctx,
            file.n_chunk,
            file.rows(),
            std::fs::metadata(&args.file)?.len()
        );
        return Ok(());
    }
    let file = exactscore_client::reference::save(&cfg, args.k, &args.file).await?;
    let rows: usize = file.header.layout.iter().map(|w| w.rows).sum();
    let bytes = std::fs::metadata(&args.file)?.len();
    outln!(
        "wrote {}: {} windows, {rows} positions, k = {}, {bytes} bytes",
        args.file.display(),
        file.windows.len(),
        file.header.k
    );
    Ok(())
}

async fn stored_kld(args: PplArgs, path: &std::path::Path) -> anyhow::Result<()> {
    let cfg = run_config(&args.run)?;
    let file = exactscore_client::reference::ReferenceFile::read(path)?;
    let report = exactscore_client::reference::kld(&cfg, &file).await?;
    out!("{}", report.to_table());
    if let Some(path) = args.json {
        let s = serde_json::to_string_pretty(&report)?;
        std::fs::write(&path, s).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn llama_cpp_kld(args: PplArgs, path: &std::path::Path, k: usize) -> anyhow::Result<()> {
    anyhow::ensure!(k >= 1, "--k must be at least 1");
    let cfg = run_config(&args.run)?;
    let file = exactscore_client::llamacpp::BaseFile::read(path)?;
    let report = exactscore_client::llamacpp::kld_base(&cfg, &file, k).await?;
    out!("{}", report.to_table());
    if let Some(path) = args.json {
        let s = serde_json::to_string_pretty(&report)?;
        std::fs::write(&path, s).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn ppl(args: PplArgs, task: Task, noise_floor_server: Option<String>) -> anyhow::Result<()> {
    let mut cfg = live_run_config(&args.run)?;
    cfg.task = task;
    cfg.noise_floor_server = noise_floor_server;
    cfg.output = args.output;
    cfg.resume = args.resume;
    let report = run_ppl(cfg).await?;
    out!("{}", report.to_table());
    if let Some(path) = args.json {
        let report = match args.per_token {
            true => report,
            false => report.without_per_token(),
        };
        let s = serde_json::to_string_pretty(&report)?;
        std::fs::write(&path, s).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn report(args: ReportArgs) -> anyhow::Result<()> {
    let mut cfg = live_run_config(&args.run)?;
    cfg.noise_floor_server = args.noise_floor_server;
    cfg.resume = args.resume;
    let options = ReportOptions {
        out: args.out,
        diff_windows: args.diff.then_some(args.diff_windows),
        plot_format: args.plot_format,
        name: args.name,
    };
    let dir = options.out.clone();
    let record = run_report(cfg, options).await?;
    let kld = record
        .kld
        .as_ref()
        .map(|k| format!(", mean KLD {:.6}", k.mean_kld))
        .unwrap_or_default();
    outln!(
        "wrote {}: perplexity {:.4}{kld} over {} windows; {}, {} and {}",
        dir.display(),
        record.perplexity.value,
        record.windows.windows,
        record.files.model_card,
        record.files.model_index,
        record.files.plots.join(", ")
    );
    Ok(())
}

fn compare(args: CompareArgs) -> anyhow::Result<()> {
    args.plot.as_deref().map(plot::check_path).transpose()?;
    let mut loaded = vec![];
    for p in &args.reports {
        let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned());
        loaded.push((stem.unwrap_or_default(), Report::from_path(p)?));
    }
    let mut reports = compare::labelled(loaded);
    let names: Vec<String> = args
        .reports
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    compare::check(&mut reports, &names, args.allow_mismatch).map_err(anyhow::Error::msg)?;
    out!("{}", compare::table(&reports));
    if let Some(p) = args.plot {
        plot::plot(&reports, &p)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// `FIRST-LAST` of --attribute-layers.
fn layer_range(s: &str) -> anyhow::Result<Vec<i64>> {
    let parse = |v: &str| v.trim().parse::<i64>();
    match s.split_once('-').map(|(a, b)| (parse(a), parse(b))) {
        Some((Ok(a), Ok(b))) => Ok(vec![a, b]),
        _ => anyhow::bail!("--attribute-layers {s:?}: expected FIRST-LAST, e.g. 10-20"),
    }
}

async fn diff(args: DiffArgs) -> anyhow::Result<()> {
    args.plot.as_deref().map(plot::check_path).transpose()?;
    let mut reports: Vec<(String, DiffReport)> = Vec::new();
    for p in &args.from {
        let s = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let r: DiffReport = serde_json::from_str(&s)
            .with_context(|| format!("{}: not an `exactscore diff` report", p.display()))?;
        let label = r.label();
        reports.push((label, r));
    }
    let server = match (args.server, args.from.is_empty()) {
        (None, true) => Some(DEFAULT_SERVER.to_string()),
        (server, _) => server,
    };
    if let Some(server) = server {
        let mut cfg = DiffConfig::new(server, DatasetSpec::parse(&args.dataset)?);
        cfg.api_key = args.api_key;
        cfg.dataset_options = DatasetOptions {
            field: Some(args.field),
            wikitext_path: args.wikitext_path,
        };
        (cfg.ctx, cfg.windows, cfg.reference_until) =
            (args.ctx, args.windows, args.reference_until);
        cfg.tokenize = args.tokenize;
        cfg.timeout = Duration::from_secs(args.timeout);
        cfg.attribute = match (
            args.attribute,
            args.attribute_layers,
            args.attribute_pattern,
        ) {
            (false, ..) => None,
            (true, None, None) => Some(AttributeInput::All(true)),
            (true, layers, pattern) => Some(AttributeInput::Select(AttributeSelection {
                layers: layers.as_deref().map(layer_range).transpose()?,
                pattern,
            })),
        };
        let report = run_diff(cfg).await?;
        if let Some(path) = &args.json {
            let s = serde_json::to_string_pretty(&report)?;
            std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))?;
        }
        let label = report.label();
        reports.push((label, report));
    }
    for (i, (_, r)) in reports.iter().enumerate() {
        if i > 0 {
            outln!();
        }
        out!("{}", r.to_table(args.top));
    }
    if let Some(p) = args.plot {
        plot::plot_diff(&reports, &p)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

async fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let c = client(&args.conn)?;
    let req = ScoreRequest {
        text: Some(TextInput::Single(args.text.clone())),
        add_special_tokens: Some(args.add_special_tokens),
        top_k: Some(args.top_k),
        return_options: Some(ReturnOptions {
            token_logprobs: true,
            top_k: args.top_k > 0,
            greedy: true,
            token_strings: true,
        }),
        ..Default::default()
    };
    let resp = c.score(&req).await?;
    let seq = resp
        .sequences
        .first()
        .context("the server returned no sequence")?;
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let on = args.color.enabled(no_color);
    let strings = seq.token_strings.clone().unwrap_or_default();
    let lps = seq.token_logprobs.clone().unwrap_or_default();
    let greedy = seq.greedy.clone().unwrap_or_default();
    outln!(
        "{:>5}  {:>7}  {:<20}  {:>9}  {:>8}  greedy{}",
        "pos",
        "id",
        "token",
        "logprob",
        "prob",
        if args.top_k > 0 { "  top" } else { "" }
    );
    for (i, id) in seq.tokens.iter().enumerate() {
        let tok = term::escape_token(strings.get(i).map(String::as_str).unwrap_or(""));
        let tok = format!("{tok:<20}");
        let (lp, prob, color) = match lps.get(i).copied().flatten() {
            Some(lp) => (
                format!("{lp:>9.4}"),
                format!("{:>8.4}", lp.exp()),
                Some(term::surprise_color(lp)),
            ),
            None => (format!("{:>9}", "-"), format!("{:>8}", "-"), None),
        };
        let g = match greedy.get(i).copied().flatten() {
            Some(true) => "yes",
            Some(false) => "no",
            None => "-",
        };
        let top = if args.top_k > 0 && i > 0 {
            seq.top_k
                .as_ref()
                .and_then(|t| t.get(i - 1))
                .map(|alts| {
                    alts.iter()
                        .map(|a| {
                            format!(
                                "{}:{:.2}",
                                term::escape_token(a.token.as_deref().unwrap_or("?")),
                                a.logprob
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default()
        } else {
            String::new()
        };
        let (tok, lp) = match color {
            Some(col) => (term::paint(&tok, col, on), term::paint(&lp, col, on)),
            None => (term::paint(&tok, term::Color::Dim, on), lp),
        };
        outln!(
            "{i:>5}  {id:>7}  {tok}  {lp}  {prob}  {g:>6}{}",
            if top.is_empty() {
                String::new()
            } else {
                format!("  {top}")
            }
        );
    }
    match (seq.mean_nll, seq.perplexity) {
        (Some(m), Some(p)) => outln!(
            "{} tokens, {} scored: sum NLL {:.4}, mean NLL {m:.4}, perplexity {p:.4}",
            seq.tokens.len(),
            seq.num_scored,
            seq.sum_nll
        ),
        _ => outln!("{} tokens, nothing scored", seq.tokens.len()),
    }
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Ppl(a) => ppl(a, Task::Ppl, None).await,
        Command::Kld(a) => match (a.reference_file, a.llama_cpp_base) {
            (Some(file), _) => stored_kld(a.run, &file).await,
            (_, Some(base)) => llama_cpp_kld(a.run, &base, a.k).await,
            _ => ppl(a.run, Task::Kld, a.noise_floor_server).await,
        },
        Command::Reference(ReferenceCommand::Save(a)) => reference_save(a).await,
        Command::Report(a) => report(a).await,
        Command::Compare(a) => compare(a),
        Command::Diff(a) => diff(a).await,
        Command::Score(a) => score(a).await,
        Command::Info(a) => {
            let info = client(&a)?.info().await?;
            outln!("{}", serde_json::to_string_pretty(&info)?);
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`exactscore info | head`): nothing left to say.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            match e.downcast_ref::<PplError>() {
                Some(PplError::Interrupted { .. }) => ExitCode::from(130),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The error and its causes on one line, a cause whose text is already shown left out (an
/// error that prints its source would otherwise show the OS error twice).
fn one_line(e: &anyhow::Error) -> String {
    let mut s = String::new();
    for c in e.chain() {
        let t = c.to_string();
        if s.contains(&t) {
            continue;
        }
        if !s.is_empty() {
            s.push_str(": ");
        }
        s.push_str(&t);
    }
    s.replace('\n', " ")
}

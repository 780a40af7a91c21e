//! The perplexity runner behind `exactscore ppl`: dataset → tokens → windows → requests spread
//! over all servers → resumable partial file → [`Report`].
//!
//! Partial file (JSON lines, flushed per line): a header line
//! `{"exactscore_partial":1, method, ctx, stride, max_windows, prefix, dataset_sha256,
//! tokens_sha256, num_tokens, num_windows, model}` then one [`WindowResult`] per finished window
//! (`{"window", "sum_nll", "count"}`) in completion order. `--resume` checks the header against the
//! current run, drops a torn last line (interrupted write), and skips the windows already there.

use std::collections::{BTreeMap, VecDeque};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use exactscore_api::ModelInfo;
use serde::{Deserialize, Serialize};

use crate::dataset::{self, DatasetError, DatasetOptions, DatasetSpec};
use crate::fingerprint::{self, Fingerprint};
use crate::http::{Client, ClientConfig, ClientError, RetryPolicy};
use crate::kld::{KldStats, KldWindow};
use crate::progress::{ProgressConfig, Reporter, Running};
use crate::report::{DatasetSummary, NoiseFloor, Report, Stats, WindowResult, STDERR_METHOD};
use crate::resolve::{self, Resolve, SystemResolver};
use crate::tokenize::{self, TokenizeError, TokenizeMode};
use crate::windows::{self, Method, Window, WindowError, WindowParams};

/// What a run computes per window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    /// Log-probabilities of the served model (`/score`): perplexity.
    #[default]
    Ppl,
    /// Divergence from the server's reference model (`/kld`), with both perplexities.
    Kld,
}

/// Everything a run needs. Build with [`PplConfig::new`] and adjust the fields.
#[derive(Debug, Clone)]
pub struct PplConfig {
    pub task: Task,
    /// Server URLs; a host name stands for every address it resolves to (see [`resolve`]).
    pub servers: Vec<String>,
    /// How host names in `servers` are looked up (the system resolver by default).
    pub resolver: Arc<dyn Resolve>,
    pub api_key: Option<String>,
    pub dataset: DatasetSpec,
    pub dataset_options: DatasetOptions,
    pub method: Method,
    pub ctx: usize,
    pub stride: usize,
    pub max_windows: Option<usize>,
    /// Requests in flight over all servers together.
    pub concurrency: usize,
    pub tokenize: TokenizeMode,
    /// Partial results file (JSON lines).
    pub output: Option<PathBuf>,
    pub resume: bool,
    /// Show progress: a bar on a terminal, else a plain line every `progress_every`.
    pub progress: bool,
    pub progress_every: Duration,
    pub timeout: Duration,
    pub retry: RetryPolicy,
    /// Stop dispatching once this many windows finished in this run (tests simulate an
    /// interruption with it).
    pub stop_after: Option<usize>,
    /// Set to stop dispatching (Ctrl-C); windows in flight are still written.
    pub cancel: Arc<AtomicBool>,
    /// Called once the windows are known and after every finished window (the Python API draws
    /// its own progress bar with it).
    pub on_progress: Option<ProgressHook>,
    /// `Task::Kld`: a server whose served model and reference are one checkpoint in two dtypes;
    /// the same windows are then run there too and reported as [`Report::noise_floor`].
    pub noise_floor_server: Option<String>,
}

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Windows finished, those resumed from the partial file included.
    pub done: usize,
    pub total: usize,
    /// Tokens scored per second in this run so far.
    pub tokens_per_s: f64,
    /// Perplexity over the windows finished so far (NaN before the first).
    pub perplexity: f64,
}

/// A function called with each [`Progress`], on the runner's task: it must return quickly.
#[derive(Clone)]
pub struct ProgressHook(pub Arc<dyn Fn(Progress) + Send + Sync>);

impl std::fmt::Debug for ProgressHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressHook")
    }
}

impl PplConfig {
    pub fn new(servers: Vec<String>, dataset: DatasetSpec) -> Self {
        Self {
            task: Task::Ppl,
            servers,
            resolver: Arc::new(SystemResolver),
            api_key: None,
            dataset,
            dataset_options: DatasetOptions::default(),
            method: Method::Exl3,
            ctx: 2048,
            stride: 512,
            max_windows: None,
            concurrency: 4,
            tokenize: TokenizeMode::Local,
            output: None,
            resume: false,
            progress: false,
            progress_every: Duration::from_secs(10),
            timeout: Duration::from_secs(600),
            retry: RetryPolicy::default(),
            stop_after: None,
            cancel: Arc::new(AtomicBool::new(false)),
            on_progress: None,
            noise_floor_server: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PplError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error(transparent)]
    Window(#[from] WindowError),
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    #[error("{0}")]
    Config(String),
    #[error("the servers of one run must be configured alike: {0}")]
    ServerMismatch(String),
    #[error("{url}: bad score response for window {window}: {message}")]
    BadResponse {
        url: String,
        window: usize,
        message: String,
    },
    #[error("partial file {path}: {message}")]
    Partial { path: PathBuf, message: String },
    #[error("{source}; {done}/{total} windows finished{}", resume_hint(.output))]
    Failed {
        source: Box<PplError>,
        done: usize,
        total: usize,
        output: Option<PathBuf>,
    },
    #[error("interrupted after {done}/{total} windows{}", resume_hint(.output))]
    Interrupted {
        done: usize,
        total: usize,
        output: Option<PathBuf>,
    },
}

fn resume_hint(output: &Option<PathBuf>) -> String {
    match output {
        Some(p) => format!(
            "; they are in {}: rerun the same command with --resume to continue",
            p.display()
        ),
        None => "; pass --output FILE to make a run resumable (then --resume continues it)".into(),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PartialHeader {
    exactscore_partial: u32,
    /// Absent from files written before `exactscore kld` existed: those are `ppl` runs.
    #[serde(default)]
    task: Task,
    method: Method,
    ctx: usize,
    stride: usize,
    max_windows: Option<usize>,
    prefix: Option<u32>,
    dataset_sha256: String,
    tokens_sha256: String,
    num_tokens: usize,
    num_windows: usize,
    model: String,
    /// The server's numbers-changing configuration; absent from files of older clients.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fingerprint: Option<Fingerprint>,
}

fn tokens_sha256(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    dataset::sha256_hex(&bytes)
}

/// Read a partial file: its header and finished windows. A torn last line is cut off the file.
fn read_partial(path: &Path) -> Result<(PartialHeader, Vec<WindowResult>), PplError> {
    let perr = |message: String| PplError::Partial {
        path: path.to_path_buf(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|e| perr(e.to_string()))?;
    let complete = match bytes.iter().rposition(|&b| b == b'\n') {
        Some(i) => i + 1,
        None => 0,
    };
    if complete < bytes.len() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| perr(e.to_string()))?;
        f.set_len(complete as u64)
            .map_err(|e| perr(e.to_string()))?;
    }
    let text = std::str::from_utf8(&bytes[..complete]).map_err(|e| perr(e.to_string()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: PartialHeader = match lines.next() {
        Some(l) => serde_json::from_str(l).map_err(|e| perr(format!("bad header: {e}")))?,
        None => return Err(perr("empty (no header)".into())),
    };
    let mut seen = std::collections::BTreeSet::new();
    let mut results = vec![];
    for (i, l) in lines.enumerate() {
        let r: WindowResult =
            serde_json::from_str(l).map_err(|e| perr(format!("line {}: {e}", i + 2)))?;
        if r.window >= header.num_windows {
            return Err(perr(format!("window {} out of range", r.window)));
        }
        if seen.insert(r.window) {
            results.push(r);
        }
    }
    Ok((header, results))
}

fn header_diff(a: &PartialHeader, b: &PartialHeader) -> Option<String> {
    let mut d = vec![];
    macro_rules! cmp {
        ($f:ident) => {
            if a.$f != b.$f {
                d.push(format!(
                    "{} {:?} (file) vs {:?} (now)",
                    stringify!($f),
                    a.$f,
                    b.$f
                ));
            }
        };
    }
    cmp!(exactscore_partial);
    cmp!(task);
    cmp!(method);
    cmp!(ctx);
    cmp!(stride);
    cmp!(max_windows);
    cmp!(prefix);
    cmp!(dataset_sha256);
    cmp!(tokens_sha256);
    cmp!(num_windows);
    cmp!(model);
    match (&a.fingerprint, &b.fingerprint) {
        (Some(fa), Some(fb)) => d.extend(
            fingerprint::differences(fa, fb)
                .into_iter()
                .map(|x| format!("server {x} (file vs now)")),
        ),
        (None, _) => d.push(
            "the file records no server configuration (an older exactscore wrote it), so \
             its numbers cannot be checked against this server's: start a new --output file"
                .into(),
        ),
        (Some(_), None) => {}
    }
    (!d.is_empty()).then(|| d.join("; "))
}

/// Picks the server with the fewest requests in flight (round-robin among ties).
struct Balancer {
    inflight: Vec<AtomicUsize>,
    rr: AtomicUsize,
}

impl Balancer {
    fn new(n: usize) -> Self {
        Self {
            inflight: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            rr: AtomicUsize::new(0),
        }
    }

    fn acquire(&self) -> usize {
        let n = self.inflight.len();
        let start = self.rr.fetch_add(1, Ordering::Relaxed) % n;
        let best = (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&i| self.inflight[i].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.inflight[best].fetch_add(1, Ordering::Relaxed);
        best
    }

    fn release(&self, i: usize) {
        self.inflight[i].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Checks that a response is about `seq` and that every per-token array covers it.
fn check_response(
    bad: &impl Fn(String) -> PplError,
    tokens: &[u32],
    seq: &[u32],
    arrays: &[(&str, Option<usize>)],
) -> Result<(), PplError> {
    if tokens != seq {
        return Err(bad("the server scored other tokens than were sent".into()));
    }
    for &(name, len) in arrays {
        match len {
            None => return Err(bad(format!("no {name}"))),
            Some(n) if n != seq.len() => {
                return Err(bad(format!("{n} {name} for {} tokens", seq.len())))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// −log p at `position`, refusing a missing, infinite or positive log-probability.
fn nll_at(
    bad: &impl Fn(String) -> PplError,
    logprobs: &[Option<f32>],
    position: usize,
) -> Result<f64, PplError> {
    match logprobs[position] {
        Some(lp) if lp.is_finite() && lp <= 0.0 => Ok(-f64::from(lp)),
        other => Err(bad(format!(
            "position {position}: log-probability {other:?}"
        ))),
    }
}

fn bad_response(url: &str, w: &Window) -> impl Fn(String) -> PplError {
    let (url, window) = (url.to_string(), w.index);
    move |message| PplError::BadResponse {
        url: url.clone(),
        window,
        message,
    }
}

/// NLL sum of a window from a score response.
fn window_nll(
    url: &str,
    w: &Window,
    seq: &[u32],
    score: &exactscore_api::SequenceScore,
) -> Result<WindowResult, PplError> {
    let bad = bad_response(url, w);
    let lps = score.token_logprobs.as_deref();
    check_response(
        &bad,
        &score.tokens,
        seq,
        &[("token_logprobs", lps.map(<[_]>::len))],
    )?;
    let lps = lps.unwrap_or_default();
    let mut sum = 0f64;
    let mut positions = Vec::new();
    for p in w.scored.clone() {
        let nll = nll_at(&bad, lps, p)?;
        sum += nll;
        crate::positions::add(&mut positions, p, nll, 0.0);
    }
    Ok(WindowResult {
        window: w.index,
        sum_nll: sum,
        count: w.num_scored(),
        kld: None,
        positions,
    })
}

/// Every per-token array of a `/kld` answer covers `seq`.
fn check_kld_response(
    bad: &impl Fn(String) -> PplError,
    seq: &[u32],
    d: &exactscore_api::SequenceDivergence,
) -> Result<(), PplError> {
    let len = |v: &Option<Vec<_>>| v.as_ref().map(Vec::len);
    check_response(
        bad,
        &d.tokens,
        seq,
        &[
            ("kld", len(&d.kld)),
            ("logprobs", d.logprobs.as_ref().map(Vec::len)),
            (
                "reference_logprobs",
                d.reference_logprobs.as_ref().map(Vec::len),
            ),
            ("same_top", d.same_top.as_ref().map(Vec::len)),
            ("delta_p", len(&d.delta_p)),
            ("reverse_kld", len(&d.reverse_kld)),
            ("top_k_agreement", d.top_k_agreement.as_ref().map(Vec::len)),
            ("reference_top_p", len(&d.reference_top_p)),
        ],
    )
}

/// One position of a `/kld` answer, checked: (kld, same top, Δp, reverse kld, top-K mask,
/// reference top p).
fn kld_position(
    bad: &impl Fn(String) -> PplError,
    d: &exactscore_api::SequenceDivergence,
    p: usize,
) -> Result<(f64, bool, f64, f64, u32, f64), PplError> {
    let at = |v: &Option<Vec<Option<f64>>>| v.as_ref().and_then(|v| v[p]);
    let same = d.same_top.as_ref().and_then(|v| v[p]);
    let mask = d.top_k_agreement.as_ref().and_then(|v| v[p]);
    let (Some(k), Some(same), Some(dp)) = (at(&d.kld), same, at(&d.delta_p)) else {
        return Err(bad(format!(
            "position {p}: missing kld, same_top or delta_p"
        )));
    };
    let (Some(r), Some(mask), Some(top_p)) = (at(&d.reverse_kld), mask, at(&d.reference_top_p))
    else {
        return Err(bad(format!(
            "position {p}: missing reverse_kld, top_k_agreement or reference_top_p"
        )));
    };
    // A divergence is ≥ 0; rounding may leave it a hair below.
    if !k.is_finite() || k < -1e-9 || !r.is_finite() || r < -1e-9 || !dp.is_finite() {
        return Err(bad(format!(
            "position {p}: kld {k}, reverse_kld {r}, delta_p {dp}"
        )));
    }
    Ok((k, same, dp, r, u32::from(mask), top_p))
}

/// A window's divergence from a `/kld` response, over the same positions as its NLL.
fn window_kld(
    url: &str,
    w: &Window,
    seq: &[u32],
    d: &exactscore_api::SequenceDivergence,
) -> Result<WindowResult, PplError> {
    let bad = bad_response(url, w);
    check_kld_response(&bad, seq, d)?;
    let lps = d.logprobs.as_deref().unwrap_or_default();
    let ref_lps = d.reference_logprobs.as_deref().unwrap_or_default();
    let mut part = KldWindow {
        reference_sum_nll: 0.0,
        same_top: 0,
        sum_delta_p: 0.0,
        sum_delta_p_squared: 0.0,
        sum_ln_ratio_squared: 0.0,
        kld: Vec::with_capacity(w.num_scored()),
        sum_reverse_kld: 0.0,
        sum_reverse_kld_squared: 0.0,
        top_k_agreement: vec![0; exactscore_api::TOP_K_AGREEMENT_MAX],
        reference_top_p: Vec::with_capacity(w.num_scored()),
    };
    let mut sum_nll = 0f64;
    let mut positions = Vec::new();
    for p in w.scored.clone() {
        let (nll, ref_nll) = (nll_at(&bad, lps, p)?, nll_at(&bad, ref_lps, p)?);
        let (k, same, dp, r, mask, top_p) = kld_position(&bad, d, p)?;
        crate::positions::add(&mut positions, p, nll, k);
        part.sum_reverse_kld += r;
        part.sum_reverse_kld_squared += r * r;
        for (k, count) in part.top_k_agreement.iter_mut().enumerate() {
            *count += usize::from(mask & (1 << k) != 0);
        }
        part.reference_top_p.push(top_p);
        sum_nll += nll;
        part.reference_sum_nll += ref_nll;
        part.same_top += usize::from(same);
        part.sum_delta_p += dp;
        part.sum_delta_p_squared += dp * dp;
        part.sum_ln_ratio_squared += (nll - ref_nll).powi(2);
        part.kld.push(k);
    }
    Ok(WindowResult {
        window: w.index,
        sum_nll,
        count: w.num_scored(),
        kld: Some(part),
        positions,
    })
}

/// Checks of the configuration that need no server.
fn validate(config: &PplConfig) -> Result<(), PplError> {
    let refuse = |m: &str| Err(PplError::Config(m.into()));
    if config.servers.is_empty() {
        return refuse("at least one --server is needed");
    }
    if config.concurrency == 0 {
        return refuse("--concurrency must be at least 1");
    }
    if config.resume && config.output.is_none() {
        return refuse("--resume needs --output (the partial file of the run to continue)");
    }
    if config.max_windows == Some(0) {
        return refuse(
            "--max-windows 0 would evaluate nothing: give at least 1, or leave it out to \
             evaluate every window",
        );
    }
    if config.timeout.is_zero() {
        return refuse(
            "--timeout 0 would fail every request at once: give the per-request time limit in \
             seconds (at least 1)",
        );
    }
    if config.noise_floor_server.is_some() && config.task == Task::Ppl {
        return refuse("--noise-floor-server is an option of `exactscore kld`");
    }
    Ok(())
}

/// The run's servers, each ready, all agreeing on everything that changes the numbers.
async fn connect(
    config: &PplConfig,
    base: &ClientConfig,
) -> Result<(Vec<Client>, Vec<ModelInfo>), PplError> {
    let clients = resolve::clients(&config.servers, base, config.resolver.as_ref()).await?;
    let mut infos = vec![];
    for c in &clients {
        c.ready().await?;
        infos.push(c.info().await?);
    }
    let first = Fingerprint::from(&infos[0]);
    for (c, i) in clients.iter().zip(&infos).skip(1) {
        let d = fingerprint::differences(&first, &Fingerprint::from(i));
        if !d.is_empty() {
            return Err(PplError::ServerMismatch(format!(
                "{} vs {}: {}",
                clients[0].label(),
                c.label(),
                d.join("; ")
            )));
        }
    }
    if config.task == Task::Kld {
        if let Some((c, _)) = clients
            .iter()
            .zip(&infos)
            .find(|(_, i)| i.reference.is_none())
        {
            return Err(PplError::Config(format!(
                "{} has no reference model: start it with --reference-model DIR (the \
                 unquantized checkpoint) to compute KL-divergences",
                c.base_url()
            )));
        }
    }
    Ok((clients, infos))
}

/// The dataset's text, its tokens, and the windows cut from them.
pub(crate) struct Prepared {
    pub(crate) ds: dataset::Dataset,
    pub(crate) tokens: Vec<u32>,
    /// Tokens of the text, a tokenizer-added BOS excluded.
    text_tokens: usize,
    pub(crate) prefix: Option<u32>,
    pub(crate) all: Vec<Window>,
}

/// `--ctx` fits every server's `max_input_tokens`.
fn check_ctx(config: &PplConfig, infos: &[ModelInfo]) -> Result<(), PplError> {
    let max_len = infos
        .iter()
        .map(|i| i.limits.max_input_tokens)
        .min()
        .unwrap_or(usize::MAX);
    if max_len > 0 && config.ctx > max_len {
        return Err(PplError::Config(format!(
            "--ctx {} exceeds the server's max_input_tokens {}",
            config.ctx, max_len
        )));
    }
    Ok(())
}

pub(crate) async fn prepare(
    config: &PplConfig,
    client: &Client,
    infos: &[ModelInfo],
) -> Result<Prepared, PplError> {
    check_ctx(config, infos)?;
    let spec = config.dataset.clone();
    let opts = config.dataset_options.clone();
    let ds = tokio::task::spawn_blocking(move || dataset::load(&spec, &opts))
        .await
        .map_err(|e| PplError::Config(e.to_string()))??;
    let tinfo = client.tokenizer_info().await?;
    // exl3/disjoint: the tokenizer's own special-token rule (BOS at the very start when it adds
    // one); rolling: no special tokens, the prefix token (BOS, else EOS) prepended instead.
    let add_special = config.method != Method::Rolling;
    let prefix = match config.method {
        Method::Rolling => Some(
            tinfo
                .bos_token_id
                .or(tinfo.eos_token_id)
                .ok_or(WindowError::NoPrefix)?,
        ),
        _ => None,
    };
    let tokens = tokenize::tokenize(client, &ds.text, add_special, config.tokenize).await?;
    let bos_added = add_special
        && tinfo.add_bos_token
        && tinfo.bos_token_id.is_some()
        && tokens.first().copied() == tinfo.bos_token_id;
    let params = WindowParams {
        method: config.method,
        ctx: config.ctx,
        stride: config.stride,
        prefix_token: prefix,
        max_windows: config.max_windows,
    };
    let all = windows::windows(tokens.len(), &params)?;
    if all.is_empty() {
        return Err(PplError::Config(format!(
            "no window: {} tokens are too few for method {} with ctx {}",
            tokens.len(),
            config.method,
            config.ctx
        )));
    }
    Ok(Prepared {
        text_tokens: tokens.len() - usize::from(bos_added),
        ds,
        tokens,
        prefix,
        all,
    })
}

fn partial_header(config: &PplConfig, p: &Prepared, info: &ModelInfo) -> PartialHeader {
    PartialHeader {
        // 2: `kld` windows carry the reverse divergence, top-K agreement and confidences.
        exactscore_partial: if config.task == Task::Kld { 2 } else { 1 },
        task: config.task,
        method: config.method,
        ctx: config.ctx,
        stride: if config.method == Method::Exl3 {
            config.stride
        } else {
            0
        },
        max_windows: config.max_windows,
        prefix: p.prefix,
        dataset_sha256: p.ds.sha256.clone(),
        tokens_sha256: tokens_sha256(&p.tokens),
        num_tokens: p.tokens.len(),
        num_windows: p.all.len(),
        model: info.model.clone(),
        fingerprint: Some(Fingerprint::from(info)),
    }
}

type Finished = BTreeMap<usize, WindowResult>;

/// The partial file: the windows it already holds (with `--resume`), and the file to append to.
fn open_partial(
    config: &PplConfig,
    header: &PartialHeader,
) -> Result<(Finished, Option<std::fs::File>), PplError> {
    let mut done = Finished::new();
    let Some(path) = &config.output else {
        return Ok((done, None));
    };
    let perr = |message: String| PplError::Partial {
        path: path.clone(),
        message,
    };
    let exists = std::fs::metadata(path).is_ok_and(|m| m.len() > 0);
    if exists && !config.resume {
        return Err(perr(
            "already exists: pass --resume to continue it, or remove it".into(),
        ));
    }
    if exists {
        let (h, results) = read_partial(path)?;
        if let Some(d) = header_diff(&h, header) {
            return Err(perr(format!("made by a different run: {d}")));
        }
        done.extend(results.into_iter().map(|r| (r.window, r)));
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| perr(e.to_string()))?;
    if !exists {
        let line = serde_json::to_string(header).map_err(|e| perr(e.to_string()))?;
        writeln!(f, "{line}")
            .and_then(|_| f.flush())
            .map_err(|e| perr(e.to_string()))?;
    }
    Ok((done, Some(f)))
}

type Outcome = Result<WindowResult, PplError>;

/// One window on one server.
async fn evaluate(task: Task, client: &Client, w: &Window, tokens: &[u32]) -> Outcome {
    let seq = w.sequence(tokens);
    let url = &client.label();
    match task {
        Task::Ppl => client
            .score_tokens(&seq)
            .await
            .map_err(PplError::from)
            .and_then(|score| window_nll(url, w, &seq, &score)),
        Task::Kld => client
            .kld_tokens(&seq)
            .await
            .map_err(PplError::from)
            .and_then(|d| window_kld(url, w, &seq, &d)),
    }
}

/// Workers that take the windows not yet `done` off a queue, spread over `clients`; their
/// results come through the returned channel until the queue is empty or `stop` is set.
fn spawn_workers(
    config: &PplConfig,
    clients: &[Client],
    p: &Prepared,
    done: &Finished,
    stop: &Arc<AtomicBool>,
) -> tokio::sync::mpsc::Receiver<Outcome> {
    let pending: VecDeque<Window> = p
        .all
        .iter()
        .filter(|w| !done.contains_key(&w.index))
        .cloned()
        .collect();
    let workers = config.concurrency.min(pending.len().max(1));
    let queue = Arc::new(Mutex::new(pending));
    let tokens = Arc::new(p.tokens.clone());
    let clients: Arc<[Client]> = clients.into();
    let balancer = Arc::new(Balancer::new(clients.len()));
    let (tx, rx) = tokio::sync::mpsc::channel(config.concurrency.saturating_mul(2).max(4));
    for _ in 0..workers {
        let (queue, tokens, balancer, clients, tx) = (
            queue.clone(),
            tokens.clone(),
            balancer.clone(),
            clients.clone(),
            tx.clone(),
        );
        let (stop, cancel, task) = (stop.clone(), config.cancel.clone(), config.task);
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) && !cancel.load(Ordering::SeqCst) {
                let Some(w) = queue.lock().ok().and_then(|mut q| q.pop_front()) else {
                    break;
                };
                let s = balancer.acquire();
                let out = evaluate(task, &clients[s], &w, &tokens).await;
                balancer.release(s);
                if tx.send(out).await.is_err() {
                    break;
                }
            }
        });
    }
    rx
}

/// Appends one finished window to the partial file.
fn append(f: &mut std::fs::File, path: &Path, r: &WindowResult) -> Result<(), PplError> {
    let line = serde_json::to_string(r).unwrap_or_default();
    writeln!(f, "{line}")
        .and_then(|_| f.flush())
        .map_err(|e| PplError::Partial {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
}

fn add_window(run: &mut Running, r: &WindowResult) {
    run.sum_nll += r.sum_nll;
    run.tokens += r.count;
    run.sum_kld += r.kld.as_ref().map_or(0.0, |k| k.kld.iter().sum());
}

fn reporter(config: &PplConfig, total: usize, resumed: usize) -> Reporter {
    let shown = ProgressConfig {
        enabled: config.progress,
        every: config.progress_every,
        lines: false,
    };
    let hook = config.on_progress.clone();
    Reporter::new(&shown, config.task, total, resumed, hook)
}

/// Receives the workers' results: written to the partial file, counted, shown. Returns the
/// tokens scored in this run; a failure names how far the run got and how to resume it.
async fn collect(
    config: &PplConfig,
    mut rx: tokio::sync::mpsc::Receiver<Outcome>,
    stop: &AtomicBool,
    done: &mut Finished,
    mut out_file: Option<std::fs::File>,
    total: usize,
) -> Result<usize, PplError> {
    let resumed = done.len();
    let mut reporter = reporter(config, total, resumed);
    let mut run = Running::default();
    done.values().for_each(|r| add_window(&mut run, r));
    run.done = resumed;
    reporter.update(&run);
    let mut first_err: Option<PplError> = None;
    while let Some(msg) = rx.recv().await {
        let r = match msg {
            Ok(r) => r,
            Err(e) => {
                stop.store(true, Ordering::SeqCst);
                first_err.get_or_insert(e);
                continue;
            }
        };
        if let (Some(f), Some(path)) = (out_file.as_mut(), config.output.as_ref()) {
            if let Err(e) = append(f, path, &r) {
                stop.store(true, Ordering::SeqCst);
                first_err.get_or_insert(e);
            }
        }
        add_window(&mut run, &r);
        run.new_tokens += r.count;
        done.insert(r.window, r);
        run.done = done.len();
        reporter.update(&run);
        if config.stop_after.is_some_and(|k| done.len() - resumed >= k) {
            stop.store(true, Ordering::SeqCst);
        }
    }
    reporter.finish();
    ending(config, first_err, done.len(), total).map(|()| run.new_tokens)
}

/// How a run that stopped receiving ended: failed (naming how far it got and how to resume),
/// interrupted, or complete.
fn ending(
    config: &PplConfig,
    first_err: Option<PplError>,
    done: usize,
    total: usize,
) -> Result<(), PplError> {
    let output = config.output.clone();
    match first_err {
        Some(e) => Err(PplError::Failed {
            source: Box::new(e),
            done,
            total,
            output,
        }),
        None if done < total => Err(PplError::Interrupted {
            done,
            total,
            output,
        }),
        None => Ok(()),
    }
}

/// Run a perplexity evaluation against `config.servers` and return the report.
pub async fn run_ppl(config: PplConfig) -> Result<Report, PplError> {
    let started = Instant::now();
    validate(&config)?;
    let base = ClientConfig {
        api_key: config.api_key.clone(),
        timeout: config.timeout,
        retry: config.retry.clone(),
        ..ClientConfig::new("")
    };
    let (clients, infos) = connect(&config, &base).await?;
    let info = infos[0].clone();
    if let Some(url) = &config.noise_floor_server {
        // Checked before the main run, so that a wrong server does not cost a whole run.
        check_noise_floor_server(url, &base, &config, &info).await?;
    }
    let prepared = prepare(&config, &clients[0], &infos).await?;
    let header = partial_header(&config, &prepared, &info);
    let (mut done, out_file) = open_partial(&config, &header)?;
    let resumed = done.len();
    let stop = Arc::new(AtomicBool::new(false));
    let rx = spawn_workers(&config, &clients, &prepared, &done, &stop);
    let run_start = Instant::now();
    let total = prepared.all.len();
    let new_tokens = collect(&config, rx, &stop, &mut done, out_file, total).await?;
    let tokens_per_s = new_tokens as f64 / run_start.elapsed().as_secs_f64().max(1e-9);
    let per_window: Vec<WindowResult> = done.into_values().collect();
    let noise_floor = match &config.noise_floor_server {
        Some(url) => Some(noise_floor(&config, url, &header, total).await?),
        None => None,
    };
    Ok(Report {
        resumed_windows: resumed,
        wall_time_s: started.elapsed().as_secs_f64(),
        tokens_per_s,
        servers: clients.iter().map(Client::label).collect(),
        noise_floor,
        ..report(&config, &prepared, &header, info, per_window)
    })
}

/// The report of a finished run (timings and servers left for the caller to fill in).
fn report(
    config: &PplConfig,
    p: &Prepared,
    header: &PartialHeader,
    info: ModelInfo,
    per_window: Vec<WindowResult>,
) -> Report {
    let stats = Stats::from_windows(&per_window);
    let kld = (config.task == Task::Kld).then(|| {
        KldStats::from_windows(
            per_window
                .iter()
                .filter_map(|r| r.kld.as_ref().map(|k| (k, r.sum_nll))),
        )
    });
    let position_buckets = crate::positions::summarize(
        per_window.iter().map(|r| r.positions.as_slice()),
        config.task == Task::Kld,
    );
    let bytes = p.ds.text.len();
    Report {
        method: config.method,
        ctx: config.ctx,
        stride: header.stride,
        max_windows: config.max_windows,
        tokenize: config.tokenize,
        dataset: DatasetSummary {
            name: p.ds.name.clone(),
            bytes,
            sha256: p.ds.sha256.clone(),
            documents: p.ds.documents,
            text_tokens: p.text_tokens,
            sequence_tokens: p.tokens.len(),
            tokens_sha256: header.tokens_sha256.clone(),
        },
        bits_per_byte: stats.bits_per_token * p.text_tokens as f64 / bytes.max(1) as f64,
        stats,
        stderr_method: STDERR_METHOD.into(),
        resumed_windows: 0,
        wall_time_s: 0.0,
        tokens_per_s: 0.0,
        servers: vec![],
        server_info: Some(info),
        kld,
        position_buckets,
        per_window,
        noise_floor: None,
    }
}

/// Why `nf` cannot measure the noise floor of a run whose server is `main`: it must serve one
/// checkpoint in two dtypes, and that checkpoint must be `main`'s reference.
fn noise_floor_mismatch(nf: &ModelInfo, main: &ModelInfo) -> Vec<String> {
    let Some(r) = &nf.reference else {
        return vec!["has no reference model".into()];
    };
    let mut why = vec![];
    if nf.model != r.model || nf.formats != r.formats || nf.architecture != r.architecture {
        why.push(format!(
            "serves {} ({}) against the reference {} ({}), not one checkpoint twice",
            nf.model,
            formats_of(&nf.formats),
            r.model,
            formats_of(&r.formats)
        ));
    }
    if r.dtype.as_deref() == Some(nf.dtype.as_str()) {
        why.push(format!(
            "serves and references in the same dtype {}",
            nf.dtype
        ));
    }
    if let Some(mr) = &main.reference {
        if mr.model != r.model || mr.formats != r.formats {
            why.push(format!(
                "its checkpoint {} is not this run's reference {}",
                r.model, mr.model
            ));
        }
    }
    why
}

fn formats_of(formats: &BTreeMap<String, String>) -> String {
    let mut f: Vec<&str> = formats.values().map(String::as_str).collect();
    f.sort_unstable();
    f.dedup();
    f.join(", ")
}

/// The noise-floor server answers and serves the run's reference checkpoint in two dtypes.
async fn check_noise_floor_server(
    url: &str,
    base: &ClientConfig,
    config: &PplConfig,
    main: &ModelInfo,
) -> Result<(), PplError> {
    for c in resolve::clients(&[url.to_string()], base, config.resolver.as_ref()).await? {
        c.ready().await?;
        let why = noise_floor_mismatch(&c.info().await?, main);
        if !why.is_empty() {
            return Err(PplError::Config(format!(
                "noise-floor server {}: {}. Start it on the reference checkpoint with --dtype \
                 bf16 --reference-model <the same directory> --reference-dtype f32",
                c.base_url(),
                why.join("; ")
            )));
        }
    }
    Ok(())
}

/// The same evaluation against the noise-floor server, which must cut the same windows from the
/// same tokens.
async fn noise_floor(
    config: &PplConfig,
    url: &str,
    header: &PartialHeader,
    windows: usize,
) -> Result<NoiseFloor, PplError> {
    let mut run = config.clone();
    run.servers = vec![url.to_string()];
    (run.output, run.resume, run.stop_after) = (None, false, None);
    run.noise_floor_server = None;
    let report = Box::pin(run_ppl(run)).await?;
    if report.dataset.tokens_sha256 != header.tokens_sha256 || report.per_window.len() != windows {
        return Err(PplError::Config(format!(
            "the noise-floor server {url} tokenizes the dataset differently ({} windows, tokens \
             sha256 {} vs {windows} windows, {}): its KLD would be over other tokens",
            report.per_window.len(),
            report.dataset.tokens_sha256,
            header.tokens_sha256
        )));
    }
    let kld = report
        .kld
        .ok_or_else(|| PplError::Config("the noise-floor run gave no KLD".into()))?;
    Ok(NoiseFloor {
        servers: report.servers,
        server_info: report.server_info,
        kld,
        wall_time_s: report.wall_time_s,
    })
}

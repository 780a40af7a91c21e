//! `Client`: the Python face of `exactscore_client::{Client, run_ppl}`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::ValueEnum;
use exactscore_api::{
    AttributeInput, AttributeSelection, KldRequest, ReturnOptions, ScoreRequest, TextInput,
    TokensInput,
};
use exactscore_client::dataset::{DatasetOptions, DatasetSpec};
use exactscore_client::tokenize::TokenizeMode;
use exactscore_client::{
    run_diff, run_ppl, ClientConfig, DiffConfig, Method, PplConfig, PplError, Progress,
    ProgressHook, RetryPolicy, Task,
};
use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;

use crate::convert::{py_str, to_py};
use crate::diff::DiffReport;
use crate::errors;
use crate::report::Report;
use crate::results::{KldResult, ScoreResult};
use crate::wait::{wait, Finished, OnInterrupt};

/// One server's URL or several.
#[derive(FromPyObject)]
enum Urls {
    One(String),
    Many(Vec<String>),
}

/// What to score: a text (tokenized by the server) or token ids.
#[derive(FromPyObject)]
enum Input {
    Text(String),
    Tokens(Vec<i64>),
}

impl Input {
    fn tokens_or_text(self) -> (Option<TokensInput>, Option<TextInput>) {
        match self {
            Input::Text(t) => (None, Some(TextInput::Single(t))),
            Input::Tokens(t) => (Some(TokensInput::Single(t)), None),
        }
    }
}

/// An evaluation dataset: `"wikitext2"`, a file path, or texts.
#[derive(FromPyObject)]
enum Dataset {
    Path(PathBuf),
    Texts(Vec<String>),
}

/// A client of one or more ExactScore servers.
///
/// ``url`` is a server's base URL (``"http://gpu0:8000"``) or a list of them. ``ppl`` and
/// ``kld_eval`` spread their windows over all of them (a host name stands for every address it
/// resolves to, e.g. each pod of a Kubernetes headless Service); ``info``, ``score`` and ``kld``
/// ask the first. ``api_key`` is sent as a bearer token (default: the ``EXACTSCORE_API_KEY``
/// environment variable). ``timeout`` is the time limit of one request, in seconds; ``retries``
/// is how often a request is retried on 429, 502, 503, 504 or a connection error, with
/// backoff (a 4xx such as a 422 validation error is never retried).
///
/// Calls block; the GIL is released while they wait on the network, and Ctrl-C interrupts them.
/// Errors raise ``ServerError`` (the server's status and JSON error), ``ConnectionError`` or
/// ``ValidationError``.
///
/// Example::
///
///     client = Client("http://gpu0:8000", api_key="...")
///     client.score("The capital of France is Paris.").logprobs
///     client.ppl("wikitext2", ctx=2048, stride=512).perplexity
#[pyclass(frozen, module = "exactscore")]
pub struct Client {
    servers: Vec<String>,
    api_key: Option<String>,
    timeout: Duration,
    retry: RetryPolicy,
    first: exactscore_client::Client,
}

/// Settings of `ppl` and `kld_eval`, as Python passed them.
struct RunArgs {
    dataset: Dataset,
    method: String,
    ctx: usize,
    stride: usize,
    concurrency: usize,
    max_windows: Option<usize>,
    field: String,
    tokenize: String,
    output: Option<PathBuf>,
    resume: bool,
    progress: bool,
    wikitext_path: Option<PathBuf>,
}

/// `value` as one of the enum's choices (the CLI's spelling).
fn choice<T: ValueEnum>(py: Python<'_>, what: &str, value: &str) -> PyResult<T> {
    T::from_str(value, true).map_err(|_| {
        let names: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value().map(|p| format!("{:?}", p.get_name())))
            .collect();
        errors::validation(
            py,
            format!("{what} {value:?}: expected one of {}", names.join(", ")),
        )
    })
}

/// The dataset to load, and where `wikitext2` is (the argument, the environment, else the copy
/// the wheel installs).
fn dataset_spec(
    py: Python<'_>,
    dataset: Dataset,
    wikitext_path: Option<PathBuf>,
) -> PyResult<(DatasetSpec, Option<PathBuf>)> {
    let spec = match dataset {
        Dataset::Path(p) => match p.to_str() {
            Some(s) => DatasetSpec::parse(s).map_err(|e| errors::validation(py, e))?,
            None => return Err(errors::validation(py, "the dataset path is not UTF-8")),
        },
        Dataset::Texts(t) => DatasetSpec::Texts(t),
    };
    let given =
        wikitext_path.or_else(|| std::env::var_os("EXACTSCORE_WIKITEXT_PATH").map(PathBuf::from));
    let wikitext_path = match (&spec, given) {
        (_, Some(p)) => Some(p),
        (DatasetSpec::Wikitext2, None) => py
            .import("exactscore._support")?
            .call_method0("wikitext_path")?
            .extract()?,
        _ => None,
    };
    Ok((spec, wikitext_path))
}

impl Client {
    /// The run `args` describe, as the runner takes it.
    fn config(&self, py: Python<'_>, task: Task, args: RunArgs) -> PyResult<PplConfig> {
        let (spec, wikitext_path) = dataset_spec(py, args.dataset, args.wikitext_path)?;
        let mut cfg = PplConfig::new(self.servers.clone(), spec);
        cfg.task = task;
        cfg.api_key = self.api_key.clone();
        cfg.dataset_options = DatasetOptions {
            field: Some(args.field),
            wikitext_path,
        };
        cfg.method = choice::<Method>(py, "method", &args.method)?;
        cfg.ctx = args.ctx;
        cfg.stride = args.stride;
        cfg.max_windows = args.max_windows;
        cfg.concurrency = args.concurrency;
        cfg.tokenize = choice::<TokenizeMode>(py, "tokenize", &args.tokenize)?;
        cfg.output = args.output;
        cfg.resume = args.resume;
        cfg.timeout = self.timeout;
        cfg.retry = self.retry.clone();
        // Python draws its own bar (tqdm: terminals and Jupyter alike).
        cfg.progress = false;
        Ok(cfg)
    }

    /// Runs an evaluation: Ctrl-C stops dispatching, lets the requests in flight finish into the
    /// partial file, and raises KeyboardInterrupt; a second Ctrl-C stops at once.
    fn run(&self, py: Python<'_>, task: Task, args: RunArgs) -> PyResult<Report> {
        let progress = args.progress;
        let mut cfg = self.config(py, task, args)?;
        let latest: Arc<Mutex<Option<Progress>>> = Arc::default();
        if progress {
            let sink = latest.clone();
            cfg.on_progress = Some(ProgressHook(Arc::new(move |p| {
                if let Ok(mut l) = sink.lock() {
                    *l = Some(p);
                }
            })));
        }
        let cancel = cfg.cancel.clone();
        let take = || latest.lock().ok().and_then(|mut l| l.take());
        let mut bar = Bar::default();
        let finished = wait(py, run_ppl(cfg), OnInterrupt::Cancel(&cancel), |py| {
            take().map_or(Ok(()), |p| bar.update(py, p))
        });
        // The last windows, then the bar goes.
        if let Some(p) = take() {
            let _ = bar.update(py, p);
        }
        bar.close(py);
        let Finished { value, interrupt } = finished?;
        match (value, interrupt) {
            // Finished all the same (every window was in flight): like the CLI, the report.
            (Ok(report), _) => Report::new(py, report),
            (
                Err(PplError::Interrupted {
                    done,
                    total,
                    output,
                }),
                Some(e),
            ) if e.is_instance_of::<PyKeyboardInterrupt>(py) => {
                let hint = match output {
                    Some(p) => format!(
                        "finished windows are in {}: call again with resume=True to continue",
                        p.display()
                    ),
                    None => "pass output=PATH to make runs resumable".into(),
                };
                Err(PyKeyboardInterrupt::new_err(format!(
                    "interrupted after {done}/{total} windows; {hint}"
                )))
            }
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(errors::ppl_error(py, &e)),
        }
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(
        signature = (url = Urls::One("http://127.0.0.1:8000".into()), api_key = None, timeout = 600.0, retries = 8),
        text_signature = "(url='http://127.0.0.1:8000', api_key=None, timeout=600.0, retries=8)"
    )]
    fn new(
        py: Python<'_>,
        url: Urls,
        api_key: Option<String>,
        timeout: f64,
        retries: u32,
    ) -> PyResult<Self> {
        let servers = match url {
            Urls::One(u) => vec![u],
            Urls::Many(v) => v,
        };
        let Some(first) = servers.first() else {
            return Err(errors::validation(py, "url: at least one server is needed"));
        };
        let timeout = Duration::try_from_secs_f64(timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                errors::validation(py, format!("timeout {timeout}: expected seconds > 0"))
            })?;
        let api_key = api_key.or_else(|| std::env::var("EXACTSCORE_API_KEY").ok());
        let retry = RetryPolicy {
            max_retries: retries,
            ..RetryPolicy::default()
        };
        let first = exactscore_client::Client::new(ClientConfig {
            api_key: api_key.clone(),
            timeout,
            retry: retry.clone(),
            ..ClientConfig::new(first.clone())
        })
        .map_err(|e| errors::client_error(py, &e))?;
        Ok(Self {
            servers,
            api_key,
            timeout,
            retry,
            first,
        })
    }

    /// The servers' URLs.
    #[getter]
    fn urls(&self) -> Vec<String> {
        self.servers.clone()
    }

    /// The first server's ``/info``: model, formats per projection, bits per weight, dtype,
    /// devices, limits, and the reference model when it has one.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.first.clone();
        let info = wait(
            py,
            async move { c.info().await },
            OnInterrupt::Abort,
            |_| Ok(()),
        )?
        .value
        .map_err(|e| errors::client_error(py, &e))?;
        to_py(py, &info)
    }

    /// Per-token log-probabilities of one text (tokenized by the server, with its BOS unless
    /// ``add_special_tokens=False``) or one list of token ids.
    ///
    /// ``top_k`` (0..=20) also returns the k most likely tokens at each position. Returns a
    /// ``ScoreResult``; ``logprobs`` are the server's f32 values, bit for bit.
    #[pyo3(signature = (input, /, *, top_k = 0, add_special_tokens = true))]
    fn score(
        &self,
        py: Python<'_>,
        input: Input,
        top_k: i64,
        add_special_tokens: bool,
    ) -> PyResult<ScoreResult> {
        let (tokens, text) = input.tokens_or_text();
        let req = ScoreRequest {
            add_special_tokens: text.is_some().then_some(add_special_tokens),
            tokens,
            text,
            top_k: Some(top_k),
            return_options: Some(ReturnOptions {
                token_logprobs: true,
                top_k: top_k > 0,
                greedy: true,
                token_strings: true,
            }),
        };
        let c = self.first.clone();
        let resp = wait(
            py,
            async move { c.score(&req).await },
            OnInterrupt::Abort,
            |_| Ok(()),
        )?
        .value
        .map_err(|e| errors::client_error(py, &e))?;
        let Some(seq) = resp.sequences.into_iter().next() else {
            return Err(errors::validation(py, "the server returned no sequence"));
        };
        ScoreResult::new(py, resp.model, seq)
    }

    /// Per-token KL-divergence of the served model from the server's reference model (a server
    /// started with ``--reference-model``) over one text or one list of token ids, with both
    /// models' log-probabilities, whether their top tokens agree and Δp. Returns a ``KldResult``.
    #[pyo3(signature = (input, /, *, add_special_tokens = true))]
    fn kld(&self, py: Python<'_>, input: Input, add_special_tokens: bool) -> PyResult<KldResult> {
        let (tokens, text) = input.tokens_or_text();
        let req = KldRequest {
            add_special_tokens: text.is_some().then_some(add_special_tokens),
            tokens,
            text,
            per_token: Some(true),
        };
        let c = self.first.clone();
        let resp = wait(
            py,
            async move { c.kld(&req).await },
            OnInterrupt::Abort,
            |_| Ok(()),
        )?
        .value
        .map_err(|e| errors::client_error(py, &e))?;
        let Some(seq) = resp.sequences.into_iter().next() else {
            return Err(errors::validation(py, "the server returned no sequence"));
        };
        KldResult::new(py, resp.model, resp.reference_model, seq)
    }

    /// Perplexity of a dataset, its windows spread over all the servers (``exactscore ppl``).
    ///
    /// ``dataset``: ``"wikitext2"`` (the WikiText-2 test split as ExLlamaV3 evaluates it,
    /// checked by sha256; the wheel carries it), a ``.txt``, ``.txt.gz``, ``.jsonl`` or
    /// ``.parquet`` path (``field``: the JSON field or column holding the text), or a list of
    /// texts (joined with blank lines, as documents).
    /// ``method``: ``"exl3"`` (windows of ``ctx`` tokens every ``stride`` tokens), ``"disjoint"``
    /// or ``"rolling"`` (lm-eval's loglikelihood_rolling; its max_length L is ``ctx=L+1``).
    /// ``ctx``: tokens per request. ``concurrency``: requests in flight over all servers.
    /// ``max_windows``: evaluate only the first N windows. ``tokenize``: ``"local"`` (the server's
    /// tokenizer.json, checked against its /tokenize) or ``"server"``.
    /// ``output``: a partial file (JSON lines, one per finished window); ``resume=True``
    /// continues the run it records. ``progress``: a progress bar on a terminal or in Jupyter.
    /// ``wikitext_path``: the ``wikitext-2-raw-test.txt.gz`` to use (default: the
    /// ``EXACTSCORE_WIKITEXT_PATH`` environment variable, else the wheel's copy).
    ///
    /// Ctrl-C stops dispatching, lets the requests in flight finish into ``output`` and raises
    /// KeyboardInterrupt; ``resume=True`` then continues, and the report equals an uninterrupted
    /// run's. Returns a ``Report``.
    #[pyo3(
        signature = (dataset = Dataset::Path("wikitext2".into()), *, method = "exl3".to_string(), ctx = 2048, stride = 512, concurrency = 4, max_windows = None, field = "text".to_string(), tokenize = "local".to_string(), output = None, resume = false, progress = true, wikitext_path = None),
        text_signature = "(self, dataset='wikitext2', *, method='exl3', ctx=2048, stride=512, concurrency=4, max_windows=None, field='text', tokenize='local', output=None, resume=False, progress=True, wikitext_path=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn ppl(
        &self,
        py: Python<'_>,
        dataset: Dataset,
        method: String,
        ctx: usize,
        stride: usize,
        concurrency: usize,
        max_windows: Option<usize>,
        field: String,
        tokenize: String,
        output: Option<PathBuf>,
        resume: bool,
        progress: bool,
        wikitext_path: Option<PathBuf>,
    ) -> PyResult<Report> {
        let args = RunArgs {
            dataset,
            method,
            ctx,
            stride,
            concurrency,
            max_windows,
            field,
            tokenize,
            output,
            resume,
            progress,
            wikitext_path,
        };
        self.run(py, Task::Ppl, args)
    }

    /// KL-divergence of the served model from the server's reference model over a dataset, with
    /// both perplexities (``exactscore kld``: llama.cpp's ``--kl-divergence`` statistics in
    /// ``Report.kld``). The same arguments, windows, partial file and resume as ``ppl``.
    #[pyo3(
        signature = (dataset = Dataset::Path("wikitext2".into()), *, method = "exl3".to_string(), ctx = 2048, stride = 512, concurrency = 4, max_windows = None, field = "text".to_string(), tokenize = "local".to_string(), output = None, resume = false, progress = true, wikitext_path = None),
        text_signature = "(self, dataset='wikitext2', *, method='exl3', ctx=2048, stride=512, concurrency=4, max_windows=None, field='text', tokenize='local', output=None, resume=False, progress=True, wikitext_path=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn kld_eval(
        &self,
        py: Python<'_>,
        dataset: Dataset,
        method: String,
        ctx: usize,
        stride: usize,
        concurrency: usize,
        max_windows: Option<usize>,
        field: String,
        tokenize: String,
        output: Option<PathBuf>,
        resume: bool,
        progress: bool,
        wikitext_path: Option<PathBuf>,
    ) -> PyResult<Report> {
        let args = RunArgs {
            dataset,
            method,
            ctx,
            stride,
            concurrency,
            max_windows,
            field,
            tokenize,
            output,
            resume,
            progress,
            wikitext_path,
        };
        self.run(py, Task::Kld, args)
    }

    /// ``exactscore diff``: where the quantization error enters, from the first server's
    /// ``/diff`` over the first ``windows`` non-overlapping stretches of ``ctx`` tokens of the
    /// dataset (the server needs ``--reference-model``). Per decoder layer the cosine error and
    /// SQNR of the hidden state against the reference's, and the final KLD; ``attribute=True``
    /// also attributes the KLD to every quantized module (``attribute_layers=(first, last)``,
    /// ``attribute_pattern="*.mlp.down_proj"`` narrow it). ``reference_until=N``: the served
    /// model goes on from the reference's state after layer N. ``timeout``: seconds for the one
    /// request. Returns a ``DiffReport``. The defaults are the CLI's.
    #[pyo3(
        signature = (dataset = Dataset::Path("wikitext2".into()), *, ctx = 2048, windows = 4, reference_until = None, attribute = false, attribute_layers = None, attribute_pattern = None, field = "text".to_string(), tokenize = "local".to_string(), timeout = 3600.0, wikitext_path = None),
        text_signature = "(self, dataset='wikitext2', *, ctx=2048, windows=4, reference_until=None, attribute=False, attribute_layers=None, attribute_pattern=None, field='text', tokenize='local', timeout=3600.0, wikitext_path=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn diff(
        &self,
        py: Python<'_>,
        dataset: Dataset,
        ctx: usize,
        windows: usize,
        reference_until: Option<usize>,
        attribute: bool,
        attribute_layers: Option<(i64, i64)>,
        attribute_pattern: Option<String>,
        field: String,
        tokenize: String,
        timeout: f64,
        wikitext_path: Option<PathBuf>,
    ) -> PyResult<DiffReport> {
        let (spec, wikitext_path) = dataset_spec(py, dataset, wikitext_path)?;
        let mut cfg = DiffConfig::new(self.servers[0].clone(), spec);
        cfg.api_key = self.api_key.clone();
        cfg.dataset_options = DatasetOptions {
            field: Some(field),
            wikitext_path,
        };
        (cfg.ctx, cfg.windows, cfg.reference_until) = (ctx, windows, reference_until);
        cfg.tokenize = choice::<TokenizeMode>(py, "tokenize", &tokenize)?;
        cfg.timeout = Duration::try_from_secs_f64(timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| {
                errors::validation(py, format!("timeout {timeout}: expected seconds > 0"))
            })?;
        cfg.retry = self.retry.clone();
        if !attribute && (attribute_layers.is_some() || attribute_pattern.is_some()) {
            return Err(errors::validation(
                py,
                "attribute_layers and attribute_pattern narrow an attribution: pass \
                 attribute=True too",
            ));
        }
        cfg.attribute = match (attribute, attribute_layers, attribute_pattern) {
            (false, ..) => None,
            (true, None, None) => Some(AttributeInput::All(true)),
            (true, layers, pattern) => Some(AttributeInput::Select(AttributeSelection {
                layers: layers.map(|(a, b)| vec![a, b]),
                pattern,
            })),
        };
        let finished = wait(py, run_diff(cfg), OnInterrupt::Abort, |_| Ok(()))?;
        let report = finished.value.map_err(|e| errors::ppl_error(py, &e))?;
        DiffReport::new(report)
    }

    fn __repr__(&self) -> String {
        let urls: Vec<String> = self.servers.iter().map(|u| py_str(u)).collect();
        match urls.as_slice() {
            [one] => format!("Client({one})"),
            many => format!("Client([{}])", many.join(", ")),
        }
    }
}

/// The progress bar `exactscore._support.progress_bar` makes (tqdm's), once the run knows its
/// windows; none where nobody would see it.
#[derive(Default)]
struct Bar {
    bar: Option<Py<PyAny>>,
    made: bool,
    shown: usize,
}

impl Bar {
    fn update(&mut self, py: Python<'_>, p: Progress) -> PyResult<()> {
        if !self.made {
            self.made = true;
            let bar = py
                .import("exactscore._support")?
                .call_method1("progress_bar", (p.total, p.done))?;
            self.bar = (!bar.is_none()).then(|| bar.unbind());
            self.shown = p.done;
        }
        let Some(bar) = &self.bar else {
            return Ok(());
        };
        let bar = bar.bind(py);
        if p.perplexity.is_finite() {
            bar.call_method1(
                "set_postfix_str",
                (
                    format!("{:.0} tok/s, ppl {:.4}", p.tokens_per_s, p.perplexity),
                    false,
                ),
            )?;
        }
        bar.call_method1("update", (p.done.saturating_sub(self.shown),))?;
        self.shown = p.done;
        Ok(())
    }

    fn close(&mut self, py: Python<'_>) {
        if let Some(bar) = self.bar.take() {
            // A bar that fails to close leaves a line on the screen, nothing worse.
            let _ = bar.bind(py).call_method0("close");
        }
    }
}

//! What `Client.score` and `Client.kld` return: one sequence of the server's answer, its
//! per-token arrays as numpy arrays when numpy is installed.

use exactscore_api::{SequenceDivergence, SequenceScore};
use pyo3::prelude::*;

use crate::convert::{float_array, py_str};

/// One of the most likely tokens at a position: `(id, logprob, token string)`.
type TopToken = (u32, f32, Option<String>);

/// Per-token log-probabilities of one sequence (``Client.score``).
///
/// Position ``i`` is token ``i``; position 0 has no log-probability (NaN in an array, ``None`` in
/// a list). ``logprobs`` holds the server's f32 values bit for bit: a ``numpy.float32`` array when
/// numpy is installed, else a list of floats.
#[pyclass(frozen, module = "exactscore")]
pub struct ScoreResult {
    /// The served model's name.
    #[pyo3(get)]
    model: String,
    /// Token ids (the server's tokenization when a text was scored).
    #[pyo3(get)]
    tokens: Vec<u32>,
    /// log p(token_i | tokens_<i), nats: numpy float32 array (NaN at 0) or list (None at 0).
    #[pyo3(get)]
    logprobs: Py<PyAny>,
    /// Each token decoded to text.
    #[pyo3(get)]
    token_strings: Option<Vec<String>>,
    /// ``greedy[i]``: token ``i`` was the model's most likely next token (None at 0).
    #[pyo3(get)]
    greedy: Option<Vec<Option<bool>>>,
    /// ``top_k[i]``: the ``top_k`` most likely tokens after token ``i`` (predicting token
    /// ``i + 1``), best first, as ``(id, logprob, token string)``; None when ``top_k`` was 0.
    #[pyo3(get)]
    top_k: Option<Vec<Vec<TopToken>>>,
    /// Σ −log p over the scored tokens (f64 sum of the f32 values).
    #[pyo3(get)]
    sum_nll: f64,
    /// Tokens with a log-probability (all but the first).
    #[pyo3(get)]
    num_scored: usize,
    /// ``sum_nll / num_scored``; None when nothing was scored.
    #[pyo3(get)]
    mean_nll: Option<f64>,
    /// ``exp(mean_nll)``; None when nothing was scored.
    #[pyo3(get)]
    perplexity: Option<f64>,
}

impl ScoreResult {
    pub fn new(py: Python<'_>, model: String, s: SequenceScore) -> PyResult<Self> {
        let logprobs = s.token_logprobs.unwrap_or_default();
        Ok(Self {
            model,
            logprobs: float_array(py, &logprobs, "float32")?.unbind(),
            tokens: s.tokens,
            token_strings: s.token_strings,
            greedy: s.greedy,
            top_k: s.top_k.map(|rows| {
                rows.into_iter()
                    .map(|row| {
                        row.into_iter()
                            .map(|t| (t.id, t.logprob, t.token))
                            .collect()
                    })
                    .collect()
            }),
            sum_nll: s.sum_nll,
            num_scored: s.num_scored,
            mean_nll: s.mean_nll,
            perplexity: s.perplexity,
        })
    }
}

#[pymethods]
impl ScoreResult {
    fn __len__(&self) -> usize {
        self.tokens.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "ScoreResult(model={}, tokens={}, num_scored={}, mean_nll={}, perplexity={})",
            py_str(&self.model),
            self.tokens.len(),
            self.num_scored,
            fmt_opt(self.mean_nll),
            fmt_opt(self.perplexity)
        )
    }
}

/// How the served model's next-token distributions differ from the server's reference model's
/// over one sequence (``Client.kld``).
///
/// Position ``i`` is the distribution after token ``i - 1``; position 0 has no value (NaN in an
/// array, ``None`` in a list). Arrays are numpy arrays when numpy is installed: ``kld`` and
/// ``delta_p`` float64, ``logprobs`` and ``reference_logprobs`` float32 (the server's values).
#[pyclass(frozen, module = "exactscore")]
pub struct KldResult {
    /// The served model's name.
    #[pyo3(get)]
    model: String,
    /// The reference model's name.
    #[pyo3(get)]
    reference_model: String,
    /// Token ids.
    #[pyo3(get)]
    tokens: Vec<u32>,
    /// KL(reference ‖ model) per position, nats.
    #[pyo3(get)]
    kld: Py<PyAny>,
    /// The served model's log p(token_i | tokens_<i).
    #[pyo3(get)]
    logprobs: Py<PyAny>,
    /// The reference model's log p(token_i | tokens_<i).
    #[pyo3(get)]
    reference_logprobs: Py<PyAny>,
    /// Whether both models' most likely token agree (None at 0).
    #[pyo3(get)]
    same_top: Vec<Option<bool>>,
    /// p_model − p_reference of the actual token.
    #[pyo3(get)]
    delta_p: Py<PyAny>,
    /// Positions with a value (all but the first).
    #[pyo3(get)]
    num_scored: usize,
    /// Σ KLD over the scored positions.
    #[pyo3(get)]
    sum_kld: f64,
    /// Σ −log p of the served model.
    #[pyo3(get)]
    sum_nll: f64,
    /// Σ −log p of the reference model.
    #[pyo3(get)]
    reference_sum_nll: f64,
    /// Positions where the most likely tokens agree.
    #[pyo3(get)]
    same_top_count: usize,
    /// Σ Δp.
    #[pyo3(get)]
    sum_delta_p: f64,
    /// Σ Δp².
    #[pyo3(get)]
    sum_delta_p_squared: f64,
}

impl KldResult {
    pub fn new(
        py: Python<'_>,
        model: String,
        reference_model: String,
        d: SequenceDivergence,
    ) -> PyResult<Self> {
        Ok(Self {
            model,
            reference_model,
            kld: float_array(py, &d.kld.unwrap_or_default(), "float64")?.unbind(),
            logprobs: float_array(py, &d.logprobs.unwrap_or_default(), "float32")?.unbind(),
            reference_logprobs: float_array(
                py,
                &d.reference_logprobs.unwrap_or_default(),
                "float32",
            )?
            .unbind(),
            delta_p: float_array(py, &d.delta_p.unwrap_or_default(), "float64")?.unbind(),
            same_top: d.same_top.unwrap_or_default(),
            tokens: d.tokens,
            num_scored: d.num_scored,
            sum_kld: d.sum_kld,
            sum_nll: d.sum_nll,
            reference_sum_nll: d.reference_sum_nll,
            same_top_count: d.same_top_count,
            sum_delta_p: d.sum_delta_p,
            sum_delta_p_squared: d.sum_delta_p_squared,
        })
    }
}

#[pymethods]
impl KldResult {
    /// ``sum_kld / num_scored``; None when nothing was scored.
    #[getter]
    fn mean_kld(&self) -> Option<f64> {
        (self.num_scored > 0).then(|| self.sum_kld / self.num_scored as f64)
    }

    fn __len__(&self) -> usize {
        self.tokens.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "KldResult(model={}, reference_model={}, tokens={}, num_scored={}, mean_kld={})",
            py_str(&self.model),
            py_str(&self.reference_model),
            self.tokens.len(),
            self.num_scored,
            fmt_opt(self.mean_kld())
        )
    }
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or_else(|| "None".into(), |v| format!("{v:.6}"))
}

//! `Report`: the Rust client's report, its fields read as attributes from the same JSON that
//! `exactscore ppl --json` writes (so the two never disagree on a name).

use pyo3::exceptions::{PyAttributeError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::{Map, Value};

use crate::convert::{json_to_py, py_str, to_py};
use crate::errors;

/// The result of ``Client.ppl`` and ``Client.kld_eval``: the report ``exactscore ppl --json``
/// writes, its fields as attributes.
///
/// Fields: ``method``, ``ctx``, ``stride``, ``max_windows``, ``tokenize``, ``dataset`` (dict:
/// ``name``, ``bytes``, ``sha256``, ``documents``, ``text_tokens``, ``sequence_tokens``),
/// ``windows``, ``tokens_scored``, ``total_nll``, ``mean_nll``, ``perplexity``,
/// ``mean_nll_stderr``, ``perplexity_stderr`` (None for fewer than 2 windows),
/// ``bits_per_token``, ``bits_per_byte``, ``stderr_method``, ``resumed_windows``,
/// ``wall_time_s``, ``tokens_per_s``, ``servers``, ``server_info`` (the server's ``/info``),
/// ``kld`` (``kld_eval`` only: ``mean_kld``, ``median_kld``, ``p99_kld``, ``same_top``, both
/// perplexities, ...) and ``per_window`` (list of ``{window, sum_nll, count}``).
///
/// ``str(report)`` is the CLI's table; ``to_dict()``, ``to_json()`` and ``to_pandas()`` convert
/// it; ``Report.from_json(path)`` reads a report the CLI wrote.
#[pyclass(frozen, module = "exactscore")]
pub struct Report {
    report: exactscore_client::Report,
    fields: Map<String, Value>,
}

impl Report {
    /// The client's report.
    pub fn inner(&self) -> &exactscore_client::Report {
        &self.report
    }

    pub fn new(py: Python<'_>, report: exactscore_client::Report) -> PyResult<Self> {
        match serde_json::to_value(&report) {
            Ok(Value::Object(fields)) => Ok(Self { report, fields }),
            Ok(other) => Err(errors::validation(py, format!("not a report: {other}"))),
            Err(e) => Err(PyRuntimeError::new_err(format!(
                "cannot convert the report: {e}"
            ))),
        }
    }
}

#[pymethods]
impl Report {
    /// Reads a report: a path to the file ``exactscore ppl/kld --json`` wrote (``str`` or
    /// ``os.PathLike``), or the JSON text itself (``to_json()``; any text starting with ``{``).
    /// A partial file (``output=``) or a diff report is refused, saying what it is.
    #[staticmethod]
    fn from_json(py: Python<'_>, source: Bound<'_, PyAny>) -> PyResult<Self> {
        let text: Option<String> = source.extract().ok();
        let report = match text {
            Some(t) if t.trim_start().starts_with('{') => {
                exactscore_client::Report::from_json_text(&t)
                    .map_err(|m| errors::validation(py, m))?
            }
            _ => {
                let path: std::path::PathBuf = source.extract()?;
                exactscore_client::Report::from_path(&path)
                    .map_err(|e| errors::validation(py, e))?
            }
        };
        Self::new(py, report)
    }

    fn __getattr__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        match self.fields.get(name) {
            Some(v) => json_to_py(py, v),
            None => Err(PyAttributeError::new_err(format!(
                "'Report' object has no attribute '{name}'"
            ))),
        }
    }

    fn __dir__(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        let mut names: Vec<String> = slf.get_type().dir()?.extract()?;
        names.extend(slf.get().fields.keys().cloned());
        names.sort();
        Ok(names)
    }

    /// The report as a dict: the JSON of ``exactscore ppl --json``, parsed.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_py(py, &self.report)
    }

    /// The report as JSON text, exactly as ``exactscore ppl --json FILE`` writes it.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string_pretty(&self.report)
            .map_err(|e| PyRuntimeError::new_err(format!("cannot write the report: {e}")))
    }

    /// A pandas DataFrame (pandas must be installed): one row of the report's fields, nested
    /// ones flattened as ``dataset.name``, ``server_info.model``, ``kld.mean_kld``, ...; or, with
    /// ``per_window=True``, one row per window (``window``, ``sum_nll``, ``count``, ...).
    #[pyo3(signature = (per_window = false))]
    fn to_pandas<'py>(&self, py: Python<'py>, per_window: bool) -> PyResult<Bound<'py, PyAny>> {
        let pandas = py.import("pandas")?;
        let dict = self.to_dict(py)?.cast_into::<PyDict>()?;
        let windows = dict.get_item("per_window")?;
        if per_window {
            return pandas.call_method1("json_normalize", (windows,));
        }
        dict.del_item("per_window")?;
        pandas.call_method1("json_normalize", (dict,))
    }

    /// The CLI's table.
    fn __str__(&self) -> String {
        self.report.to_table()
    }

    fn __repr__(&self) -> String {
        let s = &self.report.stats;
        format!(
            "Report(dataset={}, method={}, ctx={}, windows={}, perplexity={:.6}{})",
            py_str(&self.report.dataset.name),
            py_str(self.report.method.as_str()),
            self.report.ctx,
            s.windows,
            s.perplexity,
            self.report
                .kld
                .as_ref()
                .map_or(String::new(), |k| format!(", mean_kld={:.6}", k.mean_kld))
        )
    }
}

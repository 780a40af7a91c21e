//! `DiffReport` (the result of `Client.diff`) and `exactscore.compare`: the CLI's
//! `exactscore diff` and `exactscore compare`, from Python.

use std::path::PathBuf;

use pyo3::exceptions::{PyAttributeError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::{Map, Value};

use crate::convert::{json_to_py, to_py};
use crate::errors;
use crate::report::Report;

/// The result of ``Client.diff``: the report ``exactscore diff --json`` writes, its fields as
/// attributes: ``server``, ``server_info``, ``dataset``, ``ctx``, ``windows``, ``tokens``,
/// ``reference_until``, ``layers`` (per decoder layer: ``mean_cos_error``, ``mean_sqnr_db``),
/// ``kld`` (the final divergence), ``attribution`` (with ``attribute=True``), ``wall_time_s``.
///
/// ``str(report)`` is the CLI's table; ``to_dict()``, ``to_json()``, ``to_pandas()`` (a row per
/// layer; ``to_pandas("attribution")``: a row per module) and ``plot(path)`` (``.png`` or
/// ``.svg``) as ``exactscore diff --plot`` draws it; ``DiffReport.from_json(path)`` reads one.
#[pyclass(frozen, module = "exactscore")]
pub struct DiffReport {
    report: exactscore_client::DiffReport,
    fields: Map<String, Value>,
}

impl DiffReport {
    pub fn new(report: exactscore_client::DiffReport) -> PyResult<Self> {
        match serde_json::to_value(&report) {
            Ok(Value::Object(fields)) => Ok(Self { report, fields }),
            _ => Err(PyRuntimeError::new_err("cannot convert the diff report")),
        }
    }
}

#[pymethods]
impl DiffReport {
    /// Reads a report that ``exactscore diff --json`` or ``to_json()`` wrote, from its path.
    #[staticmethod]
    fn from_json(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| errors::validation(py, format!("{}: {e}", path.display())))?;
        let report = serde_json::from_str(&text).map_err(|e| {
            errors::validation(
                py,
                format!("{}: not an `exactscore diff` report ({e})", path.display()),
            )
        })?;
        Self::new(report)
    }

    fn __getattr__<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        match self.fields.get(name) {
            Some(v) => json_to_py(py, v),
            None => Err(PyAttributeError::new_err(format!(
                "'DiffReport' object has no attribute '{name}'"
            ))),
        }
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_py(py, &self.report)
    }

    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string_pretty(&self.report)
            .map_err(|e| PyRuntimeError::new_err(format!("cannot write the report: {e}")))
    }

    /// A pandas DataFrame (pandas must be installed): a row per layer, or with
    /// ``"attribution"`` a row per attributed module.
    #[pyo3(signature = (rows = "layers"))]
    fn to_pandas<'py>(&self, py: Python<'py>, rows: &str) -> PyResult<Bound<'py, PyAny>> {
        let pandas = py.import("pandas")?;
        let dict = self.to_dict(py)?.cast_into::<PyDict>()?;
        let data = match rows {
            "layers" => dict.get_item("layers")?,
            "attribution" => match dict.get_item("attribution")? {
                Some(a) if !a.is_none() => a.get_item("modules").ok(),
                _ => {
                    return Err(errors::validation(
                        py,
                        "this report has no attribution: run Client.diff(attribute=True)",
                    ))
                }
            },
            other => {
                return Err(errors::validation(
                    py,
                    format!("rows {other:?}: expected \"layers\" or \"attribution\""),
                ))
            }
        };
        pandas.call_method1("json_normalize", (data,))
    }

    /// Draws the per-layer cosine error and SQNR into ``path`` (``.png`` or ``.svg``).
    fn plot(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let reports = [(self.report.label(), self.report.clone())];
        exactscore_client::plot::plot_diff(&reports, &path).map_err(|e| errors::validation(py, e))
    }

    /// The CLI's tables (the 20 modules of largest KLD).
    fn __str__(&self) -> String {
        self.report.to_table(20)
    }

    fn __repr__(&self) -> String {
        format!(
            "DiffReport(model={}, ctx={}, windows={}, layers={}, mean_kld={:.6})",
            self.report.label(),
            self.report.ctx,
            self.report.windows,
            self.report.layers.len(),
            self.report.kld.mean_kld
        )
    }
}

/// A report to compare: a ``Report`` or the path of a ``--json`` report.
#[derive(FromPyObject)]
pub enum ReportSource<'py> {
    Report(Bound<'py, Report>),
    Path(PathBuf),
}

/// ``exactscore compare``: the reports' table (returned as text), and with ``plot`` the chart
/// (``.png`` or ``.svg``). Reports must measure the same thing (dataset, tokenizer, method,
/// ctx, stride, windows); ``allow_mismatch=True`` shows the others marked instead of raising.
#[pyfunction]
#[pyo3(signature = (reports, plot = None, allow_mismatch = false))]
pub fn compare<'py>(
    py: Python<'py>,
    reports: Vec<ReportSource<'py>>,
    plot: Option<PathBuf>,
    allow_mismatch: bool,
) -> PyResult<String> {
    if let Some(p) = &plot {
        exactscore_client::plot::check_path(p).map_err(|e| errors::validation(py, e))?;
    }
    let mut loaded = vec![];
    let mut names = vec![];
    for (i, r) in reports.into_iter().enumerate() {
        let (name, report) = match r {
            ReportSource::Report(r) => (format!("report {i}"), r.get().inner().clone()),
            ReportSource::Path(p) => (
                p.file_stem()
                    .map_or_else(String::new, |s| s.to_string_lossy().into_owned()),
                exactscore_client::Report::from_path(&p).map_err(|e| errors::validation(py, e))?,
            ),
        };
        names.push(name.clone());
        loaded.push((name, report));
    }
    let mut labelled = exactscore_client::compare::labelled(loaded);
    exactscore_client::compare::check(&mut labelled, &names, allow_mismatch)
        .map_err(|m| errors::validation(py, m))?;
    if let Some(p) = &plot {
        exactscore_client::plot::plot(&labelled, p).map_err(|e| errors::validation(py, e))?;
    }
    Ok(exactscore_client::compare::table(&labelled))
}

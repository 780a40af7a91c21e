//! Rust values as Python objects: JSON values as dicts, lists and numbers; per-token arrays as
//! numpy arrays when numpy is installed.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use serde::Serialize;
use serde_json::Value;

/// A JSON value as the object `json.loads` would make of it (integers stay `int`, and floats
/// keep every bit: serde_json's `float_roundtrip`).
pub fn json_to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (None, Some(u)) => u.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(json_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, item) in map {
                dict.set_item(k, json_to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// Any serializable value (a wire type, a report) as Python objects, through its JSON form.
pub fn to_py<'py>(py: Python<'py>, v: &impl Serialize) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(v).map_err(|e| {
        pyo3::exceptions::PyRuntimeError::new_err(format!("cannot convert to Python: {e}"))
    })?;
    json_to_py(py, &value)
}

/// A per-token float array: a numpy array of `dtype` with NaN where a position has no value
/// (position 0), when numpy can be imported; else a list with `None` there. Every value converts
/// exactly (an f32 widened to f64 and narrowed back is the same f32).
pub fn float_array<'py, T: Copy + Into<f64>>(
    py: Python<'py>,
    values: &[Option<T>],
    dtype: &str,
) -> PyResult<Bound<'py, PyAny>> {
    match py.import("numpy") {
        Ok(np) => {
            let floats: Vec<f64> = values
                .iter()
                .map(|v| v.map_or(f64::NAN, Into::into))
                .collect();
            np.call_method1("array", (floats, dtype))
        }
        Err(_) => {
            let items: Vec<Option<f64>> = values.iter().map(|v| v.map(Into::into)).collect();
            Ok(PyList::new(py, items)?.into_any())
        }
    }
}

/// A string as Python's `repr` writes it (single quotes), for `__repr__`s.
pub fn py_str(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

//! `exactscore._native`: the Python bindings of the ExactScore client (`exactscore-client`).
//! Windows, resume, fan-out, statistics and reports are the Rust client's; this crate only
//! converts arguments and results and runs the client's futures with the GIL released.
//!
//! The workspace's `unsafe_code = "deny"` holds here too: PyO3's macros expand to no code that
//! trips it. Without the `extension` feature (maturin turns it on) the crate is empty.

#![cfg(feature = "extension")]

use pyo3::prelude::*;

mod client;
mod convert;
mod diff;
mod errors;
mod report;
mod results;
mod wait;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::Client>()?;
    m.add_class::<results::ScoreResult>()?;
    m.add_class::<results::KldResult>()?;
    m.add_class::<report::Report>()?;
    m.add_class::<diff::DiffReport>()?;
    m.add_function(wrap_pyfunction!(diff::compare, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

//! The client's errors as the exceptions of `exactscore._errors`: `ServerError` (the server
//! answered with an error status or an unusable response), `ConnectionError` (no answer) and
//! `ValidationError` (refused before any request was sent).

use exactscore_client::tokenize::TokenizeError;
use exactscore_client::{ClientError, PplError};
use pyo3::call::PyCallArgs;
use pyo3::prelude::*;

use crate::convert;

/// An instance of `exactscore._errors.<class>(*args)`; a failure to build it is the error raised.
fn raise<'py>(py: Python<'py>, class: &str, args: impl PyCallArgs<'py>) -> PyErr {
    let made = py
        .import("exactscore._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1(args));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// `ValidationError(message)`.
pub fn validation(py: Python<'_>, message: impl std::fmt::Display) -> PyErr {
    raise(py, "ValidationError", (message.to_string(),))
}

/// The URL a client error is about.
fn url_of(e: &ClientError) -> Option<&str> {
    match e {
        ClientError::Unauthorized { url, .. }
        | ClientError::Api { url, .. }
        | ClientError::Connect { url, .. }
        | ClientError::Timeout { url, .. }
        | ClientError::Transport { url, .. }
        | ClientError::Decode { url, .. } => Some(url),
        ClientError::RetriesExhausted { last, .. } => url_of(last),
        ClientError::BadUrl(_) => None,
    }
}

pub fn client_error(py: Python<'_>, e: &ClientError) -> PyErr {
    let message = e.to_string();
    if matches!(e, ClientError::BadUrl(_)) {
        return validation(py, message);
    }
    let url = url_of(e).map(str::to_string);
    match e.status() {
        Some(status) => {
            let body = match e.body().map(|b| convert::to_py(py, b)).transpose() {
                Ok(body) => body,
                Err(err) => return err,
            };
            raise(py, "ServerError", (message, status, body, url))
        }
        None => raise(py, "ConnectionError", (message, url)),
    }
}

pub fn ppl_error(py: Python<'_>, e: &PplError) -> PyErr {
    match e {
        PplError::Client(c) | PplError::Tokenize(TokenizeError::Client(c)) => client_error(py, c),
        PplError::BadResponse { url, .. } => raise(
            py,
            "ServerError",
            (e.to_string(), 200, py.None(), url.clone()),
        ),
        _ => validation(py, e),
    }
}

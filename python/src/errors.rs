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
        | ClientError::NoServer { url, .. }
        | ClientError::Timeout { url, .. }
        | ClientError::Transport { url, .. }
        | ClientError::Decode { url, .. } => Some(url),
        ClientError::RetriesExhausted { last, .. } => url_of(last),
        ClientError::BadUrl(_) | ClientError::BadKey(_) => None,
    }
}

pub fn client_error(py: Python<'_>, e: &ClientError) -> PyErr {
    let message = e.to_string();
    if matches!(e, ClientError::BadUrl(_) | ClientError::BadKey(_)) {
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

/// The runner's messages name the CLI's flags; a Python caller passed keyword arguments:
/// `--ctx 100000` reads `ctx=100000`, a flag without a number its argument's name.
fn python_names(message: &str) -> String {
    const FLAGS: [(&str, &str); 9] = [
        ("--max-windows", "max_windows"),
        ("--concurrency", "concurrency"),
        ("--ctx", "ctx"),
        ("--stride", "stride"),
        ("--timeout", "timeout"),
        ("--output FILE", "output=PATH"),
        ("--output", "output"),
        ("--resume", "resume=True"),
        ("--wikitext-path", "wikitext_path"),
    ];
    let mut out = message.to_string();
    for (flag, name) in FLAGS {
        let mut done = String::new();
        let mut rest = out.as_str();
        while let Some(i) = rest.find(flag) {
            done.push_str(&rest[..i]);
            rest = &rest[i + flag.len()..];
            let number =
                rest.starts_with(' ') && rest[1..].starts_with(|c: char| c.is_ascii_digit());
            if number {
                done.push_str(&format!("{name}="));
                rest = &rest[1..];
            } else {
                done.push_str(name);
            }
        }
        done.push_str(rest);
        out = done;
    }
    out
}

pub fn ppl_error(py: Python<'_>, e: &PplError) -> PyErr {
    match e {
        PplError::Failed { source, .. } => ppl_error(py, source),
        PplError::Client(c) | PplError::Tokenize(TokenizeError::Client(c)) => client_error(py, c),
        PplError::BadResponse { url, .. } => raise(
            py,
            "ServerError",
            (e.to_string(), 200, py.None(), url.clone()),
        ),
        _ => validation(py, python_names(&e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn flags_become_keyword_arguments() {
        assert_eq!(
            super::python_names("--ctx 100000 exceeds the server's max_input_tokens 8192"),
            "ctx=100000 exceeds the server's max_input_tokens 8192"
        );
        assert_eq!(
            super::python_names("--resume needs --output (the partial file)"),
            "resume=True needs output (the partial file)"
        );
    }
}

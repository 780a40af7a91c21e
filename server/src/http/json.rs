//! `ApiJson<T>`: a JSON body extractor whose rejections are [`ApiError`]s, so malformed
//! bodies (400), oversized ones (413) and ill-typed ones (422, with the path of the field)
//! share the error shape of every other failure.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use super::error::ApiError;

pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        check_content_type(&req)?;
        check_content_encoding(&req)?;
        let limit = super::body_limit(&req);
        let read_timeout = super::body_read_timeout(&req);
        let read = Bytes::from_request(req, state);
        // A body short of its Content-Length would otherwise hold the connection forever.
        let read = match read_timeout {
            Some(limit) => tokio::time::timeout(limit, read)
                .await
                .map_err(|_| ApiError::BodyTimeout(limit))?,
            None => read.await,
        };
        let bytes = read.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit }
            } else {
                ApiError::InvalidJson {
                    field: "body".into(),
                    message: rejection.body_text(),
                }
            }
        })?;
        parse(&bytes).map(ApiJson)
    }
}

/// Bodies are read as they arrive: a compressed one would be a "malformed JSON" 400 that
/// hides the real cause, so any encoding but `identity` is a 415 naming the header.
fn check_content_encoding(req: &Request) -> Result<(), ApiError> {
    for value in req.headers().get_all(axum::http::header::CONTENT_ENCODING) {
        let text = String::from_utf8_lossy(value.as_bytes());
        if !text
            .split(',')
            .all(|coding| coding.trim().eq_ignore_ascii_case("identity"))
        {
            return Err(ApiError::UnsupportedEncoding(text.into_owned()));
        }
    }
    Ok(())
}

/// Syntax errors are 400; well-formed JSON of the wrong shape is 422 naming the field.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Every request body is an object; serde's derive would also read a list as positional
    // members (`[[1, 2]]` as `{"tokens": [1, 2]}`).
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ApiError::validation(
            "body",
            "schema",
            serde_json::Value::Null,
            "the body must be a JSON object, not a list",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        // `?` is serde_path_to_error's unknown segment (a key that did not parse).
        let path = path.trim_end_matches(".?").to_string();
        let field = if path == "." || path == "?" {
            // serde reports a missing or repeated member at the level of the object that
            // holds it: name the member.
            member_named_in(&inner.to_string()).unwrap_or_else(|| "body".into())
        } else {
            path
        };
        match inner.classify() {
            Category::Data => {
                ApiError::validation(field, "schema", serde_json::Value::Null, inner.to_string())
            }
            _ => ApiError::InvalidJson {
                field,
                message: inner.to_string(),
            },
        }
    })?;
    // Trailing characters after the value are a syntax error too.
    de.end().map_err(|e| ApiError::InvalidJson {
        field: "body".into(),
        message: e.to_string(),
    })?;
    Ok(value)
}

/// `name` from serde's "missing field `name`" / "duplicate field `name`".
fn member_named_in(message: &str) -> Option<String> {
    ["missing field `", "duplicate field `"]
        .iter()
        .find_map(|prefix| {
            let rest = message.strip_prefix(prefix)?;
            Some(rest[..rest.find('`')?].to_string())
        })
}

/// Bodies are read as JSON whatever the header says, but a header that names another format
/// (`text/plain`, `multipart/form-data`, ...) is refused with 415 rather than guessed at. No
/// header, `application/json`, any `+json` type, and `application/x-www-form-urlencoded` (what
/// `curl -d` sends by default, as the README's examples do) are accepted.
fn check_content_type(req: &Request) -> Result<(), ApiError> {
    let Some(value) = req.headers().get(axum::http::header::CONTENT_TYPE) else {
        return Ok(());
    };
    let text = String::from_utf8_lossy(value.as_bytes()).into_owned();
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"));
    if json || essence == "application/x-www-form-urlencoded" {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType(text))
    }
}

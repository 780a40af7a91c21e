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
        let limit = super::body_limit(&req);
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit }
            } else {
                ApiError::InvalidJson(rejection.body_text())
            }
        })?;
        parse(&bytes).map(ApiJson)
    }
}

/// Syntax errors are 400; well-formed JSON of the wrong shape is 422 naming the field.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        match inner.classify() {
            Category::Data => {
                let field = if path == "." { "body".into() } else { path };
                ApiError::validation(field, "schema", serde_json::Value::Null, inner.to_string())
            }
            _ => ApiError::InvalidJson(inner.to_string()),
        }
    })?;
    // Trailing characters after the value are a syntax error too.
    de.end().map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    Ok(value)
}

//! The one error type of the HTTP edge and its status table. Every non-2xx response of the
//! server is an [`ErrorBody`]; internal details are logged, never returned.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use exactscore_api::ErrorBody;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Not JSON. `field` is where the parser stopped (`body` at the top level, else the path
    /// of the member being read, e.g. `text` for invalid UTF-8 inside it).
    #[error("malformed JSON body: {message}")]
    InvalidJson { field: String, message: String },
    #[error("missing or wrong API key")]
    Unauthorized,
    #[error("no route for {0}")]
    NotFound(String),
    #[error(
        "this server has no reference model; start it with --reference-model DIR (the \
         unquantized checkpoint) to compute KL-divergences"
    )]
    NoReferenceModel,
    /// The reference serves `/kld` but cannot be compared layer by layer (`/diff`): why.
    #[error(
        "the reference model cannot be compared with the served model layer by layer: \
         {0}; /kld still works"
    )]
    IncompatibleReference(String),
    #[error("method {0} is not allowed on this route")]
    MethodNotAllowed(String),
    #[error("content type `{0}` is not JSON; send `Content-Type: application/json`")]
    UnsupportedMediaType(String),
    #[error(
        "content encoding `{0}` is not supported; send the JSON body uncompressed (no \
         `Content-Encoding`, or `identity`)"
    )]
    UnsupportedEncoding(String),
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// A request head beyond [`super::HeaderLimits`].
    #[error("request headers exceed the limit: {0}")]
    HeadersTooLarge(String),
    /// A header that must appear once (or not at all) came more than once.
    #[error("header `{0}` appears more than once; send it once")]
    RepeatedHeader(&'static str),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    /// A request that parsed but breaks a rule: names the field, the rule and the value.
    #[error("{message}")]
    Validation {
        field: String,
        rule: &'static str,
        value: Value,
        message: String,
    },
    #[error("the queue is full ({max_queued} requests); retry later")]
    Overloaded { max_queued: usize },
    #[error("the server is {0}; retry later")]
    NotReady(&'static str),
    #[error("request exceeded the server's time limit of {0:?}")]
    Timeout(std::time::Duration),
    /// The device could not compute the request; retrying later (or elsewhere) may work.
    #[error("{message}")]
    Unavailable { kind: &'static str, message: String },
    /// The model's output for a sequence holds a NaN or an infinity: an error, never a `null`.
    #[error(
        "the model's output for sequence {sequence} is not finite at position {position} (a NaN \
         or an infinity in the next-token distribution after that token); no number is served"
    )]
    Numerical { sequence: usize, position: usize },
    /// The message is logged; clients see a generic text.
    #[error("internal error")]
    Internal(String),
}

impl From<crate::engine::EngineError> for ApiError {
    fn from(e: crate::engine::EngineError) -> Self {
        use crate::engine::EngineError as E;
        let unavailable = |kind, message: String| Self::Unavailable { kind, message };
        match e {
            E::NoReference => Self::NoReferenceModel,
            // Only a client that is gone gets this (nobody reads it); a timeout answers 504
            // before the engine stops.
            E::Cancelled => unavailable(
                "cancelled",
                "the request was cancelled before its answer was computed".into(),
            ),
            E::OutOfMemory(cause) => unavailable(
                "out_of_memory",
                format!(
                    "the device ran out of memory for this sequence even in a batch of its own \
                     ({cause}); send a shorter sequence or use a device with more memory"
                ),
            ),
            E::DeviceLost(_) => unavailable(
                "device_lost",
                "the device failed and the server is restarting; retry later".into(),
            ),
            E::Abandoned => unavailable(
                "shutting_down",
                "the server shut down (its drain timeout passed) before this request was \
                 computed; retry on another instance"
                    .into(),
            ),
            E::NoReplica => unavailable(
                "no_replica_in_rotation",
                "every replica of the model has failed and left the rotation; retry later".into(),
            ),
            E::Compute(cause) => {
                tracing::error!(%cause, "a batch failed");
                unavailable(
                    "compute_failed",
                    "computing this request's batch failed on the device; retry (the failure \
                     is in the server log)"
                        .into(),
                )
            }
            // Callers that know the sequence map it to `Numerical` themselves (`compute`).
            E::Stopped | E::NonFinite { .. } => Self::Internal(e.to_string()),
        }
    }
}

impl ApiError {
    pub fn validation(
        field: impl Into<String>,
        rule: &'static str,
        value: impl Into<Value>,
        message: impl Into<String>,
    ) -> Self {
        Self::Validation {
            field: field.into(),
            rule,
            value: value.into(),
            message: message.into(),
        }
    }

    /// The status table: the one place that maps errors to HTTP.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidJson { .. } | Self::RepeatedHeader(_) => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NotFound(_) | Self::NoReferenceModel => StatusCode::NOT_FOUND,
            Self::IncompatibleReference(_) => StatusCode::CONFLICT,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::UnsupportedMediaType(_) | Self::UnsupportedEncoding(_) => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::Validation { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Numerical { .. } | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidJson { .. } => "invalid_json",
            Self::Unauthorized => "unauthorized",
            Self::NotFound(_) => "not_found",
            Self::NoReferenceModel => "no_reference_model",
            Self::IncompatibleReference(_) => "incompatible_reference",
            Self::MethodNotAllowed(_) => "method_not_allowed",
            Self::UnsupportedMediaType(_) | Self::UnsupportedEncoding(_) => {
                "unsupported_media_type"
            }
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::HeadersTooLarge(_) => "headers_too_large",
            Self::RepeatedHeader(_) => "invalid_header",
            Self::BodyTimeout(_) => "body_timeout",
            Self::Validation { .. } => "validation",
            Self::Overloaded { .. } => "overloaded",
            Self::NotReady(_) => "not_ready",
            Self::Timeout(_) => "timeout",
            Self::Unavailable { kind, .. } => kind,
            Self::Numerical { .. } => "numerical",
            Self::Internal(_) => "internal",
        }
    }

    pub fn body(&self) -> ErrorBody {
        let (field, rule, value) = match self {
            Self::Validation {
                field, rule, value, ..
            } => (
                Some(field.clone()),
                Some(rule.to_string()),
                Some(preview(value)),
            ),
            Self::InvalidJson { field, .. } => {
                (Some(field.clone()), Some("json_syntax".into()), None)
            }
            Self::MethodNotAllowed(method) => (
                Some("method".into()),
                Some("allowed_method".into()),
                Some(Value::from(method.as_str())),
            ),
            Self::UnsupportedMediaType(content_type) => (
                Some("content-type".into()),
                Some("json_content_type".into()),
                Some(preview(&Value::from(content_type.as_str()))),
            ),
            Self::Unauthorized => (
                Some("authorization".into()),
                Some("bearer_api_key".into()),
                None, // never echo credentials
            ),
            Self::PayloadTooLarge { limit } => (
                Some("body".into()),
                Some("max_body_bytes".into()),
                Some(Value::from(*limit)),
            ),
            Self::UnsupportedEncoding(encoding) => (
                Some("content-encoding".into()),
                Some("identity_encoding".into()),
                Some(preview(&Value::from(encoding.as_str()))),
            ),
            Self::HeadersTooLarge(_) => {
                (Some("headers".into()), Some("max_header_size".into()), None)
            }
            Self::RepeatedHeader(name) => (
                Some((*name).into()),
                Some("single_header".into()),
                None, // the header may be a credential
            ),
            Self::BodyTimeout(limit) => (
                Some("body".into()),
                Some("body_read_timeout".into()),
                Some(Value::from(limit.as_secs())),
            ),
            Self::Numerical { sequence, position } => (
                Some(format!("sequences[{sequence}]")),
                Some("finite".into()),
                Some(serde_json::json!({"sequence": sequence, "position": position})),
            ),
            Self::NoReferenceModel => (Some("reference_model".into()), None, None),
            Self::IncompatibleReference(_) => (
                Some("reference_model".into()),
                Some("same_layers_and_hidden_size".into()),
                None,
            ),
            _ => (None, None, None),
        };
        ErrorBody {
            error: clip(self.to_string()),
            kind: self.kind().into(),
            field,
            rule,
            value,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Internal(detail) = &self {
            tracing::error!(%detail, "internal error");
        }
        let mut response = (self.status(), Json(self.body())).into_response();
        let retry_after = match self {
            Self::Overloaded { .. } => Some("1"),
            Self::NotReady(_) | Self::Unavailable { .. } => Some("5"),
            _ => None,
        };
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(secs));
        }
        response
    }
}

/// Error messages quote what they reject (serde: `invalid type: string "…"`); a long value
/// must not come back in full.
fn clip(message: String) -> String {
    const MAX_CHARS: usize = 300;
    if message.chars().count() <= MAX_CHARS {
        return message;
    }
    message.chars().take(MAX_CHARS).collect::<String>() + "…"
}

/// Shortens a value for an error body: long strings and arrays are cut, so a 4 MB text is
/// not echoed back.
pub fn preview(value: &Value) -> Value {
    const MAX_CHARS: usize = 64;
    const MAX_ITEMS: usize = 16;
    match value {
        Value::String(s) if s.chars().count() > MAX_CHARS => {
            Value::String(s.chars().take(MAX_CHARS).collect::<String>() + "…")
        }
        Value::Array(items) => Value::Array(items.iter().take(MAX_ITEMS).map(preview).collect()),
        other => other.clone(),
    }
}

/// The error answers that every route which queues work for the model shares, for their
/// OpenAPI `responses` (each route adds its own, such as `/kld`'s 404).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // only read by the OpenAPI derive
pub enum QueuedRouteErrors {
    #[response(status = 400, description = "Malformed JSON")]
    Malformed(ErrorBody),
    #[response(status = 401, description = "Missing or wrong API key")]
    Unauthorized(ErrorBody),
    #[response(status = 413, description = "Body too large")]
    TooLarge(ErrorBody),
    #[response(
        status = 422,
        description = "Invalid request: names the field, rule and value"
    )]
    Invalid(ErrorBody),
    #[response(status = 429, description = "Queue full; see Retry-After")]
    Overloaded(ErrorBody),
    #[response(
        status = 500,
        description = "The model's output is not finite (`numerical`: names the sequence and position)"
    )]
    Numerical(ErrorBody),
    #[response(status = 503, description = "Starting or draining; see Retry-After")]
    NotReady(ErrorBody),
    #[response(status = 504, description = "Request timed out")]
    Timeout(ErrorBody),
}

//! The HTTP API: one router built with utoipa-axum, so the OpenAPI document is generated from
//! the routes actually served. Handlers are thin: validate, submit, shape the answer.

pub mod budget;
pub mod completions;
pub mod diff;
mod divergence;
pub mod error;
pub mod health;
pub mod info;
pub mod json;
pub mod kld;
pub mod memory;
pub mod metrics;
pub mod score;
pub mod serve;
pub mod stored;
mod submit;
pub mod tokenize;
pub mod validate;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use exactscore_api::{Limits, ModelInfo};
use metrics_exporter_prometheus::PrometheusHandle;
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::OpenApi as OpenApiDoc;
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::config::HttpConfig;
use crate::engine::Scheduler;
use crate::tokenizer::TextTokenizer;
use error::ApiError;

/// Everything the handlers share.
pub struct AppState {
    pub scheduler: Scheduler,
    pub tokenizer: Arc<TextTokenizer>,
    /// `/info`; its `limits` are the ones enforced.
    pub info: ModelInfo,
    pub readiness: Arc<Readiness>,
    /// One permit per admitted `/score` request (queued or computing).
    pub admission: Arc<Semaphore>,
    pub metrics: Option<PrometheusHandle>,
    pub http: HttpConfig,
    /// Unix time the server started (`created` of `/v1/models`).
    pub created: u64,
    /// The compute and answer-size limits of admission (`/info`'s `limits` say them too).
    pub budget: budget::Budget,
}

impl AppState {
    pub fn limits(&self) -> &Limits {
        &self.info.limits
    }

    /// `Ok(())` when ready to score, else why not: a lost device, [`Readiness::check`], or no
    /// replica left in rotation.
    pub fn ready(&self) -> Result<(), &'static str> {
        if self.scheduler.lost_device().is_some() {
            return Err("device_lost");
        }
        self.readiness.check()?;
        if self
            .scheduler
            .replicas()
            .iter()
            .all(|r| r.out_of_rotation.is_some())
        {
            return Err("no_replica_in_rotation");
        }
        Ok(())
    }

    /// The validation rules requests are checked against.
    pub fn rules(&self) -> validate::Rules<'_> {
        validate::Rules {
            vocab_size: self.info.vocab_size,
            max_input_tokens: self.limits().max_input_tokens,
            tokenizer: &self.tokenizer,
            budget: &self.budget,
        }
    }
}

pub type SharedState = Arc<AppState>;

/// Runs request work that can take long on the CPU (tokenizing megabytes of text) on tokio's
/// blocking pool, so it never stalls the async workers that serve health probes and metrics.
pub async fn off_runtime<R: Send + 'static>(
    state: &SharedState,
    work: impl FnOnce(&AppState) -> Result<R, ApiError> + Send + 'static,
) -> Result<R, ApiError> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || work(&state))
        .await
        .map_err(|e| ApiError::Internal(format!("request worker failed: {e}")))?
}

/// Ready = weights loaded and a warm-up batch ran, not draining, and no device lost.
#[derive(Debug, Default)]
pub struct Readiness {
    warm: AtomicBool,
    draining: AtomicBool,
    device_lost: AtomicBool,
}

impl Readiness {
    pub fn set_warm(&self) {
        self.warm.store(true, Ordering::SeqCst);
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// A sticky device error: not ready for good (the server drains and exits non-zero).
    pub fn set_device_lost(&self) {
        self.device_lost.store(true, Ordering::SeqCst);
    }

    /// `Ok(())` when ready, else why not (`device_lost`, `draining` or `starting`).
    pub fn check(&self) -> Result<(), &'static str> {
        if self.device_lost.load(Ordering::SeqCst) {
            Err("device_lost")
        } else if self.draining.load(Ordering::SeqCst) {
            Err("draining")
        } else if !self.warm.load(Ordering::SeqCst) {
            Err("starting")
        } else {
            Ok(())
        }
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "ExactScore",
        description = "Exact per-token log-probabilities of quantized LLM checkpoints."
    ),
    modifiers(&BearerAuth),
    security(("api_key" = [])),
    tags(
        (name = "scoring", description = "Log-probabilities of given tokens"),
        (name = "tokenizer", description = "The model's tokenizer"),
        (name = "model", description = "What is served"),
        (name = "operations", description = "Health and metrics")
    )
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut OpenApiDoc) {
        if let Some(components) = openapi.components.as_mut() {
            components.add_security_scheme(
                "api_key",
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
        }
    }
}

fn api_router() -> OpenApiRouter<SharedState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(score::score))
        .routes(routes!(score::score_v1))
        .routes(routes!(kld::kld))
        .routes(routes!(stored::reference))
        .routes(routes!(stored::kld_stored))
        .routes(routes!(diff::diff))
        .routes(routes!(completions::completions))
        .routes(routes!(tokenize::tokenize))
        .routes(routes!(tokenize::detokenize))
        .routes(routes!(tokenize::tokenizer_info))
        .routes(routes!(tokenize::tokenizer_json))
        .routes(routes!(info::models))
        .routes(routes!(info::info))
        .routes(routes!(health::live))
        .routes(routes!(health::ready))
        .routes(routes!(metrics::metrics))
}

/// The OpenAPI document of the served API (what `/openapi.json` returns).
pub fn openapi() -> OpenApiDoc {
    api_router().split_for_parts().1
}

/// The full application: routes, auth, body limit, metrics and tracing layers.
pub fn router(state: SharedState) -> Router {
    let (routes, doc) = api_router().split_for_parts();
    let doc = Arc::new(doc);
    let limit = state.http.max_body_bytes;
    routes
        .route(
            "/openapi.json",
            axum::routing::get(move || {
                let doc = doc.clone();
                async move { Json(doc.as_ref().clone()) }
            }),
        )
        .fallback(|req: Request| async move { ApiError::NotFound(req.uri().path().to_string()) })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::MethodNotAllowed(req.method().to_string())
        })
        // Inside the key check: a request without the key learns nothing about the limits.
        .layer(middleware::from_fn(refuse_oversized_head_or_body))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(BodyLimit(limit)))
        .layer(Extension(BodyReadTimeout(state.http.body_read_timeout)))
        .layer(middleware::from_fn(memory::trim_after_large_answers))
        .layer(middleware::from_fn(metrics::track))
        .layer(tower_http::trace::TraceLayer::new_for_http().on_failure(log_failure))
        .with_state(state)
}

/// The body limit, visible to the JSON extractor for its 413 message.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

pub(crate) fn body_limit(req: &Request) -> usize {
    req.extensions().get::<BodyLimit>().map_or(0, |b| b.0)
}

/// How long a request body may take to arrive (`--body-read-timeout-secs`), for the JSON
/// extractor.
#[derive(Debug, Clone, Copy)]
pub struct BodyReadTimeout(pub std::time::Duration);

pub(crate) fn body_read_timeout(req: &Request) -> Option<std::time::Duration> {
    req.extensions().get::<BodyReadTimeout>().map(|t| t.0)
}

/// The largest request head served (hyper parses up to [`serve::HYPER_MAX_HEADERS`] headers
/// and [`serve::HYPER_MAX_BUF_BYTES`] bytes, so anything between gets a JSON 431 from here).
pub struct HeaderLimits;

impl HeaderLimits {
    /// hyper's own default, so no head accepted before is refused now.
    pub const MAX_HEADERS: usize = 100;
    /// Names and values together.
    pub const MAX_BYTES: usize = 64 * 1024;
}

/// Refuses before anything reads the body: a head beyond [`HeaderLimits`] (431), and a
/// `Content-Length` over `--max-body-bytes` (413) — so a client that sent
/// `Expect: 100-continue` gets the 413 instead of an invitation to upload the body.
async fn refuse_oversized_head_or_body(req: Request, next: Next) -> Response {
    let headers = req.headers();
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > HeaderLimits::MAX_HEADERS {
        return ApiError::HeadersTooLarge(format!(
            "{} headers, at most {}",
            headers.len(),
            HeaderLimits::MAX_HEADERS
        ))
        .into_response();
    }
    if bytes > HeaderLimits::MAX_BYTES {
        return ApiError::HeadersTooLarge(format!(
            "{bytes} bytes of names and values, at most {}",
            HeaderLimits::MAX_BYTES
        ))
        .into_response();
    }
    let limit = body_limit(&req);
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return ApiError::PayloadTooLarge { limit }.into_response();
    }
    next.run(req).await
}

/// Routes served without the key: the probes (which carry no credentials), and `/metrics`
/// with `--metrics-without-auth`. Exact paths: `/health/live/`, `//health/live` or
/// `/health/../score` are not open (and match no route).
pub fn is_open_path(path: &str, http: &HttpConfig) -> bool {
    matches!(path, "/health/live" | "/health/ready")
        || (http.metrics_without_auth && path == "/metrics")
}

/// Bearer check on every route but the open ones (see [`is_open_path`]), unmatched paths
/// included, so that a path variant (`/score/`, `//score`, `/%73core`, `/SCORE`) is a 401
/// before it is a 404.
async fn require_api_key(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.http.api_key {
        let open = is_open_path(req.uri().path(), &state.http);
        let mut values = req.headers().get_all(AUTHORIZATION).iter();
        let (first, second) = (values.next(), values.next());
        // Which of two would a proxy in front have checked? Neither is guessed.
        if second.is_some() && !open {
            return ApiError::RepeatedHeader("authorization").into_response();
        }
        let given = first
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_credentials)
            .unwrap_or("");
        // Constant time in the key's content (its length may still leak, as with any HMAC-less
        // comparison; keys are random and long).
        let ok: bool = given.as_bytes().ct_eq(key.as_bytes()).into();
        if !open && !ok {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

/// The credentials of `Bearer <credentials>`; the scheme is case-insensitive (RFC 9110
/// §11.1), so `bearer` and `BEARER` work too.
fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, credentials) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(credentials)
}

/// Route template of a request, for metric labels (bounded cardinality).
pub(crate) fn route_label(req: &Request) -> String {
    req.extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string())
}

/// A 5xx answer in the log: 503 (not ready, draining, overloaded device, a drained request)
/// is the server saying "later", logged as a warning; any other is an error.
fn log_failure(
    class: tower_http::classify::ServerErrorsFailureClass,
    latency: std::time::Duration,
    _span: &tracing::Span,
) {
    use tower_http::classify::ServerErrorsFailureClass::StatusCode;
    let latency_ms = latency.as_millis();
    match class {
        StatusCode(code) if code == axum::http::StatusCode::SERVICE_UNAVAILABLE => {
            tracing::warn!(status = 503, latency_ms, "service unavailable")
        }
        class => tracing::error!(classification = %class, latency_ms, "response failed"),
    }
}

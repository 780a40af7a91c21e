//! The HTTP API: one router built with utoipa-axum, so the OpenAPI document is generated from
//! the routes actually served. Handlers are thin: validate, submit, shape the answer.

pub mod completions;
pub mod diff;
pub mod error;
pub mod health;
pub mod info;
pub mod json;
pub mod kld;
pub mod metrics;
pub mod score;
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
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(BodyLimit(limit)))
        .layer(middleware::from_fn(metrics::track))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// The body limit, visible to the JSON extractor for its 413 message.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

pub(crate) fn body_limit(req: &Request) -> usize {
    req.extensions().get::<BodyLimit>().map_or(0, |b| b.0)
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
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
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

/// Route template of a request, for metric labels (bounded cardinality).
pub(crate) fn route_label(req: &Request) -> String {
    req.extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string())
}

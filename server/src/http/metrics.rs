//! Prometheus metrics: the recorder (installed once per process), the `/metrics` route and
//! the middleware that counts requests by route and status.

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use exactscore_api::ErrorBody;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::SharedState;

/// Installs the global recorder the first time; later calls share its handle (tests build
/// many apps in one process).
pub fn recorder() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let seconds = [
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ];
            let counts = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
            let tokens = [
                16.0, 64.0, 256.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("exactscore_batch_sequences".into()),
                        &counts,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full("exactscore_batch_tokens".into()),
                        &tokens,
                    )
                })
                .expect("bucket lists are non-empty")
                .build_recorder();
            let handle = recorder.handle();
            // Fails only if another recorder was installed first; metrics then go there.
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            describe();
            handle
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "exactscore_requests_total",
        "HTTP requests by route and status"
    );
    describe_histogram!(
        "exactscore_request_seconds",
        Unit::Seconds,
        "HTTP request latency"
    );
    describe_gauge!("exactscore_queue_depth", "Sequences waiting for a batch");
    describe_histogram!(
        "exactscore_queue_seconds",
        Unit::Seconds,
        "Time a sequence waited"
    );
    describe_histogram!(
        "exactscore_compute_seconds",
        Unit::Seconds,
        "Model time per batch"
    );
    describe_histogram!("exactscore_batch_sequences", "Sequences per batch");
    describe_histogram!("exactscore_batch_tokens", "Tokens per batch");
    describe_counter!(
        "exactscore_tokens_processed_total",
        "Tokens run through the model"
    );
    describe_counter!(
        "exactscore_sequences_cancelled_total",
        "Sequences dropped before compute, or whose batch stopped at a layer boundary, because their client went away or timed out"
    );
    // Rendered as 0 from the start, so a scraper sees the series before the first drop.
    metrics::counter!("exactscore_sequences_cancelled_total").increment(0);
    describe_counter!(
        "exactscore_numerical_errors_total",
        "Sequences refused with a 500 `numerical` because the model's output was NaN or infinite"
    );
    metrics::counter!("exactscore_numerical_errors_total").increment(0);
    describe_counter!(
        "exactscore_tokens_scored_total",
        "Tokens returned with a logprob"
    );
    describe_gauge!(
        "exactscore_throughput_tokens_per_second",
        "Tokens per second of the last batch"
    );
}

#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses(
        (status = 200, description = "Prometheus text exposition", content_type = "text/plain", body = String),
        (status = 401, body = ErrorBody)
    ))]
pub async fn metrics(State(state): State<SharedState>) -> Response {
    let text = state
        .metrics
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Counts every response by route template and status, and times it.
pub async fn track(req: Request, next: Next) -> Response {
    let route = super::route_label(&req);
    let start = Instant::now();
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("exactscore_requests_total", "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("exactscore_request_seconds", "route" => route)
        .record(start.elapsed().as_secs_f64());
    response
}

//! Probes: liveness (the process answers) and readiness (model loaded, warmed up, not draining).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use exactscore_api::Health;

use super::SharedState;

#[utoipa::path(get, path = "/health/live", tag = "operations", security(()),
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn live() -> Json<Health> {
    Json(Health {
        status: "live".into(),
    })
}

#[utoipa::path(get, path = "/health/ready", tag = "operations", security(()),
    responses(
        (status = 200, description = "Weights loaded and warm", body = Health),
        (status = 503, description = "`starting` or `draining`", body = Health)
    ))]
pub async fn ready(State(state): State<SharedState>) -> (StatusCode, Json<Health>) {
    match state.readiness.check() {
        Ok(()) => (
            StatusCode::OK,
            Json(Health {
                status: "ready".into(),
            }),
        ),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health { status: why.into() }),
        ),
    }
}

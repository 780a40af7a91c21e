//! Probes: liveness (the process answers) and readiness (model loaded, warmed up, not draining,
//! no device lost, a replica in rotation).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use exactscore_api::{Health, ReplicaHealth};

use super::SharedState;

#[utoipa::path(get, path = "/health/live", tag = "operations", security(()),
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn live() -> Json<Health> {
    Json(Health {
        status: "live".into(),
        replicas_out_of_rotation: Vec::new(),
    })
}

#[utoipa::path(get, path = "/health/ready", tag = "operations", security(()),
    responses(
        (status = 200, description = "Weights loaded and warm", body = Health),
        (status = 503, description = "`starting`, `draining`, `device_lost` or \
            `no_replica_in_rotation`", body = Health)
    ))]
pub async fn ready(State(state): State<SharedState>) -> (StatusCode, Json<Health>) {
    let replicas_out_of_rotation = state
        .scheduler
        .replicas()
        .into_iter()
        .filter_map(|r| {
            r.out_of_rotation.map(|reason| ReplicaHealth {
                replica: r.index,
                reason,
            })
        })
        .collect();
    let (code, status) = match state.ready() {
        Ok(()) => (StatusCode::OK, "ready"),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    };
    (
        code,
        Json(Health {
            status: status.into(),
            replicas_out_of_rotation,
        }),
    )
}

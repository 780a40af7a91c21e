//! `POST /kld`: KL-divergence of the served model from the reference model at every position,
//! computed on the server where both full distributions are; only per-token numbers travel.

use axum::extract::State;
use axum::Json;
use exactscore_api::{ErrorBody, KldRequest, KldResponse};

use super::divergence::sequence_divergence;
use super::error::{ApiError, QueuedRouteErrors};
use super::json::ApiJson;
use super::submit::{submit_and_wait, UsageMeter};
use super::validate;
use super::{off_runtime, SharedState};

#[utoipa::path(post, path = "/kld", tag = "scoring", request_body = KldRequest,
    responses(
        (status = 200, description = "Per-token divergences, in request order", body = KldResponse),
        (status = 404, description = "No reference model loaded (`no_reference_model`)", body = ErrorBody),
        QueuedRouteErrors
    ))]
pub async fn kld(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<KldRequest>,
) -> Result<Json<KldResponse>, ApiError> {
    state.ready().map_err(ApiError::NotReady)?;
    let Some(reference) = state.info.reference.as_ref().map(|r| r.model.clone()) else {
        return Err(ApiError::NoReferenceModel);
    };
    let valid = off_runtime(&state, move |s| validate::kld_request(req, &s.rules())).await?;
    let done = submit_and_wait(&state, &valid.sequences, |s, ids| s.submit_kld(ids)).await?;
    let mut usage = UsageMeter::default();
    let mut sequences = Vec::with_capacity(done.len());
    for (index, (tokens, d)) in valid.sequences.into_iter().zip(&done).enumerate() {
        usage.add(tokens.len(), d.output.num_scored(), d);
        sequences.push(sequence_divergence(
            index,
            tokens,
            &d.output,
            valid.per_token,
        ));
    }
    let usage = usage.usage();
    metrics::counter!("exactscore_tokens_kld_total").increment(usage.scored_tokens as u64);
    Ok(Json(KldResponse {
        model: state.info.model.clone(),
        reference_model: reference,
        sequences,
        usage,
    }))
}

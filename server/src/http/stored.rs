//! `POST /reference` and `POST /kld/stored`: a stored reference written by one server and
//! scored against by another, with no reference model loaded (docs/stored-reference.md).
//! Both run the `/score` pass; only O(k) numbers per position cross the wire.

use std::cell::Cell;
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use exactscore_api::{
    ReferenceRequest, ReferenceResponse, StoredKldRequest, StoredKldResponse, StoredKldSequence,
    StoredRows,
};

use super::error::{ApiError, QueuedRouteErrors};
use super::json::ApiJson;
use super::submit::{submit_and_wait, UsageMeter};
use super::validate;
use super::{off_runtime, SharedState};
use crate::model::scoring::sum;
use crate::model::{StoredOutput, StoredRequest};

#[utoipa::path(post, path = "/reference", tag = "scoring", request_body = ReferenceRequest,
    responses(
        (status = 200, description = "Each sequence's stored-reference rows, in request order", body = ReferenceResponse),
        QueuedRouteErrors
    ))]
pub async fn reference(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<ReferenceRequest>,
) -> Result<Json<ReferenceResponse>, ApiError> {
    state.ready().map_err(ApiError::NotReady)?;
    let valid = off_runtime(&state, move |s| {
        validate::reference_request(req, &s.rules())
    })
    .await?;
    let k = valid.k;
    let done = submit_and_wait(&state, &valid.sequences, |s, ids| {
        s.submit_stored(ids, 0, StoredRequest::Save { k })
    })
    .await?;
    let mut usage = UsageMeter::default();
    let mut sequences = Vec::with_capacity(done.len());
    for (tokens, d) in valid.sequences.iter().zip(&done) {
        usage.add(tokens.len(), d.output.num_scored(), d);
        let StoredOutput::Reference(rows) = &d.output.stored else {
            return Err(ApiError::Internal("no reference rows computed".into()));
        };
        sequences.push(StoredRows {
            start: 0,
            k,
            ids: rows.iter().flat_map(|r| r.ids.iter().copied()).collect(),
            logprobs: rows
                .iter()
                .flat_map(|r| r.logprobs.iter().copied())
                .collect(),
            tail_logmass: rows
                .iter()
                .map(|r| r.tail_logmass.is_finite().then_some(r.tail_logmass))
                .collect(),
        });
    }
    Ok(Json(ReferenceResponse {
        model: state.info.model.clone(),
        sequences,
        usage: usage.usage(),
    }))
}

#[utoipa::path(post, path = "/kld/stored", tag = "scoring", request_body = StoredKldRequest,
    responses(
        (status = 200, description = "Bounded divergences from the stored reference, in request order", body = StoredKldResponse),
        QueuedRouteErrors
    ))]
pub async fn kld_stored(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<StoredKldRequest>,
) -> Result<Json<StoredKldResponse>, ApiError> {
    state.ready().map_err(ApiError::NotReady)?;
    let valid = off_runtime(&state, move |s| {
        validate::stored_kld_request(req, &s.rules())
    })
    .await?;
    let (tokens, stored): (Vec<Vec<u32>>, Vec<_>) = valid.sequences.into_iter().unzip();
    // Sequences are submitted in order: each takes the next one's stored rows.
    let next = Cell::new(0);
    let stored: Vec<Arc<_>> = stored.into_iter().map(Arc::new).collect();
    let done = submit_and_wait(&state, &tokens, move |s, ids| {
        let i = next.replace(next.get() + 1);
        s.submit_stored(ids, 0, StoredRequest::Bound(stored[i].clone()))
    })
    .await?;
    let mut usage = UsageMeter::default();
    let mut sequences = Vec::with_capacity(done.len());
    for (index, (tokens, d)) in tokens.iter().zip(&done).enumerate() {
        usage.add(tokens.len(), d.output.num_scored(), d);
        let StoredOutput::Bounded(rows) = &d.output.stored else {
            return Err(ApiError::Internal("no bounded rows computed".into()));
        };
        let column = |f: fn(&crate::model::stored_kld::BoundedKld) -> f64| {
            valid.per_token.then(|| rows.iter().map(f).collect())
        };
        sequences.push(StoredKldSequence {
            index,
            num_scored: rows.len(),
            sum_top_k: sum(rows.iter().map(|r| r.top_k)),
            sum_estimate: sum(rows.iter().map(|r| r.estimate)),
            sum_lower: sum(rows.iter().map(|r| r.lower)),
            sum_upper: sum(rows.iter().map(|r| r.upper)),
            sum_nll: sum(rows.iter().map(|r| -f64::from(r.logprob))),
            same_top_count: rows.iter().filter(|r| r.same_top).count(),
            top_k: column(|r| r.top_k),
            estimate: column(|r| r.estimate),
            lower: column(|r| r.lower),
            upper: column(|r| r.upper),
            logprobs: valid
                .per_token
                .then(|| rows.iter().map(|r| r.logprob).collect()),
            tail_mass: column(|r| r.tail_mass),
        });
    }
    let usage = usage.usage();
    metrics::counter!("exactscore_tokens_kld_total").increment(usage.scored_tokens as u64);
    Ok(Json(StoredKldResponse {
        model: state.info.model.clone(),
        sequences,
        usage,
    }))
}

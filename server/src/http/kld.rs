//! `POST /kld`: KL-divergence of the served model from the reference model at every position,
//! computed on the server where both full distributions are; only per-token numbers travel.

use axum::extract::State;
use axum::Json;
use exactscore_api::{
    ConfidenceBucket, ErrorBody, KldRequest, KldResponse, SequenceDivergence, CONFIDENCE_BUCKETS,
};

use super::error::ApiError;
use super::json::ApiJson;
use super::score::{compute, UsageMeter};
use super::validate;
use super::{off_runtime, SharedState};
use crate::model::SequenceKld;

#[utoipa::path(post, path = "/kld", tag = "scoring", request_body = KldRequest,
    responses(
        (status = 200, description = "Per-token divergences, in request order", body = KldResponse),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 404, description = "No reference model loaded (`no_reference_model`)", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 422, description = "Invalid request: names the field, rule and value", body = ErrorBody),
        (status = 429, description = "Queue full; see Retry-After", body = ErrorBody),
        (status = 503, description = "Starting or draining; see Retry-After", body = ErrorBody),
        (status = 504, description = "Request timed out", body = ErrorBody),
        (status = 500, description = "The model's output is not finite (`numerical`: names the sequence and position)", body = ErrorBody)
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
    let done = compute(&state, &valid.sequences, |s, ids| s.submit_kld(ids)).await?;
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

/// Shapes one sequence's divergences: per-token arrays (position 0 `null`) and their sums.
pub fn sequence_divergence(
    index: usize,
    tokens: Vec<u32>,
    kld: &SequenceKld,
    per_token: bool,
) -> SequenceDivergence {
    let delta_p: Vec<f64> = kld
        .tokens
        .iter()
        .map(|t| (t.logprob as f64).exp() - (t.reference_logprob as f64).exp())
        .collect();
    // Position 0 predicts nothing: every per-token array starts with `null`.
    fn column<T: Copy>(values: impl Iterator<Item = T>) -> Vec<Option<T>> {
        std::iter::once(None).chain(values.map(Some)).collect()
    }
    SequenceDivergence {
        index,
        tokens,
        kld: per_token.then(|| column(kld.tokens.iter().map(|t| t.kld))),
        logprobs: per_token.then(|| column(kld.tokens.iter().map(|t| t.logprob))),
        reference_logprobs: per_token
            .then(|| column(kld.tokens.iter().map(|t| t.reference_logprob))),
        same_top: per_token.then(|| column(kld.tokens.iter().map(|t| t.same_top))),
        delta_p: per_token.then(|| column(delta_p.iter().copied())),
        num_scored: kld.num_scored(),
        sum_kld: kld.sum_kld(),
        sum_nll: kld.sum_nll(),
        reference_sum_nll: kld.reference_sum_nll(),
        same_top_count: kld.same_top_count(),
        sum_delta_p: delta_p.iter().sum(),
        sum_delta_p_squared: delta_p.iter().map(|d| d * d).sum(),
        reverse_kld: per_token.then(|| column(kld.tokens.iter().map(|t| t.reverse_kld))),
        top_k_agreement: per_token.then(|| column(kld.tokens.iter().map(|t| t.top_k_agreement))),
        reference_top_p: per_token.then(|| column(kld.tokens.iter().map(|t| t.reference_top_p))),
        sum_reverse_kld: kld.sum_reverse_kld(),
        top_k_agreement_counts: kld.top_k_agreement_counts().to_vec(),
        confidence_buckets: CONFIDENCE_BUCKETS
            .iter()
            .zip(kld.confidence_buckets())
            .map(|(&(lower, upper), (count, sum_kld))| ConfidenceBucket {
                lower,
                upper,
                count,
                sum_kld,
            })
            .collect(),
    }
}

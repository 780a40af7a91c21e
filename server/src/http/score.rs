//! `POST /score`: validate, queue every sequence, wait for all of them, answer in request
//! order. Logprobs are the f32 numbers of the model, unchanged.

use axum::extract::State;
use axum::Json;
use exactscore_api::{ReturnOptions, ScoreRequest, ScoreResponse, SequenceScore, TopToken};

use super::error::{ApiError, QueuedRouteErrors};
use super::json::ApiJson;
use super::submit::{submit_and_wait, UsageMeter};
use super::validate::{self, ValidScore};
use super::{off_runtime, SharedState};
use crate::engine::ScoredSequence;
use crate::model::SequenceScores;
use crate::tokenizer::TextTokenizer;

#[utoipa::path(post, path = "/score", tag = "scoring", request_body = ScoreRequest,
    responses(
        (status = 200, description = "Scores, in request order", body = ScoreResponse),
        QueuedRouteErrors
    ))]
pub async fn score(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<ScoreRequest>,
) -> Result<Json<ScoreResponse>, ApiError> {
    handle(state, req).await
}

/// `POST /v1/score`: the same endpoint under the versioned prefix.
#[utoipa::path(post, path = "/v1/score", tag = "scoring", request_body = ScoreRequest,
    responses(
        (status = 200, description = "Same as `/score`", body = ScoreResponse),
        QueuedRouteErrors
    ))]
pub async fn score_v1(
    state: State<SharedState>,
    body: ApiJson<ScoreRequest>,
) -> Result<Json<ScoreResponse>, ApiError> {
    score(state, body).await
}

async fn handle(state: SharedState, req: ScoreRequest) -> Result<Json<ScoreResponse>, ApiError> {
    state.ready().map_err(ApiError::NotReady)?;
    let valid = off_runtime(&state, move |s| validate::score_request(req, &s.rules())).await?;
    let top_k = valid.top_k;
    let scored = submit_and_wait(&state, &valid.sequences, |s, ids| s.submit(ids, top_k)).await?;
    let response = respond(&state, valid, scored)?;
    metrics::counter!("exactscore_tokens_scored_total")
        .increment(response.usage.scored_tokens as u64);
    Ok(Json(response))
}

fn respond(
    state: &SharedState,
    valid: ValidScore,
    scored: Vec<ScoredSequence>,
) -> Result<ScoreResponse, ApiError> {
    let mut usage = UsageMeter::default();
    let mut sequences = Vec::with_capacity(scored.len());
    for (index, (tokens, s)) in valid.sequences.into_iter().zip(scored).enumerate() {
        usage.add(tokens.len(), s.output.num_scored(), &s);
        let seq = sequence_score(
            index,
            tokens,
            &s.output,
            valid.top_k,
            &valid.options,
            &state.tokenizer,
        )
        .map_err(|e| ApiError::Internal(e.to_string()))?;
        sequences.push(seq);
    }
    Ok(ScoreResponse {
        model: state.info.model.clone(),
        sequences,
        usage: usage.usage(),
    })
}

/// Shapes one sequence's scores as the wire type asks.
pub fn sequence_score(
    index: usize,
    tokens: Vec<u32>,
    scores: &SequenceScores,
    top_k: usize,
    options: &ReturnOptions,
    tokenizer: &TextTokenizer,
) -> Result<SequenceScore, crate::tokenizer::TokenizerError> {
    let num_scored = scores.num_scored();
    let sum_nll = scores.sum_nll();
    let mean_nll = (num_scored > 0).then(|| sum_nll / num_scored as f64);
    let token_logprobs = options.token_logprobs.then(|| {
        std::iter::once(None)
            .chain(scores.token_logprobs().map(Some))
            .collect()
    });
    let greedy = options.greedy.then(|| {
        std::iter::once(None)
            .chain(scores.greedy(&tokens).into_iter().map(Some))
            .collect()
    });
    let text = |id: u32| -> Result<Option<String>, _> {
        if options.token_strings {
            tokenizer.decode(&[id]).map(Some)
        } else {
            Ok(None)
        }
    };
    let top_k = if options.top_k && top_k > 0 {
        let mut rows = Vec::with_capacity(scores.rows.len());
        for row in &scores.rows {
            let mut out = Vec::with_capacity(row.top_k.len());
            for &(id, logprob) in &row.top_k {
                out.push(TopToken {
                    id,
                    logprob,
                    token: text(id)?,
                });
            }
            rows.push(out);
        }
        Some(rows)
    } else {
        None
    };
    let token_strings = if options.token_strings {
        Some(
            tokens
                .iter()
                .map(|&t| tokenizer.decode(&[t]))
                .collect::<Result<Vec<_>, _>>()?,
        )
    } else {
        None
    };
    Ok(SequenceScore {
        index,
        tokens,
        token_logprobs,
        sum_nll,
        num_scored,
        mean_nll,
        perplexity: mean_nll.map(f64::exp),
        top_k,
        greedy,
        token_strings,
    })
}

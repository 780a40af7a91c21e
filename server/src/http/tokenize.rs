//! The model's tokenizer over HTTP, in the shapes vLLM and lm-eval's remote tokenizer use.

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::Json;
use exactscore_api::{
    DetokenizeRequest, DetokenizeResponse, ErrorBody, TokenizeRequest, TokenizeResponse,
    TokenizerInfo,
};

use super::error::ApiError;
use super::json::ApiJson;
use super::validate;
use super::{off_runtime, SharedState};

#[utoipa::path(post, path = "/tokenize", tag = "tokenizer", request_body = TokenizeRequest,
    responses(
        (status = 200, body = TokenizeResponse),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 422, body = ErrorBody)
    ))]
pub async fn tokenize(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let tokens = off_runtime(&state, move |s| {
        s.tokenizer
            .encode(&req.prompt, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| {
                ApiError::validation(
                    "prompt",
                    "tokenizable",
                    serde_json::Value::Null,
                    e.to_string(),
                )
            })
    })
    .await?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len: state.limits().max_input_tokens,
    }))
}

#[utoipa::path(post, path = "/detokenize", tag = "tokenizer", request_body = DetokenizeRequest,
    responses(
        (status = 200, body = DetokenizeResponse),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 422, body = ErrorBody)
    ))]
pub async fn detokenize(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    // Decoding nothing is fine (""), unlike scoring nothing.
    let ids = if req.tokens.is_empty() {
        Vec::new()
    } else {
        validate::token_ids("tokens", &req.tokens, state.info.vocab_size)?
    };
    let prompt = state
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// `model_max_length` is the server's `max_input_tokens` (what it will actually score), not
/// the tokenizer file's nominal value.
#[utoipa::path(get, path = "/tokenizer_info", tag = "tokenizer",
    responses((status = 200, body = TokenizerInfo), (status = 401, body = ErrorBody)))]
pub async fn tokenizer_info(State(state): State<SharedState>) -> Json<TokenizerInfo> {
    let mut info = state.tokenizer.info().clone();
    info.model_max_length = state.limits().max_input_tokens;
    Json(info)
}

/// The model's `tokenizer.json`, byte for byte, so clients can tokenize locally.
#[utoipa::path(get, path = "/tokenizer.json", tag = "tokenizer",
    responses(
        (status = 200, description = "The tokenizer file", content_type = "application/json", body = Object),
        (status = 401, body = ErrorBody)
    ))]
pub async fn tokenizer_json(State(state): State<SharedState>) -> Response {
    (
        [(CONTENT_TYPE, "application/json")],
        state.tokenizer.raw_json().to_vec(),
    )
        .into_response()
}

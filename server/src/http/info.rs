//! What is served: `/info` (formats, quantization, limits) and the OpenAI `/v1/models` list.

use axum::extract::State;
use axum::Json;
use exactscore_api::{ErrorBody, ModelCard, ModelInfo, ModelList};

use super::SharedState;

#[utoipa::path(get, path = "/info", tag = "model",
    responses((status = 200, body = ModelInfo), (status = 401, body = ErrorBody)))]
pub async fn info(State(state): State<SharedState>) -> Json<ModelInfo> {
    Json(state.info.clone())
}

#[utoipa::path(get, path = "/v1/models", tag = "model",
    responses((status = 200, body = ModelList), (status = 401, body = ErrorBody)))]
pub async fn models(State(state): State<SharedState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: state.info.model.clone(),
            object: "model".into(),
            created: state.created,
            owned_by: "exactscore".into(),
            max_model_len: state.limits().max_input_tokens,
        }],
    })
}

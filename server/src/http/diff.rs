//! `POST /diff`: where the quantization error enters. The served model and the reference run
//! layer by layer on the same tokens; per decoder layer the answer gives the cosine error and
//! the SQNR of the served residual stream against the reference's, then the final divergence,
//! and on request each quantized module's share of it.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use exactscore_api::{
    Attribution, DiffRequest, DiffResponse, ErrorBody, LayerDiff, ModuleAttribution,
    SequenceLayerDiff,
};

use super::divergence::sequence_divergence;
use super::error::{ApiError, QueuedRouteErrors};
use super::json::ApiJson;
use super::submit::{submit_and_wait, UsageMeter};
use super::validate::{self, ValidDiff};
use super::{off_runtime, SharedState};
use crate::engine::{Computed, DiffSupport};
use crate::model::SequenceDiff;

#[utoipa::path(post, path = "/diff", tag = "scoring", request_body = DiffRequest,
    responses(
        (status = 200, description = "Per-layer errors and the final divergence, in request order", body = DiffResponse),
        (status = 404, description = "No reference model loaded (`no_reference_model`)", body = ErrorBody),
        (status = 409, description = "The reference differs in layer count or hidden size (`incompatible_reference`)", body = ErrorBody),
        QueuedRouteErrors
    ))]
pub async fn diff(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<DiffRequest>,
) -> Result<Json<DiffResponse>, ApiError> {
    state.ready().map_err(ApiError::NotReady)?;
    let Some(reference) = state.info.reference.as_ref().map(|r| r.model.clone()) else {
        return Err(ApiError::NoReferenceModel);
    };
    let (layers, modules) = match state.scheduler.diff_support() {
        DiffSupport::Ready { layers, modules } => (layers, modules),
        DiffSupport::Incompatible(reason) => return Err(ApiError::IncompatibleReference(reason)),
        DiffSupport::NoReference => return Err(ApiError::NoReferenceModel),
    };
    let valid = off_runtime(&state, move |s| {
        validate::diff_request(req, &s.rules(), layers, &modules)
    })
    .await?;
    let options = Arc::new(valid.options.clone());
    let done = submit_and_wait(&state, &valid.sequences, |s, ids| {
        s.submit_diff(ids, options.clone())
    })
    .await?;
    let mut usage = UsageMeter::default();
    for (tokens, d) in valid.sequences.iter().zip(&done) {
        usage.add(tokens.len(), d.output.kld.num_scored(), d);
    }
    let attribution = (!valid.options.attribute.is_empty()).then(|| attribution(&valid, &done));
    let sequences = valid
        .sequences
        .into_iter()
        .zip(&done)
        .enumerate()
        .map(|(index, (tokens, d))| {
            sequence_diff(
                index,
                tokens,
                &d.output,
                valid.per_position,
                valid.options.reference_until,
            )
        })
        .collect();
    let usage = usage.usage();
    metrics::counter!("exactscore_tokens_diff_total").increment(usage.input_tokens as u64);
    Ok(Json(DiffResponse {
        model: state.info.model.clone(),
        reference_model: reference,
        sequences,
        attribution,
        usage,
    }))
}

fn sequence_diff(
    index: usize,
    tokens: Vec<u32>,
    diff: &SequenceDiff,
    per_position: bool,
    reference_until: Option<usize>,
) -> SequenceLayerDiff {
    let layers = diff
        .layers
        .iter()
        .enumerate()
        .map(|(layer, e)| LayerDiff {
            layer,
            mean_cos_error: e.mean_cos_error(),
            mean_sqnr_db: e.mean_sqnr_db(),
            cos_error: per_position.then(|| e.cos_error.clone()),
            sqnr_db: per_position.then(|| e.sqnr_db.clone()),
            reference_state_after: reference_until.is_some_and(|n| layer <= n),
        })
        .collect();
    SequenceLayerDiff {
        index,
        layers,
        kld: sequence_divergence(index, tokens, &diff.kld, false),
    }
}

/// Every module's KLD over all positions of the request, largest first, with the additivity
/// ratio against the full KLD over the same positions.
fn attribution(valid: &ValidDiff, done: &[Computed<SequenceDiff>]) -> Attribution {
    let positions: usize = done.iter().map(|d| d.output.kld.num_scored()).sum();
    let per_position = |sum: f64| sum / positions.max(1) as f64;
    let full_kld = per_position(done.iter().map(|d| d.output.kld.sum_kld()).sum());
    let mut modules: Vec<ModuleAttribution> = valid
        .options
        .attribute
        .iter()
        .zip(&valid.formats)
        .enumerate()
        .map(|(m, (module, format))| ModuleAttribution {
            module: module.clone(),
            format: format.clone(),
            mean_kld: per_position(done.iter().map(|d| d.output.modules[m]).sum()),
        })
        .collect();
    modules.sort_by(|a, b| b.mean_kld.total_cmp(&a.mean_kld));
    let sum_module_kld = modules.iter().map(|m| m.mean_kld).sum::<f64>();
    Attribution {
        positions,
        full_kld,
        sum_module_kld,
        additivity_ratio: (full_kld > 0.0).then(|| sum_module_kld / full_kld),
        modules,
    }
}

//! `POST /v1/completions`: the OpenAI legacy completions shape that lm-evaluation-harness's
//! `local-completions` model and the OpenAI client use for log-likelihoods. The numbers are the
//! same f32 log-probabilities `/score` returns; top-1 and target come from the same row, so
//! lm-eval's `is_greedy` (float equality with the max of `top_logprobs`) is exact.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::Json;
use exactscore_api::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, CompletionUsage,
    PromptInput,
};
use serde_json::Value;

use super::budget::{NUMBER_BYTES, SEQUENCE_BYTES};
use super::error::{preview, ApiError, QueuedRouteErrors};
use super::json::ApiJson;
use super::submit::submit_and_wait;
use super::validate::{check_batch_len, check_length, token_ids, Rules, MAX_TOP_K};
use super::{off_runtime, SharedState};
use crate::model::SequenceScores;
use crate::tokenizer::TextTokenizer;

/// A validated completions request.
#[derive(Debug)]
struct ValidCompletion {
    prompts: Vec<Prompt>,
    echo: bool,
    /// `None`: no log-probabilities in the answer.
    logprobs: Option<usize>,
    /// Append the greedy next token.
    generate: bool,
}

#[derive(Debug)]
struct Prompt {
    ids: Vec<u32>,
    /// The text as given, or the decoded ids.
    text: String,
}

#[utoipa::path(post, path = "/v1/completions", tag = "scoring", request_body = CompletionRequest,
    responses(
        (status = 200, description = "OpenAI completions shape; logprobs as `/score`", body = CompletionResponse),
        QueuedRouteErrors
    ))]
pub async fn completions(
    State(state): State<SharedState>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Json<CompletionResponse>, ApiError> {
    state.ready().map_err(ApiError::NotReady)?;
    let valid = off_runtime(&state, move |s| validate(req, &s.info.model, &s.rules())).await?;
    let sequences: Vec<Vec<u32>> = valid.prompts.iter().map(|p| p.ids.clone()).collect();
    let top_k = valid.logprobs.unwrap_or(0);
    let scored = submit_and_wait(&state, &sequences, |s, ids| s.submit(ids, top_k)).await?;
    let mut choices = Vec::with_capacity(scored.len());
    let mut usage = CompletionUsage {
        prompt_tokens: 0,
        completion_tokens: 0,
        total_tokens: 0,
    };
    for (index, (prompt, s)) in valid.prompts.iter().zip(&scored).enumerate() {
        usage.prompt_tokens += prompt.ids.len();
        usage.completion_tokens += usize::from(valid.generate);
        choices.push(
            choice(index, prompt, &s.output, &valid, &state.tokenizer)
                .map_err(|e| ApiError::Internal(e.to_string()))?,
        );
    }
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
    static NEXT_ID: AtomicU64 = AtomicU64::new(0);
    Ok(Json(CompletionResponse {
        id: format!("cmpl-{}", NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        object: "text_completion".into(),
        created: state.created,
        model: state.info.model.clone(),
        choices,
        usage,
    }))
}

fn unsupported(field: &str, value: impl Into<Value>, message: impl Into<String>) -> ApiError {
    ApiError::validation(field, "unsupported", value, message)
}

fn validate(
    req: CompletionRequest,
    served: &str,
    rules: &Rules<'_>,
) -> Result<ValidCompletion, ApiError> {
    if let Some(model) = req.model.as_deref().filter(|m| *m != served) {
        return Err(ApiError::validation(
            "model",
            "served_model",
            model,
            format!("this server serves `{served}`"),
        ));
    }
    let generate = match req.max_tokens {
        Some(0) => false,
        Some(1) => true,
        Some(n) => {
            return Err(unsupported(
                "max_tokens",
                n,
                "this is a scoring server: max_tokens must be 0 (score the prompt) or 1 (also the greedy next token)",
            ))
        }
        None => {
            return Err(ApiError::validation(
                "max_tokens",
                "required",
                Value::Null,
                "give max_tokens: 0 or 1 (OpenAI's default of 16 would mean generation)",
            ))
        }
    };
    if generate {
        if let Some(t) = req.temperature.filter(|t| *t != 0.0) {
            return Err(unsupported(
                "temperature",
                t,
                "with max_tokens 1 the appended token is the argmax: temperature must be 0",
            ));
        }
        if req.temperature.is_none() {
            return Err(ApiError::validation(
                "temperature",
                "required",
                Value::Null,
                "with max_tokens 1 give temperature: 0 (OpenAI's default of 1 would mean sampling)",
            ));
        }
    }
    if let Some(n) = req.n.filter(|n| *n != 1) {
        return Err(unsupported("n", n, "only n = 1 is supported"));
    }
    if req.stream == Some(true) {
        return Err(unsupported("stream", true, "streaming is not supported"));
    }
    match &req.stop {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(stop) => {
            return Err(unsupported(
                "stop",
                preview(stop),
                "stop sequences are not supported",
            ))
        }
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_TOP_K as i64).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::validation(
                "logprobs",
                "range",
                k,
                format!("logprobs must be between 0 and {MAX_TOP_K}, got {k}"),
            ))
        }
    };
    let add_special = req.add_special_tokens.unwrap_or(false);
    let prompts = prompts(req.prompt, add_special, rules)?;
    let budget = rules.budget;
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
    budget.check_cost("prompt", budget.score_cost(&ids), "tokens × (layers + 1)")?;
    let positions: u64 = ids.iter().map(|p| p.len() as u64).sum();
    let echo = req.echo.unwrap_or(false);
    let text: u64 = prompts.iter().map(|p| p.text.len() as u64 * 6 + 2).sum();
    // Per reported position: its token, log-probability, offset and top tokens.
    let per_position = budget.string_bytes()
        + 2 * NUMBER_BYTES
        + logprobs.map_or(0, |k| {
            (k as u64 + 1) * (budget.string_bytes() + NUMBER_BYTES)
        });
    let reported = if echo { positions } else { 0 } + ids.len() as u64;
    budget.check_response(&[
        (
            "prompt",
            if echo { text } else { 0 } + ids.len() as u64 * SEQUENCE_BYTES,
        ),
        (
            "logprobs",
            if logprobs.is_some() {
                reported * per_position
            } else {
                0
            },
        ),
    ])?;
    Ok(ValidCompletion {
        prompts,
        echo: req.echo.unwrap_or(false),
        logprobs,
        generate,
    })
}

fn prompts(
    prompt: Option<PromptInput>,
    add_special: bool,
    rules: &Rules<'_>,
) -> Result<Vec<Prompt>, ApiError> {
    let internal = |e: crate::tokenizer::TokenizerError| ApiError::Internal(e.to_string());
    let from_text = |field: String, text: String| -> Result<Prompt, ApiError> {
        let ids = rules
            .tokenizer
            .encode(&text, add_special)
            .map_err(internal)?;
        if ids.is_empty() {
            return Err(ApiError::validation(
                field,
                "non_empty",
                text,
                "the prompt has no tokens",
            ));
        }
        check_length(&field, &ids, rules)?;
        Ok(Prompt { ids, text })
    };
    let from_ids = |field: String, ids: Vec<i64>| -> Result<Prompt, ApiError> {
        let ids = token_ids(&field, &ids, rules.vocab_size)?;
        check_length(&field, &ids, rules)?;
        let text = rules.tokenizer.decode(&ids).map_err(internal)?;
        Ok(Prompt { ids, text })
    };
    match prompt {
        None => Err(ApiError::validation(
            "prompt",
            "required",
            Value::Null,
            "give a prompt",
        )),
        Some(PromptInput::Text(text)) => Ok(vec![from_text("prompt".into(), text)?]),
        Some(PromptInput::Tokens(ids)) => Ok(vec![from_ids("prompt".into(), ids)?]),
        Some(PromptInput::Texts(texts)) => {
            check_batch_len("prompt", texts.len())?;
            texts
                .into_iter()
                .enumerate()
                .map(|(i, t)| from_text(format!("prompt[{i}]"), t))
                .collect()
        }
        Some(PromptInput::TokenBatch(batch)) => {
            check_batch_len("prompt", batch.len())?;
            batch
                .into_iter()
                .enumerate()
                .map(|(i, ids)| from_ids(format!("prompt[{i}]"), ids))
                .collect()
        }
    }
}

/// One choice: echoed prompt tokens (when asked) plus the greedy token (when `max_tokens` = 1).
fn choice(
    index: usize,
    prompt: &Prompt,
    scores: &SequenceScores,
    valid: &ValidCompletion,
    tokenizer: &TextTokenizer,
) -> Result<CompletionChoice, crate::tokenizer::TokenizerError> {
    let last = scores.rows.last().expect("prompts are non-empty");
    let greedy = valid.generate.then_some(last.argmax.0);
    let generated_text = match greedy {
        Some(id) => tokenizer.decode(&[id])?,
        None => String::new(),
    };
    let text = if valid.echo {
        format!("{}{generated_text}", prompt.text)
    } else {
        generated_text.clone()
    };
    let Some(k) = valid.logprobs else {
        return Ok(CompletionChoice {
            index,
            text,
            logprobs: None,
            finish_reason: "length".into(),
        });
    };
    // (token id, its log-probability, the row that predicted it) for every reported position.
    let mut positions: Vec<(u32, Option<f32>, Option<usize>)> = Vec::new();
    if valid.echo {
        positions.push((prompt.ids[0], None, None));
        for (i, &id) in prompt.ids.iter().enumerate().skip(1) {
            positions.push((id, scores.rows[i - 1].target_logprob, Some(i - 1)));
        }
    }
    if let Some(id) = greedy {
        positions.push((id, Some(last.argmax.1), Some(scores.rows.len() - 1)));
    }
    let mut logprobs = CompletionLogprobs {
        tokens: Vec::with_capacity(positions.len()),
        token_logprobs: Vec::with_capacity(positions.len()),
        top_logprobs: Vec::with_capacity(positions.len()),
        text_offset: Vec::with_capacity(positions.len()),
    };
    let mut offset = if valid.echo {
        0
    } else {
        text.chars().count() - generated_text.chars().count()
    };
    for (id, logprob, row) in positions {
        logprobs.tokens.push(tokenizer.token_string(id));
        logprobs.token_logprobs.push(logprob);
        logprobs.top_logprobs.push(row.map(|r| {
            let row = &scores.rows[r];
            let mut top: BTreeMap<String, f32> = row
                .top_k
                .iter()
                .take(k)
                .map(|&(t, lp)| (tokenizer.token_string(t), lp))
                .collect();
            if let Some(lp) = logprob {
                top.insert(tokenizer.token_string(id), lp);
            }
            top
        }));
        logprobs.text_offset.push(offset);
        offset += tokenizer.decode(&[id])?.chars().count();
    }
    Ok(CompletionChoice {
        index,
        text,
        logprobs: Some(logprobs),
        finish_reason: "length".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(body: Value) -> CompletionRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn prompt_shapes_parse_to_the_right_variant() {
        let r = request(json!({"prompt": [[1, 2], [3]], "max_tokens": 0}));
        assert!(matches!(r.prompt, Some(PromptInput::TokenBatch(_))));
        let r = request(json!({"prompt": [1, 2], "max_tokens": 0}));
        assert!(matches!(r.prompt, Some(PromptInput::Tokens(_))));
        let r = request(json!({"prompt": ["a", "b"], "max_tokens": 0}));
        assert!(matches!(r.prompt, Some(PromptInput::Texts(_))));
        let r = request(json!({"prompt": "a", "max_tokens": 0}));
        assert!(matches!(r.prompt, Some(PromptInput::Text(_))));
    }
}

//! Request validation: turns a parsed body into checked model inputs, or a 422 that names the
//! field (`tokens[1][7]`), the rule and the offending value. Pure functions, no I/O.

use exactscore_api::{KldRequest, ReturnOptions, ScoreRequest, TextInput, TokensInput};
use serde_json::{json, Value};

use super::error::{preview, ApiError};
use crate::tokenizer::TextTokenizer;

/// Largest `top_k`.
pub const MAX_TOP_K: usize = 20;
/// Sequences in one request: bounds the work a single request can pin in the queue.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 1024;

/// What validation needs to know about the model and the server.
pub struct Rules<'a> {
    pub vocab_size: usize,
    pub max_input_tokens: usize,
    pub tokenizer: &'a TextTokenizer,
}

/// A request ready for the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidScore {
    pub sequences: Vec<Vec<u32>>,
    pub top_k: usize,
    pub options: ReturnOptions,
}

pub fn score_request(req: ScoreRequest, rules: &Rules<'_>) -> Result<ValidScore, ApiError> {
    let top_k = match req.top_k {
        None => 0,
        Some(k) if (0..=MAX_TOP_K as i64).contains(&k) => k as usize,
        Some(k) => {
            return Err(ApiError::validation(
                "top_k",
                "range",
                k,
                format!("top_k must be between 0 and {MAX_TOP_K}, got {k}"),
            ))
        }
    };
    Ok(ValidScore {
        sequences: sequences(req.tokens, req.text, req.add_special_tokens, rules)?,
        top_k,
        options: req.return_options.unwrap_or_default(),
    })
}

/// A `/kld` request ready for the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidKld {
    pub sequences: Vec<Vec<u32>>,
    pub per_token: bool,
}

pub fn kld_request(req: KldRequest, rules: &Rules<'_>) -> Result<ValidKld, ApiError> {
    Ok(ValidKld {
        sequences: sequences(req.tokens, req.text, req.add_special_tokens, rules)?,
        per_token: req.per_token.unwrap_or(true),
    })
}

/// The token sequences of a request that gives exactly one of `tokens` and `text`.
fn sequences(
    tokens: Option<TokensInput>,
    text: Option<TextInput>,
    add_special_tokens: Option<bool>,
    rules: &Rules<'_>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    match (tokens, text) {
        (Some(_), Some(text)) => Err(ApiError::validation(
            "text",
            "mutually_exclusive",
            preview(&json!(text)),
            "give either `tokens` or `text`, not both",
        )),
        (None, None) => Err(ApiError::validation(
            "tokens",
            "required_one_of",
            Value::Null,
            "give one of `tokens` (token ids) or `text`",
        )),
        (Some(tokens), None) => token_sequences(tokens, rules),
        (None, Some(text)) => text_sequences(text, add_special_tokens.unwrap_or(true), rules),
    }
}

fn token_sequences(tokens: TokensInput, rules: &Rules<'_>) -> Result<Vec<Vec<u32>>, ApiError> {
    let named: Vec<(String, Vec<i64>)> = match tokens {
        TokensInput::Single(ids) => vec![("tokens".into(), ids)],
        TokensInput::Batch(batch) => {
            check_batch_len("tokens", batch.len())?;
            batch
                .into_iter()
                .enumerate()
                .map(|(i, ids)| (format!("tokens[{i}]"), ids))
                .collect()
        }
    };
    named
        .into_iter()
        .map(|(field, ids)| {
            let ids = token_ids(&field, &ids, rules.vocab_size)?;
            check_length(&field, &ids, rules)?;
            Ok(ids)
        })
        .collect()
}

fn text_sequences(
    text: TextInput,
    add_special_tokens: bool,
    rules: &Rules<'_>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let named: Vec<(String, String)> = match text {
        TextInput::Single(s) => vec![("text".into(), s)],
        TextInput::Batch(batch) => {
            check_batch_len("text", batch.len())?;
            batch
                .into_iter()
                .enumerate()
                .map(|(i, s)| (format!("text[{i}]"), s))
                .collect()
        }
    };
    named
        .into_iter()
        .map(|(field, text)| {
            let ids = rules
                .tokenizer
                .encode(&text, add_special_tokens)
                .map_err(|e| {
                    ApiError::validation(
                        &field,
                        "tokenizable",
                        preview(&json!(text)),
                        e.to_string(),
                    )
                })?;
            if ids.is_empty() {
                return Err(ApiError::validation(
                    field,
                    "non_empty",
                    json!(text),
                    "the text has no tokens",
                ));
            }
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= rules.vocab_size) {
                // The tokenizer knows more tokens than the model has rows: a checkpoint defect.
                return Err(ApiError::validation(
                    field,
                    "below_vocab_size",
                    bad,
                    format!(
                        "the tokenizer produced id {bad}, outside the model's vocabulary of {}",
                        rules.vocab_size
                    ),
                ));
            }
            check_length(&field, &ids, rules)?;
            Ok(ids)
        })
        .collect()
}

pub(crate) fn check_batch_len(field: &str, n: usize) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::validation(
            field,
            "non_empty",
            json!([]),
            format!("`{field}` is an empty list"),
        ));
    }
    if n > MAX_SEQUENCES_PER_REQUEST {
        return Err(ApiError::validation(
            field,
            "max_sequences",
            n,
            format!("{n} sequences in one request; at most {MAX_SEQUENCES_PER_REQUEST}"),
        ));
    }
    Ok(())
}

pub(crate) fn check_length(field: &str, ids: &[u32], rules: &Rules<'_>) -> Result<(), ApiError> {
    if ids.len() > rules.max_input_tokens {
        return Err(ApiError::validation(
            field,
            "max_input_tokens",
            ids.len(),
            format!(
                "sequence of {} tokens exceeds max_input_tokens = {}",
                ids.len(),
                rules.max_input_tokens
            ),
        ));
    }
    Ok(())
}

/// Checks ids against the vocabulary; `field` names the list, errors name the element.
pub fn token_ids(field: &str, ids: &[i64], vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::validation(
            field,
            "non_empty",
            json!([]),
            format!("`{field}` has no token ids"),
        ));
    }
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            let at = format!("{field}[{i}]");
            if id < 0 {
                Err(ApiError::validation(
                    at,
                    "non_negative",
                    id,
                    format!("token id {id} is negative"),
                ))
            } else if id as u64 >= vocab_size as u64 {
                Err(ApiError::validation(
                    at,
                    "below_vocab_size",
                    id,
                    format!("token id {id} is outside the vocabulary (0..{vocab_size})"),
                ))
            } else {
                Ok(id as u32)
            }
        })
        .collect()
}

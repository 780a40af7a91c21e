//! Request validation: turns a parsed body into checked model inputs, or a 422 that names the
//! field (`tokens[1][7]`), the rule and the offending value. Pure functions, no I/O.

use exactscore_api::{
    AttributeInput, AttributeSelection, DiffRequest, KldRequest, ReturnOptions, ScoreRequest,
    TextInput, TokensInput,
};
use serde_json::{json, Value};

use super::budget::{Budget, NUMBER_BYTES, SEQUENCE_BYTES};
use super::error::{preview, ApiError};
use crate::model::decoder::split_module_name;
use crate::model::DiffOptions;
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
    /// The compute and answer-size limits.
    pub budget: &'a Budget,
}

/// The member that holds a request's sequences.
fn sequences_field(text: bool) -> &'static str {
    if text {
        "text"
    } else {
        "tokens"
    }
}

/// Positions and sequences of a request.
fn counts(sequences: &[Vec<u32>]) -> (u64, u64) {
    let positions = sequences.iter().map(|s| s.len() as u64).sum();
    (positions, sequences.len() as u64)
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
    let field = sequences_field(req.text.is_some());
    let valid = ValidScore {
        sequences: sequences(req.tokens, req.text, req.add_special_tokens, rules)?,
        top_k,
        options: req.return_options.unwrap_or_default(),
    };
    let budget = rules.budget;
    budget.check_cost(
        field,
        budget.score_cost(&valid.sequences),
        "tokens × (layers + 1)",
    )?;
    budget.check_response(&score_response_parts(&valid, field, budget))?;
    Ok(valid)
}

/// What makes a `/score` answer large, by the member that asks for it (an upper estimate).
fn score_response_parts<'f>(
    valid: &ValidScore,
    field: &'f str,
    budget: &Budget,
) -> Vec<(&'f str, u64)> {
    let (positions, sequences) = counts(&valid.sequences);
    let o = &valid.options;
    let on = |flag: bool, per_position: u64| if flag { positions * per_position } else { 0 };
    // {"id":…,"logprob":…,"token":…},
    let entry = 20
        + budget.id_digits as u64
        + NUMBER_BYTES
        + on(o.token_strings, 1).min(1) * (10 + budget.max_token_json as u64);
    vec![
        (
            field,
            positions * budget.id_bytes() + sequences * SEQUENCE_BYTES,
        ),
        ("return.token_logprobs", on(o.token_logprobs, NUMBER_BYTES)),
        ("return.greedy", on(o.greedy, 6)),
        (
            "return.token_strings",
            on(o.token_strings, budget.string_bytes()),
        ),
        ("top_k", on(o.top_k, valid.top_k as u64 * entry)),
    ]
}

/// A `/kld` request ready for the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidKld {
    pub sequences: Vec<Vec<u32>>,
    pub per_token: bool,
}

/// Numbers per position of a `/kld` answer with `per_token` (its ten per-token lists).
const KLD_PER_TOKEN_NUMBERS: u64 = 10;

pub fn kld_request(req: KldRequest, rules: &Rules<'_>) -> Result<ValidKld, ApiError> {
    let field = sequences_field(req.text.is_some());
    let valid = ValidKld {
        sequences: sequences(req.tokens, req.text, req.add_special_tokens, rules)?,
        per_token: req.per_token.unwrap_or(true),
    };
    let budget = rules.budget;
    let cost = budget.kld_cost(&valid.sequences);
    budget.check_cost(field, cost, "tokens × both models' (layers + 1)")?;
    let (positions, sequences) = counts(&valid.sequences);
    let per_token = if valid.per_token {
        positions * KLD_PER_TOKEN_NUMBERS * NUMBER_BYTES
    } else {
        0
    };
    budget.check_response(&[
        (
            field,
            positions * budget.id_bytes() + sequences * SEQUENCE_BYTES,
        ),
        ("per_token", per_token),
    ])?;
    Ok(valid)
}

/// A `/diff` request ready for the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidDiff {
    pub sequences: Vec<Vec<u32>>,
    pub per_position: bool,
    pub options: DiffOptions,
    /// The served format of every module in `options.attribute`, in its order.
    pub formats: Vec<String>,
}

/// `/diff`'s request against a served model of `layers` decoder layers whose attributable
/// modules are `modules` ((name, served format), see `DiffSupport::Ready`).
pub fn diff_request(
    req: DiffRequest,
    rules: &Rules<'_>,
    layers: usize,
    modules: &[(String, String)],
) -> Result<ValidDiff, ApiError> {
    let reference_until = match req.reference_until {
        None => None,
        Some(n) if (0..layers as i64).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::validation(
                "reference_until",
                "range",
                n,
                format!(
                    "reference_until must be a decoder layer of the served model, 0..={}, got {n}",
                    layers.saturating_sub(1)
                ),
            ))
        }
    };
    let chosen = match req.attribute {
        None | Some(AttributeInput::All(false)) => Vec::new(),
        Some(AttributeInput::All(true)) => {
            chosen_modules(&AttributeSelection::default(), layers, modules)?
        }
        Some(AttributeInput::Select(selection)) => chosen_modules(&selection, layers, modules)?,
    };
    if !chosen.is_empty() && reference_until.is_some() {
        return Err(ApiError::validation(
            "attribute",
            "mutually_exclusive",
            true,
            "attribution measures each module against the full divergence; leave out \
             `reference_until` with `attribute`",
        ));
    }
    let (attribute, formats) = chosen.into_iter().unzip();
    let field = sequences_field(req.text.is_some());
    let valid = ValidDiff {
        sequences: sequences(req.tokens, req.text, req.add_special_tokens, rules)?,
        per_position: req.per_position.unwrap_or(false),
        options: DiffOptions {
            reference_until,
            attribute,
        },
        formats,
    };
    let budget = rules.budget;
    let (base, attribution) = budget.diff_cost(&valid.sequences, &valid.options.attribute);
    budget.check_cost(field, base, "tokens × both models' (layers + 1)")?;
    budget.check_cost(
        "attribute",
        base + attribution,
        &format!(
            "{base} for both models + {attribution} for {} attributed modules",
            valid.options.attribute.len()
        ),
    )?;
    let (positions, sequences) = counts(&valid.sequences);
    let per_layer = 2 * NUMBER_BYTES + 200;
    let per_position = if valid.per_position {
        positions * layers as u64 * 2 * NUMBER_BYTES
    } else {
        0
    };
    budget.check_response(&[
        (
            field,
            positions * budget.id_bytes()
                + sequences * (SEQUENCE_BYTES + layers as u64 * per_layer),
        ),
        ("per_position", per_position),
        ("attribute", valid.options.attribute.len() as u64 * 300),
    ])?;
    Ok(valid)
}

/// The modules `selection` chooses among `modules`, in their order; none is an error.
fn chosen_modules(
    selection: &AttributeSelection,
    layers: usize,
    modules: &[(String, String)],
) -> Result<Vec<(String, String)>, ApiError> {
    if modules.is_empty() {
        return Err(ApiError::validation(
            "attribute",
            "quantized_module",
            true,
            "no module of the served model differs in format from the reference's: there is \
             nothing to attribute",
        ));
    }
    let range = match selection.layers.as_deref() {
        None => None,
        Some(&[first, last]) if 0 <= first && first <= last && last < layers as i64 => {
            Some(first as usize..=last as usize)
        }
        Some(other) => {
            return Err(ApiError::validation(
                "attribute.layers",
                "range",
                json!(other),
                format!(
                    "attribute.layers is [first, last] with 0 <= first <= last <= {}",
                    layers.saturating_sub(1)
                ),
            ))
        }
    };
    let chosen: Vec<(String, String)> = modules
        .iter()
        .filter(|(name, _)| {
            let in_layers = range.as_ref().is_none_or(|r| {
                split_module_name(name).is_some_and(|(layer, _)| r.contains(&layer))
            });
            in_layers
                && selection
                    .pattern
                    .as_deref()
                    .is_none_or(|p| glob_match(p, name))
        })
        .cloned()
        .collect();
    if chosen.is_empty() {
        let (field, value) = match &selection.pattern {
            Some(pattern) => ("attribute.pattern", json!(pattern)),
            None => ("attribute.layers", json!(selection.layers)),
        };
        return Err(ApiError::validation(
            field,
            "no_module_matches",
            preview(&value),
            format!(
                "no quantized module matches (they are named like `{}`)",
                modules[0].0
            ),
        ));
    }
    Ok(chosen)
}

/// Whether `name` matches `pattern` as a whole, `*` matching any run of characters.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Greedy with backtracking to the last `*`: linear in practice, O(|p|·|n|) at worst.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && p[i] != '*' && p[i] == n[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_names() {
        let name = "model.layers.17.mlp.down_proj";
        for (pattern, expected) in [
            ("*.mlp.down_proj", true),
            ("model.layers.17.*", true),
            ("model.layers.1.*", false),
            ("*down*", true),
            ("*", true),
            ("down_proj", false),
            ("model.layers.17.mlp.down_proj", true),
            ("model.*.mlp.*_proj", true),
            ("", false),
        ] {
            assert_eq!(glob_match(pattern, name), expected, "{pattern}");
        }
        assert!(glob_match("lm_head", "lm_head"));
    }
}

/// A `/reference` request ready for the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidReference {
    pub sequences: Vec<Vec<u32>>,
    pub k: usize,
}

pub fn reference_request(
    req: exactscore_api::ReferenceRequest,
    rules: &Rules<'_>,
) -> Result<ValidReference, ApiError> {
    let max = exactscore_api::MAX_STORED_K.min(rules.vocab_size);
    let k = match req.k {
        k if (1..=max as i64).contains(&k) => k as usize,
        k => {
            return Err(ApiError::validation(
                "k",
                "range",
                k,
                format!("k must be between 1 and {max} (the vocabulary or 4096), got {k}"),
            ))
        }
    };
    let valid = ValidReference {
        sequences: sequences(Some(req.tokens), None, None, rules)?,
        k,
    };
    let budget = rules.budget;
    budget.check_cost(
        "tokens",
        budget.score_cost(&valid.sequences),
        "tokens × (layers + 1)",
    )?;
    let (positions, sequences) = counts(&valid.sequences);
    budget.check_response(&[
        ("tokens", sequences * SEQUENCE_BYTES),
        (
            "k",
            positions * (k as u64 + 1) * (budget.id_bytes() + NUMBER_BYTES),
        ),
    ])?;
    Ok(valid)
}

/// A `/kld/stored` request ready for the queue.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidStoredKld {
    pub sequences: Vec<(Vec<u32>, crate::model::stored_kld::StoredSequence)>,
    pub per_token: bool,
}

pub fn stored_kld_request(
    req: exactscore_api::StoredKldRequest,
    rules: &Rules<'_>,
) -> Result<ValidStoredKld, ApiError> {
    let tokens = TokensInput::Batch(
        req.sequences
            .iter()
            .map(|s| s.tokens.iter().map(|&t| i64::from(t)).collect())
            .collect(),
    );
    let checked = sequences(Some(tokens), None, None, rules)?;
    let mut out = Vec::with_capacity(checked.len());
    for (i, (tokens, input)) in checked.into_iter().zip(req.sequences).enumerate() {
        let stored = stored_rows(i, tokens.len(), input.reference, rules.vocab_size)?;
        out.push((tokens, stored));
    }
    let seqs: Vec<Vec<u32>> = out.iter().map(|(t, _)| t.clone()).collect();
    let budget = rules.budget;
    budget.check_cost(
        "sequences",
        budget.score_cost(&seqs),
        "tokens × (layers + 1)",
    )?;
    let (positions, sequences) = counts(&seqs);
    let per_token = req.per_token.unwrap_or(true);
    budget.check_response(&[
        ("sequences", sequences * SEQUENCE_BYTES),
        (
            "per_token",
            u64::from(per_token) * positions * 6 * NUMBER_BYTES,
        ),
    ])?;
    Ok(ValidStoredKld {
        sequences: out,
        per_token,
    })
}

/// One sequence's stored rows, checked: a row per position that predicts a token, `k` distinct
/// in-vocabulary ids each, log-probabilities that are finite, ≤ 0 and best first.
fn stored_rows(
    index: usize,
    tokens: usize,
    rows: exactscore_api::StoredRows,
    vocab: usize,
) -> Result<crate::model::stored_kld::StoredSequence, ApiError> {
    let field = |member: &str| format!("sequences[{index}].reference.{member}");
    let k = rows.k;
    let positions = rows.tail_logmass.len();
    let predicting = tokens.saturating_sub(1);
    if rows.start + positions > predicting {
        return Err(ApiError::validation(
            field("tail_logmass"),
            "length",
            positions,
            format!(
                "rows from position {} on: {positions} rows pass the sequence's {predicting} positions that predict a token",
                rows.start
            ),
        ));
    }
    if k == 0 || k > vocab {
        return Err(ApiError::validation(
            field("k"),
            "range",
            k,
            format!("k must be between 1 and the vocabulary ({vocab}), got {k}"),
        ));
    }
    for (member, len, want) in [
        ("ids", rows.ids.len(), positions * k),
        ("logprobs", rows.logprobs.len(), positions * k),
    ] {
        if len != want {
            return Err(ApiError::validation(
                field(member),
                "length",
                len,
                format!("{member} must hold {want} entries ({positions} positions × k = {k} for ids and logprobs), got {len}"),
            ));
        }
    }
    for (row, (ids, logprobs)) in rows.ids.chunks(k).zip(rows.logprobs.chunks(k)).enumerate() {
        let at = |j: usize| row * k + j;
        let mut seen = std::collections::HashSet::with_capacity(k);
        for (j, &id) in ids.iter().enumerate() {
            if id as usize >= vocab || !seen.insert(id) {
                return Err(ApiError::validation(
                    format!("{}[{}]", field("ids"), at(j)),
                    "stored_id",
                    id,
                    format!("stored ids must be distinct within a row and below the vocabulary ({vocab})"),
                ));
            }
        }
        for (j, pair) in logprobs.windows(2).enumerate() {
            if pair[1] > pair[0] {
                return Err(ApiError::validation(
                    format!("{}[{}]", field("logprobs"), at(j + 1)),
                    "descending",
                    pair[1],
                    "a row's stored log-probabilities must be best first",
                ));
            }
        }
        if let Some(j) = logprobs.iter().position(|v| !(v.is_finite() && *v <= 0.0)) {
            return Err(ApiError::validation(
                format!("{}[{}]", field("logprobs"), at(j)),
                "log_probability",
                Value::from(logprobs[j].to_string()),
                "a stored log-probability must be finite and at most 0",
            ));
        }
    }
    let mut tail_logmass = Vec::with_capacity(positions);
    for (i, v) in rows.tail_logmass.iter().enumerate() {
        match v {
            None => tail_logmass.push(f32::NEG_INFINITY),
            Some(v) if v.is_finite() && *v <= 0.0 => tail_logmass.push(*v),
            Some(v) => {
                return Err(ApiError::validation(
                    format!("{}[{i}]", field("tail_logmass")),
                    "log_probability",
                    Value::from(v.to_string()),
                    "a tail log-mass must be finite and at most 0 (null for none)",
                ))
            }
        }
    }
    Ok(crate::model::stored_kld::StoredSequence {
        start: rows.start,
        k,
        ids: rows.ids,
        logprobs: rows.logprobs,
        tail_logmass,
    })
}

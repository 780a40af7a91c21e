//! What a request will cost, known before any work: its compute in the server's own unit and
//! an upper estimate of its answer's size. Both are checked at admission (a 422 naming the
//! field, the rule, the cost and the limit), so one request can neither hold the engine for
//! minutes nor build an answer hundreds of times its body.
//!
//! The compute unit is the **token-layer**: one token through one decoder layer of one model.
//! A token through a model's final norm and lm_head counts as one more. So `/score` of `T`
//! tokens on an `L`-layer model costs `T·(L + 1)`; `/kld` adds the reference's `T·(Lr + 1)`;
//! `/diff` runs both models (`2·T·(L + 1)`) and each attributed module of decoder layer `i`
//! re-runs the reference from that layer on (`T·(L − i + 1)`; the lm_head: `T`), after one
//! reference pass up to the last attributed layer (`T·(last + 1)`).

use serde_json::json;

use super::error::ApiError;
use crate::model::decoder::split_module_name;

/// `--max-request-cost` when not given: this many full batches (`--max-batch-tokens` tokens
/// through the whole served model), which admits any `/score` or `/kld` the batch budget
/// does and an attribution of every module of an 8B-shaped model over about 2000 tokens.
pub const DEFAULT_COST_BATCHES: u64 = 16;

/// Default of `--max-response-bytes` (128 MiB).
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 128 << 20;

/// What admission checks against, from the models and the flags.
#[derive(Debug, Clone)]
pub struct Budget {
    pub served_layers: usize,
    /// Decoder layers of the reference model, when one is loaded.
    pub reference_layers: Option<usize>,
    /// Largest cost admitted, in token-layers.
    pub max_request_cost: u64,
    /// Largest estimated answer admitted, in bytes.
    pub max_response_bytes: u64,
    /// Longest JSON string (quotes and escapes included) of one decoded token.
    pub max_token_json: usize,
    /// Decimal digits of the largest token id.
    pub id_digits: usize,
}

impl Budget {
    /// The default cost limit of a model of `layers` decoder layers at `max_batch_tokens`.
    pub fn default_cost(layers: usize, max_batch_tokens: usize) -> u64 {
        DEFAULT_COST_BATCHES * max_batch_tokens as u64 * (layers as u64 + 1)
    }

    fn tokens(sequences: &[Vec<u32>]) -> u64 {
        sequences.iter().map(|s| s.len() as u64).sum()
    }

    /// `/score` and `/v1/completions`.
    pub fn score_cost(&self, sequences: &[Vec<u32>]) -> u64 {
        Self::tokens(sequences) * (self.served_layers as u64 + 1)
    }

    /// `/kld`: both models.
    pub fn kld_cost(&self, sequences: &[Vec<u32>]) -> u64 {
        let reference = self.reference_layers.unwrap_or(self.served_layers) as u64 + 1;
        Self::tokens(sequences) * (self.served_layers as u64 + 1 + reference)
    }

    /// `/diff` without attribution, and what attributing `modules` adds.
    pub fn diff_cost(&self, sequences: &[Vec<u32>], modules: &[String]) -> (u64, u64) {
        let t = Self::tokens(sequences);
        let layers = self.served_layers as u64;
        let base = 2 * t * (layers + 1);
        if modules.is_empty() {
            return (base, 0);
        }
        let mut units = 0;
        let mut last = None;
        for name in modules {
            match split_module_name(name) {
                Some((i, _)) => {
                    units += layers.saturating_sub(i as u64) + 1;
                    last = last.max(Some(i as u64));
                }
                None => units += 1,
            }
        }
        units += last.map_or(0, |l| l + 1);
        (base, t * units)
    }

    /// A 422 when `cost` is over the limit; `field` is what to send less of.
    pub fn check_cost(&self, field: &str, cost: u64, what: &str) -> Result<(), ApiError> {
        if cost <= self.max_request_cost {
            return Ok(());
        }
        Err(ApiError::validation(
            field,
            "max_request_cost",
            json!({"cost": cost, "limit": self.max_request_cost}),
            format!(
                "this request costs {cost} token-layers ({what}); the limit is {} \
                 (--max-request-cost): send fewer tokens{}",
                self.max_request_cost,
                if field == "attribute" {
                    " or attribute fewer modules"
                } else {
                    " or split the request"
                }
            ),
        ))
    }

    /// A 422 when the answer's estimate is over the limit. `parts` are (field, bytes) of what
    /// makes the answer large; the error names the largest.
    pub fn check_response(&self, parts: &[(&str, u64)]) -> Result<(), ApiError> {
        let total: u64 = parts.iter().map(|(_, b)| b).sum();
        if total <= self.max_response_bytes {
            return Ok(());
        }
        let (field, _) = parts
            .iter()
            .max_by_key(|(_, b)| *b)
            .copied()
            .unwrap_or(("body", 0));
        Err(ApiError::validation(
            field,
            "max_response_bytes",
            json!({"estimated_bytes": total, "limit": self.max_response_bytes}),
            format!(
                "the answer would be about {total} bytes; the limit is {} \
                 (--max-response-bytes); `{field}` makes up most of it: ask for less of it or \
                 split the request",
                self.max_response_bytes
            ),
        ))
    }

    /// Bytes of one token id in a JSON list (with its comma).
    pub fn id_bytes(&self) -> u64 {
        self.id_digits as u64 + 1
    }

    /// Bytes of one decoded token in a JSON list (with its comma).
    pub fn string_bytes(&self) -> u64 {
        self.max_token_json as u64 + 1
    }
}

/// Upper bound of one f32 or f64 in JSON with its comma (`-1.2345678901234567e-123,`).
pub const NUMBER_BYTES: u64 = 25;
/// Per sequence: its member names, sums and usage (an over-estimate).
pub const SEQUENCE_BYTES: u64 = 512;

/// The longest JSON string of any single decoded token of a vocabulary: `decode(id)` for
/// every id, serialized as the answer would.
pub fn max_token_json(vocab_size: usize, decode: impl Fn(u32) -> Option<String>) -> usize {
    (0..vocab_size as u32)
        .filter_map(decode)
        .map(|s| serde_json::to_string(&s).map_or(0, |j| j.len()))
        .max()
        .unwrap_or(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Budget {
        Budget {
            served_layers: 2,
            reference_layers: Some(2),
            max_request_cost: 1000,
            max_response_bytes: 1000,
            max_token_json: 10,
            id_digits: 4,
        }
    }

    #[test]
    fn costs_count_token_layers() {
        let b = budget();
        let seqs = vec![vec![1u32; 10], vec![2; 5]];
        assert_eq!(b.score_cost(&seqs), 15 * 3);
        assert_eq!(b.kld_cost(&seqs), 15 * 6);
        assert_eq!(b.diff_cost(&seqs, &[]), (15 * 6, 0));
        let modules = vec![
            "model.layers.0.mlp.down_proj".to_string(),
            "model.layers.1.self_attn.q_proj".to_string(),
            "lm_head".to_string(),
        ];
        // layer 0: 2 layers + head; layer 1: 1 + head; lm_head: 1; prefix up to layer 1: 2.
        assert_eq!(b.diff_cost(&seqs, &modules), (15 * 6, 15 * (3 + 2 + 1 + 2)));
    }

    #[test]
    fn limits_name_the_field_the_rule_and_both_numbers() {
        let b = budget();
        assert!(b.check_cost("tokens", 1000, "x").is_ok());
        let ApiError::Validation {
            field, rule, value, ..
        } = b.check_cost("attribute", 1001, "x").unwrap_err()
        else {
            panic!()
        };
        assert_eq!((field.as_str(), rule), ("attribute", "max_request_cost"));
        assert_eq!(value, json!({"cost": 1001, "limit": 1000}));
        let ApiError::Validation { field, rule, .. } = b
            .check_response(&[("tokens", 100), ("top_k", 950)])
            .unwrap_err()
        else {
            panic!()
        };
        assert_eq!((field.as_str(), rule), ("top_k", "max_response_bytes"));
    }
}

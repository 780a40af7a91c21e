//! KL-divergence of the served model's next-token distribution from a reference model's (the
//! unquantized original), computed where both full distributions are: per row, from the two
//! models' logits, only a few numbers per token leave the device.

use candle_core::{Result, Tensor};

use super::decoder::{lm_head_rows, Model};
use super::scoring::log_sum_exp;

/// One position that has a next token: how the served model's distribution differs from the
/// reference's there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenKld {
    /// KL(reference ‖ model) = Σ_v p_ref(v) · (log p_ref(v) − log p_model(v)), in nats, from the
    /// f32 log-softmax rows of both models, accumulated in f64.
    pub kld: f64,
    /// The served model's log p(next token).
    pub logprob: f32,
    /// The reference model's log p(next token).
    pub reference_logprob: f32,
    /// Whether both models' most likely token (lowest id on ties) is the same.
    pub same_top: bool,
}

/// Per-token divergences of one sequence of `n` tokens: `tokens[i]` is about the distribution
/// after token `i` (predicting token `i + 1`), so there are `n − 1` of them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SequenceKld {
    pub tokens: Vec<TokenKld>,
}

/// Scores every next-token distribution of `sequences` under both models. The reference may
/// live on another device: its logits are brought to the served model's, chunk by chunk.
pub fn kld_batch(
    model: &Model,
    reference: &Model,
    sequences: &[&[u32]],
) -> Result<Vec<SequenceKld>> {
    let hidden = model.hidden_states(sequences)?;
    let reference_hidden = reference.hidden_states(sequences)?;
    let mut offset = 0;
    let mut out = Vec::with_capacity(sequences.len());
    for tokens in sequences {
        // The last position predicts nothing that is known: its rows are never computed.
        let rows = tokens.len().saturating_sub(1);
        let mut seq = SequenceKld {
            tokens: Vec::with_capacity(rows),
        };
        let chunk = lm_head_rows(model.config().vocab_size);
        for start in (0..rows).step_by(chunk) {
            let len = chunk.min(rows - start);
            let logits = model.logits(&hidden.narrow(0, offset + start, len)?)?;
            let reference_logits =
                reference.logits(&reference_hidden.narrow(0, offset + start, len)?)?;
            let targets = &tokens[start + 1..start + 1 + len];
            seq.tokens
                .extend(kld_logits(&reference_logits, &logits, targets)?);
        }
        offset += tokens.len();
        out.push(seq);
    }
    Ok(out)
}

/// Per-row divergence of `logits` from `reference_logits` (both `[rows, vocab]`, any float
/// dtype, scored in f32). With the fused kernel on a GPU; row by row in f64 on the CPU
/// ([`kld_row`]).
pub fn kld_logits(
    reference_logits: &Tensor,
    logits: &Tensor,
    targets: &[u32],
) -> Result<Vec<TokenKld>> {
    if reference_logits.dims() != logits.dims() {
        candle_core::bail!(
            "reference logits {:?} and model logits {:?} differ in shape",
            reference_logits.dims(),
            logits.dims()
        );
    }
    crate::ops::kld_rows(reference_logits, logits, targets)
}

/// The divergence at one position, in f64 from f32 logits: the CPU reference of the kernel.
pub fn kld_row(reference: &[f32], model: &[f32], target: u32) -> TokenKld {
    let (reference_top, reference_lse) = argmax_and_lse(reference);
    let (top, lse) = argmax_and_lse(model);
    let kld = reference
        .iter()
        .zip(model)
        .map(|(&r, &m)| {
            let log_p_ref = r as f64 - reference_lse;
            log_p_ref.exp() * (log_p_ref - (m as f64 - lse))
        })
        .sum();
    let t = target as usize;
    TokenKld {
        kld,
        logprob: (model[t] as f64 - lse) as f32,
        reference_logprob: (reference[t] as f64 - reference_lse) as f32,
        same_top: top == reference_top,
    }
}

/// The index of the largest logit (lowest on ties) and log Σ exp(logits), in f64.
fn argmax_and_lse(logits: &[f32]) -> (usize, f64) {
    let mut top = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[top] {
            top = i;
        }
    }
    (top, log_sum_exp(logits, logits[top]))
}

impl SequenceKld {
    /// The first position whose divergence or log-probabilities are NaN or infinite (a NaN or
    /// an infinity in either model's logits makes its log-sum-exp, and so all three, so).
    pub fn first_non_finite(&self) -> Option<usize> {
        self.tokens.iter().position(|t| {
            !(t.kld.is_finite() && t.logprob.is_finite() && t.reference_logprob.is_finite())
        })
    }

    pub fn num_scored(&self) -> usize {
        self.tokens.len()
    }

    pub fn sum_kld(&self) -> f64 {
        self.tokens.iter().map(|t| t.kld).sum()
    }

    /// Σ −log p(next token) of the served model, in f64.
    pub fn sum_nll(&self) -> f64 {
        self.tokens.iter().map(|t| -(t.logprob as f64)).sum()
    }

    /// Σ −log p(next token) of the reference model, in f64.
    pub fn reference_sum_nll(&self) -> f64 {
        self.tokens
            .iter()
            .map(|t| -(t.reference_logprob as f64))
            .sum()
    }

    pub fn same_top_count(&self) -> usize {
        self.tokens.iter().filter(|t| t.same_top).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_rows_have_exactly_zero_divergence() {
        let row = [0.3f32, -1.5, 2.25, 0.0, 7.0];
        let k = kld_row(&row, &row, 2);
        assert_eq!(k.kld, 0.0);
        assert!(k.same_top);
        assert_eq!(k.logprob, k.reference_logprob);
    }

    #[test]
    fn divergence_matches_the_closed_form_of_two_distributions() {
        // p = softmax(ln [0.5, 0.25, 0.25]), q = softmax(ln [0.25, 0.5, 0.25]).
        let p = [0.5f32.ln(), 0.25f32.ln(), 0.25f32.ln()];
        let q = [0.25f32.ln(), 0.5f32.ln(), 0.25f32.ln()];
        let k = kld_row(&p, &q, 1);
        let expect = 0.5 * (0.5f64 / 0.25).ln() + 0.25 * (0.25f64 / 0.5).ln();
        assert!((k.kld - expect).abs() < 1e-7, "{} vs {expect}", k.kld);
        assert!(!k.same_top);
        assert!((k.logprob as f64 - 0.5f64.ln()).abs() < 1e-6);
        assert!((k.reference_logprob as f64 - 0.25f64.ln()).abs() < 1e-6);
    }

    #[test]
    fn a_non_finite_logit_in_either_model_is_found_at_its_position() {
        let row = [0.3f32, -1.5, 2.25];
        let mut bad = row;
        bad[1] = f32::NAN;
        for (reference, model) in [(row, bad), (bad, row), ([0.0, f32::INFINITY, 1.0], row)] {
            let seq = SequenceKld {
                tokens: vec![kld_row(&row, &row, 0), kld_row(&reference, &model, 2)],
            };
            assert_eq!(seq.first_non_finite(), Some(1), "{reference:?} {model:?}");
        }
        let seq = SequenceKld {
            tokens: vec![kld_row(&row, &row, 0)],
        };
        assert_eq!(seq.first_non_finite(), None);
    }

    #[test]
    fn ties_pick_the_lowest_id_in_both_models() {
        let k = kld_row(&[1.0, 3.0, 3.0], &[3.0, 1.0, 3.0], 0);
        assert!(!k.same_top);
        let k = kld_row(&[1.0, 3.0, 3.0], &[1.0, 3.0, 3.0 - 1e-6], 0);
        assert!(k.same_top);
    }
}

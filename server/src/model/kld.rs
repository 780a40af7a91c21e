//! KL-divergence of the served model's next-token distribution from a reference model's (the
//! unquantized original), computed where both full distributions are: per row, from the two
//! models' logits, only a few numbers per token leave the device.

use std::ops::Range;

use candle_core::{Result, Tensor};

use super::decoder::{lm_head_rows, Model};
use super::scoring::sum;
pub use crate::ops::{kld_row, top_k_agreement, TokenKld, TOP_K_AGREEMENT_MAX};

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
    kld_hidden(
        |rows| reference.logits(&reference_hidden.narrow(0, rows.start, rows.len())?),
        |rows| model.logits(&hidden.narrow(0, rows.start, rows.len())?),
        sequences,
        model.config().vocab_size,
    )
}

/// The rows whose logits a divergence of `sequences` needs, as ranges of the batch's rows
/// (the sequences concatenated), [`lm_head_rows`] of a `vocab`-token head at a time. The last
/// position of a sequence predicts nothing that is known: its row is never computed.
pub fn logit_chunks(sequences: &[&[u32]], vocab: usize) -> Vec<Range<usize>> {
    let chunk = lm_head_rows(vocab);
    let mut offset = 0;
    let mut out = Vec::new();
    for tokens in sequences {
        let rows = tokens.len().saturating_sub(1);
        out.extend((0..rows).step_by(chunk).map(|start| {
            let len = chunk.min(rows - start);
            offset + start..offset + start + len
        }));
        offset += tokens.len();
    }
    out
}

/// The divergences of `sequences`, each side's logits (over `vocab` tokens) of a range of the
/// batch's rows given by its `logits`, the ranges of [`logit_chunks`] in order. The one chunk
/// loop of every divergence: the model's, `/diff`'s and the pipelined engine's (whose reference
/// side hands its chunks over a channel, hence the error type of the caller's choice).
pub fn kld_hidden<E: From<candle_core::Error>>(
    mut reference_logits: impl FnMut(Range<usize>) -> std::result::Result<Tensor, E>,
    mut logits: impl FnMut(Range<usize>) -> std::result::Result<Tensor, E>,
    sequences: &[&[u32]],
    vocab: usize,
) -> std::result::Result<Vec<SequenceKld>, E> {
    let mut out: Vec<SequenceKld> = sequences.iter().map(|_| SequenceKld::default()).collect();
    let mut chunks = logit_chunks(sequences, vocab).into_iter().peekable();
    let mut offset = 0;
    for (tokens, seq) in sequences.iter().zip(&mut out) {
        let end = offset + tokens.len();
        while let Some(rows) = chunks.next_if(|rows| rows.start < end) {
            let model_logits = logits(rows.clone())?;
            let reference = reference_logits(rows.clone())?;
            let targets = &tokens[rows.start - offset + 1..rows.end - offset + 1];
            seq.tokens
                .extend(kld_logits(&reference, &model_logits, targets)?);
        }
        offset = end;
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

impl SequenceKld {
    /// The first position whose divergence or log-probabilities are NaN or infinite (a NaN or
    /// an infinity in either model's logits makes its log-sum-exp, and so all three, so).
    pub fn first_non_finite(&self) -> Option<usize> {
        self.tokens.iter().position(|t| {
            !(t.kld.is_finite()
                && t.reverse_kld.is_finite()
                && t.logprob.is_finite()
                && t.reference_logprob.is_finite())
        })
    }

    pub fn num_scored(&self) -> usize {
        self.tokens.len()
    }

    pub fn sum_kld(&self) -> f64 {
        sum(self.tokens.iter().map(|t| t.kld))
    }

    /// Σ −log p(next token) of the served model, in f64.
    pub fn sum_nll(&self) -> f64 {
        sum(self.tokens.iter().map(|t| -(t.logprob as f64)))
    }

    /// Σ −log p(next token) of the reference model, in f64.
    pub fn reference_sum_nll(&self) -> f64 {
        sum(self.tokens.iter().map(|t| -(t.reference_logprob as f64)))
    }

    pub fn same_top_count(&self) -> usize {
        self.tokens.iter().filter(|t| t.same_top).count()
    }

    pub fn sum_reverse_kld(&self) -> f64 {
        sum(self.tokens.iter().map(|t| t.reverse_kld))
    }

    /// Positions whose top-K sets agree, K = 1..=[`TOP_K_AGREEMENT_MAX`].
    pub fn top_k_agreement_counts(&self) -> [usize; TOP_K_AGREEMENT_MAX] {
        std::array::from_fn(|k| {
            self.tokens
                .iter()
                .filter(|t| t.top_k_agreement & (1 << k) != 0)
                .count()
        })
    }

    /// (positions, Σ KLD) in each of [`exactscore_api::CONFIDENCE_BUCKETS`].
    pub fn confidence_buckets(&self) -> Vec<(usize, f64)> {
        let mut buckets = vec![(0, 0.0); exactscore_api::CONFIDENCE_BUCKETS.len()];
        for t in &self.tokens {
            let b = &mut buckets[exactscore_api::confidence_bucket(t.reference_top_p)];
            b.0 += 1;
            b.1 += t.kld;
        }
        buckets
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
    fn reverse_divergence_and_reference_confidence_match_the_closed_form() {
        let (p, q) = ([0.5f64, 0.25, 0.25], [0.25f64, 0.5, 0.25]);
        let logits = |d: [f64; 3]| d.map(|x| x.ln() as f32);
        let k = kld_row(&logits(p), &logits(q), 1);
        let reverse: f64 = (0..3).map(|v| q[v] * (q[v] / p[v]).ln()).sum();
        assert!((k.reverse_kld - reverse).abs() < 1e-7, "{}", k.reverse_kld);
        assert!((k.reference_top_p - 0.5).abs() < 1e-7);
        // An asymmetric pair: the two directions differ.
        let (p, q) = ([0.9f64, 0.05, 0.05], [1.0f64 / 3.0, 1.0 / 3.0, 1.0 / 3.0]);
        let k = kld_row(&logits(p), &logits(q), 0);
        let forward: f64 = (0..3).map(|v| p[v] * (p[v] / q[v]).ln()).sum();
        let reverse: f64 = (0..3).map(|v| q[v] * (q[v] / p[v]).ln()).sum();
        assert!((k.kld - forward).abs() < 1e-7 && (k.reverse_kld - reverse).abs() < 1e-7);
        assert!((forward - reverse).abs() > 1e-2);
        let row = [0.3f32, -1.5, 2.25, 0.0, 7.0];
        assert_eq!(kld_row(&row, &row, 2).reverse_kld, 0.0);
    }

    #[test]
    fn top_k_agreement_compares_sets_not_orders() {
        // Reference order 5 4 3 2 1 0; the model swaps the first two and the fifth and sixth.
        let reference = [0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0];
        let model = [1.0f32, 0.0, 2.0, 3.0, 5.0, 4.0];
        let k = kld_row(&reference, &model, 0);
        // K = 1: 5 vs 4; K = 2, 3, 4: the same sets; K = 5: {5,4,3,2,1} vs {4,5,3,2,0}.
        assert_eq!(k.top_k_agreement, 0b01110);
        assert!(!k.same_top);
        let row = [0.3f32, -1.5, 2.25, 0.0, 7.0, 1.0, 1.0];
        assert_eq!(kld_row(&row, &row, 0).top_k_agreement, 0b11111);
        // Fewer tokens than K: every K covers the whole vocabulary.
        assert_eq!(
            kld_row(&[1.0, 2.0], &[2.0, 1.0], 0).top_k_agreement,
            0b11110
        );
        // Ties go to the lowest id in both: {0, 1} vs {0, 1}, not {0, 2}.
        let k = kld_row(&[3.0, 1.0, 1.0], &[3.0, 1.0, 1.0 - 1e-6], 0);
        assert_eq!(k.top_k_agreement & 0b11, 0b11);
    }

    #[test]
    fn sequence_sums_count_agreements_and_bucket_by_confidence() {
        let token = |kld, mask, p| TokenKld {
            kld,
            reverse_kld: 2.0 * kld,
            logprob: -1.0,
            reference_logprob: -1.0,
            same_top: mask & 1 == 1,
            top_k_agreement: mask,
            reference_top_p: p,
        };
        let s = SequenceKld {
            tokens: vec![
                token(0.5, 0b11111, 0.1),
                token(0.25, 0b00110, 0.3),
                token(0.125, 0b00001, 0.96),
                token(1.0, 0b10000, 1.0),
            ],
        };
        assert_eq!(s.top_k_agreement_counts(), [2, 2, 2, 1, 2]);
        assert_eq!(s.sum_reverse_kld(), 3.75);
        assert_eq!(
            s.confidence_buckets(),
            vec![(1, 0.5), (1, 0.25), (0, 0.0), (0, 0.0), (2, 1.125)]
        );
    }

    #[test]
    fn ties_pick_the_lowest_id_in_both_models() {
        let k = kld_row(&[1.0, 3.0, 3.0], &[3.0, 1.0, 3.0], 0);
        assert!(!k.same_top);
        let k = kld_row(&[1.0, 3.0, 3.0], &[1.0, 3.0, 3.0 - 1e-6], 0);
        assert!(k.same_top);
    }
}

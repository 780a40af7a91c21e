//! One sequence's divergences as `/kld` and `/diff` answer them.

use exactscore_api::{ConfidenceBucket, SequenceDivergence, CONFIDENCE_BUCKETS};

use crate::model::scoring::sum;
use crate::model::SequenceKld;

/// Shapes one sequence's divergences: per-token arrays (position 0 `null`) and their sums.
pub fn sequence_divergence(
    index: usize,
    tokens: Vec<u32>,
    kld: &SequenceKld,
    per_token: bool,
) -> SequenceDivergence {
    let delta_p: Vec<f64> = kld
        .tokens
        .iter()
        .map(|t| (t.logprob as f64).exp() - (t.reference_logprob as f64).exp())
        .collect();
    // Position 0 predicts nothing: every per-token array starts with `null`.
    fn column<T: Copy>(values: impl Iterator<Item = T>) -> Vec<Option<T>> {
        std::iter::once(None).chain(values.map(Some)).collect()
    }
    SequenceDivergence {
        index,
        tokens,
        kld: per_token.then(|| column(kld.tokens.iter().map(|t| t.kld))),
        logprobs: per_token.then(|| column(kld.tokens.iter().map(|t| t.logprob))),
        reference_logprobs: per_token
            .then(|| column(kld.tokens.iter().map(|t| t.reference_logprob))),
        same_top: per_token.then(|| column(kld.tokens.iter().map(|t| t.same_top))),
        delta_p: per_token.then(|| column(delta_p.iter().copied())),
        num_scored: kld.num_scored(),
        sum_kld: kld.sum_kld(),
        sum_nll: kld.sum_nll(),
        reference_sum_nll: kld.reference_sum_nll(),
        same_top_count: kld.same_top_count(),
        sum_delta_p: sum(delta_p.iter().copied()),
        sum_delta_p_squared: sum(delta_p.iter().map(|d| d * d)),
        reverse_kld: per_token.then(|| column(kld.tokens.iter().map(|t| t.reverse_kld))),
        top_k_agreement: per_token.then(|| column(kld.tokens.iter().map(|t| t.top_k_agreement))),
        reference_top_p: per_token.then(|| column(kld.tokens.iter().map(|t| t.reference_top_p))),
        sum_reverse_kld: kld.sum_reverse_kld(),
        top_k_agreement_counts: kld.top_k_agreement_counts().to_vec(),
        confidence_buckets: CONFIDENCE_BUCKETS
            .iter()
            .zip(kld.confidence_buckets())
            .map(|(&(lower, upper), (count, sum_kld))| ConfidenceBucket {
                lower,
                upper,
                count,
                sum_kld,
            })
            .collect(),
    }
}

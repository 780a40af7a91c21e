//! Per-row scoring of f32 logits: log-softmax over the full vocabulary, the log-probability of
//! the actual next token, top-k and argmax, all from the same row so greedy checks are exact.

use candle_core::{Result, Tensor};

/// What one position of a sequence yields.
#[derive(Debug, Clone, PartialEq)]
pub struct RowScore {
    /// log p(next token) where the next token is known (every position but the last).
    pub target_logprob: Option<f32>,
    /// Most likely next token (lowest id on ties) and its log-probability.
    pub argmax: (u32, f32),
    /// The `k` most likely next tokens, best first (empty when k = 0).
    pub top_k: Vec<(u32, f32)>,
}

/// Scores of one sequence of `n` tokens: `rows[i]` is the distribution after token `i`.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceScores {
    pub rows: Vec<RowScore>,
}

impl RowScore {
    /// Whether every number of the row is finite. A NaN or +inf anywhere in the row's logits
    /// makes the log-sum-exp, and so the argmax's log-probability, NaN or infinite; a -inf
    /// logit shows in the target's or a top-k log-probability where it matters.
    pub fn is_finite(&self) -> bool {
        self.argmax.1.is_finite()
            && self.target_logprob.is_none_or(f32::is_finite)
            && self.top_k.iter().all(|(_, lp)| lp.is_finite())
    }
}

impl SequenceScores {
    /// The first position whose row is not finite ([`RowScore::is_finite`]).
    pub fn first_non_finite(&self) -> Option<usize> {
        self.rows.iter().position(|r| !r.is_finite())
    }

    /// log p(token_i | tokens_<i) for i = 1..n.
    pub fn token_logprobs(&self) -> impl Iterator<Item = f32> + '_ {
        self.rows.iter().filter_map(|r| r.target_logprob)
    }

    /// Sum of negative log-likelihoods, accumulated in f64.
    pub fn sum_nll(&self) -> f64 {
        self.token_logprobs().map(|lp| -(lp as f64)).sum()
    }

    pub fn num_scored(&self) -> usize {
        self.rows.len().saturating_sub(1)
    }

    /// Whether token i+1 was the argmax after token i, for i = 0..n-1.
    pub fn greedy(&self, tokens: &[u32]) -> Vec<bool> {
        self.rows
            .iter()
            .zip(tokens.iter().skip(1))
            .map(|(r, &t)| r.argmax.0 == t)
            .collect()
    }
}

/// Scores every row of `logits` `[rows, vocab]` (any float dtype; scored in f32): with the
/// fused kernel on a GPU, so only these small vectors leave it, row by row on the CPU
/// ([`score_row`]).
pub fn score_logits(
    logits: &Tensor,
    targets: &[Option<u32>],
    top_k: usize,
) -> Result<Vec<RowScore>> {
    crate::ops::score_rows(logits, targets, top_k)
}

/// Scores one row of logits. `lse` is accumulated in f64 so the result is the correctly
/// rounded f32 of the exact log-probability for all practical purposes.
pub fn score_row(logits: &[f32], target: Option<u32>, top_k: usize) -> RowScore {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = log_sum_exp(logits, max);
    let logprob = |id: usize| (logits[id] as f64 - lse) as f32;
    let best = top_indices(logits, top_k.max(1));
    RowScore {
        target_logprob: target.map(|t| logprob(t as usize)),
        argmax: (best[0] as u32, logprob(best[0])),
        top_k: best
            .iter()
            .take(top_k)
            .map(|&i| (i as u32, logprob(i)))
            .collect(),
    }
}

/// log Σ exp(logits) given their maximum, accumulated in f64 (the one formula every CPU path
/// uses, so `/score` and `/kld` report the same f32 log-probabilities).
pub fn log_sum_exp(logits: &[f32], max: f32) -> f64 {
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    max as f64 + sum.ln()
}

/// Indices of the `k` largest values, best first; ties broken by the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, &v) in values.iter().enumerate() {
        if best.len() == k && v <= values[best[k - 1]] {
            continue;
        }
        let at = best.partition_point(|&j| values[j] >= v);
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_normalise_and_top_k_is_sorted_with_stable_ties() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let row = score_row(&logits, Some(4), 3);
        let total: f64 = (0..5)
            .map(|i| (score_row(&logits, Some(i), 0).target_logprob.unwrap() as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(row.argmax.0, 1);
        assert_eq!(
            row.top_k.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 2, 0]
        );
        assert_eq!(row.top_k[0].1, row.argmax.1);
        let expect = 0.5 - (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp() + 0.5f64.exp()).ln();
        assert!((row.target_logprob.unwrap() as f64 - expect).abs() < 1e-6);
    }

    #[test]
    fn a_row_with_a_nan_or_an_infinity_is_found_from_its_scores_alone() -> Result<()> {
        let finite = [0.5f32, -1.0, 2.0, 0.0];
        let with = |i: usize, v: f32| {
            let mut row = finite;
            row[i] = v;
            row
        };
        // -inf where it is not read (not the target, not in the top-k): a valid distribution.
        for (row, target, expect_finite) in [
            (finite, Some(1), true),
            (with(3, f32::NEG_INFINITY), Some(1), true),
            (with(3, f32::NEG_INFINITY), Some(3), false),
            (with(0, f32::NAN), None, false),
            (with(2, f32::INFINITY), Some(1), false),
            (with(1, f32::NAN), Some(0), false),
        ] {
            let logits = Tensor::new(&[finite, row, finite], &candle_core::Device::Cpu)?;
            let scores = SequenceScores {
                rows: score_logits(&logits, &[Some(0), target, None], 2)?,
            };
            let expect = (!expect_finite).then_some(1);
            assert_eq!(
                scores.first_non_finite(),
                expect,
                "{row:?} target {target:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn top_k_larger_than_vocab_returns_everything() {
        let row = score_row(&[0.0, 1.0], None, 5);
        assert_eq!(row.top_k.len(), 2);
        assert_eq!(row.target_logprob, None);
    }
}

//! Per-row scoring of f32 logits: log-softmax over the full vocabulary, the log-probability of
//! the actual next token, top-k and argmax, all from the same row so greedy checks are exact.

use candle_core::{Result, Tensor};

pub use crate::ops::{log_sum_exp, score_row, RowScore};

use super::stored_kld::StoredOutput;

/// Scores of one sequence of `n` tokens: `rows[i]` is the distribution after token `i`.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceScores {
    pub rows: Vec<RowScore>,
    /// What [`super::stored_kld::StoredRequest`] asked for, a row per scored position.
    pub stored: StoredOutput,
}

impl SequenceScores {
    /// The first position whose row is not finite ([`RowScore::is_finite`]).
    pub fn first_non_finite(&self) -> Option<usize> {
        let row = self.rows.iter().position(|r| !r.is_finite());
        match (row, self.stored.first_nan()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// log p(token_i | tokens_<i) for i = 1..n.
    pub fn token_logprobs(&self) -> impl Iterator<Item = f32> + '_ {
        self.rows.iter().filter_map(|r| r.target_logprob)
    }

    /// Sum of negative log-likelihoods, accumulated in f64.
    pub fn sum_nll(&self) -> f64 {
        sum(self.token_logprobs().map(|lp| -(lp as f64)))
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

/// The sum of `values` from +0: an empty sum (a one-token sequence scores nothing) is 0, not
/// the -0 of `Iterator::sum` for floats. Any other sum has the same bits either way.
pub fn sum(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |total, v| total + v)
}

#[cfg(test)]
mod tests {
    use super::*;

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
                stored: StoredOutput::None,
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
}

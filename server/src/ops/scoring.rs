//! The scoring family: per row of logits, the log-softmax over the full vocabulary with the
//! log-probability of the actual next token, argmax and top-k (all from the same row, so greedy
//! checks are exact); the KL divergence of two models' rows; and /diff's per-row sums of two
//! states. On a GPU one fused kernel per row computes them and only these few numbers per row
//! leave it; the CPU references below are the specification those kernels are checked against.

use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

pub use exactscore_api::TOP_K_AGREEMENT_MAX;

super::gpu_entry_points!(scoring {
    /// The kernel's output words ([`decode_score_words`]).
    fn score_rows(logits: &Tensor, targets: &[i32], top_k: usize) -> Result<Vec<u32>>;
    /// The kernel's output words ([`decode_kld_words`]).
    fn kld_rows(reference_logits: &Tensor, logits: &Tensor, targets: &[u32]) -> Result<Vec<u32>>;
    fn row_pair_sums(a: &Tensor, b: &Tensor) -> Result<Vec<[f64; 4]>>;
    /// The kernel's output words ([`decode_reference_words`]).
    fn reference_rows(logits: &Tensor, k: usize) -> Result<Vec<u32>>;
    /// The kernel's output words ([`decode_served_tail_words`]).
    fn served_tail_rows(
        logits: &Tensor,
        ids: &[i32],
        k: usize,
        targets: &[i32],
        mass: &[f64],
        cap: &[f64],
    ) -> Result<Vec<u32>>;
});

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

/// One position that has a next token: how the served model's distribution differs from the
/// reference's there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenKld {
    /// KL(reference ‖ model) = Σ_v p_ref(v) · (log p_ref(v) − log p_model(v)), in nats, from the
    /// f32 log-softmax rows of both models, accumulated in f64.
    pub kld: f64,
    /// KL(model ‖ reference) = Σ_v p_model(v) · (log p_model(v) − log p_ref(v)), likewise.
    pub reverse_kld: f64,
    /// The served model's log p(next token).
    pub logprob: f32,
    /// The reference model's log p(next token).
    pub reference_logprob: f32,
    /// Whether both models' most likely token (lowest id on ties) is the same.
    pub same_top: bool,
    /// Bit K − 1 set when both models' K most likely tokens (best first, lowest id on ties)
    /// are the same set, K = 1..=[`TOP_K_AGREEMENT_MAX`]; bit 0 equals `same_top`.
    pub top_k_agreement: u8,
    /// The reference's probability of its most likely token, in f64.
    pub reference_top_p: f64,
}

/// Scores every row of `logits` `[rows, vocab]` (any float dtype; scored in f32): with the fused
/// kernel on a GPU, so only a few numbers per row leave it; row by row on the CPU.
/// `targets[i]`: the next token of row i, if known.
pub fn score_rows(logits: &Tensor, targets: &[Option<u32>], top_k: usize) -> Result<Vec<RowScore>> {
    if logits.device().is_cuda() {
        let t: Vec<i32> = targets.iter().map(|t| t.map_or(-1, |t| t as i32)).collect();
        let words = gpu::score_rows(logits, &t, top_k)?;
        return Ok(decode_score_words(&words, targets, top_k));
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(targets)
        .map(|(row, &target)| score_row(row, target, top_k))
        .collect())
}

/// The rows of `score_rows` in kernels/scoring.cu from its output, 4-byte words (f32 as their
/// bits): per row the target's log-probability, the argmax id and its log-probability, then
/// the top-k ids and log-probabilities (`rows * top_k` each, row-major).
fn decode_score_words(words: &[u32], targets: &[Option<u32>], top_k: usize) -> Vec<RowScore> {
    let rows = targets.len();
    let f32_at = |at: usize| f32::from_bits(words[at]);
    let (ids, logprobs) = (3 * rows, 3 * rows + rows * top_k);
    (0..rows)
        .map(|i| RowScore {
            target_logprob: targets[i].map(|_| f32_at(i)),
            argmax: (words[rows + i], f32_at(2 * rows + i)),
            top_k: (i * top_k..(i + 1) * top_k)
                .map(|j| (words[ids + j], f32_at(logprobs + j)))
                .collect(),
        })
        .collect()
}

/// Per-row divergence of `logits` from `reference_logits` (same shape, any float dtype, scored
/// in f32): with the fused kernel on a GPU (the reference's logits brought to the model's
/// device); row by row in f64 on the CPU.
pub fn kld_rows(
    reference_logits: &Tensor,
    logits: &Tensor,
    targets: &[u32],
) -> Result<Vec<TokenKld>> {
    if logits.device().is_cuda() {
        let reference_logits = &crate::device::transfer(reference_logits, logits.device())?;
        // Two compute dtypes (`--reference-dtype`): both rows in f32, which holds either
        // exactly; the kernel scores in f32 whatever it reads.
        let words = if reference_logits.dtype() != logits.dtype() {
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            gpu::kld_rows(&f32(reference_logits)?, &f32(logits)?, targets)?
        } else {
            gpu::kld_rows(reference_logits, logits, targets)?
        };
        return Ok(decode_kld_words(&words, targets.len()));
    }
    let reference_rows = reference_logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    // Rows are independent, each summed in its own order: the same bits on any thread count.
    Ok(reference_rows
        .par_iter()
        .zip(&rows)
        .zip(targets)
        .map(|((r, m), &t)| kld_row(r, m, t))
        .collect())
}

/// The rows of `kld_rows` in kernels/scoring.cu from its output, 4-byte words: three f64
/// vectors (two words a row each: the divergence, the reverse divergence, the reference's top
/// probability), then one word a row each: the model's and the reference's log p(target) (f32
/// bits), both argmax ids, the top-K agreement mask.
fn decode_kld_words(words: &[u32], rows: usize) -> Vec<TokenKld> {
    let f64_at = |vector: usize, i: usize| {
        let at = vector * rows + 2 * i;
        f64::from_bits(u64::from(words[at]) | (u64::from(words[at + 1]) << 32))
    };
    let word = |vector: usize, i: usize| words[vector * rows + i];
    (0..rows)
        .map(|i| TokenKld {
            kld: f64_at(0, i),
            reverse_kld: f64_at(2, i),
            reference_top_p: f64_at(4, i),
            logprob: f32::from_bits(word(6, i)),
            reference_logprob: f32::from_bits(word(7, i)),
            same_top: word(8, i) == word(9, i),
            top_k_agreement: word(10, i) as u8,
        })
        .collect()
}

/// The served model's side of a divergence from a stored reference at one position
/// (`model::stored_kld` bounds it): only O(K) numbers per row.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedTail {
    /// log q of each of the reference's stored tokens, in their order, in f64.
    pub logprobs: Vec<f64>,
    /// log Q_T: the served model's log-mass outside the stored tokens, summed over them
    /// directly (not 1 − Σ top-K, which cancels), in f64.
    pub log_tail_mass: f64,
    /// The served model's log p(next token).
    pub target_logprob: f32,
    /// The served model's most likely token (lowest id on ties).
    pub argmax: u32,
    /// max Σ_j p_j·(−log q_j) over the tail tokens j, over every p with 0 ≤ p_j ≤ `cap` and
    /// Σ p_j = `mass` ([`TailBudget`]): the worst tail the reference could have for this
    /// model; it fills the tokens the model finds least likely up to the cap.
    pub worst_tail: f64,
}

/// The tail the reference may have at one position: its mass, and the most any one tail
/// token may hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TailBudget {
    pub mass: f64,
    pub cap: f64,
}

/// The reference's side of a stored reference at one position: its `k` most likely tokens
/// (best first, lowest id on ties) with their log-probabilities, and log Σ p of the others.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceRow {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// −∞ where the top K is the whole vocabulary.
    pub tail_logmass: f32,
}

/// [`ServedTail`] of every row of `logits` `[rows, vocab]` against the stored tokens
/// `ids[row]` (no id twice, as many in every row): with the fused kernel on a GPU, so only
/// O(K) numbers per row leave it; row by row on the CPU.
pub fn served_tail_rows(
    logits: &Tensor,
    ids: &[&[u32]],
    targets: &[u32],
    budgets: &[TailBudget],
) -> Result<Vec<ServedTail>> {
    if logits.device().is_cuda() && !ids.is_empty() {
        let k = ids[0].len();
        if ids.iter().any(|r| r.len() != k) {
            candle_core::bail!("served_tail_rows: rows with different numbers of stored ids");
        }
        let flat: Vec<i32> = ids
            .iter()
            .flat_map(|r| r.iter().map(|&i| i as i32))
            .collect();
        let t: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
        let mass: Vec<f64> = budgets.iter().map(|b| b.mass).collect();
        let cap: Vec<f64> = budgets.iter().map(|b| b.cap).collect();
        let words = gpu::served_tail_rows(logits, &flat, k, &t, &mass, &cap)?;
        return Ok(decode_served_tail_words(&words, targets.len(), k));
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .par_iter()
        .zip(ids)
        .zip(targets)
        .zip(budgets)
        .map(|(((row, ids), &target), &budget)| served_tail_row(row, ids, target, budget))
        .collect())
}

/// [`ReferenceRow`] of every row of `logits` `[rows, vocab]`, with `k` tokens each: with the
/// fused kernel on a GPU (only the K best and one tail number per row leave it); row by row on
/// the CPU.
pub fn reference_rows(logits: &Tensor, k: usize) -> Result<Vec<ReferenceRow>> {
    if logits.device().is_cuda() && logits.dim(0)? > 0 {
        let k = k.min(logits.dim(1)?);
        let words = gpu::reference_rows(logits, k)?;
        return Ok(decode_reference_words(&words, logits.dim(0)?, k));
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows.par_iter().map(|row| reference_row(row, k)).collect())
}

/// The rows of `reference_rows` in kernels/stored_reference.cu from its words: the ids and the
/// log-probabilities (`rows * k` each, f32 bits), then the tail's log-mass a row.
fn decode_reference_words(words: &[u32], rows: usize, k: usize) -> Vec<ReferenceRow> {
    let (lps, tails) = (rows * k, 2 * rows * k);
    (0..rows)
        .map(|r| ReferenceRow {
            ids: words[r * k..(r + 1) * k].to_vec(),
            logprobs: words[lps + r * k..lps + (r + 1) * k]
                .iter()
                .map(|&w| f32::from_bits(w))
                .collect(),
            tail_logmass: f32::from_bits(words[tails + r]),
        })
        .collect()
}

/// The rows of `served_tail_rows` in kernels/stored_reference.cu from its words: three f64 vectors
/// (two words a value: the stored tokens' log q, `rows * k`; the tail's log-mass; the worst
/// tail), then the log q(target) (f32 bits) and the argmax of each row.
fn decode_served_tail_words(words: &[u32], rows: usize, k: usize) -> Vec<ServedTail> {
    let f64_at =
        |at: usize| f64::from_bits(u64::from(words[2 * at]) | (u64::from(words[2 * at + 1]) << 32));
    let (tails, worst) = (rows * k, rows * (k + 1));
    let words_at = 2 * rows * (k + 2);
    (0..rows)
        .map(|r| ServedTail {
            logprobs: (r * k..(r + 1) * k).map(f64_at).collect(),
            log_tail_mass: f64_at(tails + r),
            target_logprob: f32::from_bits(words[words_at + r]),
            argmax: words[words_at + rows + r],
            worst_tail: f64_at(worst + r),
        })
        .collect()
}

/// One row of [`reference_rows`].
pub fn reference_row(logits: &[f32], k: usize) -> ReferenceRow {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = log_sum_exp(logits, max);
    let best = top_indices(logits, k.min(logits.len()));
    let mut stored = vec![false; logits.len()];
    best.iter().for_each(|&i| stored[i] = true);
    ReferenceRow {
        ids: best.iter().map(|&i| i as u32).collect(),
        logprobs: best
            .iter()
            .map(|&i| (logits[i] as f64 - lse) as f32)
            .collect(),
        tail_logmass: (tail_log_sum_exp(logits, &stored, max) - lse) as f32,
    }
}

/// log Σ exp over the logits not marked `stored`, in f64 (−∞ for none).
fn tail_log_sum_exp(logits: &[f32], stored: &[bool], max: f32) -> f64 {
    let sum: f64 = logits
        .iter()
        .zip(stored)
        .filter(|(_, &s)| !s)
        .map(|(&l, _)| ((l - max) as f64).exp())
        .sum();
    max as f64 + sum.ln()
}

/// One row of [`served_tail_rows`].
pub fn served_tail_row(logits: &[f32], ids: &[u32], target: u32, budget: TailBudget) -> ServedTail {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = log_sum_exp(logits, max);
    let mut stored = vec![false; logits.len()];
    ids.iter().for_each(|&i| stored[i as usize] = true);
    // −log q of every tail token: the worst tail puts the cap on the largest of them.
    let mut surprise: Vec<f64> = logits
        .iter()
        .zip(&stored)
        .filter(|(_, &s)| !s)
        .map(|(&l, _)| lse - l as f64)
        .collect();
    ServedTail {
        logprobs: ids
            .iter()
            .map(|&i| logits[i as usize] as f64 - lse)
            .collect(),
        log_tail_mass: tail_log_sum_exp(logits, &stored, max) - lse,
        target_logprob: (logits[target as usize] as f64 - lse) as f32,
        argmax: top_indices(logits, 1)[0] as u32,
        worst_tail: worst_tail(&mut surprise, budget),
    }
}

/// max Σ p_j·s_j over 0 ≤ p_j ≤ cap, Σ p_j = mass (a fractional knapsack): the cap on the
/// ⌊mass/cap⌋ largest `surprise`s and the remainder on the next.
fn worst_tail(surprise: &mut [f64], budget: TailBudget) -> f64 {
    let TailBudget { mass, cap } = budget;
    if mass <= 0.0 || cap <= 0.0 || surprise.is_empty() {
        return 0.0;
    }
    let full = ((mass / cap).floor() as usize).min(surprise.len());
    let rest = (mass - full as f64 * cap).max(0.0);
    // No mass on a token adds nothing, even where the served model gives it q = 0 (an
    // infinite surprise): 0 · ∞ is 0 here, not NaN.
    let rest_on = |s: f64| if rest > 0.0 { rest * s } else { 0.0 };
    let descending = |a: &f64, b: &f64| b.total_cmp(a);
    if full == surprise.len() {
        // Only through rounding of a mass that fills every token: the rest on the largest.
        let largest = surprise.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        return cap * surprise.iter().sum::<f64>() + rest_on(largest);
    }
    surprise.select_nth_unstable_by(full, descending);
    cap * surprise[..full].iter().sum::<f64>() + rest_on(surprise[full])
}

/// Per row of two states `[rows, hidden]` on one device: (Σ a·b, Σ a², Σ b², Σ (a − b)²),
/// each in f64 over the values converted to f32 (every float dtype converts to f32, and f32 to
/// f64, exactly). Only these four numbers per row leave a GPU.
pub fn row_pair_sums(a: &Tensor, b: &Tensor) -> Result<Vec<[f64; 4]>> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    if a.device().is_cuda() {
        return gpu::row_pair_sums(&a, &b);
    }
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let sums = Tensor::stack(
        &[
            (&a * &b)?.sum(1)?,
            a.sqr()?.sum(1)?,
            b.sqr()?.sum(1)?,
            (&a - &b)?.sqr()?.sum(1)?,
        ],
        1,
    )?;
    Ok(sums
        .to_vec2::<f64>()?
        .into_iter()
        .map(|v| [v[0], v[1], v[2], v[3]])
        .collect())
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

/// The divergence at one position, in f64 from f32 logits: the CPU reference of the kernel.
pub fn kld_row(reference: &[f32], model: &[f32], target: u32) -> TokenKld {
    let (reference_top, reference_lse) = top_ids_and_lse(reference);
    let (top, lse) = top_ids_and_lse(model);
    let (mut kld, mut reverse_kld) = (0f64, 0f64);
    for (&r, &m) in reference.iter().zip(model) {
        let (log_p_ref, log_p) = (r as f64 - reference_lse, m as f64 - lse);
        kld += log_p_ref.exp() * (log_p_ref - log_p);
        reverse_kld += log_p.exp() * (log_p - log_p_ref);
    }
    let t = target as usize;
    TokenKld {
        kld,
        reverse_kld,
        logprob: (model[t] as f64 - lse) as f32,
        reference_logprob: (reference[t] as f64 - reference_lse) as f32,
        same_top: top[0] == reference_top[0],
        top_k_agreement: top_k_agreement(&reference_top, &top),
        reference_top_p: (reference[reference_top[0] as usize] as f64 - reference_lse).exp(),
    }
}

/// The bit mask of [`TokenKld::top_k_agreement`] from both rows' best ids, best first.
pub fn top_k_agreement(reference_top: &[u32], top: &[u32]) -> u8 {
    (1..=TOP_K_AGREEMENT_MAX).fold(0, |mask, k| {
        // A vocabulary of fewer than K tokens: its whole set.
        let n = k.min(top.len()).min(reference_top.len());
        let same = reference_top[..n].iter().all(|id| top[..n].contains(id));
        mask | (u8::from(same) << (k - 1))
    })
}

/// The [`TOP_K_AGREEMENT_MAX`] best ids of a row (fewer when the row is shorter), best first
/// and the lowest id first on ties, with log Σ exp(logits) in f64. Each value enters the sorted
/// list from its end, as in the kernel.
fn top_ids_and_lse(logits: &[f32]) -> (Vec<u32>, f64) {
    // (value, id) is better than (value', id') when larger, or equal with a lower id.
    let better = |i: usize, j: usize| logits[i] > logits[j] || (logits[i] == logits[j] && i < j);
    let mut top: Vec<usize> = Vec::with_capacity(TOP_K_AGREEMENT_MAX);
    for i in 0..logits.len() {
        if top.len() == TOP_K_AGREEMENT_MAX {
            if !better(i, top[TOP_K_AGREEMENT_MAX - 1]) {
                continue;
            }
            top.pop();
        }
        let mut at = top.len();
        while at > 0 && better(i, top[at - 1]) {
            at -= 1;
        }
        top.insert(at, i);
    }
    let best = top.first().map_or(f32::NEG_INFINITY, |&i| logits[i]);
    (
        top.into_iter().map(|i| i as u32).collect(),
        log_sum_exp(logits, best),
    )
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
    fn top_k_larger_than_vocab_returns_everything() {
        let row = score_row(&[0.0, 1.0], None, 5);
        assert_eq!(row.top_k.len(), 2);
        assert_eq!(row.target_logprob, None);
    }
}

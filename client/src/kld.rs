//! KL-divergence statistics of `exactscore kld`, as llama.cpp's `perplexity --kl-divergence`
//! prints them, from the per-token numbers of the server's `/kld`.
//!
//! With `n` scored tokens, per-token divergences `k_i` (nats), top-1 agreement `a_i ∈ {0, 1}`,
//! `Δp_i = p_model(t_i) − p_ref(t_i)` and NLLs `m_i` (served model) and `r_i` (reference):
//! - mean KLD `k̄ = Σk_i / n`, standard error `sqrt((Σk_i²/n − k̄²) / (n − 1))`;
//! - median, p90, p99, p99.9: linear interpolation between order statistics (numpy's default
//!   and llama.cpp's); max;
//! - same top `ā = Σa_i / n` ± `sqrt(ā(1 − ā) / (n − 1))`;
//! - mean Δp ± its standard error, RMS Δp `sqrt(ΣΔp_i² / n)`;
//! - PPL of each model `exp(Σm_i / n)`, `exp(Σr_i / n)`; `ln(PPL ratio) = Σ(m_i − r_i) / n` ±
//!   its standard error from `Σ(m_i − r_i)²`; the ratio is its exponential (± ratio · SE).
//!
//! Tokens are treated as independent for these errors, as llama.cpp does (an overlapping `exl3`
//! window scores a token more than once, which makes them optimistic).
//!
//! Beyond llama.cpp, as ExLlamaV3's comparisons print them: p10, p25 and p75 of the KLD; the
//! reverse divergence KL(model ‖ reference) (mean ± SE); top-K agreement for K = 1..=5 (the
//! fraction of tokens where both models' K most likely tokens are the same set); and the KLD
//! grouped by the reference's top-token probability (share of tokens, mean and median per
//! [`exactscore_api::CONFIDENCE_BUCKETS`] range).

use exactscore_api::{confidence_bucket, CONFIDENCE_BUCKETS, TOP_K_AGREEMENT_MAX};
use serde::{Deserialize, Serialize};

/// What one window contributes (kept per window in reports and partial files).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KldWindow {
    /// Σ −log p of the reference model over the window's scored positions.
    pub reference_sum_nll: f64,
    /// Positions where both models' most likely token agree.
    pub same_top: usize,
    pub sum_delta_p: f64,
    pub sum_delta_p_squared: f64,
    /// Σ (NLL_model − NLL_reference)².
    pub sum_ln_ratio_squared: f64,
    /// Per scored position, in order.
    pub kld: Vec<f64>,
    /// Σ KL(model ‖ reference) and Σ of its squares. Absent (0) from older partial files.
    #[serde(default)]
    pub sum_reverse_kld: f64,
    #[serde(default)]
    pub sum_reverse_kld_squared: f64,
    /// Positions whose top-K sets agree, K = 1..=5.
    #[serde(default)]
    pub top_k_agreement: Vec<usize>,
    /// The reference's top-token probability per scored position, aligned with `kld` (f64 as
    /// the server sends it: a rounded copy could change its confidence bucket, and its JSON
    /// text would not read back to the same number in Python).
    #[serde(default)]
    pub reference_top_p: Vec<f64>,
}

/// The KLD of the tokens whose reference top-token probability is in `[lower, upper)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KldBucket {
    pub lower: f64,
    pub upper: f64,
    pub tokens: usize,
    /// Fraction of all tokens.
    pub share: f64,
    /// `null` for an empty bucket.
    pub mean_kld: Option<f64>,
    pub median_kld: Option<f64>,
}

/// The statistics of a KLD run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KldStats {
    pub tokens: usize,
    pub mean_kld: f64,
    pub mean_kld_stderr: Option<f64>,
    pub median_kld: f64,
    pub p90_kld: f64,
    pub p99_kld: f64,
    pub p99_9_kld: f64,
    pub max_kld: f64,
    /// Fraction of tokens whose top-1 token agrees, 0..=1.
    pub same_top: f64,
    pub same_top_stderr: Option<f64>,
    pub mean_delta_p: f64,
    pub mean_delta_p_stderr: Option<f64>,
    pub rms_delta_p: f64,
    pub perplexity: f64,
    pub reference_perplexity: f64,
    /// PPL(model) / PPL(reference).
    pub perplexity_ratio: f64,
    pub perplexity_ratio_stderr: Option<f64>,
    pub ln_perplexity_ratio: f64,
    pub ln_perplexity_ratio_stderr: Option<f64>,
    /// Absent from reports older than these fields.
    #[serde(default)]
    pub p10_kld: f64,
    #[serde(default)]
    pub p25_kld: f64,
    #[serde(default)]
    pub p75_kld: f64,
    /// Mean KL(model ‖ reference).
    #[serde(default)]
    pub mean_reverse_kld: f64,
    #[serde(default)]
    pub mean_reverse_kld_stderr: Option<f64>,
    /// Fraction of tokens whose top-K sets agree, K = 1..=5 (`[0]` is `same_top`).
    #[serde(default)]
    pub top_k_agreement: Vec<f64>,
    /// KLD by the reference's confidence.
    #[serde(default)]
    pub confidence_buckets: Vec<KldBucket>,
    /// The per-token KLD histogram: percent of the tokens per log-spaced bin, from
    /// [`crate::plot::KLD_FLOOR`] up, [`crate::plot::BINS_PER_DECADE`] bins per decade (what
    /// `compare --plot` draws when a report keeps no per-token values). Absent from older
    /// reports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub histogram: Vec<f64>,
}

/// Standard error of a mean from the sums of the values and of their squares.
fn stderr_of_mean(sum: f64, sum_squares: f64, n: usize) -> Option<f64> {
    (n >= 2).then(|| {
        let mean = sum / n as f64;
        ((sum_squares / n as f64 - mean * mean).max(0.0) / (n as f64 - 1.0)).sqrt()
    })
}

/// The `q` quantile (0..=1) of sorted values, interpolating linearly between neighbours.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, frac) = (at.floor() as usize, at - at.floor());
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + frac * (sorted[hi] - sorted[lo])
}

impl KldStats {
    /// `windows`: each window's KLD part with the served model's NLL sum over the same
    /// positions.
    pub fn from_windows<'a>(windows: impl IntoIterator<Item = (&'a KldWindow, f64)>) -> Self {
        let mut kld: Vec<f64> = Vec::new();
        let mut by_confidence: Vec<Vec<f64>> = vec![Vec::new(); CONFIDENCE_BUCKETS.len()];
        let (mut same, mut dp, mut dp2, mut nll, mut ref_nll, mut lr2) =
            (0usize, 0.0, 0.0, 0.0, 0.0, 0.0);
        let (mut reverse, mut reverse2) = (0.0, 0.0);
        let mut agreement = [0usize; TOP_K_AGREEMENT_MAX];
        for (w, sum_nll) in windows {
            kld.extend_from_slice(&w.kld);
            same += w.same_top;
            dp += w.sum_delta_p;
            dp2 += w.sum_delta_p_squared;
            nll += sum_nll;
            ref_nll += w.reference_sum_nll;
            lr2 += w.sum_ln_ratio_squared;
            reverse += w.sum_reverse_kld;
            reverse2 += w.sum_reverse_kld_squared;
            for (total, count) in agreement.iter_mut().zip(&w.top_k_agreement) {
                *total += count;
            }
            for (&k, &p) in w.kld.iter().zip(&w.reference_top_p) {
                by_confidence[confidence_bucket(p)].push(k);
            }
        }
        let n = kld.len();
        let nf = n as f64;
        let histogram = crate::plot::kld_histogram(&kld)
            .into_iter()
            .map(|(_, share)| share)
            .collect();
        let sum: f64 = kld.iter().sum();
        let sum_squares: f64 = kld.iter().map(|k| k * k).sum();
        kld.sort_by(f64::total_cmp);
        let confidence_buckets = CONFIDENCE_BUCKETS
            .iter()
            .zip(by_confidence)
            .map(|(&(lower, upper), mut values)| {
                values.sort_by(f64::total_cmp);
                let tokens = values.len();
                KldBucket {
                    lower,
                    upper,
                    tokens,
                    share: tokens as f64 / nf,
                    mean_kld: (tokens > 0).then(|| values.iter().sum::<f64>() / tokens as f64),
                    median_kld: (tokens > 0).then(|| quantile(&values, 0.5)),
                }
            })
            .collect();
        let same_top = same as f64 / nf;
        let ln_ratio = (nll - ref_nll) / nf;
        let ln_ratio_stderr = stderr_of_mean(nll - ref_nll, lr2, n);
        let ratio = ln_ratio.exp();
        Self {
            tokens: n,
            mean_kld: sum / nf,
            mean_kld_stderr: stderr_of_mean(sum, sum_squares, n),
            median_kld: quantile(&kld, 0.5),
            p90_kld: quantile(&kld, 0.9),
            p99_kld: quantile(&kld, 0.99),
            p99_9_kld: quantile(&kld, 0.999),
            max_kld: kld.last().copied().unwrap_or(f64::NAN),
            same_top,
            same_top_stderr: (n >= 2).then(|| (same_top * (1.0 - same_top) / (nf - 1.0)).sqrt()),
            mean_delta_p: dp / nf,
            mean_delta_p_stderr: stderr_of_mean(dp, dp2, n),
            rms_delta_p: (dp2 / nf).sqrt(),
            perplexity: (nll / nf).exp(),
            reference_perplexity: (ref_nll / nf).exp(),
            perplexity_ratio: ratio,
            perplexity_ratio_stderr: ln_ratio_stderr.map(|se| se * ratio),
            ln_perplexity_ratio: ln_ratio,
            ln_perplexity_ratio_stderr: ln_ratio_stderr,
            p10_kld: quantile(&kld, 0.1),
            p25_kld: quantile(&kld, 0.25),
            p75_kld: quantile(&kld, 0.75),
            mean_reverse_kld: reverse / nf,
            mean_reverse_kld_stderr: stderr_of_mean(reverse, reverse2, n),
            top_k_agreement: agreement.iter().map(|&a| a as f64 / nf).collect(),
            confidence_buckets,
            histogram,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!((quantile(&v, 0.9) - 3.7).abs() < 1e-12);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }

    #[test]
    fn statistics_pool_the_tokens_of_every_window() {
        let a = KldWindow {
            reference_sum_nll: 3.0,
            same_top: 1,
            sum_delta_p: 0.1,
            sum_delta_p_squared: 0.01,
            sum_ln_ratio_squared: 1.0,
            kld: vec![0.0, 0.3],
            sum_reverse_kld: 0.5,
            sum_reverse_kld_squared: 0.2,
            top_k_agreement: vec![1, 2, 0, 0, 1],
            reference_top_p: vec![0.1, 0.97],
        };
        let b = KldWindow {
            reference_sum_nll: 1.0,
            same_top: 2,
            sum_delta_p: -0.3,
            sum_delta_p_squared: 0.05,
            sum_ln_ratio_squared: 2.0,
            kld: vec![0.1, 0.2],
            sum_reverse_kld: 0.3,
            sum_reverse_kld_squared: 0.05,
            top_k_agreement: vec![2, 1, 1, 0, 2],
            reference_top_p: vec![0.2, 1.0],
        };
        let s = KldStats::from_windows([(&a, 4.0), (&b, 2.0)]);
        assert_eq!(s.tokens, 4);
        assert!((s.mean_kld - 0.15).abs() < 1e-12);
        // values 0, .1, .2, .3: sd² (population) = 0.0125, / 3
        assert!((s.mean_kld_stderr.unwrap() - (0.0125f64 / 3.0).sqrt()).abs() < 1e-12);
        assert!((s.median_kld - 0.15).abs() < 1e-12);
        assert_eq!(s.max_kld, 0.3);
        assert_eq!(s.same_top, 0.75);
        assert!((s.mean_delta_p + 0.05).abs() < 1e-12);
        assert!((s.rms_delta_p - (0.06f64 / 4.0).sqrt()).abs() < 1e-12);
        assert!((s.ln_perplexity_ratio - 0.5).abs() < 1e-12);
        assert!((s.perplexity / s.reference_perplexity - s.perplexity_ratio).abs() < 1e-12);
        // 0, .1, .2, .3 at 25 % and 75 %: .075 and .225.
        assert!((s.p25_kld - 0.075).abs() < 1e-12 && (s.p75_kld - 0.225).abs() < 1e-12);
        assert!((s.mean_reverse_kld - 0.2).abs() < 1e-12);
        assert_eq!(s.top_k_agreement, vec![0.75, 0.75, 0.25, 0.0, 0.75]);
        // Confidences .1 and .2 in [0, .25) with KLD 0 and .1; .97 and 1.0 in [.95, 1].
        let b = &s.confidence_buckets;
        assert_eq!(
            b.iter().map(|b| b.tokens).collect::<Vec<_>>(),
            [2, 0, 0, 0, 2]
        );
        assert!((b[0].mean_kld.unwrap() - 0.05).abs() < 1e-12);
        assert!((b[4].median_kld.unwrap() - 0.25).abs() < 1e-12);
        assert_eq!((b[1].mean_kld, b[0].share), (None, 0.5));
    }
}

//! NLL and KLD by position in the window: where long context degrades.
//!
//! A scored position `p` of a request (`log p(seq[p] | seq[..p])`, so `p` tokens of context,
//! a rolling window's prefix token included) falls into the bucket of [`POSITION_BUCKETS`] that
//! holds `p`: `[0, 2048)`, `[2048, 8192)`, `[8192, 32768)`, `[32768, 131072)`, `[131072, ∞)`.
//! Each window keeps, per bucket up to its last non-empty one, the count of its scored
//! positions there and their NLL (and KLD) sums ([`PositionSums`]); a report adds them up over
//! the windows: mean NLL, perplexity and mean KLD per non-empty bucket ([`PositionBucket`]).
//! Tokens are counted once per window that scores them, as in the report's totals.

use serde::{Deserialize, Serialize};

/// Lower bounds of the position buckets; each bucket ends where the next begins, the last
/// never.
pub const POSITION_BUCKETS: [usize; 5] = [0, 2048, 8192, 32768, 131072];

/// The bucket of position `p`.
pub fn bucket(p: usize) -> usize {
    POSITION_BUCKETS
        .iter()
        .rposition(|&lower| p >= lower)
        .unwrap_or(0)
}

/// One window's scored positions in one bucket.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PositionSums {
    pub tokens: usize,
    /// Σ −log p of the served model.
    pub sum_nll: f64,
    /// Σ KL(reference ‖ model); 0 for `ppl`.
    #[serde(default)]
    pub sum_kld: f64,
}

/// Adds one scored position `p` (its NLL and, for `kld`, its KLD) to a window's sums.
pub fn add(sums: &mut Vec<PositionSums>, p: usize, nll: f64, kld: f64) {
    let b = bucket(p);
    if sums.len() <= b {
        sums.resize(b + 1, PositionSums::default());
    }
    let s = &mut sums[b];
    s.tokens += 1;
    s.sum_nll += nll;
    s.sum_kld += kld;
}

/// The statistics of one bucket over a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PositionBucket {
    /// Positions `lower..upper` (`upper` `null`: no end).
    pub lower: usize,
    pub upper: Option<usize>,
    pub tokens: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
    /// `exactscore kld` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_kld: Option<f64>,
}

/// The non-empty buckets of windows' sums (`kld`: the run has divergences).
pub fn summarize<'a>(
    windows: impl IntoIterator<Item = &'a [PositionSums]>,
    kld: bool,
) -> Vec<PositionBucket> {
    let mut total = vec![PositionSums::default(); POSITION_BUCKETS.len()];
    for sums in windows {
        for (t, s) in total.iter_mut().zip(sums) {
            t.tokens += s.tokens;
            t.sum_nll += s.sum_nll;
            t.sum_kld += s.sum_kld;
        }
    }
    total
        .into_iter()
        .enumerate()
        .filter(|(_, s)| s.tokens > 0)
        .map(|(b, s)| {
            let n = s.tokens as f64;
            PositionBucket {
                lower: POSITION_BUCKETS[b],
                upper: POSITION_BUCKETS.get(b + 1).copied(),
                tokens: s.tokens,
                mean_nll: s.sum_nll / n,
                perplexity: (s.sum_nll / n).exp(),
                mean_kld: kld.then(|| s.sum_kld / n),
            }
        })
        .collect()
}

/// `2K`, `128K`, `1000`: a position as the table shows it.
pub fn short(p: usize) -> String {
    if p > 0 && p.is_multiple_of(1024) {
        format!("{}K", p / 1024)
    } else {
        p.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_fall_into_their_buckets() {
        for (p, b) in [
            (0, 0),
            (2047, 0),
            (2048, 1),
            (8191, 1),
            (8192, 2),
            (32767, 2),
            (32768, 3),
            (131071, 3),
            (131072, 4),
            (usize::MAX, 4),
        ] {
            assert_eq!(bucket(p), b, "{p}");
        }
        assert_eq!(
            (short(2048), short(131072), short(1000)),
            ("2K".into(), "128K".into(), "1000".into())
        );
    }

    /// Two windows' sums add up per bucket; the means are of the tokens, not of the windows.
    #[test]
    fn buckets_add_windows_token_by_token() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for p in 1..3000 {
            add(&mut a, p, 1.0, 0.5);
        }
        for p in 1..10_000 {
            add(&mut b, p, if p < 2048 { 3.0 } else { 2.0 }, 0.25);
        }
        assert_eq!(a.len(), 2);
        assert_eq!(b.len(), 3);
        let buckets = summarize([&a[..], &b[..]], true);
        assert_eq!(buckets.len(), 3);
        let first = &buckets[0];
        assert_eq!(
            (first.lower, first.upper, first.tokens),
            (0, Some(2048), 2 * 2047)
        );
        assert!((first.mean_nll - 2.0).abs() < 1e-12);
        assert!((first.mean_kld.unwrap() - 0.375).abs() < 1e-12);
        let second = &buckets[1];
        assert_eq!(second.tokens, (3000 - 2048) + (8192 - 2048));
        let want = ((3000 - 2048) as f64 * 1.0 + (8192 - 2048) as f64 * 2.0) / second.tokens as f64;
        assert!((second.mean_nll - want).abs() < 1e-12);
        assert!((second.perplexity - want.exp()).abs() < 1e-9);
        assert_eq!((buckets[2].lower, buckets[2].tokens), (8192, 10_000 - 8192));
        assert_eq!(summarize([&a[..]], false)[0].mean_kld, None);
    }
}

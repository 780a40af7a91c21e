//! Window arithmetic: how a long token sequence is cut into scoring requests. Pure, no I/O.
//!
//! A [`Window`] is one request: a token sequence (optionally a prefix token followed by a
//! contiguous slice of the text's tokens) and the range of its positions whose log-probability is
//! counted. Position `p` of a request is `log p(seq[p] | seq[..p])`; position 0 is never scored.
//!
//! In every method `ctx` is the number of tokens **sent per request** (what the server sees), so
//! no request is longer than `ctx`.
//!
//! * `exl3` — window `k` is `tokens[k·stride .. k·stride + ctx]`, full windows only; positions
//!   `1..ctx` of every window are scored, so positions covered by several windows are counted
//!   once per window (ExLlamaV3's eval).
//! * `disjoint` — window 0 is `tokens[0 .. ctx]`; window `j > 0` is
//!   `tokens[j·(ctx-1) .. min(j·(ctx-1) + ctx, n)]`, i.e. it starts with the **last token of window
//!   `j-1`**, which is context only. Positions `1..len` are scored, so every token after the very
//!   first is scored exactly once. A trailing window of a single token (nothing to score) is
//!   dropped; the last window may be shorter than `ctx`.
//! * `rolling` — lm-eval's `loglikelihood_rolling`: `get_rolling_token_windows(tokens,
//!   prefix_token, max_seq_len = ctx - 1, context_len = 1)` followed by `make_disjoint_window`.
//!   With `M = ctx - 1`: the first request is `[prefix] + tokens[..min(M, n)]`, every token after
//!   the prefix scored; every later request predicts the next `w = min(M, n - predicted)` tokens and
//!   is `tokens[end - M - 1 .. end]` (`end = predicted + w`), scoring its last `w` positions. Full
//!   windows therefore have exactly one token of context (the previous window's last token); the
//!   final, short window is filled up to `ctx` tokens with extra context on the left, exactly as
//!   lm-eval does. Every token of the text (not the prefix) is predicted exactly once. lm-eval's
//!   `max_length = L` corresponds to `ctx = L + 1` here (L model inputs + the last target).
//!
//! `max_windows` keeps the first N windows of the method (in order).

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Windowing method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Exl3,
    Disjoint,
    Rolling,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Exl3 => "exl3",
            Method::Disjoint => "disjoint",
            Method::Rolling => "rolling",
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parameters of a windowing.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowParams {
    pub method: Method,
    /// Tokens per request (≥ 2).
    pub ctx: usize,
    /// `exl3` only: start offset between consecutive windows (≥ 1).
    pub stride: usize,
    /// `rolling` only: the token prepended to the first window (BOS, else EOS).
    pub prefix_token: Option<u32>,
    /// Keep at most this many windows (the first ones).
    pub max_windows: Option<usize>,
}

/// One request: `prefix` (if any) followed by `tokens[range]`; positions `scored` are counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    pub index: usize,
    pub prefix: Option<u32>,
    /// Range of the text's token indices sent after the prefix.
    pub range: Range<usize>,
    /// Positions of the request sequence (prefix included) whose log-probability counts.
    pub scored: Range<usize>,
}

impl Window {
    /// Number of tokens in the request.
    pub fn len(&self) -> usize {
        self.range.len() + usize::from(self.prefix.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of scored positions.
    pub fn num_scored(&self) -> usize {
        self.scored.len()
    }

    /// The request's token ids.
    pub fn sequence(&self, tokens: &[u32]) -> Vec<u32> {
        let mut seq = Vec::with_capacity(self.len());
        seq.extend(self.prefix);
        seq.extend_from_slice(&tokens[self.range.clone()]);
        seq
    }

    /// Index into the text's tokens of request position `pos`, `None` for the prefix.
    pub fn token_index(&self, pos: usize) -> Option<usize> {
        match self.prefix {
            Some(_) if pos == 0 => None,
            Some(_) => Some(self.range.start + pos - 1),
            None => Some(self.range.start + pos),
        }
    }

    /// Text token indices predicted by this window (one per scored position).
    pub fn predicted(&self) -> impl Iterator<Item = usize> + '_ {
        self.scored.clone().filter_map(|p| self.token_index(p))
    }
}

/// Errors of invalid window parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("--ctx must be at least 2 (got {0})")]
    CtxTooSmall(usize),
    #[error("--stride must be at least 1")]
    ZeroStride,
    #[error("method rolling needs a prefix token (the tokenizer has neither BOS nor EOS)")]
    NoPrefix,
}

/// Cut `n` tokens into windows.
pub fn windows(n: usize, params: &WindowParams) -> Result<Vec<Window>, WindowError> {
    let ctx = params.ctx;
    if ctx < 2 {
        return Err(WindowError::CtxTooSmall(ctx));
    }
    let limit = params.max_windows.unwrap_or(usize::MAX);
    let mut out = Vec::new();
    let mut push = |prefix: Option<u32>, range: Range<usize>, scored: Range<usize>| {
        let index = out.len();
        out.push(Window {
            index,
            prefix,
            range,
            scored,
        });
        out.len() < limit
    };
    if limit == 0 {
        return Ok(out);
    }
    match params.method {
        Method::Exl3 => {
            if params.stride == 0 {
                return Err(WindowError::ZeroStride);
            }
            let mut start = 0;
            while start + ctx <= n {
                if !push(None, start..start + ctx, 1..ctx) {
                    break;
                }
                start += params.stride;
            }
        }
        Method::Disjoint => {
            let step = ctx - 1;
            let mut start = 0;
            while start + 1 < n {
                let end = (start + ctx).min(n);
                if !push(None, start..end, 1..end - start) {
                    break;
                }
                start += step;
            }
        }
        Method::Rolling => {
            let prefix = params.prefix_token.ok_or(WindowError::NoPrefix)?;
            if n == 0 {
                return Ok(out);
            }
            let m = ctx - 1;
            let first = m.min(n);
            let mut more = push(Some(prefix), 0..first, 1..first + 1);
            let mut predicted = first;
            while more && predicted < n {
                let w = (n - predicted).min(m);
                let end = predicted + w;
                let start = end - m - 1;
                more = push(None, start..end, (m + 1 - w)..(m + 1));
                predicted = end;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(method: Method, ctx: usize, stride: usize) -> WindowParams {
        WindowParams {
            method,
            ctx,
            stride,
            prefix_token: Some(u32::MAX),
            max_windows: None,
        }
    }

    /// lm-eval's own gold test (`test_get_rolling_token_windows_v1`, max_seq_len 10, 34 tokens),
    /// after `make_disjoint_window`, expressed as full request sequences.
    #[test]
    fn rolling_matches_lm_eval_gold() {
        let toks: Vec<u32> = (0..34).collect();
        let ws = windows(34, &params(Method::Rolling, 11, 0)).unwrap();
        let p = u32::MAX;
        let mut expected: Vec<(Vec<u32>, Vec<u32>)> = vec![];
        // (input + last prediction, predictions)
        let mut first = vec![p];
        first.extend(0..10);
        expected.push((first, (0..10).collect()));
        expected.push(((9..20).collect(), (10..20).collect()));
        expected.push(((19..30).collect(), (20..30).collect()));
        expected.push(((23..34).collect(), (30..34).collect()));
        assert_eq!(ws.len(), expected.len());
        for (w, (seq, preds)) in ws.iter().zip(expected) {
            assert_eq!(w.sequence(&toks), seq);
            let got: Vec<u32> = w.predicted().map(|i| toks[i]).collect();
            assert_eq!(got, preds);
        }
    }

    #[test]
    fn exl3_small() {
        let ws = windows(10, &params(Method::Exl3, 4, 3)).unwrap();
        let ranges: Vec<_> = ws.iter().map(|w| w.range.clone()).collect();
        assert_eq!(ranges, vec![0..4, 3..7, 6..10]);
        assert!(ws.iter().all(|w| w.scored == (1..4)));
    }

    /// Long-context windows (`--ctx 32768 --stride 8192`) over WikiText-2's 340k tokens: every
    /// full window, 8192 apart, each scoring all its positions, the last ending before the text.
    #[test]
    fn exl3_long_context() {
        let n = 340_000;
        let ws = windows(n, &params(Method::Exl3, 32768, 8192)).unwrap();
        assert_eq!(ws.len(), (n - 32768) / 8192 + 1);
        for (k, w) in ws.iter().enumerate() {
            assert_eq!(w.range, k * 8192..k * 8192 + 32768);
            assert_eq!((w.scored.clone(), w.len()), (1..32768, 32768));
        }
        assert!(ws.last().unwrap().range.end + 8192 > n);
        let ws = windows(n, &params(Method::Disjoint, 131072, 0)).unwrap();
        assert_eq!(ws.len(), 3);
        assert_eq!(ws.iter().map(Window::num_scored).sum::<usize>(), n - 1);
    }

    #[test]
    fn disjoint_small() {
        let ws = windows(10, &params(Method::Disjoint, 4, 0)).unwrap();
        let ranges: Vec<_> = ws.iter().map(|w| w.range.clone()).collect();
        assert_eq!(ranges, vec![0..4, 3..7, 6..10]);
        let ws = windows(11, &params(Method::Disjoint, 4, 0)).unwrap();
        assert_eq!(ws.last().unwrap().range, 9..11);
        assert_eq!(ws.last().unwrap().scored, 1..2);
    }

    #[test]
    fn max_windows_truncates() {
        let mut p = params(Method::Exl3, 4, 1);
        p.max_windows = Some(2);
        assert_eq!(windows(100, &p).unwrap().len(), 2);
        p.max_windows = Some(0);
        assert!(windows(100, &p).unwrap().is_empty());
    }

    #[test]
    fn invalid_params() {
        assert_eq!(
            windows(10, &params(Method::Exl3, 1, 1)),
            Err(WindowError::CtxTooSmall(1))
        );
        assert_eq!(
            windows(10, &params(Method::Exl3, 4, 0)),
            Err(WindowError::ZeroStride)
        );
        let mut p = params(Method::Rolling, 4, 0);
        p.prefix_token = None;
        assert_eq!(windows(10, &p), Err(WindowError::NoPrefix));
    }
}

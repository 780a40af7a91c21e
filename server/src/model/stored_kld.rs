//! KL(P_ref ‖ Q) against a stored reference: the reference's K most likely tokens with their
//! log-probabilities and the log of the mass of all the others, without the reference model.
//! The top-K part is exact; for the tail the served model's own distribution gives a rigorous
//! interval (docs/stored-reference.md derives it): the bounds contain the divergence of the
//! full reference for every reference distribution consistent with the stored numbers.

use crate::ops::{ServedTail, TailBudget};

/// Half-width, in log space, of the interval a stored f32 log-probability `v` stands for:
/// rounding a value computed in f64 to f32 moves it by at most 2^-24 |v|; twice that plus an
/// absolute 2^-23 also covers the f64 log-sum-exp it came from.
pub fn stored_log_halfwidth(v: f32) -> f64 {
    (f64::from(v).abs() + 1.0) * f64::powi(2.0, -23)
}

/// The stored reference at one position: its K most likely tokens (best first) with their
/// log-probabilities, and log Σ p over every other token (−∞ when there is none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StoredRow<'a> {
    pub ids: &'a [u32],
    pub logprobs: &'a [f32],
    pub tail_logmass: f32,
}

/// What one stored row lets the tail's reference distribution be: its mass P_T lies in
/// `[mass_low, mass_high]` and every tail probability is at most `cap` (a tail token is no
/// likelier than the K-th, and no likelier than the whole tail).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TailSet {
    pub mass_low: f64,
    pub mass_high: f64,
    pub cap: f64,
    /// Tokens outside the top K.
    pub tokens: usize,
}

impl StoredRow<'_> {
    /// The set of tail distributions the stored numbers allow, for a `vocab`-token model.
    pub fn tail_set(&self, vocab: usize) -> TailSet {
        let width = stored_log_halfwidth(self.tail_logmass);
        let log_mass = f64::from(self.tail_logmass);
        let (mass_low, mass_high) = if log_mass == f64::NEG_INFINITY {
            (0.0, 0.0)
        } else {
            ((log_mass - width).exp(), (log_mass + width).exp().min(1.0))
        };
        let last = self.logprobs.last().map_or(0.0, |&v| {
            (f64::from(v) + stored_log_halfwidth(v)).exp().min(1.0)
        });
        TailSet {
            mass_low,
            mass_high,
            cap: last.min(mass_high),
            tokens: vocab.saturating_sub(self.ids.len()),
        }
    }
}

impl TailSet {
    /// The mass and cap at which the served model's worst tail is needed: the largest mass
    /// (the worst tail only grows with it, every −ln q being ≥ 0). A cap too small to place
    /// that mass on the tail's tokens (only possible through the widening) is raised to
    /// mass / tokens, which enlarges the set and keeps the bound.
    pub fn budget(&self) -> TailBudget {
        TailBudget {
            mass: self.mass_high,
            cap: self.cap(),
        }
    }

    fn cap(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.cap.max(self.mass_high / self.tokens as f64)
        }
    }
}

/// The divergence at one position from a stored reference, in nats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundedKld {
    /// Σ over the stored top K of p·(log p − log q), at the stored log-probabilities.
    pub top_k: f64,
    /// `top_k` + P_T·log(P_T / Q_T): the tail as one token (what top-K caches report).
    pub estimate: f64,
    /// Rigorous bounds of the full divergence.
    pub lower: f64,
    pub upper: f64,
    /// The served model's log p(next token).
    pub logprob: f32,
    /// The served model's mass outside the reference's top K (Q_T).
    pub tail_mass: f64,
    /// Whether the served model's most likely token is the reference's.
    pub same_top: bool,
}

/// p·(ln p − ln q) and its extremes over p ∈ [p_low, p_high]: convex in p with its minimum
/// −q/e at p = q/e, so the maximum lies at an end and the minimum at an end or there.
fn term_range(p_low: f64, p_high: f64, log_q: f64) -> (f64, f64) {
    let term = |p: f64| if p == 0.0 { 0.0 } else { p * (p.ln() - log_q) };
    let (a, b) = (term(p_low), term(p_high));
    let vertex = (log_q - 1.0).exp();
    let low = if (p_low..=p_high).contains(&vertex) {
        -vertex
    } else {
        a.min(b)
    };
    (low, a.max(b))
}

/// max Σ p·ln p over {0 ≤ p_j ≤ cap, Σ p_j = mass}: convex, so largest at a vertex, and
/// every vertex holds ⌊mass/cap⌋ tokens at the cap and the remainder on one more.
pub fn max_neg_entropy(mass: f64, cap: f64) -> f64 {
    if mass <= 0.0 || cap <= 0.0 {
        return 0.0;
    }
    let full = (mass / cap).floor();
    let rest = (mass - full * cap).max(0.0);
    let xlnx = |x: f64| if x > 0.0 { x * x.ln() } else { 0.0 };
    full * xlnx(cap) + xlnx(rest)
}

/// [`max_neg_entropy`] over every mass in `[low, high]`: continuous, and convex between
/// multiples of `cap`, so the largest at an end or at the first multiple inside (the
/// value k·cap·ln cap falls with k).
pub fn max_neg_entropy_over(low: f64, high: f64, cap: f64) -> f64 {
    let mut best = max_neg_entropy(low, cap).max(max_neg_entropy(high, cap));
    if cap > 0.0 {
        let first = (low / cap).ceil() * cap;
        if first > low && first < high {
            best = best.max(max_neg_entropy(first, cap));
        }
    }
    best
}

/// The bounded divergence at one position from the stored row and the served model's side.
pub fn bounded_kld(row: &StoredRow<'_>, tail: &TailSet, served: &ServedTail) -> BoundedKld {
    let (mut top_k, mut lower, mut upper, mut magnitude) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&v, &log_q) in row.logprobs.iter().zip(&served.logprobs) {
        let (v64, width) = (f64::from(v), stored_log_halfwidth(v));
        let nominal = v64.exp() * (v64 - log_q);
        let (low, high) = term_range((v64 - width).exp(), (v64 + width).exp(), log_q);
        top_k += nominal;
        lower += low;
        upper += high;
        magnitude += nominal.abs();
    }
    let log_q_tail = served.log_tail_mass;
    // The tail collapsed to one token: log-sum inequality, so a lower bound at every P_T.
    let collapsed = |mass: f64| {
        if mass == 0.0 {
            0.0
        } else {
            mass * (mass.ln() - log_q_tail)
        }
    };
    let nominal_mass = if row.tail_logmass == f32::NEG_INFINITY {
        0.0
    } else {
        f64::from(row.tail_logmass).exp()
    };
    let vertex = (log_q_tail - 1.0).exp();
    let tail_lower = if (tail.mass_low..=tail.mass_high).contains(&vertex) {
        -vertex
    } else {
        collapsed(tail.mass_low).min(collapsed(tail.mass_high))
    };
    // Σ p ln p + Σ p (−ln q), each at its own maximum; the second grows with the mass.
    let tail_upper = if tail.mass_high == 0.0 {
        0.0
    } else {
        max_neg_entropy_over(tail.mass_low, tail.mass_high, tail.cap()) + served.worst_tail
    };
    let estimate_tail = collapsed(nominal_mass);
    magnitude += tail_upper.abs() + tail_lower.abs();
    // The sums above are f64: allow their rounding (far below the f32 widening).
    let slack = 1e-12 * (1.0 + magnitude);
    BoundedKld {
        top_k,
        estimate: top_k + estimate_tail,
        lower: lower + tail_lower - slack,
        upper: upper + tail_upper + slack,
        logprob: served.target_logprob,
        tail_mass: log_q_tail.exp(),
        same_top: row.ids.first() == Some(&served.argmax),
    }
}

/// A stored reference for one sequence: `k` entries a row for the positions `start..start +
/// rows` (each predicting a known token), row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredSequence {
    pub start: usize,
    pub k: usize,
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub tail_logmass: Vec<f32>,
}

impl StoredSequence {
    pub fn row(&self, i: usize) -> StoredRow<'_> {
        let at = i * self.k..(i + 1) * self.k;
        StoredRow {
            ids: &self.ids[at.clone()],
            logprobs: &self.logprobs[at],
            tail_logmass: self.tail_logmass[i],
        }
    }

    pub fn rows(&self) -> usize {
        self.tail_logmass.len()
    }
}

/// What a scoring pass computes at each position beyond the log-probabilities of `/score`.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum StoredRequest {
    #[default]
    None,
    /// The reference's side: its `k` most likely tokens and its tail's log-mass
    /// (`/reference`).
    Save { k: usize },
    /// The served model bounded against a stored reference (`/kld/stored`).
    Bound(std::sync::Arc<StoredSequence>),
}

impl StoredRequest {
    pub const NONE: &'static StoredRequest = &StoredRequest::None;
}

/// What [`StoredRequest`] yields for one sequence: a reference row per position that predicts
/// a known token, or a bound per stored row.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum StoredOutput {
    #[default]
    None,
    Reference(Vec<crate::ops::ReferenceRow>),
    Bounded(Vec<BoundedKld>),
}

impl StoredOutput {
    /// The first row holding a NaN (an infinity is a valid bound or tail log-mass).
    pub fn first_nan(&self) -> Option<usize> {
        match self {
            StoredOutput::None => None,
            StoredOutput::Reference(rows) => rows
                .iter()
                .position(|r| r.logprobs.iter().any(|v| !v.is_finite()) || r.tail_logmass.is_nan()),
            StoredOutput::Bounded(rows) => rows.iter().position(|b| {
                [b.top_k, b.estimate, b.lower, b.upper]
                    .iter()
                    .any(|v| v.is_nan())
                    || !b.logprob.is_finite()
            }),
        }
    }
}

/// The stored-reference rows of one chunk of logits `[rows, vocab]` whose rows are the
/// positions `start..start + rows` of a sequence (`targets`: their next tokens).
pub fn stored_rows(
    request: &StoredRequest,
    logits: &candle_core::Tensor,
    start: usize,
    targets: &[u32],
    out: &mut StoredOutput,
) -> candle_core::Result<()> {
    let vocab = logits.dim(1)?;
    // The chunk may end with the last position, which predicts nothing known.
    let logits = logits.narrow(0, 0, targets.len())?;
    match (request, out) {
        (StoredRequest::None, _) => {}
        (StoredRequest::Save { k }, StoredOutput::Reference(rows)) => {
            rows.extend(crate::ops::reference_rows(&logits, *k)?);
        }
        (StoredRequest::Bound(stored), StoredOutput::Bounded(rows)) => {
            // The positions of this chunk that the stored rows cover.
            let first = start.max(stored.start);
            let end = (start + targets.len()).min(stored.start + stored.rows());
            if first >= end {
                return Ok(());
            }
            let logits = logits.narrow(0, first - start, end - first)?;
            let targets = &targets[first - start..end - start];
            let stored_rows: Vec<StoredRow<'_>> =
                (first..end).map(|i| stored.row(i - stored.start)).collect();
            let tails: Vec<TailSet> = stored_rows.iter().map(|r| r.tail_set(vocab)).collect();
            let ids: Vec<&[u32]> = stored_rows.iter().map(|r| r.ids).collect();
            let budgets: Vec<TailBudget> = tails.iter().map(TailSet::budget).collect();
            let served = crate::ops::served_tail_rows(&logits, &ids, targets, &budgets)?;
            rows.extend(
                stored_rows
                    .iter()
                    .zip(&tails)
                    .zip(&served)
                    .map(|((row, tail), served)| bounded_kld(row, tail, served)),
            );
        }
        (_, out) => {
            candle_core::bail!("stored-reference output {out:?} does not match its request")
        }
    }
    Ok(())
}

impl StoredRequest {
    /// The empty output this request fills.
    pub fn output(&self) -> StoredOutput {
        match self {
            StoredRequest::None => StoredOutput::None,
            StoredRequest::Save { .. } => StoredOutput::Reference(Vec::new()),
            StoredRequest::Bound(_) => StoredOutput::Bounded(Vec::new()),
        }
    }
}

//! The pure, synchronous queue of sequences waiting to be scored. No runtime, no locks, no
//! clocks beyond the timestamp each entry carries: the batcher owns the concurrency, this
//! module owns the policy (strict FIFO under a token and a sequence budget).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use super::{Computed, EngineError};
use crate::model::{DiffOptions, SequenceDiff, SequenceKld, SequenceScores, StoredRequest};

/// Where the engine sends the outcome of one sequence.
pub type Reply<T> = oneshot::Sender<Result<Computed<T>, EngineError>>;

/// One sequence waiting to be computed.
#[derive(Debug)]
pub struct Entry {
    pub tokens: Vec<u32>,
    pub enqueued: Instant,
    pub task: Task,
}

/// What to compute for a sequence; `/score` and `/kld` share one queue and one batch budget.
#[derive(Debug)]
pub enum Task {
    /// Log-probabilities under the served model, with the `top_k` best tokens per position.
    Score {
        top_k: usize,
        /// A stored reference's rows to write or to bound against (`/reference`,
        /// `/kld/stored`).
        stored: StoredRequest,
        reply: Reply<SequenceScores>,
    },
    /// Divergence of the served model from the reference model at every position.
    Kld { reply: Reply<SequenceKld> },
    /// Both models compared after every decoder layer (`/diff`); the options are shared by
    /// the sequences of one request.
    Diff {
        options: Arc<DiffOptions>,
        reply: Reply<SequenceDiff>,
    },
}

impl Entry {
    /// The HTTP handler drops its receiver when the client goes away or the request times out.
    pub fn is_cancelled(&self) -> bool {
        match &self.task {
            Task::Score { reply, .. } => reply.is_closed(),
            Task::Kld { reply } => reply.is_closed(),
            Task::Diff { reply, .. } => reply.is_closed(),
        }
    }
}

impl Entry {
    /// Answers the entry with `error` instead of computing it.
    pub fn fail(self, error: EngineError) {
        match self.task {
            Task::Score { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Task::Kld { reply } => {
                let _ = reply.send(Err(error));
            }
            Task::Diff { reply, .. } => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

/// Counts sequences dropped uncomputed because their client went away (or timed out):
/// `exactscore_sequences_cancelled_total`.
pub fn count_cancelled(n: usize) {
    if n > 0 {
        metrics::counter!("exactscore_sequences_cancelled_total").increment(n as u64);
    }
}

/// How much one batch may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Sum of sequence lengths in one batch.
    pub max_batch_tokens: usize,
    /// Sequences in one batch.
    pub max_batch_requests: usize,
}

/// Two lanes: `/score` and `/kld` sequences in `entries`, `/diff` ones in `diffs` (computed by
/// a thread of their own, see `worker::spawn`), each in arrival order.
#[derive(Debug)]
pub struct State {
    entries: VecDeque<Entry>,
    diffs: VecDeque<Entry>,
    limits: BatchLimits,
}

impl State {
    pub fn new(limits: BatchLimits) -> Self {
        Self {
            entries: VecDeque::new(),
            diffs: VecDeque::new(),
            limits,
        }
    }

    pub fn push(&mut self, entry: Entry) {
        match entry.task {
            Task::Diff { .. } => self.diffs.push_back(entry),
            _ => self.entries.push_back(entry),
        }
    }

    /// Sequences waiting in both lanes (cancelled ones included until the next
    /// `drop_cancelled`).
    pub fn len(&self) -> usize {
        self.entries.len() + self.diffs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty() && self.diffs.is_empty()
    }

    /// Takes every waiting entry out of the queue (to answer them with an error).
    pub fn take_all(&mut self) -> Vec<Entry> {
        self.entries.drain(..).chain(self.diffs.drain(..)).collect()
    }

    /// Removes entries whose client is gone, so they are never computed. Returns how many.
    pub fn drop_cancelled(&mut self) -> usize {
        let before = self.len();
        self.entries.retain(|e| !e.is_cancelled());
        self.diffs.retain(|e| !e.is_cancelled());
        let dropped = before - self.len();
        count_cancelled(dropped);
        dropped
    }

    /// The next batch of the `/diff` lane: the head request's sequences (entries that share
    /// its options), under both budgets; a head longer than the token budget alone.
    pub fn next_diff_batch(&mut self) -> Vec<Entry> {
        self.drop_cancelled();
        let options = |e: &Entry| match &e.task {
            Task::Diff { options, .. } => Some(options.clone()),
            _ => None,
        };
        let Some(first) = self.diffs.front().and_then(options) else {
            return Vec::new();
        };
        let mut batch = Vec::new();
        let mut tokens = 0;
        while let Some(head) = self.diffs.front() {
            let len = head.tokens.len();
            let same = options(head).is_some_and(|o| Arc::ptr_eq(&o, &first));
            let fits = tokens + len <= self.limits.max_batch_tokens;
            if !same
                || batch.len() >= self.limits.max_batch_requests
                || (!fits && !batch.is_empty())
            {
                break;
            }
            tokens += len;
            batch.extend(self.diffs.pop_front());
            if !fits {
                break;
            }
        }
        batch
    }

    /// The batch to hand the engine now: a full one as soon as the queue holds it, a partial
    /// one only when the engine waits for work (`engine_idle`). A partial batch formed while
    /// the engine computes would run next with fewer sequences than arrive before the engine
    /// is free, and a forward over fewer windows costs more per window on a GPU.
    pub fn take_batch(&mut self, engine_idle: bool) -> Vec<Entry> {
        self.drop_cancelled();
        if engine_idle || self.holds_full_batch() {
            self.next_batch()
        } else {
            Vec::new()
        }
    }

    /// Whether [`Self::next_batch`] would end at a budget rather than at the end of the queue.
    fn holds_full_batch(&self) -> bool {
        let mut tokens = 0;
        self.entries.iter().enumerate().any(|(n, e)| {
            tokens += e.tokens.len();
            n + 1 >= self.limits.max_batch_requests || tokens >= self.limits.max_batch_tokens
        })
    }

    /// Takes the next batch: entries in arrival order while both budgets hold. Stops at the
    /// first entry that does not fit (no overtaking, so a long sequence is never starved).
    /// A head entry longer than the token budget is taken alone rather than left stuck.
    pub fn next_batch(&mut self) -> Vec<Entry> {
        self.drop_cancelled();
        let mut batch = Vec::new();
        let mut tokens = 0;
        while let Some(head) = self.entries.front() {
            let len = head.tokens.len();
            let fits = tokens + len <= self.limits.max_batch_tokens;
            if batch.len() >= self.limits.max_batch_requests || (!fits && !batch.is_empty()) {
                break;
            }
            tokens += len;
            batch.extend(self.entries.pop_front());
            if !fits {
                break; // oversize head, alone
            }
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type ScoreReceiver = oneshot::Receiver<Result<Computed<SequenceScores>, EngineError>>;

    fn entry(len: usize) -> (Entry, ScoreReceiver) {
        let (tx, rx) = oneshot::channel();
        let e = Entry {
            tokens: vec![len as u32; len],
            enqueued: Instant::now(),
            task: Task::Score {
                top_k: 0,
                stored: StoredRequest::None,
                reply: tx,
            },
        };
        (e, rx)
    }

    fn state(tokens: usize, requests: usize) -> State {
        State::new(BatchLimits {
            max_batch_tokens: tokens,
            max_batch_requests: requests,
        })
    }

    fn lens(batch: &[Entry]) -> Vec<usize> {
        batch.iter().map(|e| e.tokens.len()).collect()
    }

    #[test]
    fn fifo_order_is_kept() {
        let mut s = state(100, 10);
        let mut keep = Vec::new();
        for len in [3, 1, 2] {
            let (e, rx) = entry(len);
            s.push(e);
            keep.push(rx);
        }
        assert_eq!(lens(&s.next_batch()), vec![3, 1, 2]);
        assert!(s.is_empty());
        assert!(s.next_batch().is_empty());
    }

    #[test]
    fn token_budget_splits_batches_without_overtaking() {
        let mut s = state(10, 10);
        let mut keep = Vec::new();
        for len in [4, 5, 3, 1] {
            let (e, rx) = entry(len);
            s.push(e);
            keep.push(rx);
        }
        // 4 + 5 = 9; 3 does not fit, and 1 must not overtake it.
        assert_eq!(lens(&s.next_batch()), vec![4, 5]);
        assert_eq!(lens(&s.next_batch()), vec![3, 1]);
    }

    #[test]
    fn request_budget_caps_batch_size() {
        let mut s = state(1000, 2);
        let mut keep = Vec::new();
        for _ in 0..5 {
            let (e, rx) = entry(1);
            s.push(e);
            keep.push(rx);
        }
        assert_eq!(s.next_batch().len(), 2);
        assert_eq!(s.next_batch().len(), 2);
        assert_eq!(s.next_batch().len(), 1);
    }

    #[test]
    fn cancelled_entries_are_dropped_before_compute() {
        let mut s = state(100, 10);
        let (a, rx_a) = entry(1);
        let (b, rx_b) = entry(2);
        let (c, rx_c) = entry(3);
        s.push(a);
        s.push(b);
        s.push(c);
        drop(rx_b); // client of b went away
        assert_eq!(s.len(), 3);
        assert_eq!(lens(&s.next_batch()), vec![1, 3]);
        drop((rx_a, rx_c));
    }

    #[test]
    fn drop_cancelled_reports_count() {
        let mut s = state(100, 10);
        let (a, rx_a) = entry(1);
        let (b, _rx_b) = entry(2);
        s.push(a);
        s.push(b);
        drop(rx_a);
        assert_eq!(s.drop_cancelled(), 1);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn oversize_head_runs_alone() {
        let mut s = state(10, 10);
        let mut keep = Vec::new();
        for len in [25, 2, 2] {
            let (e, rx) = entry(len);
            s.push(e);
            keep.push(rx);
        }
        assert_eq!(lens(&s.next_batch()), vec![25]);
        assert_eq!(lens(&s.next_batch()), vec![2, 2]);
    }

    fn push_all(s: &mut State, lens: &[usize]) -> Vec<ScoreReceiver> {
        lens.iter()
            .map(|&len| {
                let (e, rx) = entry(len);
                s.push(e);
                rx
            })
            .collect()
    }

    #[test]
    fn partial_batch_waits_for_an_idle_engine() {
        let mut s = state(10, 4);
        let _keep = push_all(&mut s, &[3, 4]);
        assert!(s.take_batch(false).is_empty());
        assert_eq!(s.len(), 2);
        assert_eq!(lens(&s.take_batch(true)), vec![3, 4]);
    }

    #[test]
    fn full_batch_goes_while_the_engine_computes() {
        // The token budget reached exactly, then exceeded by the next entry.
        let mut s = state(10, 4);
        let _keep = push_all(&mut s, &[4, 6, 5, 1]);
        assert_eq!(lens(&s.take_batch(false)), vec![4, 6]);
        assert!(s.take_batch(false).is_empty());
        // The request budget.
        let mut s = state(100, 2);
        let _keep = push_all(&mut s, &[1, 1, 1]);
        assert_eq!(lens(&s.take_batch(false)), vec![1, 1]);
        assert!(s.take_batch(false).is_empty());
        assert_eq!(lens(&s.take_batch(true)), vec![1]);
        // An oversize head is a full batch on its own.
        let mut s = state(10, 4);
        let _keep = push_all(&mut s, &[25, 2]);
        assert_eq!(lens(&s.take_batch(false)), vec![25]);
    }

    #[test]
    fn cancelled_entries_do_not_count_towards_a_full_batch() {
        let mut s = state(10, 4);
        let (a, rx_a) = entry(8);
        let (b, _rx_b) = entry(3);
        s.push(a);
        s.push(b);
        drop(rx_a);
        assert!(s.take_batch(false).is_empty());
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn oversize_entry_waits_behind_a_partial_batch() {
        let mut s = state(10, 10);
        let mut keep = Vec::new();
        for len in [2, 25] {
            let (e, rx) = entry(len);
            s.push(e);
            keep.push(rx);
        }
        assert_eq!(lens(&s.next_batch()), vec![2]);
        assert_eq!(lens(&s.next_batch()), vec![25]);
    }
}

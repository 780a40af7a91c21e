//! The scoring engine: a pure queue ([`queue::State`]), a batcher task that forms batches from
//! it ([`batcher::Scheduler`]) and one OS thread that owns the model ([`worker`]). The
//! [`Engine`] trait is the seam between that machinery and the model, so HTTP tests can run
//! the real queue and batcher over a [`fake::FakeEngine`].

pub mod batcher;
pub mod fake;
pub mod fault;
pub mod pipeline;
pub mod queue;
pub mod stage_thread;
pub mod worker;

use std::sync::Arc;
use std::time::Duration;

use crate::model::{DiffOptions, ScoreInput, SequenceDiff, SequenceKld, SequenceScores};

pub use batcher::Scheduler;
pub use pipeline::{MicroBatching, ModelEngine};
pub use queue::BatchLimits;
pub use stage_thread::IdleHook;

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// The model failed on a batch (details are logged, not returned to clients).
    #[error("scoring failed: {0}")]
    Compute(String),
    #[error("the engine has stopped")]
    Stopped,
    /// A divergence was asked of an engine that has no reference model.
    #[error("no reference model is loaded")]
    NoReference,
    /// The device ran out of memory, even for the sequence alone (batches are retried in
    /// halves first; see [`fault::with_halving`]).
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    /// A sticky device error: the device accepts no more work and the server must restart.
    #[error("device lost: {0}")]
    DeviceLost(String),
    /// The drain timeout passed during a shutdown before this sequence was computed.
    #[error("the server shut down before this sequence was computed")]
    Abandoned,
    /// Every replica has been taken out of rotation after failing.
    #[error("no replica is in rotation")]
    NoReplica,
    /// A sequence's output holds a NaN or an infinity: the next-token distribution after
    /// token `position` (see [`Computed::checked`]). Never served as a number.
    #[error("the model's output is not finite at position {position}")]
    NonFinite { position: usize },
    /// Nobody waits for the sequences of the call any more (their clients hung up or timed
    /// out): the engine stopped at a layer or module boundary.
    #[error("nobody waits for this sequence any more")]
    Cancelled,
}

/// Whether anyone still waits for each sequence of one engine call. The engine asks at its
/// boundaries (before each decoder layer, each attributed module, each chunk of logits): it
/// stops with [`EngineError::Cancelled`] once nobody waits for any of them, and where it can
/// (the pipelined forward of `/score` and `/kld`) drops the sequences nobody waits for from
/// the rest of the pass, answering `None` for them ([`Answers`]).
#[derive(Clone, Default)]
pub struct Cancel {
    /// Whether nobody waits for sequence `i` any more, numbered over the whole call.
    gone: Option<Arc<dyn Fn(usize) -> bool + Send + Sync>>,
    /// This part's sequences in `gone`'s numbering (a micro-batch, a half after an OOM).
    first: usize,
    count: usize,
}

impl Cancel {
    /// Never cancelled (warm-up, benches, tests).
    pub fn never() -> Self {
        Self::default()
    }

    /// `count` sequences, sequence `i` cancelled once `gone(i)` returns true.
    pub fn per_sequence(
        count: usize,
        gone: impl Fn(usize) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self {
            gone: Some(Arc::new(gone)),
            first: 0,
            count,
        }
    }

    /// The same watch over sequences `range` of this part, numbered from 0.
    pub fn part(&self, range: std::ops::Range<usize>) -> Self {
        Self {
            gone: self.gone.clone(),
            first: self.first + range.start,
            count: range.len(),
        }
    }

    /// Whether nobody waits for sequence `i` of this part any more.
    pub fn is_gone(&self, i: usize) -> bool {
        self.gone.as_ref().is_some_and(|gone| gone(self.first + i))
    }

    /// Whether nobody waits for any sequence of this part.
    pub fn is_cancelled(&self) -> bool {
        self.gone.is_some() && (0..self.count).all(|i| self.is_gone(i))
    }

    /// `Err(Cancelled)` once nobody waits.
    pub fn check(&self) -> Result<(), EngineError> {
        if self.is_cancelled() {
            Err(EngineError::Cancelled)
        } else {
            Ok(())
        }
    }
}

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.gone {
            Some(_) => write!(
                f,
                "Cancel(sequences {}..{})",
                self.first,
                self.first + self.count
            ),
            None => f.write_str("Cancel(never)"),
        }
    }
}

/// The answers of one engine call, in input order: `None` for a sequence that the engine
/// dropped from the pass because nobody waited for it any more ([`Cancel`]).
pub type Answers<T> = Vec<Option<T>>;

/// Runs one batch. Implemented by the model ([`ModelEngine`]), and by a fake for tests.
/// Called from the worker threads of one replica ([`Engine::concurrency`] of them).
pub trait Engine: Send + Sync + 'static {
    /// Scores every input; results in input order. `cancel`: see [`Cancel`].
    fn score(
        &self,
        batch: &[ScoreInput<'_>],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceScores>, EngineError>;

    /// KL-divergence from the reference model at every position of every sequence; results
    /// in input order.
    fn kld(
        &self,
        sequences: &[&[u32]],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceKld>, EngineError>;

    /// `/diff`: the served model against the reference after every decoder layer, the final
    /// divergence and the attributed modules' ones; results in input order. Runs on a lane
    /// of its own (a thread beside the scoring workers): an engine lets other batches in at
    /// its layer and module boundaries, so a long attribution does not starve small requests.
    fn diff(
        &self,
        sequences: &[&[u32]],
        options: &DiffOptions,
        cancel: &Cancel,
    ) -> Result<Answers<SequenceDiff>, EngineError> {
        let _ = (sequences, options, cancel);
        Err(EngineError::NoReference)
    }

    /// What `/diff` can do here.
    fn diff_support(&self) -> DiffSupport {
        DiffSupport::NoReference
    }

    /// Batches computed at once: a pipeline of several stages overlaps consecutive batches.
    fn concurrency(&self) -> usize {
        1
    }

    /// Whether a batch handed over now would start at once (the first stage is free), so the
    /// batcher may send a partial batch instead of waiting for it to fill.
    fn first_stage_free(&self) -> bool {
        true
    }

    /// `hook` runs whenever the first stage becomes free.
    fn on_first_stage_free(&self, hook: IdleHook) {
        let _ = hook;
    }

    /// The drain timeout passed: work not yet started fails with [`EngineError::Abandoned`].
    fn abandon(&self) {}
}

/// Whether the two models of an engine can be compared layer by layer (`/diff`).
#[derive(Debug, Clone, PartialEq)]
pub enum DiffSupport {
    NoReference,
    /// A reference that `/kld` can use but `/diff` cannot: why (layer count, hidden size).
    Incompatible(String),
    Ready {
        layers: usize,
        /// The served modules whose weights differ in format from the reference's (what
        /// attribution can swap, as `Model::linears` names them), with their served format.
        modules: Vec<(String, String)>,
    },
}

/// The outcome of one sequence (`T`: its scores or its divergences), with the timings of the
/// batch that computed it.
#[derive(Debug, Clone, PartialEq)]
pub struct Computed<T> {
    pub output: T,
    /// Time from submission to the start of its batch.
    pub queue_time: Duration,
    /// Compute time of its whole batch.
    pub compute_time: Duration,
    /// Identifies the batch, so a request split over several batches counts each once.
    pub batch_id: u64,
}

/// A sequence scored by `/score`.
pub type ScoredSequence = Computed<SequenceScores>;

/// An output whose numbers can be checked to be finite, position by position.
pub trait Finite {
    /// The first position whose numbers are not all finite.
    fn first_non_finite(&self) -> Option<usize>;
}

impl Finite for SequenceScores {
    fn first_non_finite(&self) -> Option<usize> {
        SequenceScores::first_non_finite(self)
    }
}

impl Finite for SequenceKld {
    fn first_non_finite(&self) -> Option<usize> {
        SequenceKld::first_non_finite(self)
    }
}

impl Finite for SequenceDiff {
    fn first_non_finite(&self) -> Option<usize> {
        SequenceDiff::first_non_finite(self)
    }
}

impl<T: Finite> Computed<T> {
    /// `self`, or [`EngineError::NonFinite`] (logged and counted in
    /// `exactscore_numerical_errors_total`) when one of its numbers is a NaN or an infinity.
    /// O(positions) over the few numbers per position that left the device, never the logits.
    pub fn checked(self) -> Result<Self, EngineError> {
        match self.output.first_non_finite() {
            None => Ok(self),
            Some(position) => {
                tracing::error!(
                    batch_id = self.batch_id,
                    position,
                    "non-finite model output; not served"
                );
                metrics::counter!("exactscore_numerical_errors_total").increment(1);
                Err(EngineError::NonFinite { position })
            }
        }
    }
}

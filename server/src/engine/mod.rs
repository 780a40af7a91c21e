//! The scoring engine: a pure queue ([`queue::State`]), a batcher task that forms batches from
//! it ([`batcher::Scheduler`]) and one OS thread that owns the model ([`worker`]). The
//! [`Engine`] trait is the seam between that machinery and the model, so HTTP tests can run
//! the real queue and batcher over a [`fake::FakeEngine`].

pub mod batcher;
pub mod fake;
pub mod queue;
pub mod worker;

use std::time::Duration;

use crate::model::{Model, ScoreInput, SequenceScores};

pub use batcher::Scheduler;
pub use queue::BatchLimits;

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// The model failed on a batch (details are logged, not returned to clients).
    #[error("scoring failed: {0}")]
    Compute(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Runs one batch. Implemented by the model, and by a fake for tests.
pub trait Engine: Send + 'static {
    /// Scores every input; results in input order.
    fn score(&mut self, batch: &[ScoreInput<'_>]) -> Result<Vec<SequenceScores>, EngineError>;
}

/// The real engine: a loaded [`Model`].
pub struct ModelEngine(pub Model);

impl Engine for ModelEngine {
    fn score(&mut self, batch: &[ScoreInput<'_>]) -> Result<Vec<SequenceScores>, EngineError> {
        self.0
            .score(batch)
            .map_err(|e| EngineError::Compute(e.to_string()))
    }
}

/// The outcome of one sequence, with the timings of the batch that computed it.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredSequence {
    pub scores: SequenceScores,
    /// Time from submission to the start of its batch.
    pub queue_time: Duration,
    /// Compute time of its whole batch.
    pub compute_time: Duration,
    /// Identifies the batch, so a request split over several batches counts each once.
    pub batch_id: u64,
}

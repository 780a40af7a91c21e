//! What a failed batch means, decided in one place: the device ran out of memory (retry the
//! batch in halves), the device is lost (a sticky CUDA error poisons the context for good: the
//! server must go not-ready and exit for its orchestrator to restart it), or the batch failed
//! on its own (answer the error, keep serving).

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{Answers, Cancel, DiffSupport, Engine, EngineError, IdleHook};
use crate::model::{DiffOptions, ScoreInput, SequenceDiff, SequenceKld, SequenceScores};

/// Driver errors after which the CUDA context accepts no more work: every later call fails
/// the same way, so the process must be restarted.
const STICKY: [&str; 10] = [
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
];

/// Out-of-memory as the CUDA driver, cuBLAS and candle's allocator report it.
const OUT_OF_MEMORY: [&str; 3] = [
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "out of memory",
];

/// Runs `f`, turning a panic into [`EngineError::Compute`]: a panic in the model fails its
/// batch, not the thread every request waits on.
pub fn guarded<T>(f: impl FnOnce() -> Result<T, EngineError>) -> Result<T, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        Err(EngineError::Compute(message))
    })
}

/// The [`EngineError`] of a model error, by what the error says happened on the device.
pub fn classify(error: &candle_core::Error) -> EngineError {
    let message = error.to_string();
    if STICKY.iter().any(|s| message.contains(s)) {
        EngineError::DeviceLost(message)
    } else if OUT_OF_MEMORY.iter().any(|s| message.contains(s)) {
        EngineError::OutOfMemory(message)
    } else {
        EngineError::Compute(message)
    }
}

/// A model error as the engine reports it ([`classify`]), so that engine code can use `?` on
/// model calls.
impl From<candle_core::Error> for EngineError {
    fn from(error: candle_core::Error) -> Self {
        classify(&error)
    }
}

/// Runs `compute` over `items`; when it fails with out-of-memory, runs each half of `items`
/// the same way, recursively, and joins the halves' results in order. A single item that does
/// not fit fails with the out-of-memory error. Each retry is counted in
/// `exactscore_oom_retries_total`. Results must be per item, so that halves join exactly (the
/// model is batch-invariant: a sequence's numbers do not depend on what shares its batch).
pub fn with_halving<I, T>(
    items: &[I],
    compute: &mut impl FnMut(Range<usize>, &[I]) -> Result<Vec<T>, EngineError>,
) -> Result<Vec<T>, EngineError> {
    halving_from(0, items, compute)
}

/// [`with_halving`] over `items`, the part of the whole that starts at `first` (`compute` is
/// given each part's range of the whole).
fn halving_from<I, T>(
    first: usize,
    items: &[I],
    compute: &mut impl FnMut(Range<usize>, &[I]) -> Result<Vec<T>, EngineError>,
) -> Result<Vec<T>, EngineError> {
    match compute(first..first + items.len(), items) {
        Err(EngineError::OutOfMemory(cause)) if items.len() > 1 => {
            metrics::counter!("exactscore_oom_retries_total").increment(1);
            tracing::warn!(
                sequences = items.len(),
                %cause,
                "out of device memory; retrying the batch as two halves"
            );
            let (head, tail) = items.split_at(items.len() / 2);
            let mut out = halving_from(first, head, compute)?;
            out.extend(halving_from(first + head.len(), tail, compute)?);
            Ok(out)
        }
        other => other,
    }
}

/// A fault injected into the real engine (the hidden `--inject-fault` flag), so that process
/// tests can drive the failure paths of the real binary without a failing device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectedFault {
    /// Every batch after the first `n` fails with a sticky device error.
    DeviceLostAfter(usize),
    /// Any batch of more than this many tokens runs out of memory.
    OutOfMemoryAbove(usize),
}

impl std::str::FromStr for InjectedFault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, n) = s
            .split_once(':')
            .ok_or("expected `device-lost-after:N` or `out-of-memory-above:N`")?;
        let n: usize = n.parse().map_err(|_| format!("`{n}` is not a count"))?;
        match kind {
            "device-lost-after" => Ok(Self::DeviceLostAfter(n)),
            "out-of-memory-above" => Ok(Self::OutOfMemoryAbove(n)),
            other => Err(format!("unknown fault `{other}`")),
        }
    }
}

/// `--inject-fault`: a fault, in every replica or (`FAULT@R`) only in replica `R`, so that a
/// multi-replica process test can watch the healthy replicas answer while one fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultInjection {
    pub fault: InjectedFault,
    pub replica: Option<usize>,
}

impl FaultInjection {
    pub fn applies_to(&self, replica: usize) -> bool {
        self.replica.is_none_or(|r| r == replica)
    }
}

impl std::str::FromStr for FaultInjection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (fault, replica) = match s.split_once('@') {
            Some((fault, r)) => {
                let r = r
                    .parse()
                    .map_err(|_| format!("`{r}` is not a replica index"))?;
                (fault, Some(r))
            }
            None => (s, None),
        };
        Ok(Self {
            fault: fault.parse()?,
            replica,
        })
    }
}

/// An engine with an [`InjectedFault`].
pub struct FaultInjecting {
    inner: Arc<dyn Engine>,
    fault: InjectedFault,
    batches: AtomicUsize,
}

impl FaultInjecting {
    pub fn new(inner: Arc<dyn Engine>, fault: InjectedFault) -> Self {
        Self {
            inner,
            fault,
            batches: AtomicUsize::new(0),
        }
    }

    fn check(&self, tokens: usize) -> Result<(), EngineError> {
        let batch = self.batches.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            InjectedFault::DeviceLostAfter(n) if batch >= n => Err(EngineError::DeviceLost(
                "injected: CUDA_ERROR_LAUNCH_FAILED".into(),
            )),
            InjectedFault::OutOfMemoryAbove(limit) if tokens > limit => Err(
                EngineError::OutOfMemory(format!("injected: {tokens} tokens > {limit}")),
            ),
            _ => Ok(()),
        }
    }
}

impl Engine for FaultInjecting {
    fn score(
        &self,
        batch: &[ScoreInput<'_>],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceScores>, EngineError> {
        self.check(batch.iter().map(|b| b.tokens.len()).sum())?;
        self.inner.score(batch, cancel)
    }

    fn kld(
        &self,
        sequences: &[&[u32]],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceKld>, EngineError> {
        self.check(sequences.iter().map(|s| s.len()).sum())?;
        self.inner.kld(sequences, cancel)
    }

    fn diff(
        &self,
        sequences: &[&[u32]],
        options: &DiffOptions,
        cancel: &Cancel,
    ) -> Result<Answers<SequenceDiff>, EngineError> {
        self.check(sequences.iter().map(|s| s.len()).sum())?;
        self.inner.diff(sequences, options, cancel)
    }

    fn diff_support(&self) -> DiffSupport {
        self.inner.diff_support()
    }

    fn concurrency(&self) -> usize {
        self.inner.concurrency()
    }

    fn first_stage_free(&self) -> bool {
        self.inner.first_stage_free()
    }

    fn on_first_stage_free(&self, hook: IdleHook) {
        self.inner.on_first_stage_free(hook)
    }

    fn abandon(&self) {
        self.inner.abandon()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(message: &str) -> candle_core::Error {
        candle_core::Error::Msg(message.into())
    }

    #[test]
    fn an_injection_names_its_replica_or_applies_to_all() {
        let all: FaultInjection = "device-lost-after:3".parse().unwrap();
        assert_eq!(all.fault, InjectedFault::DeviceLostAfter(3));
        assert!(all.applies_to(0) && all.applies_to(5));
        let one: FaultInjection = "out-of-memory-above:64@1".parse().unwrap();
        assert_eq!(one.fault, InjectedFault::OutOfMemoryAbove(64));
        assert!(!one.applies_to(0) && one.applies_to(1));
        let bad = "device-lost-after:3@x"
            .parse::<FaultInjection>()
            .unwrap_err();
        assert!(bad.contains("`x` is not a replica index"), "{bad}");
    }

    #[test]
    fn driver_errors_are_classified_by_their_code() {
        let lost = "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")";
        assert!(matches!(classify(&error(lost)), EngineError::DeviceLost(_)));
        let oom = "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")";
        assert!(matches!(classify(&error(oom)), EngineError::OutOfMemory(_)));
        let other = "shape mismatch in matmul";
        assert!(matches!(classify(&error(other)), EngineError::Compute(_)));
    }

    /// A computation that runs out of memory above 3 items succeeds in halves, in order.
    #[test]
    fn halving_retries_until_the_pieces_fit() {
        let items: Vec<u32> = (0..10).collect();
        let mut calls = Vec::new();
        let mut compute = |range: Range<usize>, part: &[u32]| {
            assert_eq!(range.len(), part.len());
            assert_eq!(items[range].as_ref(), part);
            calls.push(part.len());
            if part.len() > 3 {
                Err(EngineError::OutOfMemory("too big".into()))
            } else {
                Ok(part.iter().map(|i| i * 10).collect())
            }
        };
        let out = with_halving(&items, &mut compute).unwrap();
        assert_eq!(out, (0..10).map(|i| i * 10).collect::<Vec<_>>());
        assert_eq!(calls, [10, 5, 2, 3, 5, 2, 3]);
        // One item that never fits fails with the out-of-memory error.
        let mut never =
            |_, _: &[u32]| -> Result<Vec<u32>, _> { Err(EngineError::OutOfMemory("never".into())) };
        assert!(matches!(
            with_halving(&items, &mut never),
            Err(EngineError::OutOfMemory(_))
        ));
        // Other errors are not retried.
        let mut calls = 0;
        let mut broken = |_, _: &[u32]| -> Result<Vec<u32>, _> {
            calls += 1;
            Err(EngineError::Compute("broken".into()))
        };
        assert!(with_halving(&items, &mut broken).is_err());
        assert_eq!(calls, 1);
    }
}

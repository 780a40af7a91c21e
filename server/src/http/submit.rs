//! What every scoring handler shares: its sequences queued and awaited under the admission and
//! timeout limits, and the usage they report.

use std::collections::HashSet;
use std::time::Duration;

use exactscore_api::Usage;

use super::error::ApiError;
use super::SharedState;
use crate::engine::batcher::ReplyReceiver;
use crate::engine::{Computed, EngineError, Finite, Scheduler};

/// Queues every sequence with `submit` and waits for all of them: bounded by the admission
/// semaphore (429) and the request timeout (504). Shared by `/score`, `/v1/completions`,
/// `/kld` and `/diff`.
pub(crate) async fn submit_and_wait<T: Finite>(
    state: &SharedState,
    sequences: &[Vec<u32>],
    submit: impl Fn(&Scheduler, Vec<u32>) -> ReplyReceiver<T>,
) -> Result<Vec<Computed<T>>, ApiError> {
    // Held until the answer is built: bounds requests queued or computing.
    let _permit = state
        .admission
        .clone()
        .try_acquire_owned()
        .map_err(|_| match state.ready() {
            // Draining holds every permit: a request that passed the readiness check
            // just before the signal is refused like the ones after it.
            Err(why) => ApiError::NotReady(why),
            Ok(()) => ApiError::Overloaded {
                max_queued: state.limits().max_queued_requests,
            },
        })?;
    let receivers: Vec<_> = sequences
        .iter()
        .map(|ids| submit(&state.scheduler, ids.clone()))
        .collect();
    // Dropping the receivers (timeout, or the client hanging up and this future being
    // dropped) cancels whatever has not been computed yet.
    let wait = async {
        let mut out = Vec::with_capacity(receivers.len());
        for rx in receivers {
            out.push(
                rx.await
                    .unwrap_or(Err(EngineError::Stopped))
                    .and_then(Computed::checked),
            );
        }
        out
    };
    let timeout = state.http.request_timeout;
    // After the drain timeout, a request still waiting is answered at once, not when (or if)
    // its batch finishes.
    let results = tokio::select! {
        results = tokio::time::timeout(timeout, wait) => {
            results.map_err(|_| ApiError::Timeout(timeout))?
        }
        () = state.scheduler.abandoned() => return Err(EngineError::Abandoned.into()),
    };
    results
        .into_iter()
        .enumerate()
        .map(|(sequence, result)| {
            result.map_err(|e| match e {
                EngineError::NonFinite { position } => ApiError::Numerical { sequence, position },
                e => ApiError::from(e),
            })
        })
        .collect()
}

/// Sums the work of a request's sequences; a batch shared by several of them counts once.
#[derive(Default)]
pub(crate) struct UsageMeter {
    usage: Usage,
    batches: HashSet<u64>,
}

impl UsageMeter {
    pub fn add<T>(&mut self, input_tokens: usize, scored_tokens: usize, done: &Computed<T>) {
        let u = &mut self.usage;
        u.input_tokens += input_tokens;
        u.scored_tokens += scored_tokens;
        u.queue_ms = u.queue_ms.max(ms(done.queue_time));
        if self.batches.insert(done.batch_id) {
            u.compute_ms += ms(done.compute_time);
        }
    }

    pub fn usage(self) -> Usage {
        self.usage
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

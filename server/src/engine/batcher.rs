//! The scheduler: the async face of the queue. Handlers `submit` sequences; one task forms a
//! batch whenever the engine thread can take one: at once when it is full, else only once the
//! engine waits, so that the sequences that arrive during a computation all join the next
//! batch (see [`State::take_batch`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, Notify};

use super::queue::{BatchLimits, Entry, State, Task};
use super::{worker, Computed, Engine, EngineError};
use crate::model::{SequenceKld, SequenceScores};

/// Cheap to clone; every clone talks to the same queue.
#[derive(Clone)]
pub struct Scheduler {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the batching task: a sequence queued, the engine waiting, or the shutdown.
    notify: Notify,
    closed: AtomicBool,
    /// The engine thread waits for a batch (none is formed ahead).
    engine_idle: AtomicBool,
}

/// Joins the engine thread once the scheduler is shut down and the queue has drained.
pub struct EngineThread(JoinHandle<()>);

impl EngineThread {
    pub fn join(self) {
        if self.0.join().is_err() {
            tracing::error!("engine thread panicked");
        }
    }
}

pub type ReplyReceiver<T = SequenceScores> = oneshot::Receiver<Result<Computed<T>, EngineError>>;

impl Scheduler {
    /// Starts the engine thread and the batching task (needs a Tokio runtime).
    pub fn start(
        engine: Box<dyn Engine>,
        limits: BatchLimits,
    ) -> std::io::Result<(Self, EngineThread)> {
        let (tx, rx) = mpsc::channel(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(limits)),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
            engine_idle: AtomicBool::new(false),
        });
        let signal = shared.clone();
        let thread = worker::spawn(engine, rx, move |idle| {
            signal.engine_idle.store(idle, Ordering::SeqCst);
            if idle {
                signal.notify.notify_one();
            }
        })?;
        tokio::spawn(batch_loop(shared.clone(), tx));
        Ok((Self { shared }, EngineThread(thread)))
    }

    /// Queues one sequence for `/score`; the receiver yields its scores. Dropping the receiver
    /// cancels it.
    pub fn submit(&self, tokens: Vec<u32>, top_k: usize) -> ReplyReceiver {
        let (reply, rx) = oneshot::channel();
        self.push(tokens, Task::Score { top_k, reply });
        rx
    }

    /// Queues one sequence for `/kld`; the receiver yields its divergences. Dropping the
    /// receiver cancels it.
    pub fn submit_kld(&self, tokens: Vec<u32>) -> ReplyReceiver<SequenceKld> {
        let (reply, rx) = oneshot::channel();
        self.push(tokens, Task::Kld { reply });
        rx
    }

    fn push(&self, tokens: Vec<u32>, task: Task) {
        let mut state = self.shared.lock();
        state.push(Entry {
            tokens,
            enqueued: Instant::now(),
            task,
        });
        metrics::gauge!("exactscore_queue_depth").set(state.len() as f64);
        drop(state);
        self.shared.notify.notify_one();
    }

    /// Sequences waiting for a batch.
    pub fn queue_depth(&self) -> usize {
        self.shared.lock().len()
    }

    /// Stops the batcher once the queue is empty; the engine thread ends after its last batch.
    pub fn shutdown(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.notify.notify_one();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain data with no invariant a panic could break mid-way.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn batch_loop(shared: Arc<Shared>, tx: mpsc::Sender<Vec<Entry>>) {
    loop {
        // Wait for the engine to have room before choosing what goes in the batch.
        let Ok(permit) = tx.reserve().await else {
            return; // engine thread gone
        };
        loop {
            let (batch, depth) = {
                let mut state = shared.lock();
                let batch = state.take_batch(shared.engine_idle.load(Ordering::SeqCst));
                (batch, state.len())
            };
            metrics::gauge!("exactscore_queue_depth").set(depth as f64);
            if !batch.is_empty() {
                permit.send(batch);
                break;
            }
            if depth == 0 && shared.closed.load(Ordering::SeqCst) {
                return; // drops `tx`: the engine thread finishes
            }
            shared.notify.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::fake::FakeEngine;

    async fn batch_id(rx: ReplyReceiver) -> u64 {
        rx.await
            .expect("engine gone")
            .expect("batch failed")
            .batch_id
    }

    /// Sequences that arrive while a batch computes join one batch: a full one leaves at once,
    /// the rest wait for the engine instead of leaving with the first arrival.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn arrivals_during_a_computation_share_the_next_batch() {
        let (engine, gate) = FakeEngine::gated();
        let limits = BatchLimits {
            max_batch_tokens: 100,
            max_batch_requests: 2,
        };
        let (scheduler, thread) = Scheduler::start(Box::new(engine), limits).unwrap();
        let a = scheduler.submit(vec![1, 2], 0);
        let gate = tokio::task::spawn_blocking(move || {
            gate.wait_started();
            gate
        })
        .await
        .unwrap();
        let pause = || tokio::time::sleep(Duration::from_millis(50));
        let b = scheduler.submit(vec![3, 4], 0);
        pause().await;
        let c = scheduler.submit(vec![5, 6], 0);
        let d = scheduler.submit(vec![7, 8], 0);
        pause().await;
        for _ in 0..3 {
            gate.release();
        }
        let ids = [
            batch_id(a).await,
            batch_id(b).await,
            batch_id(c).await,
            batch_id(d).await,
        ];
        assert_eq!(ids, [1, 2, 2, 3]);
        scheduler.shutdown();
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .unwrap();
    }
}

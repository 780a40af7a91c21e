//! The scheduler: the async face of the queue. Handlers `submit` sequences; one task forms a
//! batch whenever the engine thread can take one, as late as possible so that sequences that
//! arrive during a computation join the next batch.

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
    notify: Notify,
    closed: AtomicBool,
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
        let thread = worker::spawn(engine, rx)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(limits)),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
        });
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
                let batch = state.next_batch();
                (batch, state.len())
            };
            metrics::gauge!("exactscore_queue_depth").set(depth as f64);
            if !batch.is_empty() {
                permit.send(batch);
                break;
            }
            if shared.closed.load(Ordering::SeqCst) {
                return; // drops `tx`: the engine thread finishes
            }
            shared.notify.notified().await;
        }
    }
}

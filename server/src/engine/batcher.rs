//! The scheduler: the async face of the queue. Handlers `submit` sequences; one task forms a
//! batch whenever a replica can take one: at once when it is full, else only once the replica
//! waits (a worker is idle and its first pipeline stage free), so that the sequences that
//! arrive during a computation all join the next batch (see [`State::take_batch`]). Batches
//! go to the replicas in rotation, an idle one first.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch, Notify};

use super::queue::{BatchLimits, Entry, State, Task};
use super::worker::{self, Hooks, ReplicaState};
use super::{Computed, DiffSupport, Engine, EngineError};
use crate::model::{DiffOptions, SequenceDiff, SequenceKld, SequenceScores, StoredRequest};

/// Cheap to clone; every clone talks to the same queue.
#[derive(Clone)]
pub struct Scheduler {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Wakes the batching task: a sequence queued, a worker waiting, a stage free, a replica's
    /// health changed, or the shutdown.
    notify: Notify,
    closed: AtomicBool,
    replicas: Vec<Replica>,
    abandoned: Arc<AtomicBool>,
    abandon_signal: watch::Sender<bool>,
    /// The first sticky device error, once one happened.
    fatal: watch::Sender<Option<String>>,
}

struct Replica {
    engine: Arc<dyn Engine>,
    state: Arc<ReplicaState>,
}

/// What `/health/ready` and `/metrics` say of one replica.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaStatus {
    pub index: usize,
    /// Why it left the rotation; `None` while it serves.
    pub out_of_rotation: Option<String>,
}

/// The worker threads of every replica, joined once the scheduler is shut down and the queue
/// has drained.
pub struct EngineThread(Vec<JoinHandle<()>>);

impl EngineThread {
    /// Waits for every worker to stop.
    pub fn join(self) {
        for handle in self.0 {
            if handle.join().is_err() {
                tracing::error!("engine worker panicked");
            }
        }
    }

    /// Waits up to `limit` for every worker to stop (a worker in the middle of a long batch
    /// is left running); returns whether all stopped.
    pub async fn join_within(self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.0.iter().all(JoinHandle::is_finished) {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.join();
        true
    }
}

pub type ReplyReceiver<T = SequenceScores> = oneshot::Receiver<Result<Computed<T>, EngineError>>;

impl Scheduler {
    /// Starts the workers of every replica and the batching task (needs a Tokio runtime).
    pub fn start(
        engines: Vec<Arc<dyn Engine>>,
        limits: BatchLimits,
    ) -> std::io::Result<(Self, EngineThread)> {
        let replicas: Vec<Replica> = engines
            .into_iter()
            .enumerate()
            .map(|(index, engine)| Replica {
                engine,
                state: Arc::new(ReplicaState::new(index)),
            })
            .collect();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(limits)),
            notify: Notify::new(),
            closed: AtomicBool::new(false),
            replicas,
            abandoned: Arc::new(AtomicBool::new(false)),
            abandon_signal: watch::Sender::new(false),
            fatal: watch::Sender::new(None),
        });
        let wake = {
            let shared = Arc::downgrade(&shared);
            Arc::new(move || {
                if let Some(shared) = shared.upgrade() {
                    shared.notify.notify_one();
                }
            })
        };
        let hooks = Hooks {
            wake: wake.clone(),
            fatal: {
                let shared = Arc::downgrade(&shared);
                Arc::new(move |message: &str| {
                    if let Some(shared) = shared.upgrade() {
                        tracing::error!(%message, "sticky device error: the server must restart");
                        shared.fatal.send_if_modified(|fatal| {
                            let first = fatal.is_none();
                            if first {
                                *fatal = Some(message.to_string());
                            }
                            first
                        });
                    }
                })
            },
            abandoned: shared.abandoned.clone(),
            batch_ids: Arc::new(AtomicU64::new(0)),
        };
        let mut senders = Vec::new();
        let mut diff_senders = Vec::new();
        let mut threads = Vec::new();
        for replica in &shared.replicas {
            let (tx, rx) = mpsc::channel(1);
            let (diff_tx, diff_rx) = mpsc::channel(1);
            senders.push(tx);
            diff_senders.push(diff_tx);
            replica.engine.on_first_stage_free(wake.clone());
            threads.extend(worker::spawn(
                replica.engine.clone(),
                replica.state.clone(),
                rx,
                diff_rx,
                hooks.clone(),
            )?);
        }
        tokio::spawn(batch_loop(shared.clone(), senders, diff_senders));
        Ok((Self { shared }, EngineThread(threads)))
    }

    /// Queues one sequence for `/score`; the receiver yields its scores. Dropping the receiver
    /// cancels it.
    pub fn submit(&self, tokens: Vec<u32>, top_k: usize) -> ReplyReceiver {
        self.submit_stored(tokens, top_k, StoredRequest::None)
    }

    /// [`Self::submit`] with a stored reference's rows to write or to bound against.
    pub fn submit_stored(
        &self,
        tokens: Vec<u32>,
        top_k: usize,
        stored: StoredRequest,
    ) -> ReplyReceiver {
        let (reply, rx) = oneshot::channel();
        self.push(
            tokens,
            Task::Score {
                top_k,
                stored,
                reply,
            },
        );
        rx
    }

    /// Queues one sequence for `/kld`; the receiver yields its divergences. Dropping the
    /// receiver cancels it.
    pub fn submit_kld(&self, tokens: Vec<u32>) -> ReplyReceiver<SequenceKld> {
        let (reply, rx) = oneshot::channel();
        self.push(tokens, Task::Kld { reply });
        rx
    }

    /// Queues one sequence for `/diff` with its request's options; the receiver yields what
    /// the comparison found. Dropping the receiver cancels it.
    pub fn submit_diff(
        &self,
        tokens: Vec<u32>,
        options: Arc<DiffOptions>,
    ) -> ReplyReceiver<SequenceDiff> {
        let (reply, rx) = oneshot::channel();
        self.push(tokens, Task::Diff { options, reply });
        rx
    }

    /// What `/diff` can do: every replica's engine holds the same two models, so the first
    /// one answers for all.
    pub fn diff_support(&self) -> DiffSupport {
        self.shared
            .replicas
            .first()
            .map_or(DiffSupport::NoReference, |r| r.engine.diff_support())
    }

    fn push(&self, tokens: Vec<u32>, task: Task) {
        let entry = Entry {
            tokens,
            enqueued: Instant::now(),
            task,
        };
        if self.shared.abandoned.load(Ordering::SeqCst) {
            return entry.fail(EngineError::Abandoned);
        }
        let mut state = self.shared.lock();
        state.push(entry);
        metrics::gauge!("exactscore_queue_depth").set(state.len() as f64);
        drop(state);
        self.shared.notify.notify_one();
    }

    /// Sequences waiting for a batch.
    pub fn queue_depth(&self) -> usize {
        self.shared.lock().len()
    }

    /// Stops the batcher once the queue is empty; the workers end after their last batch.
    pub fn shutdown(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.notify.notify_one();
    }

    /// The drain timeout has passed: every sequence not yet computed is answered
    /// [`EngineError::Abandoned`] (queued ones at once; handlers waiting on batches in flight
    /// see [`Self::abandoned`]), and compute stops at the next batch or micro-batch boundary.
    pub fn abandon(&self) {
        self.shared.abandoned.store(true, Ordering::SeqCst);
        for replica in &self.shared.replicas {
            replica.engine.abandon();
        }
        let waiting = self.shared.lock().take_all();
        for entry in waiting {
            entry.fail(EngineError::Abandoned);
        }
        self.shared.abandon_signal.send_replace(true);
        self.shutdown();
    }

    /// Resolves once [`Self::abandon`] has been called.
    pub fn abandoned(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut signal = self.shared.abandon_signal.subscribe();
        async move {
            let _ = signal.wait_for(|abandoned| *abandoned).await;
        }
    }

    /// Resolves with the message of the first sticky device error (never, if none happens).
    pub fn device_lost(&self) -> impl Future<Output = String> + Send + 'static {
        let mut fatal = self.shared.fatal.subscribe();
        async move {
            let message = fatal
                .wait_for(Option::is_some)
                .await
                .map(|message| message.clone().unwrap_or_default());
            match message {
                Ok(message) => message,
                Err(_) => std::future::pending().await,
            }
        }
    }

    /// The first sticky device error, if one happened.
    pub fn lost_device(&self) -> Option<String> {
        self.shared.fatal.borrow().clone()
    }

    /// The engine of every replica, in replica order.
    pub fn engines(&self) -> Vec<Arc<dyn Engine>> {
        self.shared
            .replicas
            .iter()
            .map(|r| r.engine.clone())
            .collect()
    }

    /// Every replica and whether it is in rotation.
    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        self.shared
            .replicas
            .iter()
            .map(|r| ReplicaStatus {
                index: r.state.index,
                out_of_rotation: r.state.out_of_rotation_reason(),
            })
            .collect()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is plain data with no invariant a panic could break mid-way.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The replica the next batch goes to, and whether it waits for work (so a partial batch
    /// may go): an idle one in rotation with room first, else any in rotation with room, which
    /// then only takes a full batch. `Err` when no replica is in rotation.
    #[allow(clippy::result_unit_err)]
    fn choose(
        &self,
        senders: &[mpsc::Sender<Vec<Entry>>],
        next: usize,
    ) -> Result<Option<(usize, bool)>, ()> {
        let n = self.replicas.len();
        let mut choice = None;
        let mut serving = false;
        for r in (0..n).map(|i| (next + i) % n) {
            let replica = &self.replicas[r];
            if !replica.state.in_rotation() {
                continue;
            }
            serving = true;
            if senders[r].capacity() == 0 {
                continue;
            }
            if replica.state.has_idle_worker() && replica.engine.first_stage_free() {
                return Ok(Some((r, true)));
            }
            choice.get_or_insert((r, false));
        }
        if serving {
            Ok(choice)
        } else {
            Err(())
        }
    }
}

/// Hands `/diff` batches to every replica whose diff lane waits for one.
fn dispatch_diffs(shared: &Shared, senders: &[mpsc::Sender<Vec<Entry>>]) {
    for (replica, sender) in shared.replicas.iter().zip(senders) {
        if !replica.state.in_rotation() || !replica.state.diff_lane_idle() || sender.capacity() == 0
        {
            continue;
        }
        let batch = shared.lock().next_diff_batch();
        if batch.is_empty() {
            return;
        }
        if let Err(e) = sender.try_send(batch) {
            for entry in e.into_inner() {
                entry.fail(EngineError::Stopped);
            }
        }
    }
}

async fn batch_loop(
    shared: Arc<Shared>,
    senders: Vec<mpsc::Sender<Vec<Entry>>>,
    diff_senders: Vec<mpsc::Sender<Vec<Entry>>>,
) {
    let mut next = 0;
    loop {
        dispatch_diffs(&shared, &diff_senders);
        let depth = match shared.choose(&senders, next) {
            Ok(Some((r, idle))) => {
                let mut state = shared.lock();
                let batch = state.take_batch(idle);
                let depth = state.len();
                drop(state);
                metrics::gauge!("exactscore_queue_depth").set(depth as f64);
                if !batch.is_empty() {
                    next = r + 1;
                    if let Err(e) = senders[r].try_send(batch) {
                        // Only this task sends, after checking for room: the workers are gone.
                        for entry in e.into_inner() {
                            entry.fail(EngineError::Stopped);
                        }
                    }
                    continue;
                }
                depth
            }
            Ok(None) => shared.lock().len(),
            Err(()) => {
                // No replica left to compute anything: answer instead of letting requests
                // wait for their timeout.
                let waiting = shared.lock().take_all();
                for entry in waiting {
                    entry.fail(EngineError::NoReplica);
                }
                0
            }
        };
        if depth == 0 && shared.closed.load(Ordering::SeqCst) {
            return; // drops the senders: the workers finish
        }
        shared.notify.notified().await;
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
        let (scheduler, thread) = Scheduler::start(vec![Arc::new(engine)], limits).unwrap();
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

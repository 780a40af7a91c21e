//! The worker threads of one replica. Each takes a formed batch from the replica's channel
//! (capacity 1: one batch formed ahead), computes it on the replica's engine, retrying in
//! halves when the device runs out of memory, answers every sequence on its own oneshot, and
//! keeps the replica's health: a sticky device error stops the server, a replica that keeps
//! failing leaves the rotation. A pipelined engine gets two workers, so that the next batch
//! enters the first stage while the last stages finish the previous one.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc;

use super::fault::{guarded, with_halving};
use super::queue::{Entry, Reply, Task};
use super::{Answers, Cancel, Computed, Engine, EngineError};
use crate::model::{DiffOptions, ScoreInput, SequenceDiff, StoredRequest};

/// Consecutive failed batches after which a replica leaves the rotation.
pub const FAILURES_OUT_OF_ROTATION: usize = 3;

/// The health of one replica, shared by its workers and the scheduler.
#[derive(Debug)]
pub struct ReplicaState {
    pub index: usize,
    in_rotation: AtomicBool,
    consecutive_failures: AtomicUsize,
    /// Workers waiting for a batch.
    idle_workers: AtomicUsize,
    /// The `/diff` lane's worker waits for a batch.
    diff_lane_idle: AtomicBool,
    out_of_rotation: Mutex<Option<String>>,
}

impl ReplicaState {
    pub fn new(index: usize) -> Self {
        metrics::gauge!("exactscore_replica_in_rotation", "replica" => index.to_string()).set(1.0);
        Self {
            index,
            in_rotation: AtomicBool::new(true),
            consecutive_failures: AtomicUsize::new(0),
            idle_workers: AtomicUsize::new(0),
            diff_lane_idle: AtomicBool::new(false),
            out_of_rotation: Mutex::new(None),
        }
    }

    pub fn in_rotation(&self) -> bool {
        self.in_rotation.load(Ordering::SeqCst)
    }

    /// Some worker waits for a batch.
    pub fn has_idle_worker(&self) -> bool {
        self.idle_workers.load(Ordering::SeqCst) > 0
    }

    /// The `/diff` lane waits for a batch.
    pub fn diff_lane_idle(&self) -> bool {
        self.diff_lane_idle.load(Ordering::SeqCst)
    }

    /// Why the replica left the rotation, if it has.
    pub fn out_of_rotation_reason(&self) -> Option<String> {
        self.out_of_rotation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn take_out_of_rotation(&self, reason: String) {
        tracing::error!(replica = self.index, %reason, "replica taken out of rotation");
        *self
            .out_of_rotation
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(reason);
        self.in_rotation.store(false, Ordering::SeqCst);
        metrics::gauge!("exactscore_replica_in_rotation", "replica" => self.index.to_string())
            .set(0.0);
    }
}

/// What the workers tell the scheduler.
#[derive(Clone)]
pub struct Hooks {
    /// A worker waits, or has taken a batch (room in its channel), or a replica's health
    /// changed: the batcher looks again.
    pub wake: Arc<dyn Fn() + Send + Sync>,
    /// A sticky device error: the server must stop (its message).
    pub fatal: Arc<dyn Fn(&str) + Send + Sync>,
    /// Set once the drain timeout has passed: batches not yet started are abandoned.
    pub abandoned: Arc<AtomicBool>,
    /// Batch ids, unique across replicas.
    pub batch_ids: Arc<AtomicU64>,
}

/// Starts the replica's workers ([`Engine::concurrency`] of them) and its `/diff` lane (one
/// thread for the batches of `diffs`, so that a long comparison does not hold up the scoring
/// batches; the engine interleaves the two at the comparison's boundaries). They end once the
/// sending sides are dropped and the channels are empty.
pub fn spawn(
    engine: Arc<dyn Engine>,
    state: Arc<ReplicaState>,
    batches: mpsc::Receiver<Vec<Entry>>,
    mut diffs: mpsc::Receiver<Vec<Entry>>,
    hooks: Hooks,
) -> std::io::Result<Vec<JoinHandle<()>>> {
    let lane = {
        let (engine, state, hooks) = (engine.clone(), state.clone(), hooks.clone());
        std::thread::Builder::new()
            .name(format!("exactscore-replica-{}-diff", state.index))
            .spawn(move || {
                loop {
                    state.diff_lane_idle.store(true, Ordering::SeqCst);
                    (hooks.wake)();
                    let batch = diffs.blocking_recv();
                    state.diff_lane_idle.store(false, Ordering::SeqCst);
                    let Some(batch) = batch else { break };
                    let batch_id = hooks.batch_ids.fetch_add(1, Ordering::SeqCst) + 1;
                    run_batch(engine.as_ref(), batch, batch_id, &state, &hooks);
                }
                tracing::info!(replica = state.index, "diff lane stopped");
            })?
    };
    let batches = Arc::new(Mutex::new(batches));
    let mut threads = vec![lane];
    for handle in (0..engine.concurrency().max(1)).map(|worker| {
        let (engine, state, batches, hooks) = (
            engine.clone(),
            state.clone(),
            batches.clone(),
            hooks.clone(),
        );
        std::thread::Builder::new()
            .name(format!(
                "exactscore-replica-{}-worker-{worker}",
                state.index
            ))
            .spawn(move || {
                while let Some(batch) = next_batch(&batches, &state, &hooks) {
                    let batch_id = hooks.batch_ids.fetch_add(1, Ordering::SeqCst) + 1;
                    run_batch(engine.as_ref(), batch, batch_id, &state, &hooks);
                }
                tracing::info!(replica = state.index, worker, "engine worker stopped");
            })
    }) {
        threads.push(handle?);
    }
    Ok(threads)
}

/// The next batch, counting this worker idle while it waits for one; `None` once the batcher
/// has stopped.
fn next_batch(
    batches: &Mutex<mpsc::Receiver<Vec<Entry>>>,
    state: &ReplicaState,
    hooks: &Hooks,
) -> Option<Vec<Entry>> {
    let mut batches = batches.lock().unwrap_or_else(|p| p.into_inner());
    let batch = match batches.try_recv() {
        Ok(batch) => Some(batch),
        Err(mpsc::error::TryRecvError::Disconnected) => None,
        Err(mpsc::error::TryRecvError::Empty) => {
            state.idle_workers.fetch_add(1, Ordering::SeqCst);
            (hooks.wake)();
            let batch = batches.blocking_recv();
            state.idle_workers.fetch_sub(1, Ordering::SeqCst);
            batch
        }
    };
    // Room in the channel: the batcher may form the next batch ahead.
    (hooks.wake)();
    batch
}

fn run_batch(
    engine: &dyn Engine,
    batch: Vec<Entry>,
    batch_id: u64,
    state: &ReplicaState,
    hooks: &Hooks,
) {
    // The batch was formed before the previous one finished: clients may have left since.
    let formed = batch.len();
    let mut scores = Vec::new();
    let mut klds = Vec::new();
    // One group per request's options, in arrival order.
    let mut diffs: Vec<(Arc<DiffOptions>, Vec<Job<SequenceDiff>>)> = Vec::new();
    for entry in batch.into_iter().filter(|e| !e.is_cancelled()) {
        let (tokens, enqueued) = (entry.tokens, entry.enqueued);
        match entry.task {
            Task::Score {
                top_k,
                stored,
                reply,
            } => scores.push((
                Job {
                    tokens,
                    enqueued,
                    reply,
                },
                (top_k, stored),
            )),
            Task::Kld { reply } => klds.push(Job {
                tokens,
                enqueued,
                reply,
            }),
            Task::Diff { options, reply } => {
                let job = Job {
                    tokens,
                    enqueued,
                    reply,
                };
                match diffs.iter_mut().find(|(o, _)| **o == *options) {
                    Some((_, jobs)) => jobs.push(job),
                    None => diffs.push((options, vec![job])),
                }
            }
        }
    }
    let computed = scores.len() + klds.len() + diffs.iter().map(|(_, j)| j.len()).sum::<usize>();
    super::queue::count_cancelled(formed - computed);
    let run = BatchRun {
        batch_id,
        state,
        hooks,
    };
    // A batch mixing both tasks runs them one after the other, each as one forward pass.
    let (jobs, rows): (Vec<_>, Vec<(usize, StoredRequest)>) = scores.into_iter().unzip();
    run.jobs(jobs, |sequences, cancel| {
        let inputs: Vec<ScoreInput<'_>> = sequences
            .iter()
            .zip(&rows)
            .map(|(&tokens, (top_k, stored))| ScoreInput {
                tokens,
                top_k: *top_k,
                stored,
            })
            .collect();
        with_halving(&inputs, &mut |range, part| {
            engine.score(part, &cancel.part(range))
        })
    });
    run.jobs(klds, |sequences, cancel| {
        with_halving(sequences, &mut |range, part| {
            engine.kld(part, &cancel.part(range))
        })
    });
    for (options, jobs) in diffs {
        run.jobs(jobs, |sequences, cancel| {
            with_halving(sequences, &mut |range, part| {
                engine.diff(part, &options, &cancel.part(range))
            })
        });
    }
}

/// One sequence of a batch and where its answer goes.
struct Job<T> {
    tokens: Vec<u32>,
    enqueued: Instant,
    reply: Reply<T>,
}

struct BatchRun<'a> {
    batch_id: u64,
    state: &'a ReplicaState,
    hooks: &'a Hooks,
}

impl BatchRun<'_> {
    /// Computes `jobs` in one call and answers each on its own channel. A job whose receiver
    /// is gone may be dropped from the pass at its next boundary, and the call stops once
    /// every job's receiver is gone ([`Cancel`]).
    fn jobs<T: Send + 'static>(
        &self,
        jobs: Vec<Job<T>>,
        compute: impl FnOnce(&[&[u32]], &Cancel) -> Result<Answers<T>, EngineError>,
    ) {
        if jobs.is_empty() {
            return;
        }
        let (jobs, replies): (Vec<_>, Vec<_>) = jobs
            .into_iter()
            .map(|j| ((j.tokens, j.enqueued), Some(j.reply)))
            .unzip();
        let replies = Arc::new(Mutex::new(replies));
        let cancel = {
            let replies = replies.clone();
            Cancel::per_sequence(jobs.len(), move |i| {
                let replies = replies.lock().unwrap_or_else(|p| p.into_inner());
                replies[i].as_ref().is_none_or(|r| r.is_closed())
            })
        };
        let sequences: Vec<&[u32]> = jobs.iter().map(|(t, _)| t.as_slice()).collect();
        let tokens: usize = sequences.iter().map(|s| s.len()).sum();
        let start = Instant::now();
        let result = if self.hooks.abandoned.load(Ordering::SeqCst) {
            Err(EngineError::Abandoned)
        } else {
            guarded(|| compute(&sequences, &cancel))
        };
        let compute_time = start.elapsed();
        drop((cancel, sequences));
        let jobs: Vec<Job<T>> = {
            let mut replies = replies.lock().unwrap_or_else(|p| p.into_inner());
            jobs.into_iter()
                .zip(replies.iter_mut())
                .filter_map(|((tokens, enqueued), reply)| {
                    Some(Job {
                        tokens,
                        enqueued,
                        reply: reply.take()?,
                    })
                })
                .collect()
        };
        let result = match result {
            Ok(outputs) if outputs.len() != jobs.len() => Err(EngineError::Compute(format!(
                "engine returned {} results for {} inputs",
                outputs.len(),
                jobs.len()
            ))),
            other => other,
        };
        self.record(jobs.len(), tokens, compute_time.as_secs_f64(), &result);
        match result {
            Ok(outputs) => {
                let dropped = outputs.iter().filter(|o| o.is_none()).count();
                if dropped > 0 {
                    tracing::info!(
                        batch_id = self.batch_id,
                        sequences = dropped,
                        "nobody waited for these sequences any more; dropped from the pass"
                    );
                    super::queue::count_cancelled(dropped);
                }
                for (job, output) in jobs.into_iter().zip(outputs) {
                    let Some(output) = output else {
                        let _ = job.reply.send(Err(EngineError::Cancelled));
                        continue;
                    };
                    let queue_time = start.saturating_duration_since(job.enqueued);
                    metrics::histogram!("exactscore_queue_seconds")
                        .record(queue_time.as_secs_f64());
                    let _ = job.reply.send(Ok(Computed {
                        output,
                        queue_time,
                        compute_time,
                        batch_id: self.batch_id,
                    }));
                }
            }
            Err(err) => {
                // A batch the drain abandoned is the shutdown working, not a failure; one
                // nobody waits for any more stopped early, as it should.
                if matches!(err, EngineError::Abandoned) {
                    tracing::info!(batch_id = self.batch_id, "batch abandoned by the drain");
                } else if matches!(err, EngineError::Cancelled) {
                    tracing::info!(
                        batch_id = self.batch_id,
                        sequences = jobs.len(),
                        "nobody waits for the batch any more; stopped"
                    );
                    super::queue::count_cancelled(jobs.len());
                } else {
                    tracing::error!(
                        batch_id = self.batch_id,
                        replica = self.state.index,
                        error = %err,
                        "batch failed"
                    );
                }
                for job in jobs {
                    let _ = job.reply.send(Err(err.clone()));
                }
            }
        }
    }

    /// Metrics of the batch, and the replica's health after it.
    fn record<T>(
        &self,
        sequences: usize,
        tokens: usize,
        seconds: f64,
        result: &Result<T, EngineError>,
    ) {
        let replica = self.state.index.to_string();
        metrics::histogram!("exactscore_batch_sequences").record(sequences as f64);
        metrics::histogram!("exactscore_batch_tokens").record(tokens as f64);
        metrics::histogram!("exactscore_compute_seconds").record(seconds);
        metrics::counter!("exactscore_replica_batches_total", "replica" => replica.clone())
            .increment(1);
        let state = self.state;
        match result {
            Ok(_) => {
                metrics::counter!("exactscore_tokens_processed_total").increment(tokens as u64);
                metrics::counter!("exactscore_replica_tokens_total", "replica" => replica)
                    .increment(tokens as u64);
                if seconds > 0.0 {
                    metrics::gauge!("exactscore_throughput_tokens_per_second")
                        .set(tokens as f64 / seconds);
                }
                state.consecutive_failures.store(0, Ordering::SeqCst);
            }
            // Stopped because nobody waits: not a failure of the replica.
            Err(EngineError::Cancelled) => {}
            Err(err) => {
                metrics::counter!("exactscore_replica_failed_batches_total", "replica" => replica)
                    .increment(1);
                match err {
                    EngineError::DeviceLost(message) => {
                        state.take_out_of_rotation(format!("device lost: {message}"));
                        (self.hooks.fatal)(message);
                        (self.hooks.wake)();
                    }
                    EngineError::Compute(message) => {
                        let failures =
                            state.consecutive_failures.fetch_add(1, Ordering::SeqCst) + 1;
                        if failures >= FAILURES_OUT_OF_ROTATION && state.in_rotation() {
                            state.take_out_of_rotation(format!(
                                "{failures} consecutive batches failed, the last with: {message}"
                            ));
                            (self.hooks.wake)();
                        }
                    }
                    // The request's size, a shutdown or a missing reference: not the replica.
                    _ => {}
                }
            }
        }
    }
}

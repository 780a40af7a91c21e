//! The engine thread: owns the model, takes one batch at a time from a channel of capacity 1
//! (so exactly one batch is formed ahead while the current one computes) and answers every
//! sequence of the batch on its own oneshot.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc;

use super::queue::{Entry, Reply, Task};
use super::{Computed, Engine, EngineError};
use crate::model::ScoreInput;

/// Starts the engine thread. It ends when the sending side of `batches` is dropped.
/// `set_idle(true)` tells the batcher that the thread waits with no batch formed ahead,
/// `set_idle(false)` that it has one again.
pub fn spawn(
    mut engine: Box<dyn Engine>,
    mut batches: mpsc::Receiver<Vec<Entry>>,
    set_idle: impl Fn(bool) + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("exactscore-engine".into())
        .spawn(move || {
            let mut batch_id = 0u64;
            loop {
                let batch = match batches.try_recv() {
                    Ok(batch) => batch,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                    Err(mpsc::error::TryRecvError::Empty) => {
                        set_idle(true);
                        let batch = batches.blocking_recv();
                        set_idle(false);
                        match batch {
                            Some(batch) => batch,
                            None => break,
                        }
                    }
                };
                batch_id += 1;
                run_batch(engine.as_mut(), batch, batch_id);
            }
            tracing::info!("engine thread stopped");
        })
}

fn run_batch(engine: &mut dyn Engine, batch: Vec<Entry>, batch_id: u64) {
    // The batch was formed before the previous one finished: clients may have left since.
    let formed = batch.len();
    let mut scores = Vec::new();
    let mut klds = Vec::new();
    for entry in batch.into_iter().filter(|e| !e.is_cancelled()) {
        let (tokens, enqueued) = (entry.tokens, entry.enqueued);
        match entry.task {
            Task::Score { top_k, reply } => scores.push((
                Job {
                    tokens,
                    enqueued,
                    reply,
                },
                top_k,
            )),
            Task::Kld { reply } => klds.push(Job {
                tokens,
                enqueued,
                reply,
            }),
        }
    }
    super::queue::count_cancelled(formed - scores.len() - klds.len());
    // A batch mixing both tasks runs them one after the other, each as one forward pass.
    let top_ks: Vec<usize> = scores.iter().map(|(_, k)| *k).collect();
    let jobs = scores.into_iter().map(|(job, _)| job).collect();
    run_jobs(jobs, batch_id, |sequences| {
        let inputs: Vec<ScoreInput<'_>> = sequences
            .iter()
            .zip(&top_ks)
            .map(|(&tokens, &top_k)| ScoreInput { tokens, top_k })
            .collect();
        engine.score(&inputs)
    });
    run_jobs(klds, batch_id, |sequences| engine.kld(sequences));
}

/// One sequence of a batch and where its answer goes.
struct Job<T> {
    tokens: Vec<u32>,
    enqueued: std::time::Instant,
    reply: Reply<T>,
}

/// Computes `jobs` in one call and answers each on its own channel.
fn run_jobs<T>(
    jobs: Vec<Job<T>>,
    batch_id: u64,
    compute: impl FnOnce(&[&[u32]]) -> Result<Vec<T>, EngineError>,
) {
    if jobs.is_empty() {
        return;
    }
    let sequences: Vec<&[u32]> = jobs.iter().map(|j| j.tokens.as_slice()).collect();
    let tokens: usize = sequences.iter().map(|s| s.len()).sum();
    let start = Instant::now();
    // A panic in the model must fail this batch, not kill the thread every request waits on.
    let result = catch_unwind(AssertUnwindSafe(|| compute(&sequences))).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        Err(EngineError::Compute(msg))
    });
    let compute_time = start.elapsed();
    drop(sequences);
    record_batch(jobs.len(), tokens, compute_time.as_secs_f64());

    match result {
        Ok(outputs) if outputs.len() == jobs.len() => {
            for (job, output) in jobs.into_iter().zip(outputs) {
                let queue_time = start.saturating_duration_since(job.enqueued);
                metrics::histogram!("exactscore_queue_seconds").record(queue_time.as_secs_f64());
                let _ = job.reply.send(Ok(Computed {
                    output,
                    queue_time,
                    compute_time,
                    batch_id,
                }));
            }
        }
        other => {
            let err = match other {
                Err(e) => e,
                Ok(s) => EngineError::Compute(format!(
                    "engine returned {} results for {} inputs",
                    s.len(),
                    jobs.len()
                )),
            };
            tracing::error!(batch_id, error = %err, "batch failed");
            for job in jobs {
                let _ = job.reply.send(Err(err.clone()));
            }
        }
    }
}

fn record_batch(sequences: usize, tokens: usize, seconds: f64) {
    metrics::histogram!("exactscore_batch_sequences").record(sequences as f64);
    metrics::histogram!("exactscore_batch_tokens").record(tokens as f64);
    metrics::histogram!("exactscore_compute_seconds").record(seconds);
    metrics::counter!("exactscore_tokens_processed_total").increment(tokens as u64);
    if seconds > 0.0 {
        metrics::gauge!("exactscore_throughput_tokens_per_second").set(tokens as f64 / seconds);
    }
}

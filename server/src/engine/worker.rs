//! The engine thread: owns the model, takes one batch at a time from a channel of capacity 1
//! (so exactly one batch is formed ahead while the current one computes) and answers every
//! sequence of the batch on its own oneshot.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc;

use super::queue::Entry;
use super::{Engine, EngineError, ScoredSequence};
use crate::model::ScoreInput;

/// Starts the engine thread. It ends when the sending side of `batches` is dropped.
pub fn spawn(
    mut engine: Box<dyn Engine>,
    mut batches: mpsc::Receiver<Vec<Entry>>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("exactscore-engine".into())
        .spawn(move || {
            let mut batch_id = 0u64;
            while let Some(batch) = batches.blocking_recv() {
                batch_id += 1;
                run_batch(engine.as_mut(), batch, batch_id);
            }
            tracing::info!("engine thread stopped");
        })
}

fn run_batch(engine: &mut dyn Engine, batch: Vec<Entry>, batch_id: u64) {
    // The batch was formed before the previous one finished: clients may have left since.
    let formed = batch.len();
    let batch: Vec<Entry> = batch.into_iter().filter(|e| !e.is_cancelled()).collect();
    super::queue::count_cancelled(formed - batch.len());
    if batch.is_empty() {
        return;
    }
    let tokens: usize = batch.iter().map(|e| e.tokens.len()).sum();
    let inputs: Vec<ScoreInput<'_>> = batch
        .iter()
        .map(|e| ScoreInput {
            tokens: &e.tokens,
            top_k: e.top_k,
        })
        .collect();
    let start = Instant::now();
    // A panic in the model must fail this batch, not kill the thread every request waits on.
    let result = catch_unwind(AssertUnwindSafe(|| engine.score(&inputs))).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        Err(EngineError::Compute(msg))
    });
    let compute_time = start.elapsed();
    drop(inputs);
    record_batch(batch.len(), tokens, compute_time.as_secs_f64());

    match result {
        Ok(scores) if scores.len() == batch.len() => {
            for (entry, scores) in batch.into_iter().zip(scores) {
                let queue_time = start.saturating_duration_since(entry.enqueued);
                metrics::histogram!("exactscore_queue_seconds").record(queue_time.as_secs_f64());
                let _ = entry.reply.send(Ok(ScoredSequence {
                    scores,
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
                    batch.len()
                )),
            };
            tracing::error!(batch_id, error = %err, "batch failed");
            for entry in batch {
                let _ = entry.reply.send(Err(err.clone()));
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

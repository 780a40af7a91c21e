//! The model engine of one replica: the served model (and the reference model of `/kld`) as
//! chains of pipeline stages, each stage a thread ([`StageThread`]) on its own device. A batch
//! is cut into micro-batches of whole sequences; each micro-batch goes down the chain, handed
//! from stage to stage as a hidden state, and the last stage scores it. Every kernel sees the
//! inputs it sees on one device, so the numbers are those of the unsplit model, bit for bit.

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, RwLock};

use candle_core::Tensor;

use super::fault::{classify, guarded};
use super::stage_thread::{IdleHook, StageThread};
use super::{Answers, Cancel, DiffSupport, Engine, EngineError};
use crate::model::diff::{attributable_modules, diff_batch_with, incompatibility};
use crate::model::kld::{kld_hidden, logit_chunks};
use crate::model::{
    keep_sequences, DiffOptions, Keep, Model, ScoreInput, SequenceDiff, SequenceKld,
    SequenceScores, StoredRequest,
};

/// A model and one thread per stage.
struct Chain {
    model: Arc<Model>,
    stages: Vec<StageThread>,
}

/// The sequences of one micro-batch, owned so that stage threads can hold them.
struct MicroBatch {
    sequences: Vec<Vec<u32>>,
    top_k: Vec<usize>,
    stored: Vec<StoredRequest>,
    /// Whether anyone still waits for the batch this micro-batch belongs to.
    cancel: Cancel,
}

/// Why work must stop at the next boundary: the drain timeout passed, or nobody waits.
fn stop_reason(abandoned: &AtomicBool, cancel: &Cancel) -> Option<EngineError> {
    if abandoned.load(Ordering::SeqCst) {
        Some(EngineError::Abandoned)
    } else if cancel.is_cancelled() {
        Some(EngineError::Cancelled)
    } else {
        None
    }
}

/// A boundary check for model code (which knows only candle's errors): the reason is kept in
/// `stop` so that the caller can return it instead of the generic error.
fn boundary_error(stop: &Cell<Option<EngineError>>, reason: EngineError) -> candle_core::Error {
    let message = reason.to_string();
    stop.set(Some(reason));
    candle_core::Error::Msg(message)
}

impl MicroBatch {
    /// The tokens of sequences `live`.
    fn tokens(&self, live: &[usize]) -> Vec<&[u32]> {
        live.iter().map(|&i| self.sequences[i].as_slice()).collect()
    }

    fn lens(&self, live: &[usize]) -> Vec<usize> {
        live.iter().map(|&i| self.sequences[i].len()).collect()
    }

    /// The sequences someone still waits for.
    fn waited_for(&self) -> Vec<usize> {
        (0..self.sequences.len())
            .filter(|&i| !self.cancel.is_gone(i))
            .collect()
    }

    /// `outputs` of sequences `live` as the micro-batch's answers: `None` for the others.
    fn answers<T>(&self, live: &[usize], outputs: Vec<T>) -> Answers<T> {
        let mut answers: Answers<T> = (0..self.sequences.len()).map(|_| None).collect();
        for (&i, output) in live.iter().zip(outputs) {
            answers[i] = Some(output);
        }
        answers
    }
}

/// A micro-batch's hidden state `[tokens, hidden]` and the sequences it holds (indices into
/// the micro-batch, ascending, concatenated in that order): a sequence nobody waits for any
/// more is dropped at the next decoder layer, the others' numbers unchanged.
struct State {
    x: Tensor,
    live: Vec<usize>,
}

type Hidden = Result<State, EngineError>;

impl Chain {
    fn new(model: Arc<Model>, name: &str) -> std::io::Result<Self> {
        let stages = (0..model.stage_count())
            .map(|k| StageThread::spawn(format!("exactscore-{name}-stage-{k}")))
            .collect::<std::io::Result<_>>()?;
        Ok(Self { model, stages })
    }

    /// Queues `batch` down the chain; `finish` runs on the last stage's thread with the
    /// final-norm hidden state (or the first failure on the way).
    fn submit(
        &self,
        batch: Arc<MicroBatch>,
        abandoned: &Arc<AtomicBool>,
        finish: impl FnOnce(Hidden) + Send + 'static,
    ) {
        let last = self.stages.len() - 1;
        let mut finish = Some(finish);
        let mut input: Option<Receiver<Hidden>> = None;
        for (k, stage) in self.stages.iter().enumerate() {
            let (model, batch, abandoned) = (self.model.clone(), batch.clone(), abandoned.clone());
            let from_previous = input.take();
            let (to_next, next) = mpsc::sync_channel::<Hidden>(1);
            let finish = if k == last { finish.take() } else { None };
            stage.submit(Box::new(move || {
                let x = guarded(|| {
                    if let Some(reason) = stop_reason(&abandoned, &batch.cancel) {
                        return Err(reason);
                    }
                    let State { x, live } = match from_previous {
                        None => {
                            let live = batch.waited_for();
                            let x = model.embed(&batch.tokens(&live));
                            State {
                                x: x.map_err(|e| classify(&e))?,
                                live,
                            }
                        }
                        Some(rx) => rx.recv().unwrap_or_else(|_| {
                            Err(EngineError::Compute("the previous stage stopped".into()))
                        })?,
                    };
                    // Work nobody waits for stops before the next decoder layer: the whole
                    // micro-batch, or the sequences whose clients left.
                    let (stop, lens) = (Cell::new(None), batch.lens(&live));
                    let live = RefCell::new(live);
                    let boundary = || {
                        if let Some(reason) = stop_reason(&abandoned, &batch.cancel) {
                            return Err(boundary_error(&stop, reason));
                        }
                        let mut live = live.borrow_mut();
                        let keep: Vec<bool> =
                            live.iter().map(|&i| !batch.cancel.is_gone(i)).collect();
                        if keep.iter().all(|&k| k) {
                            return Ok(Keep::All);
                        }
                        let mut kept = keep.iter();
                        live.retain(|_| kept.next() == Some(&true));
                        Ok(Keep::Only(keep))
                    };
                    let x = model
                        .forward_stage_checked(k, x, &lens, &boundary)
                        .map_err(|e| stop.take().unwrap_or_else(|| classify(&e)))?;
                    let x = if k == last {
                        model.final_norm(&x)
                    } else {
                        crate::device::transfer(&x, model.stage_device(k + 1))
                    };
                    Ok(State {
                        x: x.map_err(|e| classify(&e))?,
                        live: live.into_inner(),
                    })
                });
                match finish {
                    Some(finish) => finish(x),
                    None => {
                        let _ = to_next.send(x);
                    }
                }
            }));
            input = Some(next);
        }
    }

    fn first_stage(&self) -> &StageThread {
        &self.stages[0]
    }
}

/// How a batch is cut into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatching {
    /// This many sequences per micro-batch.
    Sequences(usize),
    /// As many micro-batches as the served model has distinct GPUs (one on a single device,
    /// where cutting costs GEMM efficiency and overlaps nothing).
    PerDevice,
}

/// The served model and, for `/kld`, the reference model of one replica.
pub struct ModelEngine {
    served: Chain,
    reference: Option<Chain>,
    micro_batching: MicroBatching,
    /// Distinct physical devices of the served model (for [`MicroBatching::PerDevice`]).
    devices: usize,
    /// Pipelined batches waiting for [`Self::exclusive`]: a `/diff` lets them in at its next
    /// boundary.
    waiting: AtomicUsize,
    /// Held while a batch's jobs are handed to the stages: every stage thread then sees the
    /// micro-batches of concurrent batches in one order, so a stage never waits for a
    /// micro-batch that an earlier stage has queued behind one it waits for in turn.
    ordering: Mutex<()>,
    /// `/diff` runs both models on its lane's own thread, stage after stage, so it has the
    /// devices to itself: the pipelined tasks hold this shared for a whole batch, a diff holds
    /// it exclusively (a device's work is never issued from two threads at once), one unit of
    /// work at a time (a layer, a chunk of logits): between units it lets waiting batches in.
    exclusive: RwLock<()>,
    /// Every stage of both models is on the CPU, where several threads may compute at once:
    /// a `/diff` then runs beside the scoring batches instead of taking turns with them (a
    /// turn lasts a whole decoder layer, seconds for 8192-token sequences on a CPU).
    cpu_only: bool,
    diff_support: DiffSupport,
    abandoned: Arc<AtomicBool>,
}

impl ModelEngine {
    pub fn new(
        model: Model,
        reference: Option<Model>,
        micro_batching: MicroBatching,
    ) -> std::io::Result<Self> {
        let devices = distinct_devices(&model);
        let on_cpu = |m: &Model| (0..m.stage_count()).all(|k| m.stage_device(k).is_cpu());
        let cpu_only = on_cpu(&model) && reference.as_ref().is_none_or(on_cpu);
        let diff_support = match &reference {
            None => DiffSupport::NoReference,
            Some(r) => match incompatibility(&model, r) {
                Some(reason) => {
                    tracing::warn!(%reason, "/diff is off (/kld works): the reference cannot be compared layer by layer");
                    DiffSupport::Incompatible(reason)
                }
                None => DiffSupport::Ready {
                    layers: model.config().num_layers,
                    modules: attributable_modules(&model, r)
                        .into_iter()
                        .map(|name| {
                            let format = model.linear(&name).map(|l| l.weight().describe());
                            (name, format.unwrap_or_default())
                        })
                        .collect(),
                },
            },
        };
        Ok(Self {
            served: Chain::new(Arc::new(model), "model")?,
            reference: reference
                .map(|r| Chain::new(Arc::new(r), "reference"))
                .transpose()?,
            micro_batching,
            devices,
            waiting: AtomicUsize::new(0),
            ordering: Mutex::new(()),
            exclusive: RwLock::new(()),
            cpu_only,
            diff_support,
            abandoned: Arc::new(AtomicBool::new(false)),
        })
    }

    pub fn model(&self) -> &Model {
        &self.served.model
    }

    pub fn reference(&self) -> Option<&Model> {
        self.reference.as_ref().map(|r| &*r.model)
    }

    fn micro_batches(&self, sequences: usize) -> Vec<Range<usize>> {
        let size = match self.micro_batching {
            MicroBatching::Sequences(n) => n.max(1),
            MicroBatching::PerDevice => sequences.div_ceil(self.devices.max(1)).max(1),
        };
        (0..sequences)
            .step_by(size)
            .map(|start| start..(start + size).min(sequences))
            .collect()
    }

    /// Cuts `sequences` into micro-batches, hands each to `submit` (in one order for every
    /// stage) and gathers the per-sequence results in input order.
    fn run<T: Send + 'static>(
        &self,
        sequences: &[&[u32]],
        top_k: &[usize],
        stored: &[StoredRequest],
        cancel: &Cancel,
        submit: impl Fn(Arc<MicroBatch>, SyncSender<Result<Answers<T>, EngineError>>),
    ) -> Result<Answers<T>, EngineError> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _shared = self.exclusive.read().unwrap_or_else(|p| p.into_inner());
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        let parts = self.micro_batches(sequences.len());
        let receivers: Vec<_> = {
            let _order = self.ordering.lock().unwrap_or_else(|p| p.into_inner());
            parts
                .iter()
                .map(|range| {
                    let batch = Arc::new(MicroBatch {
                        sequences: sequences[range.clone()]
                            .iter()
                            .map(|s| s.to_vec())
                            .collect(),
                        top_k: top_k[range.clone()].to_vec(),
                        stored: stored[range.clone()].to_vec(),
                        cancel: cancel.part(range.clone()),
                    });
                    let (done, rx) = mpsc::sync_channel(1);
                    submit(batch, done);
                    rx
                })
                .collect()
        };
        let mut out = Vec::with_capacity(sequences.len());
        let mut failure = None;
        for rx in receivers {
            match rx.recv() {
                Ok(Ok(part)) => out.extend(part),
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                }
                Err(_) => {
                    failure.get_or_insert(EngineError::Compute("a pipeline stage stopped".into()));
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

/// GPUs (or the CPU) that the model's stages run on, each counted once.
fn distinct_devices(model: &Model) -> usize {
    let mut seen: Vec<candle_core::DeviceLocation> = Vec::new();
    for k in 0..model.stage_count() {
        let location = model.stage_device(k).location();
        if !seen.contains(&location) {
            seen.push(location);
        }
    }
    seen.len()
}

/// The sequence (index into `sequences`) of each chunk of [`logit_chunks`], in order: a chunk
/// never spans two sequences.
fn chunk_owners(sequences: &[&[u32]], vocab: usize) -> Vec<usize> {
    sequences
        .iter()
        .enumerate()
        .flat_map(|(k, tokens)| std::iter::repeat_n(k, logit_chunks(&[tokens], vocab).len()))
        .collect()
}

impl Engine for ModelEngine {
    fn score(
        &self,
        batch: &[ScoreInput<'_>],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceScores>, EngineError> {
        let sequences: Vec<&[u32]> = batch.iter().map(|b| b.tokens).collect();
        let top_k: Vec<usize> = batch.iter().map(|b| b.top_k).collect();
        let stored: Vec<StoredRequest> = batch.iter().map(|b| b.stored.clone()).collect();
        self.run(&sequences, &top_k, &stored, cancel, |part, done| {
            let model = self.served.model.clone();
            self.served
                .submit(part.clone(), &self.abandoned, move |hidden| {
                    let scores = hidden.and_then(|State { x, live }| {
                        guarded(|| {
                            let inputs: Vec<ScoreInput<'_>> = live
                                .iter()
                                .map(|&i| ScoreInput {
                                    tokens: &part.sequences[i],
                                    top_k: part.top_k[i],
                                    stored: &part.stored[i],
                                })
                                .collect();
                            let scores = model.score_hidden(&x, &inputs);
                            Ok(part.answers(&live, scores.map_err(|e| classify(&e))?))
                        })
                    });
                    let _ = done.send(scores);
                });
        })
    }

    /// Both chains run the micro-batch; the reference's last stage computes its logits one
    /// row chunk at a time and hands each, copied to the served model's last device, to the
    /// served model's last stage, which computes its own and the divergence. Each chain drops
    /// the sequences nobody waits for on its own; the divergence covers those both kept.
    fn kld(
        &self,
        sequences: &[&[u32]],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceKld>, EngineError> {
        let reference = self.reference.as_ref().ok_or(EngineError::NoReference)?;
        let top_k = vec![0; sequences.len()];
        let stored = vec![StoredRequest::None; sequences.len()];
        self.run(sequences, &top_k, &stored, cancel, |part, done| {
            // The reference's kept sequences first, then its logits chunk by chunk.
            let (live_tx, live_rx) = mpsc::sync_channel::<Vec<usize>>(1);
            let (chunks_tx, chunks_rx) = mpsc::sync_channel::<Result<Tensor, EngineError>>(1);
            let served = self.served.model.clone();
            let target = served.stage_device(served.stage_count() - 1).clone();
            let reference_model = reference.model.clone();
            let part_of_reference = part.clone();
            reference.submit(part.clone(), &self.abandoned, move |hidden| {
                let State { x, live } = match hidden {
                    Ok(state) => state,
                    Err(e) => {
                        let _ = chunks_tx.send(Err(e));
                        return;
                    }
                };
                let vocab = reference_model.config().vocab_size;
                let chunks = logit_chunks(&part_of_reference.tokens(&live), vocab);
                if live_tx.send(live).is_err() {
                    return;
                }
                for rows in chunks {
                    let logits = guarded(|| {
                        let logits =
                            reference_model.logits(&x.narrow(0, rows.start, rows.len())?)?;
                        Ok(crate::device::transfer(&logits, &target)?)
                    });
                    let failed = logits.is_err();
                    // The served side hung up (it failed): stop.
                    if chunks_tx.send(logits).is_err() || failed {
                        return;
                    }
                }
            });
            self.served
                .submit(part.clone(), &self.abandoned, move |hidden| {
                    let stopped = || {
                        chunks_rx.recv().map_or_else(
                            |_| Err(EngineError::Compute("the reference stopped".into())),
                            |chunk| chunk.and(Err(EngineError::Compute("no sequences".into()))),
                        )
                    };
                    let result = hidden.and_then(|State { x, live }| {
                        let reference_live = live_rx.recv().or_else(|_| stopped())?;
                        guarded(|| {
                            let both: Vec<usize> = live
                                .iter()
                                .copied()
                                .filter(|i| reference_live.contains(i))
                                .collect();
                            let x = if both.len() == live.len() {
                                x
                            } else {
                                let keep: Vec<bool> =
                                    live.iter().map(|i| both.contains(i)).collect();
                                keep_sequences(&x, &part.lens(&live), &keep)?.0
                            };
                            let vocab = served.config().vocab_size;
                            // Which sequence each of the reference's chunks belongs to, so
                            // that chunks of sequences the served side dropped are skipped.
                            let mut owners = chunk_owners(&part.tokens(&reference_live), vocab)
                                .into_iter()
                                .map(|k| reference_live[k]);
                            let klds = kld_hidden::<EngineError>(
                                |_| loop {
                                    let chunk = chunks_rx.recv().unwrap_or_else(|_| {
                                        Err(EngineError::Compute("the reference stopped".into()))
                                    })?;
                                    if owners.next().is_some_and(|i| both.contains(&i)) {
                                        return Ok(chunk);
                                    }
                                },
                                |rows| {
                                    part.cancel.check()?;
                                    Ok(served.logits(&x.narrow(0, rows.start, rows.len())?)?)
                                },
                                &part.tokens(&both),
                                vocab,
                            )?;
                            Ok(part.answers(&both, klds))
                        })
                    });
                    let _ = done.send(result);
                });
        })
    }

    /// On this worker's thread with the devices to itself (see [`ModelEngine::exclusive`]):
    /// a diagnostic, so it trades the pipeline's overlap for lockstep simplicity.
    /// At every boundary of the comparison (each layer, logits chunk, attributed module) it
    /// stops if nobody waits any more or the drain timeout passed, and on GPUs hands the
    /// devices to the batches waiting for them before it goes on (on the CPU it runs beside
    /// them, see [`ModelEngine::cpu_only`]).
    fn diff(
        &self,
        sequences: &[&[u32]],
        options: &DiffOptions,
        cancel: &Cancel,
    ) -> Result<Answers<SequenceDiff>, EngineError> {
        let reference = self.reference.as_ref().ok_or(EngineError::NoReference)?;
        let exclusive = || self.exclusive.write().unwrap_or_else(|p| p.into_inner());
        let held = RefCell::new((!self.cpu_only).then(exclusive));
        if let Some(reason) = stop_reason(&self.abandoned, cancel) {
            return Err(reason);
        }
        let stop = Cell::new(None);
        let boundary = || {
            if let Some(reason) = stop_reason(&self.abandoned, cancel) {
                return Err(boundary_error(&stop, reason));
            }
            if !self.cpu_only && self.waiting.load(Ordering::SeqCst) > 0 {
                // One turn for the batches waiting now; the lock prefers a waiting writer, so
                // batches that come later wait for the next boundary.
                drop(held.borrow_mut().take());
                while self.waiting.load(Ordering::SeqCst) > 0 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                *held.borrow_mut() = Some(exclusive());
            }
            Ok(())
        };
        let result = guarded(|| {
            diff_batch_with(
                &self.served.model,
                &reference.model,
                sequences,
                options,
                &boundary,
            )
            .map_err(|e| stop.take().unwrap_or_else(|| classify(&e)))
        });
        drop(held);
        // A diff stops as a whole: its sequences share the comparison's cached logits.
        result.map(|diffs| diffs.into_iter().map(Some).collect())
    }

    fn diff_support(&self) -> DiffSupport {
        self.diff_support.clone()
    }

    fn concurrency(&self) -> usize {
        let stages = self
            .served
            .stages
            .len()
            .max(self.reference.as_ref().map_or(0, |r| r.stages.len()));
        if stages > 1 {
            2
        } else {
            1
        }
    }

    fn first_stage_free(&self) -> bool {
        self.served.first_stage().is_idle()
            && self
                .reference
                .as_ref()
                .is_none_or(|r| r.first_stage().is_idle())
    }

    fn on_first_stage_free(&self, hook: IdleHook) {
        self.served.first_stage().set_on_idle(hook.clone());
        if let Some(r) = &self.reference {
            r.first_stage().set_on_idle(hook);
        }
    }

    fn abandon(&self) {
        self.abandoned.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use candle_core::{DType, Device};

    use super::*;
    use crate::model::ModelOptions;
    use crate::quant::{ActivationQuantMode, LinearOptions};

    fn load(name: &str) -> Model {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name);
        let options = ModelOptions {
            linear: LinearOptions {
                device: Device::Cpu,
                dtype: DType::F32,
                activation_quant: ActivationQuantMode::Emulate,
                kv_cache: Default::default(),
                fp8_matmul: Default::default(),
                fused_fp8_scales: Default::default(),
            },
            max_seq_len: 2048,
            attention: Default::default(),
        };
        Model::load(&dir, &options).unwrap()
    }

    /// A sequence whose client left is dropped at the next decoder layer while the others of
    /// its batch go on: it is answered `None`, the others exactly as when computed alone, for
    /// `/score` and for `/kld` (where the two chains may drop it at different layers).
    #[test]
    fn a_sequence_nobody_waits_for_is_dropped_and_the_others_are_unchanged() {
        let engine = ModelEngine::new(
            load("llama-w4a16-g128"),
            Some(load("llama-dense-bf16")),
            MicroBatching::PerDevice,
        )
        .unwrap();
        let sequences: Vec<Vec<u32>> = (0..3)
            .map(|s| (0..48).map(|i| ((i * 11 + s * 29) % 2000) as u32).collect())
            .collect();
        let refs: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
        // Sequence 1's client leaves once the pass has asked about it twice (the embedding
        // and the first decoder layer of a chain): it is gone from the second layer on.
        let leaving = || {
            let asked = Arc::new(AtomicUsize::new(0));
            Cancel::per_sequence(3, move |i| {
                i == 1 && asked.fetch_add(1, Ordering::SeqCst) >= 2
            })
        };
        let inputs: Vec<ScoreInput<'_>> = refs
            .iter()
            .map(|&tokens| ScoreInput {
                stored: crate::model::StoredRequest::NONE,
                tokens,
                top_k: 2,
            })
            .collect();
        let scores = engine.score(&inputs, &leaving()).unwrap();
        assert!(scores[1].is_none(), "the dropped sequence was scored");
        let klds = engine.kld(&refs, &leaving()).unwrap();
        assert!(
            klds[1].is_none(),
            "the dropped sequence's divergence was computed"
        );
        for i in [0, 2] {
            let alone = engine.score(&inputs[i..=i], &Cancel::never()).unwrap();
            assert_eq!(scores[i], alone[0], "sequence {i}'s scores moved");
            let alone = engine.kld(&refs[i..=i], &Cancel::never()).unwrap();
            assert_eq!(klds[i], alone[0], "sequence {i}'s divergence moved");
        }
    }

    /// The turns GPUs take, forced on the CPU: a small batch that comes while an attribution
    /// runs is computed at the diff's next boundary, not after the diff; a diff whose `Cancel`
    /// turns true stops with `Cancelled`.
    #[test]
    fn a_diff_hands_the_devices_over_at_its_boundaries_and_stops_when_cancelled() {
        let mut engine = ModelEngine::new(
            load("llama-w4a16-g128"),
            Some(load("llama-dense-bf16")),
            MicroBatching::PerDevice,
        )
        .unwrap();
        assert!(engine.cpu_only);
        engine.cpu_only = false;
        let engine = Arc::new(engine);
        let DiffSupport::Ready { modules, .. } = engine.diff_support() else {
            panic!("the fixtures can be compared");
        };
        let options = DiffOptions {
            reference_until: None,
            attribute: modules.into_iter().map(|(name, _)| name).collect(),
        };
        let sequences: Vec<Vec<u32>> = (0..2)
            .map(|s| {
                (0..1024)
                    .map(|i| ((i * 7 + s * 13) % 2000) as u32)
                    .collect()
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let diff = std::thread::spawn({
            let (engine, stop) = (engine.clone(), stop.clone());
            move || {
                let refs: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
                let cancel = Cancel::per_sequence(2, move |_| stop.load(Ordering::SeqCst));
                let start = Instant::now();
                let result = engine.diff(&refs, &options, &cancel).map(drop);
                (result, start.elapsed())
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        let input = ScoreInput {
            stored: crate::model::StoredRequest::NONE,
            tokens: &[1992, 5, 6],
            top_k: 0,
        };
        engine.score(&[input], &Cancel::never()).unwrap();
        let waited = start.elapsed();
        stop.store(true, Ordering::SeqCst);
        let (result, ran) = diff.join().unwrap();
        println!("small batch waited {waited:?}; the diff stopped after {ran:?}");
        // Still running when the small batch was done: it was let in between units.
        assert_eq!(result, Err(EngineError::Cancelled));
    }
}

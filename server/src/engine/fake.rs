//! A deterministic stand-in for the model, for HTTP tests: no weights, instant answers, an
//! optional gate that holds a batch until the test releases it (to fill the queue), and
//! optional faults (a device that runs out of memory above some batch size, or fails always).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};

use super::{Answers, Cancel, DiffSupport, Engine, EngineError};
use crate::model::{
    DiffOptions, LayerError, RowScore, ScoreInput, SequenceDiff, SequenceKld, SequenceScores,
    TokenKld,
};

#[derive(Default)]
pub struct FakeEngine {
    gate: Option<Mutex<Gate>>,
    fault: Option<FakeFault>,
    batches: AtomicUsize,
}

/// How a fake engine fails.
#[derive(Debug, Clone, PartialEq)]
pub enum FakeFault {
    /// Out of memory for any batch of more than this many tokens in total.
    OutOfMemoryAbove(usize),
    /// Every batch after the first `after` (the warm-up) fails with `error`.
    FailAfter { after: usize, error: EngineError },
}

struct Gate {
    started: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
}

/// The test's side of a gate: wait for a batch to start, then let it finish.
pub struct GateHandle {
    started: mpsc::Receiver<()>,
    release: mpsc::Sender<()>,
}

impl GateHandle {
    /// Blocks until the engine has started a batch.
    pub fn wait_started(&self) {
        self.started.recv().expect("fake engine gone");
    }

    /// Lets one gated batch finish.
    pub fn release(&self) {
        let _ = self.release.send(());
    }
}

impl FakeEngine {
    /// An engine whose every batch waits for [`GateHandle::release`].
    pub fn gated() -> (Self, GateHandle) {
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        let engine = Self {
            gate: Some(Mutex::new(Gate {
                started: started_tx,
                release: release_rx,
            })),
            ..Self::default()
        };
        let handle = GateHandle {
            started: started_rx,
            release: release_tx,
        };
        (engine, handle)
    }

    /// A token the fake model cannot predict: its log-probability is NaN (as a real model's is
    /// when its logits overflow), to test that no such number is served.
    pub const NAN_TOKEN: u32 = 1999;

    /// The fake log-probability of `token`: `-(token + 1) / 1000`, easy to check in tests
    /// (NaN for [`Self::NAN_TOKEN`]).
    pub fn logprob(token: u32) -> f32 {
        if token == Self::NAN_TOKEN {
            return f32::NAN;
        }
        -((token + 1) as f32) / 1000.0
    }

    /// The fake divergence before `token`: what the fake reference disagrees by.
    pub fn token_kld(token: u32) -> TokenKld {
        let same_top = token.is_multiple_of(2);
        TokenKld {
            kld: token as f64 / 1e4,
            reverse_kld: token as f64 / 2e4,
            logprob: Self::logprob(token),
            reference_logprob: 2.0 * Self::logprob(token),
            same_top,
            // bit 0 is same_top; the others follow the id's bits
            top_k_agreement: (token as u8 & 0b11110) | u8::from(same_top),
            reference_top_p: (token % 101) as f64 / 100.0,
        }
    }

    /// Decoder layers of the fake model, and its attributable modules (q/k/v/o and
    /// gate/up/down of each, all "int4").
    pub const LAYERS: usize = 2;

    pub fn modules() -> Vec<(String, String)> {
        let names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            .into_iter()
            .chain([
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            ]);
        (0..Self::LAYERS)
            .flat_map(|i| names.clone().map(move |n| format!("model.layers.{i}.{n}")))
            .map(|name| (name, "int4".to_string()))
            .collect()
    }

    /// The fake error of layer `layer` at a position holding `token`: grows with depth.
    pub fn layer_error(layer: usize, token: u32) -> (f64, f64) {
        let cos_error = (layer + 1) as f64 * (token % 100) as f64 / 1e4;
        (cos_error, 30.0 - 10.0 * layer as f64)
    }

    /// An engine that fails as `fault` says.
    pub fn faulty(fault: FakeFault) -> Self {
        Self {
            fault: Some(fault),
            ..Self::default()
        }
    }

    /// This engine with `fault` as well.
    pub fn with_fault(mut self, fault: FakeFault) -> Self {
        self.fault = Some(fault);
        self
    }

    /// Waits at the gate, then fails the batch of `tokens` tokens if the fault says so.
    fn pass_gate(&self, tokens: usize) -> Result<(), EngineError> {
        if let Some(gate) = &self.gate {
            let gate = gate.lock().unwrap_or_else(|p| p.into_inner());
            let _ = gate.started.send(());
            gate.release.recv().map_err(|_| EngineError::Stopped)?;
        }
        let batch = self.batches.fetch_add(1, Ordering::SeqCst);
        match &self.fault {
            Some(FakeFault::OutOfMemoryAbove(limit)) if tokens > *limit => Err(
                EngineError::OutOfMemory(format!("fake: {tokens} tokens > {limit}")),
            ),
            Some(FakeFault::FailAfter { after, error }) if batch >= *after => Err(error.clone()),
            _ => Ok(()),
        }
    }
}

impl Engine for FakeEngine {
    fn score(
        &self,
        batch: &[ScoreInput<'_>],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceScores>, EngineError> {
        self.pass_gate(batch.iter().map(|b| b.tokens.len()).sum())?;
        cancel.check()?;
        Ok(batch
            .iter()
            .enumerate()
            .map(|(i, input)| {
                (!cancel.is_gone(i)).then(|| SequenceScores {
                    rows: (0..input.tokens.len())
                        .map(|i| {
                            let target = input.tokens.get(i + 1).copied();
                            // The "model" always predicts token 0 best, then 1, 2, ...
                            RowScore {
                                target_logprob: target.map(Self::logprob),
                                argmax: (0, Self::logprob(0)),
                                top_k: (0..input.top_k as u32)
                                    .map(|t| (t, Self::logprob(t)))
                                    .collect(),
                            }
                        })
                        .collect(),
                    stored: input.stored.output(),
                })
            })
            .collect())
    }

    fn kld(
        &self,
        sequences: &[&[u32]],
        cancel: &Cancel,
    ) -> Result<Answers<SequenceKld>, EngineError> {
        self.pass_gate(sequences.iter().map(|s| s.len()).sum())?;
        cancel.check()?;
        Ok(sequences
            .iter()
            .enumerate()
            .map(|(i, tokens)| {
                (!cancel.is_gone(i)).then(|| SequenceKld {
                    tokens: tokens.iter().skip(1).map(|&t| Self::token_kld(t)).collect(),
                })
            })
            .collect())
    }

    /// Per layer [`Self::layer_error`], the fake divergences, and module `m`'s KLD sum the
    /// sequence's KLD sum over `m + 2`.
    fn diff(
        &self,
        sequences: &[&[u32]],
        options: &DiffOptions,
        cancel: &Cancel,
    ) -> Result<Answers<SequenceDiff>, EngineError> {
        let klds = self.kld(sequences, cancel)?;
        Ok(sequences
            .iter()
            .zip(klds)
            .map(|(tokens, kld)| {
                let kld = kld?;
                let layers = (0..Self::LAYERS)
                    .map(|layer| {
                        let (cos_error, sqnr_db) =
                            tokens.iter().map(|&t| Self::layer_error(layer, t)).unzip();
                        LayerError { cos_error, sqnr_db }
                    })
                    .collect();
                let sum = kld.sum_kld();
                let modules = (0..options.attribute.len())
                    .map(|m| sum / (m + 2) as f64)
                    .collect();
                Some(SequenceDiff {
                    layers,
                    kld,
                    modules,
                })
            })
            .collect())
    }

    fn diff_support(&self) -> DiffSupport {
        DiffSupport::Ready {
            layers: Self::LAYERS,
            modules: Self::modules(),
        }
    }
}

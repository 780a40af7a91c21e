//! Which decoder layers each pipeline stage of a model holds: a pure function of the model's
//! part sizes and the stage count (or an explicit `--layer-split`). The embedding goes with the
//! first stage, the final norm and the lm_head with the last. Every stage holds whole layers in
//! order, so each kernel sees exactly the inputs it sees on one device.

use std::ops::Range;

use candle_core::DType;

use super::checkpoint::Checkpoint;
use super::config::ModelConfig;

/// Stored bytes of a model's parts, as the checkpoint holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct PartBytes {
    pub embed: u64,
    pub layers: Vec<u64>,
    /// Final norm and lm_head (a tied head counts the embedding table again: on another device
    /// it is a second copy).
    pub head: u64,
}

impl PartBytes {
    /// The parts' sizes from the checkpoint's tensor headers (nothing is loaded).
    pub fn of(config: &ModelConfig, ckpt: &Checkpoint) -> Self {
        let bytes = |prefix: &str| ckpt.stored_bytes_with_prefix(prefix);
        let embed = bytes("model.embed_tokens.");
        let lm_head = match bytes("lm_head.") {
            0 if config.tie_word_embeddings => embed,
            b => b,
        };
        Self {
            embed,
            layers: (0..config.num_layers)
                .map(|i| bytes(&format!("model.layers.{i}.")))
                .collect(),
            head: bytes("model.norm.") + lm_head,
        }
    }
}

/// Expected activation memory of a stage beyond its weights, at the largest batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationBytes {
    /// Any stage that runs decoder layers (the largest single layer's working set).
    pub layers: u64,
    /// What scoring adds on the last stage (f32 logits of one row chunk and their scratch).
    pub scoring: u64,
}

impl ActivationBytes {
    /// An estimate for `tokens` tokens per batch (`--max-batch-tokens`), sequences of at most
    /// `max_seq` tokens, in `dtype`; `flash`: attention never materialises its `[T, T]` scores.
    pub fn estimate(
        config: &ModelConfig,
        dtype: DType,
        tokens: usize,
        max_seq: usize,
        flash: bool,
    ) -> Self {
        let s = dtype.size_in_bytes() as u64;
        let (t, h) = (tokens as u64, config.hidden_size as u64);
        let q = (config.num_heads * config.head_dim) as u64;
        let kv = (config.num_kv_heads * config.head_dim) as u64;
        let inter = config.intermediate_size as u64;
        // Residual stream in and out, its normed copy and the hidden state handed on.
        let stream = 4 * t * h * s;
        // q, k, v and the attention output, plus the dequantized q/k/v/o weights.
        let attention_tensors = t * (2 * q + 2 * kv) * s + (2 * q + 2 * kv) * h * s;
        // One sequence's f32 scores and their probabilities, when materialised.
        let scores = if flash {
            0
        } else {
            let l = max_seq as u64;
            config.num_heads as u64 * l * l * (4 + s)
        };
        // gate, up and their product over one row chunk, plus three dequantized weights.
        let chunk = t.min(super::llama::MLP_CHUNK as u64);
        let mlp = 3 * chunk * inter * s + 3 * inter * h * s;
        let logits_rows = super::llama::lm_head_rows(config.vocab_size) as u64;
        Self {
            layers: stream + (attention_tensors + scores).max(mlp),
            // Logits in the compute dtype and in f32, for the served and the reference model.
            scoring: 2 * logits_rows * config.vocab_size as u64 * (s + 4),
        }
    }
}

/// One stage of a replica: its layers, and the memory it is expected to need.
#[derive(Debug, Clone, PartialEq)]
pub struct StagePlan {
    pub layers: Range<usize>,
    /// Stored bytes of the parts it holds.
    pub weight_bytes: u64,
    /// `weight_bytes` plus its expected activation peak.
    pub expected_peak: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlacementError {
    #[error("{stages} pipeline stages for {layers} decoder layers: every stage needs a layer")]
    TooManyStages { stages: usize, layers: usize },
    #[error("the layer split sums to {sum}, the model has {layers} decoder layers")]
    SplitSum { sum: usize, layers: usize },
    #[error("a layer split needs one count per stage ({stages}), got {given}")]
    SplitLength { stages: usize, given: usize },
}

/// `counts[k]` layers on stage `k`, in order.
pub fn from_split(
    parts: &PartBytes,
    activation: &ActivationBytes,
    counts: &[usize],
) -> Result<Vec<StagePlan>, PlacementError> {
    let layers = parts.layers.len();
    let sum: usize = counts.iter().sum();
    if sum != layers {
        return Err(PlacementError::SplitSum { sum, layers });
    }
    if counts.contains(&0) {
        return Err(PlacementError::TooManyStages {
            stages: counts.len(),
            layers,
        });
    }
    let mut start = 0;
    Ok(counts
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let range = start..start + n;
            start += n;
            plan(parts, activation, k, counts.len(), range)
        })
        .collect())
}

/// The split of `stages` contiguous layer ranges whose largest expected peak is smallest
/// (on ties, the first such split in the order ranges are tried: earlier stages shorter).
pub fn balance(
    parts: &PartBytes,
    activation: &ActivationBytes,
    stages: usize,
) -> Result<Vec<StagePlan>, PlacementError> {
    let layers = parts.layers.len();
    if stages == 0 || stages > layers {
        return Err(PlacementError::TooManyStages { stages, layers });
    }
    // best[k][j]: the smallest largest peak of stages 0..=k holding layers 0..j, and where
    // stage k starts in that split.
    let peak =
        |k: usize, range: Range<usize>| plan(parts, activation, k, stages, range).expected_peak;
    let mut best = vec![vec![(u64::MAX, 0usize); layers + 1]; stages];
    for (j, cell) in best[0].iter_mut().enumerate().skip(1) {
        *cell = (peak(0, 0..j), 0);
    }
    for k in 1..stages {
        for j in k + 1..=layers {
            for i in k..j {
                let (before, _) = best[k - 1][i];
                let worst = before.max(peak(k, i..j));
                if worst < best[k][j].0 {
                    best[k][j] = (worst, i);
                }
            }
        }
    }
    let mut counts = vec![0; stages];
    let mut end = layers;
    for k in (0..stages).rev() {
        let start = best[k][end].1;
        counts[k] = end - start;
        end = start;
    }
    from_split(parts, activation, &counts)
}

fn plan(
    parts: &PartBytes,
    activation: &ActivationBytes,
    stage: usize,
    stages: usize,
    layers: Range<usize>,
) -> StagePlan {
    let (first, last) = (stage == 0, stage + 1 == stages);
    let weight_bytes = parts.layers[layers.clone()].iter().sum::<u64>()
        + if first { parts.embed } else { 0 }
        + if last { parts.head } else { 0 };
    let act = activation.layers + if last { activation.scoring } else { 0 };
    StagePlan {
        layers,
        weight_bytes,
        expected_peak: weight_bytes + act,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(layers: usize, layer: u64, embed: u64, head: u64) -> PartBytes {
        PartBytes {
            embed,
            layers: vec![layer; layers],
            head,
        }
    }

    const ACT: ActivationBytes = ActivationBytes {
        layers: 10,
        scoring: 0,
    };

    fn counts(plans: &[StagePlan]) -> Vec<usize> {
        plans.iter().map(|p| p.layers.len()).collect()
    }

    #[test]
    fn equal_layers_and_ends_split_evenly() {
        let p = parts(80, 100, 0, 0);
        assert_eq!(counts(&balance(&p, &ACT, 2).unwrap()), [40, 40]);
        assert_eq!(counts(&balance(&p, &ACT, 4).unwrap()), [20, 20, 20, 20]);
        assert_eq!(counts(&balance(&p, &ACT, 1).unwrap()), [80]);
    }

    #[test]
    fn the_embedding_and_the_head_take_the_place_of_layers() {
        // 8 layers of 100 and an embedding of 300 on stage 0: 2 | 6 and 3 | 5 layers both
        // peak at 610 (weights + 10 of activations); the first found, stage 0 shorter, wins.
        let p = parts(8, 100, 300, 0);
        let plans = balance(&p, &ACT, 2).unwrap();
        assert_eq!(counts(&plans), [2, 6]);
        assert_eq!(plans[0].weight_bytes, 500);
        assert_eq!(plans[1].weight_bytes, 600);
        // A head as large as two layers moves two layers to the first stage.
        let plans = balance(&parts(8, 100, 0, 200), &ACT, 2).unwrap();
        assert_eq!(counts(&plans), [5, 3]);
        assert_eq!(plans.iter().map(|p| p.expected_peak).max(), Some(510));
    }

    #[test]
    fn the_split_minimises_the_largest_stage() {
        // Uneven layers: brute force over all 3-stage splits agrees with the balance.
        let p = PartBytes {
            embed: 50,
            layers: vec![10, 90, 30, 70, 20, 60, 40, 80, 5],
            head: 70,
        };
        let act = ActivationBytes {
            layers: 7,
            scoring: 13,
        };
        let got = balance(&p, &act, 3).unwrap();
        let worst = |plans: &[StagePlan]| plans.iter().map(|s| s.expected_peak).max().unwrap();
        let mut best = u64::MAX;
        for a in 1..8 {
            for b in 1..9 - a {
                let c = 9 - a - b;
                best = best.min(worst(&from_split(&p, &act, &[a, b, c]).unwrap()));
            }
        }
        assert_eq!(worst(&got), best);
        assert_eq!(got.iter().map(|s| s.layers.len()).sum::<usize>(), 9);
        assert_eq!(got[0].layers.start, 0);
        assert_eq!(got[2].layers.end, 9);
    }

    #[test]
    fn an_explicit_split_is_taken_as_given_and_checked() {
        let p = parts(6, 100, 10, 20);
        let plans = from_split(&p, &ACT, &[1, 2, 3]).unwrap();
        assert_eq!(
            plans.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(),
            [0..1, 1..3, 3..6]
        );
        assert_eq!(plans[0].weight_bytes, 110);
        assert_eq!(plans[2].weight_bytes, 320);
        assert_eq!(
            from_split(&p, &ACT, &[1, 2]),
            Err(PlacementError::SplitSum { sum: 3, layers: 6 })
        );
        assert_eq!(
            balance(&p, &ACT, 7),
            Err(PlacementError::TooManyStages {
                stages: 7,
                layers: 6
            })
        );
    }
}

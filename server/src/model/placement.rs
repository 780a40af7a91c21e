//! Which decoder layers each pipeline stage of a model holds: a pure function of the model's
//! part sizes, the work of each part, the stage count and what each device holds (or an
//! explicit `--layer-split`). The embedding goes with the first stage, the final norm and the
//! lm_head with the last. Every stage holds whole layers in order, so each kernel sees exactly
//! the inputs it sees on one device.
//!
//! A pipeline runs as fast as its slowest stage, so the default split balances the stages'
//! work (matmul FLOPs per token) among the splits whose every stage fits its device's memory
//! (weights plus the expected activation peak at `--max-batch-tokens`); where no such split
//! exists, or the memory is unknown (the CPU), it balances the expected memory peaks instead.
//! Balancing memory alone would give a W4A16 model's last stage, which holds a bf16 lm_head and
//! the scoring's logits, a third of the layers of the first (measured: 23 + 9 layers of the 8B
//! shape, 1.42x one GPU instead of 1.77x for bf16).

use std::ops::Range;

use candle_core::{DType, Device};

use super::config::ModelConfig;
use crate::checkpoint::Checkpoint;

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

/// Matmul FLOPs per token of a model's parts: what a stage's time grows with.
#[derive(Debug, Clone, PartialEq)]
pub struct PartWork {
    pub layers: Vec<f64>,
    /// The lm_head (the embedding costs nothing: a gather).
    pub head: f64,
}

impl PartWork {
    /// 2 × the weights a token multiplies in each part: every projection of a dense layer, the
    /// router and `experts_per_token` experts of a sparse one, and the attention over a
    /// sequence of `seq` tokens (the mean position: `seq` / 2 keys).
    pub fn of(config: &ModelConfig, seq: usize) -> Self {
        let (h, q, kv) = (
            config.hidden_size as f64,
            (config.num_heads * config.head_dim) as f64,
            (config.num_kv_heads * config.head_dim) as f64,
        );
        let attention = 2.0 * (h * q + 2.0 * h * kv + q * h) + 2.0 * q * seq as f64;
        let layers = (0..config.num_layers)
            .map(|i| {
                let mlp = match &config.moe {
                    Some(moe) if config.is_sparse_layer(i) => {
                        let expert = 3.0 * h * moe.expert_intermediate_size as f64;
                        h * moe.num_experts as f64 + moe.experts_per_token as f64 * expert
                    }
                    _ => 3.0 * h * config.intermediate_size as f64,
                };
                attention + 2.0 * mlp
            })
            .collect();
        Self {
            layers,
            head: 2.0 * h * config.vocab_size as f64,
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
    /// `max_seq` tokens, in `dtype`; `flash`: attention never materialises its `[T, T]` scores;
    /// `cpu`: the stage computes on the CPU.
    pub fn estimate(
        config: &ModelConfig,
        dtype: DType,
        tokens: usize,
        max_seq: usize,
        flash: bool,
        cpu: bool,
    ) -> Self {
        let s = dtype.size_in_bytes() as u64;
        let (t, h) = (tokens as u64, config.hidden_size as u64);
        // Gemma 4's global layers attend materialized beside flash sliding layers.
        let flash = flash && config.flash_serves_every_layer();
        // Gemma 4: the widest layer's heads and MLP, and the wider stream its layers hand on.
        let (q, kv, inter, width) = match &config.gemma4 {
            Some(g) => {
                let widest = |f: &dyn Fn(&crate::model::config::Gemma4Layer) -> usize| {
                    g.layers.iter().map(f).max().unwrap_or(0) as u64
                };
                (
                    widest(&|l| config.num_heads * l.head_dim),
                    widest(&|l| l.num_kv_heads * l.head_dim),
                    widest(&|l| l.intermediate_size),
                    g.stream_width as u64,
                )
            }
            // Latent attention's heads are zero-padded to the flash head size.
            None => (
                (config.num_heads * config.attention_head_dim()) as u64,
                (config.num_kv_heads * config.attention_head_dim()) as u64,
                config.intermediate_size as u64,
                h,
            ),
        };
        // Residual stream in and out, its normed copy and the hidden state handed on.
        let stream = 2 * t * h * s + 2 * t * width * s;
        // q, k, v and the attention output, plus the dequantized q/k/v/o weights.
        let attention_tensors = t * (2 * q + 2 * kv) * s + (2 * q + 2 * kv) * h * s;
        // One sequence's f32 scores and their probabilities, when materialised. On the CPU
        // they are f32 whatever the dtype, one block of query rows at a time (with its rows of
        // the causal mask), beside f32 copies of q and of k and v repeated to the query heads,
        // the blocks' outputs and their concatenation: linear in the length.
        let l = max_seq as u64;
        let scores = match (flash, cpu) {
            (true, _) => 0,
            (false, false) => config.num_heads as u64 * l * l * (4 + s),
            (false, true) => {
                let blocks = crate::ops::AttentionBlocks::default();
                let (heads, dim) = (config.num_heads, config.head_dim);
                let (rows, _) = blocks.shape(heads, max_seq, dim);
                let block = blocks.block_elements(heads, max_seq, dim) as u64;
                8 * block + 4 * rows as u64 * l + 4 * l * (5 * q + 2 * kv)
            }
        };
        // gate, up and their product over one row chunk, plus three dequantized weights.
        let chunk = t.min(super::blocks::MLP_CHUNK as u64);
        let mlp = 3 * chunk * inter * s + 3 * inter * h * s;
        // A sparse layer's routed pass (blocks::moe): Gemma 4's mixture beside its dense MLP, or
        // the experts in place of it.
        let routed = match (
            &config.moe,
            config.gemma4.as_ref().and_then(|g| g.moe.as_ref()),
        ) {
            (Some(m), _) => Some((
                m.experts_per_token,
                m.num_experts,
                m.expert_intermediate_size,
            )),
            (None, Some(m)) => Some((m.top_k, m.num_experts, m.intermediate_size)),
            (None, None) => None,
        };
        let moe = routed.map_or(0, |(k, experts, inter)| {
            super::blocks::routed_pass_bytes(t, k as u64, experts as u64, h, inter as u64, s)
        });
        let logits_rows = super::decoder::lm_head_rows(config.vocab_size) as u64;
        Self {
            layers: stream + (attention_tensors + scores).max(mlp).max(moe),
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
    #[error("reading the memory of {device}: {message}")]
    Device { device: String, message: String },
    #[error("{stages} pipeline stages for {layers} decoder layers: every stage needs a layer")]
    TooManyStages { stages: usize, layers: usize },
    /// `sum`: `None` where it overflows.
    #[error(
        "the layer split sums to {}, the model has {layers} decoder layers",
        sum.map_or("more than any count of layers".to_string(), |s| s.to_string())
    )]
    SplitSum { sum: Option<usize>, layers: usize },
    #[error("a layer split needs one count per stage ({stages}), got {given}")]
    SplitLength { stages: usize, given: usize },
}

/// What the model of `config`/`ckpt` needs to be placed on `devices`: its parts' bytes and
/// work, and its activations at `batch_tokens` tokens of sequences up to `max_seq` (`flash`:
/// attention never materialises its scores).
pub struct PlacementInputs<'a> {
    pub config: &'a ModelConfig,
    pub ckpt: &'a Checkpoint,
    pub dtype: DType,
    pub batch_tokens: usize,
    pub max_seq: usize,
    pub flash: bool,
}

/// The stages of a model on `devices` (one each): `split` layers per stage, or the default
/// [`balance`] against each GPU's memory, shared by the model's stages on it.
pub fn plan_on(
    inputs: &PlacementInputs<'_>,
    devices: &[Device],
    split: Option<&[usize]>,
) -> Result<Vec<StagePlan>, PlacementError> {
    let c = inputs.config;
    let parts = PartBytes::of(c, inputs.ckpt);
    let activation = ActivationBytes::estimate(
        c,
        inputs.dtype,
        inputs.batch_tokens,
        inputs.max_seq,
        inputs.flash,
        devices.iter().all(Device::is_cpu),
    );
    match split {
        Some(counts) => from_split(&parts, &activation, counts),
        None => {
            let work = PartWork::of(c, inputs.max_seq);
            let capacity = capacities(devices)?;
            balance(
                &parts,
                &activation,
                &work,
                capacity.as_deref(),
                devices.len(),
            )
        }
    }
}

/// What each stage may hold: its GPU's memory less a margin for the CUDA context and the
/// allocator, shared equally by the stages on that GPU; `None` on the CPU.
fn capacities(devices: &[Device]) -> Result<Option<Vec<u64>>, PlacementError> {
    let locations: Vec<_> = devices.iter().map(Device::location).collect();
    let mut out = Vec::with_capacity(devices.len());
    for (device, location) in devices.iter().zip(&locations) {
        let total = crate::device::memory_capacity(device).map_err(|e| PlacementError::Device {
            device: format!("{location:?}"),
            message: e.to_string(),
        })?;
        let Some(total) = total else {
            return Ok(None);
        };
        let sharing = locations.iter().filter(|l| *l == location).count() as u64;
        out.push(usable_bytes(total) / sharing);
    }
    Ok(Some(out))
}

/// What a GPU of `total` bytes may hold: its memory less a margin of 8 % for the CUDA context
/// and the allocator.
pub fn usable_bytes(total: u64) -> u64 {
    total / 100 * 92
}

/// What each stage may hold for the memory plan's check: `limit` (`--max-memory-gib`) or the
/// device's memory (a GPU's total less 8 %, the host's available memory for the CPU), shared
/// equally by the stages on one device; `None` where it is unknown.
pub fn memory_limits(
    devices: &[Device],
    limit: Option<u64>,
) -> Result<Vec<Option<u64>>, PlacementError> {
    let locations: Vec<_> = devices.iter().map(Device::location).collect();
    let gpu = capacities(devices)?;
    let host = crate::device::host_memory_available();
    Ok(locations
        .iter()
        .enumerate()
        .map(|(k, location)| {
            let sharing = locations.iter().filter(|l| *l == location).count() as u64;
            match (limit, &gpu) {
                (Some(limit), _) => Some(limit / sharing),
                (None, Some(gpu)) => Some(gpu[k]),
                (None, None) if devices[k].is_cpu() => host.map(|h| h / sharing),
                (None, None) => None,
            }
        })
        .collect())
}

/// The first stage whose expected peak passes its limit (see [`memory_limits`]).
pub fn first_over(plans: &[StagePlan], limits: &[Option<u64>]) -> Option<usize> {
    plans
        .iter()
        .zip(limits)
        .position(|(plan, limit)| limit.is_some_and(|l| plan.expected_peak > l))
}

/// `counts[k]` layers on stage `k`, in order.
pub fn from_split(
    parts: &PartBytes,
    activation: &ActivationBytes,
    counts: &[usize],
) -> Result<Vec<StagePlan>, PlacementError> {
    let layers = parts.layers.len();
    // Checked: counts come from a flag and may be as large as usize allows.
    let sum = counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
    if sum != Some(layers) {
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

/// The default split of `stages` contiguous layer ranges: the one whose busiest stage has the
/// least work among those whose every stage fits `capacity[k]` bytes; without capacities, or
/// when no split fits them, the one whose largest expected peak is smallest. Ties go to the
/// first split tried (earlier stages shorter).
pub fn balance(
    parts: &PartBytes,
    activation: &ActivationBytes,
    work: &PartWork,
    capacity: Option<&[u64]>,
    stages: usize,
) -> Result<Vec<StagePlan>, PlacementError> {
    let layers = parts.layers.len();
    if stages == 0 || stages > layers {
        return Err(PlacementError::TooManyStages { stages, layers });
    }
    let peak =
        |k: usize, range: Range<usize>| plan(parts, activation, k, stages, range).expected_peak;
    if let Some(capacity) = capacity {
        let stage_work = |k: usize, range: Range<usize>| {
            let fits = peak(k, range.clone()) <= capacity[k];
            let w: f64 = work.layers[range].iter().sum::<f64>()
                + if k + 1 == stages { work.head } else { 0.0 };
            // A stage that does not fit costs more than any that does.
            if fits {
                w.round() as u64
            } else {
                u64::MAX / 2
            }
        };
        let counts = minimax_split(layers, stages, stage_work);
        if let Ok(plans) = from_split(parts, activation, &counts) {
            if plans
                .iter()
                .zip(capacity)
                .all(|(p, &c)| p.expected_peak <= c)
            {
                return Ok(plans);
            }
        }
    }
    let counts = minimax_split(layers, stages, peak);
    from_split(parts, activation, &counts)
}

/// Layer counts of the split of `layers` into `stages` non-empty contiguous ranges whose
/// largest `cost(stage, range)` is smallest (ties: the first found, earlier stages shorter).
fn minimax_split(
    layers: usize,
    stages: usize,
    cost: impl Fn(usize, Range<usize>) -> u64,
) -> Vec<usize> {
    // best[k][j]: the smallest largest cost of stages 0..=k holding layers 0..j, and where
    // stage k starts in that split.
    let mut best = vec![vec![(u64::MAX, 0usize); layers + 1]; stages];
    for (j, cell) in best[0].iter_mut().enumerate().skip(1) {
        *cell = (cost(0, 0..j), 0);
    }
    for k in 1..stages {
        for j in k + 1..=layers {
            for i in k..j {
                let (before, _) = best[k - 1][i];
                let worst = before.max(cost(k, i..j));
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
    counts
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

    fn no_work(p: &PartBytes) -> PartWork {
        PartWork {
            layers: vec![1.0; p.layers.len()],
            head: 0.0,
        }
    }

    /// A mixture's routed rows count, up to the budget of one pass: Qwen3-30B-A3B's shape (128
    /// experts of 768, 8 per token, hidden 2048) at 8 and 32 windows of 2048 in bf16.
    #[test]
    fn a_mixtures_routed_rows_count_up_to_one_pass() {
        let config = ModelConfig::from_json(
            r#"{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "vocab_size": 151936, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                "max_position_embeddings": 40960, "tie_word_embeddings": false,
                "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}"#,
        )
        .unwrap();
        let at =
            |tokens| ActivationBytes::estimate(&config, DType::BF16, tokens, 2048, true, false);
        let (eight, thirty_two) = (at(8 * 2048).layers, at(32 * 2048).layers);
        // 16384 tokens × 8 rows: in and out (2 × 512 MiB) and gate, up, product (3 × 192 MiB)
        let routed = 16384 * 8 * (2 * 2048 + 3 * 768) * 2;
        assert!(
            eight > routed,
            "{eight} bytes at 8 windows, routed rows alone {routed}"
        );
        // four times the tokens: the stream grows with them, the routed pass does not
        let stream_growth = 3 * 3 * 16384 * 2048 * 2 * 4;
        assert!(
            thirty_two < eight + stream_growth,
            "{thirty_two} bytes at 32 windows against {eight} at 8"
        );
    }

    /// With memory to spare, the work decides: a head that costs as much work as two layers
    /// but holds far more bytes (a bf16 lm_head beside 4-bit layers) moves two layers, not
    /// the many its bytes would.
    #[test]
    fn with_room_the_split_balances_work_not_bytes() {
        let p = parts(8, 100, 300, 1500);
        let work = PartWork {
            layers: vec![1e6; 8],
            head: 2e6,
        };
        let roomy = [10_000, 10_000];
        let plans = balance(&p, &ACT, &work, Some(&roomy), 2).unwrap();
        assert_eq!(counts(&plans), [5, 3]);
        // Memory alone would leave the last stage one layer.
        assert_eq!(counts(&balance(&p, &ACT, &work, None, 2).unwrap()), [7, 1]);
        // When the work-balanced split does not fit, the one that fits with the least work.
        let tight = [10_000, 1_750];
        let plans = balance(&p, &ACT, &work, Some(&tight), 2).unwrap();
        assert_eq!(counts(&plans), [6, 2]);
        assert!(plans[1].expected_peak <= 1_750);
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
        assert_eq!(
            counts(&balance(&p, &ACT, &no_work(&p), None, 2).unwrap()),
            [40, 40]
        );
        assert_eq!(
            counts(&balance(&p, &ACT, &no_work(&p), None, 4).unwrap()),
            [20, 20, 20, 20]
        );
        assert_eq!(
            counts(&balance(&p, &ACT, &no_work(&p), None, 1).unwrap()),
            [80]
        );
    }

    #[test]
    fn the_embedding_and_the_head_take_the_place_of_layers() {
        // 8 layers of 100 and an embedding of 300 on stage 0: 2 | 6 and 3 | 5 layers both
        // peak at 610 (weights + 10 of activations); the first found, stage 0 shorter, wins.
        let p = parts(8, 100, 300, 0);
        let plans = balance(&p, &ACT, &no_work(&p), None, 2).unwrap();
        assert_eq!(counts(&plans), [2, 6]);
        assert_eq!(plans[0].weight_bytes, 500);
        assert_eq!(plans[1].weight_bytes, 600);
        // A head as large as two layers moves two layers to the first stage.
        let plans = balance(
            &parts(8, 100, 0, 200),
            &ACT,
            &no_work(&parts(8, 100, 0, 200)),
            None,
            2,
        )
        .unwrap();
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
        let got = balance(&p, &act, &no_work(&p), None, 3).unwrap();
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
            Err(PlacementError::SplitSum {
                sum: Some(3),
                layers: 6
            })
        );
        // Counts whose sum overflows (the flag takes any usize) are refused, not a panic.
        for counts in [[usize::MAX, 3], [1 << 63, (1 << 63) + 2]] {
            let err = from_split(&p, &ACT, &counts).unwrap_err();
            assert_eq!(
                err,
                PlacementError::SplitSum {
                    sum: None,
                    layers: 6
                }
            );
            assert!(err.to_string().contains("more than any count"), "{err}");
        }
        assert_eq!(
            balance(&p, &ACT, &no_work(&p), None, 7),
            Err(PlacementError::TooManyStages {
                stages: 7,
                layers: 6
            })
        );
    }
}

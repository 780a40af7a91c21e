//! Shared helpers for the fixture tests: paths, model loading, reference.json access.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use exactscore_server::model::{Model, ModelOptions, ScoreInput, SequenceScores};
use exactscore_server::quant::{ActivationQdq, ActivationQuantMode, LinearOptions};
use serde_json::Value;

pub const VARIANTS: &[&str] = &[
    "llama-dense-bf16",
    "llama-w4a16-g128",
    "llama-w4a16-asym-g64",
    "llama-w8a16-channel",
    "llama-nvfp4a16",
    "llama-nvfp4",
    "llama-fp8-dynamic",
];

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

pub fn options(dtype: DType, act: ActivationQuantMode) -> ModelOptions {
    ModelOptions {
        linear: LinearOptions {
            device: Device::Cpu,
            dtype,
            activation_quant: act,
            kv_cache: Default::default(),
            fp8_matmul: Default::default(),
            fused_fp8_scales: Default::default(),
        },
        max_seq_len: 512,
        attention: Default::default(),
    }
}

pub fn load(variant: &str, act: ActivationQuantMode) -> Model {
    Model::load(&fixtures().join(variant), &options(DType::F32, act))
        .unwrap_or_else(|e| panic!("{variant}: {e}"))
}

pub fn reference(variant: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(variant).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// `model`'s scores of `seqs` in one batch, with the `top_k` alternatives of each position.
pub fn score_all(model: &Model, seqs: &[Vec<u32>], top_k: usize) -> Vec<SequenceScores> {
    let batch: Vec<ScoreInput> = seqs
        .iter()
        .map(|t| ScoreInput {
            stored: exactscore_server::model::StoredRequest::NONE,
            tokens: t,
            top_k,
        })
        .collect();
    model.score(&batch).unwrap()
}

/// Per-token |Δ| between our log-probs and a reference block, flattened.
pub fn deltas(ours: &[SequenceScores], reference: &[Vec<f64>]) -> Vec<f64> {
    ours.iter()
        .zip(reference)
        .flat_map(|(s, r)| {
            assert_eq!(s.num_scored(), r.len());
            s.token_logprobs()
                .zip(r)
                .map(|(a, b)| (a as f64 - b).abs())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Token ids of every reference sequence.
pub fn sequences(reference: &Value) -> Vec<Vec<u32>> {
    reference["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// Reference log-probs of positions 1.. of each sequence in `block` (`sequences` entries).
pub fn reference_logprobs(block: &Value) -> Vec<Vec<f64>> {
    block
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s["token_logprobs"].as_array().unwrap()[1..]
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        })
        .collect()
}

/// Asserts that `qdq(input)` equals `expected` bit for bit.
pub fn assert_bit_exact(qdq: &ActivationQdq, input: &Tensor, expected: &Tensor, what: &str) {
    let ours = qdq
        .apply(input)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let want = expected.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mismatches = ours
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        mismatches,
        0,
        "{what}: {mismatches} of {} values differ",
        want.len()
    );
}

/// A checkpoint's tensors: name → (dtype, shape, bytes).
pub type Tensors = BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// A copy of fixture `variant` in a temp dir, with `edit` applied to its tensors and
/// `config_edit` to its config.json, written as `shards` safetensors files (more than one: with
/// a `model.safetensors.index.json`, tensors dealt out in name order).
pub fn edited_copy(
    variant: &str,
    shards: usize,
    edit: impl FnOnce(&mut Tensors),
    config_edit: impl FnOnce(&mut serde_json::Value),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join(variant);
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors);
    write_shards(dir.path(), &tensors, shards);
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config_edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    // An older ModelOpt export's quantization config lies beside config.json.
    let legacy = src.join("hf_quant_config.json");
    if legacy.is_file() {
        std::fs::copy(&legacy, dir.path().join("hf_quant_config.json")).unwrap();
    }
    dir
}

fn write_shards(dir: &Path, tensors: &Tensors, shards: usize) {
    let per_shard = tensors.len().div_ceil(shards);
    let names: Vec<&String> = tensors.keys().collect();
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in names.chunks(per_shard).enumerate() {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", i + 1)
        };
        let views: Vec<(String, safetensors::tensor::TensorView)> = chunk
            .iter()
            .map(|&n| {
                let (d, s, b) = &tensors[n];
                let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
                (n.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        for &n in chunk {
            weight_map.insert(n.clone(), Value::String(file.clone()));
        }
    }
    if shards > 1 {
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

/// The parsed config.json of fixture `variant`.
pub fn load_config(variant: &str) -> exactscore_server::model::ModelConfig {
    let text = std::fs::read_to_string(fixtures().join(variant).join("config.json")).unwrap();
    exactscore_server::model::ModelConfig::from_json(&text).unwrap()
}

/// The samples of a Prometheus text exposition (`/metrics`), by series name and labels.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

//! Shared helpers for the fixture tests: paths, model loading, reference.json access.
#![allow(dead_code)]

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use exactscore_server::model::{Model, ModelOptions};
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

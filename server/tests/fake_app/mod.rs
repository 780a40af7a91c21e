//! What the HTTP tests over the fake engine share: the `/info` the fake app reports.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use exactscore_api::{Limits, ModelInfo};

/// The fixture tokenizer's vocabulary, which the fake model pretends to have.
pub const VOCAB: usize = 2000;
pub const MAX_INPUT: usize = 64;

/// The tiny fixture whose tokenizer the fake app uses.
pub fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama-w4a16-g128")
}

/// `/info` of a fake 2-layer model admitting `max_queued` requests, without a reference model.
pub fn info(max_queued: usize) -> ModelInfo {
    ModelInfo {
        model: "fake".into(),
        architecture: "LlamaForCausalLM".into(),
        vocab_size: VOCAB,
        num_layers: 2,
        hidden_size: 256,
        formats: BTreeMap::new(),
        activation_quant: BTreeMap::new(),
        activation_quant_mode: "emulate".into(),
        kv_cache: None,
        kv_cache_quant_mode: "emulate".into(),
        kv_cache_dtype: "auto".into(),
        attention: "materialized".into(),
        bits_per_weight: 4.25,
        dtype: "f32".into(),
        devices: vec!["cpu".into()],
        placement: Vec::new(),
        limits: Limits {
            max_input_tokens: MAX_INPUT,
            max_batch_tokens: 256,
            max_batch_requests: 4,
            max_queued_requests: max_queued,
            max_top_k: 20,
            max_request_cost: u64::MAX,
            max_response_bytes: u64::MAX,
        },
        version: "test".into(),
        reference: None,
        checkpoint_sha256: None,
    }
}

//! `LlamaForCausalLM`: the reading every other architecture starts from (the provided methods
//! of `ArchitectureConfig`); its MLP may carry biases (as DeepSeek-V2's may).

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::shared::{ProjectionBiases, SharedKeys};

pub(super) struct LlamaForCausalLM;

impl ArchitectureConfig for LlamaForCausalLM {
    fn hf_name(&self) -> &'static str {
        "LlamaForCausalLM"
    }

    fn transformers_defaults(&self) -> Value {
        json!({ "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048 })
    }

    fn biases(&self, keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases::attention_and_mlp_bias(keys)
    }
}

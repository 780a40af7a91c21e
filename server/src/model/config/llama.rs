//! `LlamaForCausalLM`: the reading every other architecture starts from (the provided methods
//! of `ArchitectureConfig`), and the only one whose MLP may carry biases.

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
        ProjectionBiases {
            mlp: keys.mlp_bias.unwrap_or(false),
            ..ProjectionBiases::attention_bias(keys)
        }
    }
}

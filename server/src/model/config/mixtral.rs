//! `MixtralForCausalLM`: every layer a mixture of `num_local_experts` experts of
//! `intermediate_size`, named `block_sparse_moe.experts.E.{w1,w3,w2}`, their top-k
//! probabilities always renormalised; no projection has a bias.

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::shared::{experts, MoeConfig, ProjectionBiases, SharedKeys};
use crate::checkpoint::LoadError;

pub(super) struct MixtralForCausalLM;

impl ArchitectureConfig for MixtralForCausalLM {
    fn hf_name(&self) -> &'static str {
        "MixtralForCausalLM"
    }

    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
            "num_key_value_heads": 8,
        })
    }

    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        let moe = experts(root, "num_local_experts", "intermediate_size", num_layers)?;
        Ok(Some(MoeConfig {
            norm_topk_prob: true,
            mixtral_names: true,
            ..moe
        }))
    }

    fn biases(&self, _keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases::NONE
    }
}

//! `Glm4MoeForCausalLM` (GLM-4.5, 4.6, 4.7): Llama-style attention whose q/k/v carry
//! `attention_bias` (o_proj never), optional per-head q/k norms (`use_qk_norm`), partial
//! rotary (transformers' default factor 0.5), and DeepSeek-V3's mixture of experts after
//! `first_k_dense_replace` dense layers (docs/architectures/deepseek.md).

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::deepseek_v3::{attribute_names, deepseek_moe, first_k_dense};
use super::shared::{optional_usize, MoeConfig, ProjectionBiases, SharedKeys};
use crate::checkpoint::LoadError;

pub(super) struct Glm4MoeForCausalLM;

impl ArchitectureConfig for Glm4MoeForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Glm4MoeForCausalLM"
    }

    /// `Glm4MoeConfig`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 131072,
            "num_key_value_heads": 8, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
            "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": true,
            "use_qk_norm": false, "num_nextn_predict_layers": 1,
        })
    }

    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        Ok(attribute_names(root))
    }

    /// q/k/v as `attention_bias` says; o_proj is built without one.
    fn biases(&self, keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases {
            o: false,
            ..ProjectionBiases::attention_bias(keys)
        }
    }

    fn qk_norm(&self, root: &Value) -> bool {
        root.get("use_qk_norm").and_then(Value::as_bool) == Some(true)
    }

    /// `kwargs.setdefault("partial_rotary_factor", 0.5)`.
    fn partial_rotary_default(&self) -> Option<f64> {
        Some(0.5)
    }

    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        deepseek_moe(root, first_k_dense(root, num_layers)?).map(Some)
    }

    fn mtp_layers(&self, root: &Value) -> Result<usize, LoadError> {
        Ok(optional_usize(root, "num_nextn_predict_layers")?.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use crate::model::config::ModelConfig;

    #[test]
    fn glm4_moe_partial_rotary_biases_and_qk_norm() {
        let text = r#"{"architectures":["Glm4MoeForCausalLM"],"vocab_size":10,"hidden_size":64,
            "intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":32,"attention_bias":true,"use_qk_norm":true,
            "n_routed_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":16}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (32, 16));
        assert!(c.qkv_bias && !c.o_bias && c.qk_norm && c.mla.is_none());
        assert_eq!(c.moe.unwrap().sparse_layers, vec![false, true]);
    }
}

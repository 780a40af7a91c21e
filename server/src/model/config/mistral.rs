//! `MistralForCausalLM`: every layer slides (MistralConfig's default window is 4096), and no
//! projection has a bias whatever the config says.

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::shared::{ProjectionBiases, SharedKeys};

pub(super) struct MistralForCausalLM;

impl ArchitectureConfig for MistralForCausalLM {
    fn hf_name(&self) -> &'static str {
        "MistralForCausalLM"
    }

    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 131072,
            "num_key_value_heads": 8, "sliding_window": 4096,
        })
    }

    fn biases(&self, _keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases::NONE
    }
}

#[cfg(test)]
mod tests {
    use crate::model::config::{ModelConfig, RopeScaling};

    #[test]
    fn old_type_key_and_plain_theta() {
        let text = r#"{"architectures":["MistralForCausalLM"],"vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,"rope_theta":10000.0,
        "rope_scaling":null,"sliding_window":4096,"num_key_value_heads":null}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.rope.scaling, RopeScaling::Default);
        // An explicit null is transformers' "as many as the query heads".
        assert_eq!(c.num_kv_heads, 2);
        assert_eq!(c.sliding_window, Some(4096));
    }
}

//! `Qwen2ForCausalLM`: q/k/v always carry biases and o_proj never does; a `sliding_window` in
//! the file is only active with `use_sliding_window` (as in every Qwen).

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::shared::{ProjectionBiases, SharedKeys};

pub(super) struct Qwen2ForCausalLM;

impl ArchitectureConfig for Qwen2ForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }

    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
            "num_key_value_heads": 32,
        })
    }

    fn sliding_window(&self, window: Option<usize>, keys: &SharedKeys) -> Option<usize> {
        window_if_used(window, keys)
    }

    fn biases(&self, _keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases {
            qkv: true,
            o: false,
            mlp: false,
        }
    }
}

/// Qwen configs carry a `sliding_window` value that is only active with `use_sliding_window`.
pub(super) fn window_if_used(window: Option<usize>, keys: &SharedKeys) -> Option<usize> {
    window.filter(|_| keys.use_sliding_window == Some(true))
}

//! `Qwen2ForCausalLM`: q/k/v always carry biases and o_proj never does; a `sliding_window` in
//! the file is only active with `use_sliding_window` (as in every Qwen), and then only in the
//! layers `layer_types` names (else those from `max_window_layers` on).

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::gemma2::listed_layer_types;
use super::shared::{optional_usize, ProjectionBiases, SharedKeys, SlidingLayers};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

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

    fn sliding_layers(
        &self,
        root: &Value,
        num_layers: usize,
        _local_rope: Option<Rope>,
    ) -> Result<Option<SlidingLayers>, LoadError> {
        window_layers(root, num_layers)
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

/// Which layers slide (`Qwen2Config` / `Qwen3Config`): those `layer_types` calls
/// `sliding_attention` (transformers 5 writes the list), else layer `i >= max_window_layers`
/// (default 28). Without the list every layer would slide, which transformers never does.
pub(super) fn window_layers(
    root: &Value,
    num_layers: usize,
) -> Result<Option<SlidingLayers>, LoadError> {
    let sliding = match root.get("layer_types") {
        Some(Value::Array(types)) => listed_layer_types(types, num_layers)?,
        None | Some(Value::Null) => {
            let first = optional_usize(root, "max_window_layers")?.unwrap_or(28);
            (0..num_layers).map(|i| i >= first).collect()
        }
        Some(other) => {
            return Err(LoadError::config(
                "layer_types",
                format!("{other} is not a list"),
            ))
        }
    };
    Ok(Some(SlidingLayers {
        sliding,
        local_rope: None,
    }))
}

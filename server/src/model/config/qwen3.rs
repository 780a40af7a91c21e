//! `Qwen3ForCausalLM`: Qwen2 with q/k norms, and biases where `attention_bias` says.

use serde_json::Value;

use super::architecture::ArchitectureConfig;
use super::qwen2::{window_if_used, window_layers, Qwen2ForCausalLM};
use super::shared::{SharedKeys, SlidingLayers};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

pub(super) struct Qwen3ForCausalLM;

impl ArchitectureConfig for Qwen3ForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Qwen3ForCausalLM"
    }

    /// Qwen3Config's defaults are Qwen2Config's.
    fn transformers_defaults(&self) -> Value {
        Qwen2ForCausalLM.transformers_defaults()
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

    fn qk_norm(&self, _root: &Value) -> bool {
        true
    }
}

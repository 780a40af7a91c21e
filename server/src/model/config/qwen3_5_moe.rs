//! Qwen3.5-MoE: `Qwen3_5MoeForCausalLM` (model_type `qwen3_5_moe_text`, tensors under
//! `model.`) and the text model of `Qwen3_5MoeForConditionalGeneration` (model_type
//! `qwen3_5_moe`, keys under `text_config`, tensors under `model.language_model.`, the vision
//! tower under `model.visual.`, never read). Qwen3.5's hybrid layers with a mixture of experts
//! and a sigmoid-gated shared expert in every layer: no dense MLP (`intermediate_size`,
//! `decoder_sparse_step`, `mlp_only_layers` and `norm_topk_prob` are deleted from the config
//! class; the top-k probabilities are always renormalised).

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::qwen3_5::conditional_text_config;
use super::qwen3_next::{hybrid_defaults, linear_attention, shared_expert_size, UNREAD_PREFIXES};
use super::shared::{
    experts, keys_set, LinearAttentionConfig, MoeConfig, SharedKeys, SOFTCAPPING_KEYS,
};
use crate::checkpoint::LoadError;

pub(super) struct Qwen3_5Moe {
    pub(super) vision_language: bool,
}

impl ArchitectureConfig for Qwen3_5Moe {
    fn hf_name(&self) -> &'static str {
        if self.vision_language {
            "Qwen3_5MoeForConditionalGeneration"
        } else {
            "Qwen3_5MoeForCausalLM"
        }
    }

    /// `Qwen3_5MoeTextConfig`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        let mut d = hybrid_defaults(2);
        for (k, v) in json!({
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "num_experts_per_tok": 8, "num_experts": 256,
        })
        .as_object()
        .unwrap()
        {
            d[k.as_str()] = v.clone();
        }
        d
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Qwen3Next
    }

    fn is_vision_language(&self) -> bool {
        self.vision_language
    }

    /// The text-only class reads a `ForConditionalGeneration` checkpoint too
    /// (`conversion_mapping.py` strips `language_model` for `qwen3_5_moe_text`).
    fn reads_nested_text_model(&self) -> bool {
        true
    }

    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        let mut text = if self.vision_language {
            conditional_text_config(root, "qwen3_5_moe_text")?
        } else {
            root
        };
        // The config class deletes it: every layer is sparse, whatever a file says.
        if let Some(t) = text.as_object_mut() {
            t.remove("intermediate_size");
        }
        Ok(text)
    }

    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        keys_set(root, &SOFTCAPPING_KEYS)
    }

    fn unread_prefixes(&self) -> &'static [&'static str] {
        &UNREAD_PREFIXES
    }

    fn sliding_window(&self, _window: Option<usize>, _keys: &SharedKeys) -> Option<usize> {
        None
    }

    fn partial_rotary_default(&self) -> Option<f64> {
        Some(0.25)
    }

    fn linear_attention(
        &self,
        root: &Value,
        num_layers: usize,
    ) -> Result<Option<LinearAttentionConfig>, LoadError> {
        linear_attention(root, num_layers, false).map(Some)
    }

    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        let moe = experts(root, "num_experts", "moe_intermediate_size", num_layers)?;
        Ok(Some(MoeConfig {
            norm_topk_prob: true,
            shared_expert_intermediate_size: Some(shared_expert_size(root)?),
            weights_in_compute_dtype: true,
            ..moe
        }))
    }

    fn qk_norm(&self, _root: &Value) -> bool {
        true
    }

    fn attn_output_gate(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, ModelConfig};

    #[test]
    fn qwen3_5_moe_is_sparse_everywhere_and_always_renormalises() {
        let text = r#"{"architectures":["Qwen3_5MoeForCausalLM"],"vocab_size":10,
            "hidden_size":8,"intermediate_size":16,"num_hidden_layers":3,"num_attention_heads":2,
            "head_dim":64,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":4,
            "norm_topk_prob":false,"mlp_only_layers":[1],"full_attention_interval":2}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3_5Moe);
        assert_eq!(c.intermediate_size, 0);
        let m = c.moe.unwrap();
        assert_eq!(m.sparse_layers, vec![true; 3]);
        assert!(m.norm_topk_prob);
        assert_eq!(m.shared_expert_intermediate_size, Some(512));
        assert_eq!(
            c.linear_attention.unwrap().linear_layers,
            vec![true, false, true]
        );
    }
}

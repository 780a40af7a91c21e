//! Qwen3.5 (dense): `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`, keys at the top level,
//! tensors under `model.`) and the text model of `Qwen3_5ForConditionalGeneration` (model_type
//! `qwen3_5`, keys under `text_config`, tensors under `model.language_model.`, the vision tower
//! under `model.visual.`, never read). Qwen3-Next's hybrid layers (`qwen3_next.rs`) with
//! Qwen3.5's separate `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a`, and a dense
//! MLP in every layer. Its mrope reduces to the plain partial rope for text (see
//! `qwen3_next.rs`).

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::qwen3_next::{hybrid_defaults, linear_attention, UNREAD_PREFIXES};
use super::shared::{keys_set, LinearAttentionConfig, SharedKeys, SOFTCAPPING_KEYS};
use super::vision_language;
use crate::checkpoint::LoadError;

pub(super) struct Qwen3_5 {
    pub(super) vision_language: bool,
}

/// The text config of a Qwen3.5 / Qwen3.5-MoE `ForConditionalGeneration` file: `text_config`
/// (whose `model_type` must be `text_model_type` where given) with the top-level quantization,
/// token ids and dtype; the lm_head is tied by the top-level `tie_word_embeddings` (default
/// false), the composite config being the model's.
pub(super) fn conditional_text_config(
    root: Value,
    text_model_type: &str,
) -> Result<Value, LoadError> {
    let mut text = vision_language::text_config(&root)?;
    match text.get("model_type") {
        None | Some(Value::Null) => {}
        Some(t) if t == text_model_type => {}
        Some(other) => {
            return Err(LoadError::config(
                "text_config.model_type",
                format!("{other} is not supported (supported: \"{text_model_type}\")"),
            ))
        }
    }
    text["tie_word_embeddings"] = root
        .get("tie_word_embeddings")
        .cloned()
        .unwrap_or(Value::Bool(false));
    Ok(vision_language::with_top_level_keys(&root, text))
}

impl ArchitectureConfig for Qwen3_5 {
    fn hf_name(&self) -> &'static str {
        if self.vision_language {
            "Qwen3_5ForConditionalGeneration"
        } else {
            "Qwen3_5ForCausalLM"
        }
    }

    /// `Qwen3_5TextConfig`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        hybrid_defaults(4)
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Qwen3Next
    }

    fn is_vision_language(&self) -> bool {
        self.vision_language
    }

    /// The text-only class reads a `ForConditionalGeneration` checkpoint too
    /// (`conversion_mapping.py` strips `language_model` for `qwen3_5_text`).
    fn reads_nested_text_model(&self) -> bool {
        true
    }

    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        if !self.vision_language {
            return Ok(root);
        }
        conditional_text_config(root, "qwen3_5_text")
    }

    /// A mixture of experts belongs to Qwen3.5-MoE, another architecture.
    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        let mut refused = keys_set(root, &SOFTCAPPING_KEYS);
        if root
            .get("num_experts")
            .is_some_and(|v| v != &json!(0) && !v.is_null())
        {
            refused.push("num_experts");
        }
        refused
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
    fn qwen3_5_conditional_generation_reads_its_text_config() {
        let text = r#"{"architectures":["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings":true,"eos_token_id":7,"text_config":{"model_type":"qwen3_5_text",
            "vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,
            "num_attention_heads":4,"head_dim":64,"tie_word_embeddings":false,
            "layer_types":["linear_attention","full_attention"],
            "rope_parameters":{"rope_type":"default","rope_theta":1e7,"mrope_section":[3,3,2],
            "mrope_interleaved":true,"partial_rotary_factor":0.25}}}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3_5Multimodal);
        assert!(c.tie_word_embeddings, "the top-level flag governs");
        assert_eq!(
            (c.rotary_dim, c.num_kv_heads, c.eos_token_ids.clone()),
            (16, 4, vec![7])
        );
        let la = c.linear_attention.unwrap();
        assert!(!la.grouped_projections);
        assert_eq!((la.k_heads, la.v_heads, la.k_dim), (16, 32, 128));
        assert!(c.moe.is_none());
        let err = ModelConfig::from_json(&text.replace("qwen3_5_text", "qwen3_5_moe_text"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("text_config.model_type"), "{err}");
    }
}

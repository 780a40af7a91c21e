//! `Mistral3ForConditionalGeneration` (Mistral Small 3.x): only its text model is served, a
//! Mistral whose keys sit under `text_config`.

use serde_json::Value;

use super::architecture::ArchitectureConfig;
use super::mistral::MistralForCausalLM;
use super::shared::{ProjectionBiases, SharedKeys};
use super::vision_language;
use crate::checkpoint::LoadError;

pub(super) struct Mistral3ForConditionalGeneration;

impl ArchitectureConfig for Mistral3ForConditionalGeneration {
    fn hf_name(&self) -> &'static str {
        "Mistral3ForConditionalGeneration"
    }

    fn transformers_defaults(&self) -> Value {
        MistralForCausalLM.transformers_defaults()
    }

    fn is_vision_language(&self) -> bool {
        true
    }

    /// A Mistral 4 or DeepSeek-V3 text model is another architecture ([`super::mistral4`],
    /// [`super::deepseek_v3`]).
    fn reads(&self, root: &Value) -> bool {
        !matches!(
            super::mistral4::text_model_type(root),
            Some("mistral4" | "deepseek_v3")
        )
    }

    /// transformers builds the text model from `text_config.model_type` (another one,
    /// Ministral 3's, is another architecture), and ties its lm_head by the top-level flag
    /// (default true) where the checkpoint has none; the text model's own is not read.
    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        let text = wrapped_text_config(&root)?;
        match text.get("model_type") {
            None | Some(Value::Null) => {}
            Some(t) if t == "mistral" => {}
            Some(other) => {
                return Err(LoadError::config(
                    "text_config.model_type",
                    format!(
                        "{other} is not supported (supported: \"mistral\", \"mistral4\", \
                         \"deepseek_v3\")"
                    ),
                ))
            }
        }
        Ok(text)
    }

    fn biases(&self, keys: &SharedKeys) -> ProjectionBiases {
        MistralForCausalLM.biases(keys)
    }
}

/// The text model's config of a `Mistral3ForConditionalGeneration`, whichever it is: its lm_head
/// is tied by the top-level flag (default true), never by the text model's own.
pub(super) fn wrapped_text_config(root: &Value) -> Result<Value, LoadError> {
    let mut text = vision_language::text_config(root)?;
    text["tie_word_embeddings"] = root
        .get("tie_word_embeddings")
        .cloned()
        .unwrap_or(Value::Bool(true));
    Ok(vision_language::with_top_level_keys(root, text))
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, ModelConfig};

    #[test]
    fn mistral3_reads_its_text_config_and_refuses_other_text_models() {
        let text = r#"{"architectures":["Mistral3ForConditionalGeneration"],"text_config":
            {"model_type":"mistral","vocab_size":10,"hidden_size":32,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":8,"rope_theta":1e9,
            "tie_word_embeddings":false}}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.architecture, Architecture::Mistral3Multimodal);
        // MistralConfig's defaults (window, 8 KV heads); the top-level tie flag governs.
        assert_eq!((c.sliding_window, c.num_kv_heads), (Some(4096), 8));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope.theta, 1e9);
        let err = ModelConfig::from_json(&text.replace("\"mistral\"", "\"ministral3\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("text_config.model_type") && err.contains("ministral3"),
            "{err}"
        );
    }
}

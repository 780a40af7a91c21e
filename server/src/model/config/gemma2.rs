//! `Gemma2ForCausalLM`, and what Gemma 3 takes from it (as transformers' modular Gemma 3 does):
//! the GeGLU activation under `hidden_activation`, `layer_types`, `query_pre_attn_scalar` and
//! the final soft-capping. Gemma 2 alone applies the attention soft-capping.

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::shared::{
    gate_activation, optional_f64, Activation, ScoreShaping, SharedKeys, SlidingLayers,
};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

pub(super) struct Gemma2ForCausalLM;

impl ArchitectureConfig for Gemma2ForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Gemma2ForCausalLM"
    }

    fn transformers_defaults(&self) -> Value {
        json!({
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
            "tie_word_embeddings": true, "max_position_embeddings": 8192, "head_dim": 256,
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Gemma
    }

    fn unimplemented_keys(&self, _root: &Value) -> Vec<&'static str> {
        Vec::new()
    }

    fn activation(&self, keys: &SharedKeys) -> Result<Activation, LoadError> {
        gemma_activation(self.hf_name(), keys)
    }

    /// Without `layer_types`, layers alternate from a sliding layer 0.
    fn sliding_layers(
        &self,
        root: &Value,
        num_layers: usize,
        local_rope: Option<Rope>,
    ) -> Result<Option<SlidingLayers>, LoadError> {
        let sliding = layer_types(root, num_layers, |_| Ok(2))?;
        Ok(Some(SlidingLayers {
            sliding,
            local_rope,
        }))
    }

    fn score_shaping(&self, root: &Value) -> Result<ScoreShaping, LoadError> {
        Ok(ScoreShaping {
            query_pre_attn_scalar: optional_f64(root, "query_pre_attn_scalar")?,
            attn_logit_softcapping: optional_f64(root, "attn_logit_softcapping")?,
            final_logit_softcapping: optional_f64(root, "final_logit_softcapping")?,
        })
    }
}

/// Gemma's `hidden_activation` (else `hidden_act`): GeGLU, or SiLU.
pub(super) fn gemma_activation(
    architecture: &str,
    keys: &SharedKeys,
) -> Result<Activation, LoadError> {
    gate_activation(
        architecture,
        "hidden_activation",
        keys.hidden_activation
            .as_deref()
            .or(keys.hidden_act.as_deref()),
        &[
            ("gelu_pytorch_tanh", Activation::GeluTanh),
            ("silu", Activation::Silu),
        ],
    )
}

/// Which layers slide: Gemma's `layer_types` (`sliding_attention` / `full_attention`); without
/// it, all but every `pattern(root)`-th layer, as transformers derives them. Sliding layers need
/// a `sliding_window`.
pub(super) fn layer_types(
    root: &Value,
    num_layers: usize,
    pattern: impl FnOnce(&Value) -> Result<usize, LoadError>,
) -> Result<Vec<bool>, LoadError> {
    let sliding = match root.get("layer_types") {
        Some(Value::Array(types)) => listed_layer_types(types, num_layers)?,
        Some(Value::Null) | None => {
            let pattern = pattern(root)?;
            (0..num_layers).map(|i| (i + 1) % pattern != 0).collect()
        }
        Some(other) => {
            return Err(LoadError::config(
                "layer_types",
                format!("{other} is not a list"),
            ))
        }
    };
    if sliding.iter().any(|&s| s) && !root.get("sliding_window").is_some_and(Value::is_u64) {
        return Err(LoadError::config(
            "sliding_window",
            "sliding layers need a positive integer window",
        ));
    }
    Ok(sliding)
}

pub(super) fn listed_layer_types(
    types: &[Value],
    num_layers: usize,
) -> Result<Vec<bool>, LoadError> {
    if types.len() != num_layers {
        return Err(LoadError::config(
            "layer_types",
            format!("{} entries for {num_layers} layers", types.len()),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(LoadError::config(
                "layer_types",
                format!("{t} is not supported (supported: sliding_attention, full_attention)"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::model::config::ModelConfig;

    #[test]
    fn gemma2_softcaps_default_as_transformers_does() {
        let text = r#"{"architectures":["Gemma2ForCausalLM"],"vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":2,"num_attention_heads":2,"head_dim":4}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.attn_logit_softcapping, Some(50.0));
        assert_eq!(c.final_logit_softcapping, Some(30.0));
        assert_eq!(c.sliding_layers.unwrap().sliding, vec![true, false]);
        let off = text.replace(
            "\"head_dim\":4",
            "\"head_dim\":4,\"final_logit_softcapping\":null",
        );
        assert_eq!(
            ModelConfig::from_json(&off)
                .unwrap()
                .final_logit_softcapping,
            None
        );
    }
}

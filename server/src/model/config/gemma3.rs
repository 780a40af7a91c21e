//! Gemma 3's text model: `Gemma3ForCausalLM`, or the text part of a vision-language
//! `Gemma3ForConditionalGeneration` (keys under `text_config`). Gemma 2's reading with q/k
//! norms, a local RoPE base for the sliding layers, and no attention soft-capping.

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::gemma2::{gemma_activation, layer_types};
use super::rope_parameters::parse_rope;
use super::shared::{keys_set, optional_f64, Activation, ScoreShaping, SharedKeys, SlidingLayers};
use super::vision_language;
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

pub(super) struct Gemma3 {
    pub(super) vision_language: bool,
}

impl ArchitectureConfig for Gemma3 {
    fn hf_name(&self) -> &'static str {
        if self.vision_language {
            "Gemma3ForConditionalGeneration"
        } else {
            "Gemma3ForCausalLM"
        }
    }

    fn transformers_defaults(&self) -> Value {
        json!({
            "vocab_size": 262208, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "tie_word_embeddings": true, "max_position_embeddings": 131072, "head_dim": 256,
            "final_logit_softcapping": null, "attn_logit_softcapping": null,
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Gemma
    }

    fn is_vision_language(&self) -> bool {
        self.vision_language
    }

    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        if !self.vision_language {
            return Ok(root);
        }
        let text = vision_language::text_config(&root)?;
        Ok(vision_language::with_top_level_keys(&root, text))
    }

    /// transformers' Gemma 3 never applies the attention soft-capping, and
    /// `use_bidirectional_attention` drops the causal mask: both are refused rather than
    /// guessed at.
    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        keys_set(
            root,
            &["attn_logit_softcapping", "use_bidirectional_attention"],
        )
    }

    fn activation(&self, keys: &SharedKeys) -> Result<Activation, LoadError> {
        gemma_activation(self.hf_name(), keys)
    }

    /// A global RoPE and a local one for the sliding layers: `rope_parameters.{full,sliding}_attention`
    /// in transformers 5; `rope_theta` + `rope_scaling` for the global and
    /// `rope_local_base_freq` in 4.x files.
    fn rope(&self, root: &Value, _keys: &SharedKeys) -> Result<(Rope, Option<Rope>), LoadError> {
        let params = root.get("rope_parameters").filter(|p| !p.is_null());
        let (global, local) = match params {
            Some(p) if p.get("full_attention").is_some() => (
                parse_rope(&p.get("full_attention").cloned(), &None, None, root)?,
                parse_rope(&p.get("sliding_attention").cloned(), &None, None, root)?,
            ),
            _ => {
                let v4_scaling = root.get("rope_scaling").cloned();
                let theta = root.get("rope_theta").and_then(Value::as_f64);
                let global = parse_rope(&params.cloned(), &v4_scaling, theta, root)?;
                let local_theta = root.get("rope_local_base_freq").and_then(Value::as_f64);
                (global, parse_rope(&None, &None, local_theta, root)?)
            }
        };
        Ok((global, Some(local)))
    }

    /// Without `layer_types`, every `sliding_window_pattern`-th layer is global. (Configs
    /// written by transformers 5 also carry a stale `_sliding_window_pattern`, which
    /// transformers itself ignores when `layer_types` is set.)
    fn sliding_layers(
        &self,
        root: &Value,
        num_layers: usize,
        local_rope: Option<Rope>,
    ) -> Result<Option<SlidingLayers>, LoadError> {
        let sliding = layer_types(root, num_layers, |root| {
            root.get("sliding_window_pattern")
                .and_then(Value::as_u64)
                .filter(|&p| p > 0)
                .map(|p| p as usize)
                .ok_or_else(|| {
                    LoadError::config("sliding_window_pattern", "must be a positive integer")
                })
        })?;
        Ok(Some(SlidingLayers {
            sliding,
            local_rope,
        }))
    }

    fn qk_norm(&self, _root: &Value) -> bool {
        true
    }

    fn score_shaping(&self, root: &Value) -> Result<ScoreShaping, LoadError> {
        Ok(ScoreShaping {
            query_pre_attn_scalar: optional_f64(root, "query_pre_attn_scalar")?,
            attn_logit_softcapping: None,
            final_logit_softcapping: optional_f64(root, "final_logit_softcapping")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, ModelConfig, Rope, RopeScaling};

    fn rope(theta: f64, scaling: RopeScaling) -> Rope {
        Rope { theta, scaling }
    }

    #[test]
    fn gemma3_v4_style_without_layer_types_uses_the_pattern() {
        let text = r#"{"architectures":["Gemma3ForConditionalGeneration"],"eos_token_id":[1,106],
            "text_config":{"hidden_size":8,"intermediate_size":16,"num_hidden_layers":7,
            "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"sliding_window":1024,
            "rope_scaling":{"factor":8.0,"rope_type":"linear"},"query_pre_attn_scalar":168}}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!(c.architecture, Architecture::Gemma3Multimodal);
        let s = c.sliding_layers.unwrap();
        assert_eq!(s.sliding, vec![true, true, true, true, true, false, true]);
        assert_eq!(s.local_rope, Some(rope(10000.0, RopeScaling::Default)));
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.vocab_size, 262208);
        assert_eq!(c.eos_token_ids, vec![1, 106]);
    }
}

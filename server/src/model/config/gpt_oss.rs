//! `GptOssForCausalLM` (gpt-oss-20b, -120b): attention with biases and one sink logit per head,
//! sliding and full layers (`layer_types`, alternating from a sliding layer 0 by default), YaRN
//! RoPE (transformers' default where the file names no RoPE), and in every layer a mixture of
//! `num_local_experts` experts of `intermediate_size`: a router with a bias, the softmax of the
//! top-k logits, experts with biases and the clamped SwiGLU, whose `alpha` (1.702) and `limit`
//! (7.0) transformers hard-codes.

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::gemma2::layer_types;
use super::rope_parameters;
use super::shared::{experts, Activation, MoeConfig, SharedKeys, SlidingLayers};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;
use crate::ops::CLAMPED_SWIGLU_LIMIT;

pub(super) struct GptOssForCausalLM;

/// `GptOssConfig`'s `rope_parameters` when the file gives neither them nor `rope_scaling`.
fn default_rope_parameters() -> Value {
    json!({
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": false, "original_max_position_embeddings": 4096,
    })
}

impl ArchitectureConfig for GptOssForCausalLM {
    fn hf_name(&self) -> &'static str {
        "GptOssForCausalLM"
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::GptOss
    }

    /// `GptOssConfig`'s class defaults: its `head_dim` of 64 stands where the file has none
    /// (`hidden_size / num_attention_heads` only for an explicit `null`).
    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "max_position_embeddings": 131072,
            "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
            "attention_bias": true, "tie_word_embeddings": false, "num_experts_per_tok": 4,
        })
    }

    /// transformers' `GptOssExperts` applies its clamped SwiGLU whatever `hidden_act` says.
    fn activation(&self, _keys: &SharedKeys) -> Result<Activation, LoadError> {
        Ok(Activation::ClampedSwiglu)
    }

    fn rope(&self, root: &Value, keys: &SharedKeys) -> Result<(Rope, Option<Rope>), LoadError> {
        let named = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
        let v5 = match named(&keys.rope_parameters) || named(&keys.rope_scaling) {
            true => keys.rope_parameters.clone(),
            false => Some(default_rope_parameters()),
        };
        let rope = rope_parameters::parse_rope(&v5, &keys.rope_scaling, keys.rope_theta, root)?;
        Ok((rope, None))
    }

    fn sliding_layers(
        &self,
        root: &Value,
        num_layers: usize,
        local_rope: Option<Rope>,
    ) -> Result<Option<SlidingLayers>, LoadError> {
        Ok(Some(SlidingLayers {
            sliding: layer_types(root, num_layers, |_| Ok(2))?,
            local_rope,
        }))
    }

    /// `num_experts` is transformers' other name of `num_local_experts` (its attribute map).
    /// The top-k logits' softmax is the renormalised top-k of the softmax of all of them (the
    /// same numbers up to f32 rounding), the weights rounded to the compute dtype as
    /// transformers' softmax in that dtype leaves them.
    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        if let Some(limit) = root.get("swiglu_limit").filter(|v| !v.is_null()) {
            if limit.as_f64() != Some(CLAMPED_SWIGLU_LIMIT) {
                return Err(LoadError::config(
                    "swiglu_limit",
                    format!(
                        "{limit}: transformers' GptOssExperts clamps at {CLAMPED_SWIGLU_LIMIT} \
                         whatever the config says; no other limit is implemented"
                    ),
                ));
            }
        }
        let experts_key = match (root.get("num_local_experts"), root.get("num_experts")) {
            (None, Some(_)) => "num_experts",
            _ => "num_local_experts",
        };
        let moe = experts(root, experts_key, "intermediate_size", num_layers)?;
        Ok(Some(MoeConfig {
            norm_topk_prob: true,
            weights_in_compute_dtype: true,
            gpt_oss_experts: true,
            ..moe
        }))
    }

    fn attention_sinks(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use crate::model::config::{ModelConfig, RopeScaling};

    const CONFIG: &str = r#"{"architectures":["GptOssForCausalLM"],"vocab_size":10,
        "hidden_size":8,"intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":4,
        "num_key_value_heads":2,"head_dim":4,"num_local_experts":4,"sliding_window":3}"#;

    #[test]
    fn gpt_oss_reads_transformers_defaults() {
        let c = ModelConfig::from_json(CONFIG).unwrap();
        assert_eq!(
            c.sliding_layers.as_ref().unwrap().sliding,
            vec![true, false, true, false]
        );
        assert_eq!(c.sliding_window, Some(3));
        assert!(c.attention_sinks && c.qkv_bias && c.o_bias && !c.tie_word_embeddings);
        assert!(!c.flash_attention_possible());
        let m = c.moe.as_ref().unwrap();
        assert!(m.gpt_oss_experts && m.norm_topk_prob && m.weights_in_compute_dtype);
        assert_eq!((m.num_experts, m.experts_per_token), (4, 4));
        assert_eq!(m.expert_intermediate_size, 16);
        assert_eq!(c.rope.theta, 150000.0);
        match c.rope.scaling {
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                ..
            } => assert_eq!(
                (
                    factor,
                    beta_fast,
                    beta_slow,
                    original_max_position_embeddings,
                    truncate
                ),
                (32.0, 32.0, 1.0, 4096.0, false)
            ),
            other => panic!("{other:?}"),
        }
        // head_dim's class default is 64, not hidden_size / heads
        let no_head_dim = CONFIG.replace("\"head_dim\":4,", "");
        assert_eq!(ModelConfig::from_json(&no_head_dim).unwrap().head_dim, 64);
    }

    #[test]
    fn gpt_oss_refuses_what_transformers_does_not_compute() {
        let err = |text: &str| ModelConfig::from_json(text).unwrap_err().to_string();
        let limit = CONFIG.replace("\"sliding_window\":3", "\"swiglu_limit\":3.0");
        assert!(err(&limit).contains("swiglu_limit"), "{}", err(&limit));
        let seven = CONFIG.replace("\"sliding_window\":3", "\"swiglu_limit\":7.0");
        assert!(ModelConfig::from_json(&seven).is_ok());
        let types = CONFIG.replace(
            "\"sliding_window\":3",
            "\"sliding_window\":3,\"layer_types\":[\"chunked_attention\",\"full_attention\",\
             \"full_attention\",\"full_attention\"]",
        );
        assert!(err(&types).contains("layer_types"), "{}", err(&types));
        let no_window = CONFIG.replace("\"sliding_window\":3", "\"sliding_window\":null");
        assert!(
            err(&no_window).contains("sliding_window"),
            "{}",
            err(&no_window)
        );
    }
}

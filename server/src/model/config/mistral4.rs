//! `Mistral4ForCausalLM` (Mistral Small 4): DeepSeek-V3's latent attention ([`MlaConfig`]) with
//! Llama 4's query scaling ([`Llama4QueryScaling`]) and YaRN over the rotary part, and a mixture
//! of experts routed by softmax scores in the compute dtype ([`MoeRouter::SoftmaxGrouped`]) plus
//! shared experts, after `first_k_dense_replace` dense layers (docs/architectures/deepseek.md).

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::deepseek_v3::{
    expert_groups, first_k_dense, mla, routed_scaling_factor, shared_expert_moe,
};
use super::shared::{GroupScore, Llama4QueryScaling, MlaConfig, MoeConfig, MoeRouter};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

/// `Mistral4ForCausalLM`, or the text model of a `Mistral3ForConditionalGeneration` whose
/// `text_config` is a Mistral 4's.
pub(super) struct Mistral4 {
    pub(super) vision_language: bool,
}

/// `text_config.model_type` of `root`.
pub(super) fn text_model_type(root: &Value) -> Option<&str> {
    root.get("text_config")?.get("model_type")?.as_str()
}

impl ArchitectureConfig for Mistral4 {
    fn hf_name(&self) -> &'static str {
        match self.vision_language {
            false => "Mistral4ForCausalLM",
            true => "Mistral3ForConditionalGeneration",
        }
    }

    fn is_vision_language(&self) -> bool {
        self.vision_language
    }

    fn reads(&self, root: &Value) -> bool {
        !self.vision_language || text_model_type(root) == Some("mistral4")
    }

    /// `Mistral4Config`'s defaults (sizes and vocabulary excepted), its RoPE parameters
    /// included (a file without `rope_parameters` gets them whole).
    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
            "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 128,
            "routed_scaling_factor": 1.0, "kv_lora_rank": 256, "q_lora_rank": 1024,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1,
            "topk_group": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 0,
            "norm_topk_prob": true, "rope_interleave": true,
            "rope_parameters": {
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
            },
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Mla
    }

    /// The class's `attribute_map` (`num_local_experts` for `n_routed_experts`). The class
    /// reads `rope_parameters` only: a v4 `rope_scaling` is refused rather than guessed at.
    /// Under Mistral 3's wrapper the lm_head is tied by the top-level flag (default true), as
    /// for its Mistral text model.
    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        let mut root = match self.vision_language {
            false => root,
            true => super::mistral3::wrapped_text_config(&root)?,
        };
        if let Some(map) = root.as_object_mut() {
            if let Some(v) = map.remove("num_local_experts") {
                map.insert("n_routed_experts".to_string(), v);
            }
            if map.get("rope_scaling").is_some_and(|v| !v.is_null()) {
                return Err(LoadError::config(
                    "rope_scaling",
                    "is not read by Mistral4Config (give rope_parameters)",
                ));
            }
        }
        Ok(root)
    }

    fn mla(&self, root: &Value, rope: &Rope) -> Result<Option<MlaConfig>, LoadError> {
        let mla = mla(root, rope)?;
        check_partial_rotary(root, &mla)?;
        Ok(Some(MlaConfig {
            query_scaling: Some(llama_4_scaling(root)?),
            ..mla
        }))
    }

    /// Renormalised where `norm_topk_prob` (`null`: not); the weights stay in the compute
    /// dtype.
    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        let moe = shared_expert_moe(root, first_k_dense(root, num_layers)?)?;
        // A group scores the sum of its two best experts (`topk(2)`), so it needs two.
        let (n_group, topk_group) = expert_groups(root, &moe, 2)?;
        let norm_topk_prob = match root.get("norm_topk_prob") {
            Some(Value::Bool(b)) => *b,
            Some(Value::Null) => false,
            v => {
                return Err(LoadError::config(
                    "norm_topk_prob",
                    format!("{} is not a boolean", v.unwrap_or(&Value::Null)),
                ))
            }
        };
        Ok(Some(MoeConfig {
            norm_topk_prob,
            weights_in_compute_dtype: true,
            router: MoeRouter::SoftmaxGrouped {
                n_group,
                topk_group,
                group_score: GroupScore::TopTwoSum,
                routed_scaling_factor: routed_scaling_factor(root)?,
                in_compute_dtype: true,
            },
            ..moe
        }))
    }
}

/// The rotary embedding turns `int(qk_head_dim * partial_rotary_factor)` dimensions (the config
/// sets the factor to `qk_rope_head_dim / qk_head_dim` unless the file gives one); the
/// attention rotates `qk_rope_head_dim`, so they must agree.
fn check_partial_rotary(root: &Value, mla: &MlaConfig) -> Result<(), LoadError> {
    let key = "rope_parameters.partial_rotary_factor";
    let Some(factor) = root
        .get("rope_parameters")
        .and_then(|p| p.get("partial_rotary_factor"))
    else {
        return Ok(());
    };
    let factor = factor
        .as_f64()
        .ok_or_else(|| LoadError::config(key, format!("{factor} is not a number")))?;
    let head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
    let rotary = (head_dim as f64 * factor) as usize;
    if rotary != mla.qk_rope_head_dim {
        return Err(LoadError::config(
            key,
            format!(
                "{factor} rotates {rotary} of {head_dim} dimensions, not qk_rope_head_dim = {}",
                mla.qk_rope_head_dim
            ),
        ));
    }
    Ok(())
}

/// `llama_4_scaling_beta` and `original_max_position_embeddings` of `rope_parameters`, which the
/// attention reads on every call (without them it fails).
fn llama_4_scaling(root: &Value) -> Result<Llama4QueryScaling, LoadError> {
    let params = root.get("rope_parameters");
    let get = |key: &str| {
        let field = format!("rope_parameters.{key}");
        match params.and_then(|p| p.get(key)) {
            Some(v) => v
                .as_f64()
                .filter(|v| v.is_finite())
                .ok_or_else(|| LoadError::config(&field, format!("{v} is not a number"))),
            None => Err(LoadError::config(
                &field,
                "missing (Mistral 4's query scaling reads it)",
            )),
        }
    };
    let (beta, original) = (
        get("llama_4_scaling_beta")?,
        get("original_max_position_embeddings")?,
    );
    if original <= 0.0 {
        return Err(LoadError::config(
            "rope_parameters.original_max_position_embeddings",
            format!("{original} is out of range (> 0)"),
        ));
    }
    Ok(Llama4QueryScaling {
        beta,
        original_max_position_embeddings: original,
    })
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, GroupScore, ModelConfig, MoeRouter};

    const M4: &str = r#"{"architectures":["Mistral4ForCausalLM"],"vocab_size":10,
        "hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,
        "q_lora_rank":32,"kv_lora_rank":32,"qk_nope_head_dim":16,"qk_rope_head_dim":8,
        "v_head_dim":12,"n_routed_experts":8,"n_group":4,"topk_group":2,"num_experts_per_tok":2,
        "moe_intermediate_size":16,"first_k_dense_replace":1,"routed_scaling_factor":2.0,
        "max_position_embeddings":4096,
        "rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":16.0,
          "original_max_position_embeddings":256,"mscale":1.0,"mscale_all_dim":1.0,
          "llama_4_scaling_beta":0.1}}"#;

    #[test]
    fn mistral4_reads_query_scaling_and_compute_dtype_routing() {
        let c = ModelConfig::from_json(M4).unwrap();
        assert_eq!(c.architecture, Architecture::Mistral4);
        let m = c.mla.as_ref().unwrap();
        let s = m.query_scaling.unwrap();
        assert_eq!((s.scale(0), s.scale(255)), (1.0, 1.0));
        assert_eq!(s.scale(256), 1.0 + 0.1f32 * 2f32.ln());
        assert_eq!(s.scale(1000), 1.0 + 0.1f32 * 4f32.ln());
        assert!(m.rope_interleave);
        let moe = c.moe.unwrap();
        assert!(moe.norm_topk_prob && moe.weights_in_compute_dtype);
        assert_eq!(moe.shared_expert_intermediate_size, Some(16));
        assert_eq!(
            moe.router,
            MoeRouter::SoftmaxGrouped {
                n_group: 4,
                topk_group: 2,
                group_score: GroupScore::TopTwoSum,
                routed_scaling_factor: 2.0,
                in_compute_dtype: true,
            }
        );
        // without rope_parameters: the class's YaRN and beta
        let mut bare: serde_json::Value = serde_json::from_str(M4).unwrap();
        bare.as_object_mut().unwrap().remove("rope_parameters");
        let c = ModelConfig::from_json(&bare.to_string()).unwrap();
        let s = c.mla.unwrap().query_scaling.unwrap();
        assert_eq!((s.beta, s.original_max_position_embeddings), (0.1, 8192.0));
    }

    #[test]
    fn mistral3_wrapper_reads_a_mistral4_text_model() {
        let mut text: serde_json::Value = serde_json::from_str(M4).unwrap();
        text.as_object_mut().unwrap().remove("architectures");
        text["model_type"] = "mistral4".into();
        let wrapped = serde_json::json!({
            "architectures": ["Mistral3ForConditionalGeneration"], "text_config": text,
        });
        let c = ModelConfig::from_json(&wrapped.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Mistral4Multimodal);
        assert!(c.architecture.is_vision_language() && c.mla.is_some());
        // the top-level flag ties the lm_head, as for a Mistral text model
        assert!(c.tie_word_embeddings);
        let mut mistral = wrapped.clone();
        mistral["text_config"]["model_type"] = "mistral".into();
        mistral["text_config"]["num_key_value_heads"] = 4.into();
        let c = ModelConfig::from_json(&mistral.to_string());
        assert_eq!(c.unwrap().architecture, Architecture::Mistral3Multimodal);
    }

    #[test]
    fn mistral4_refuses_what_it_cannot_read() {
        for (from, to, field) in [
            (
                ",\n          \"llama_4_scaling_beta\":0.1",
                "",
                "llama_4_scaling_beta",
            ),
            ("\"n_group\":4", "\"n_group\":8", "n_group"),
            (
                "\"factor\":16.0,",
                "\"factor\":16.0,\"partial_rotary_factor\":0.5,",
                "partial_rotary_factor",
            ),
            (
                "\"max_position_embeddings\":4096",
                "\"rope_scaling\":{\"type\":\"yarn\"}",
                "rope_scaling",
            ),
            (
                "\"first_k_dense_replace\":1",
                "\"first_k_dense_replace\":null",
                "first_k_dense_replace",
            ),
        ] {
            let bad = M4.replace(from, to);
            assert_ne!(bad, M4);
            let err = ModelConfig::from_json(&bad).unwrap_err().to_string();
            assert!(err.contains(field), "{to}: {err}");
        }
    }
}

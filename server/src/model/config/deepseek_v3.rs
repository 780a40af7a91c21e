//! `DeepseekV3ForCausalLM` (DeepSeek-V3/V3.1, Kimi K2): multi-head latent attention
//! ([`MlaConfig`]), a mixture of experts routed by sigmoid scores with a correction bias and a
//! group limit ([`MoeRouter::SigmoidGrouped`]) plus shared experts, after
//! `first_k_dense_replace` dense layers. The readers of the latent attention and of the routing
//! are shared with GLM-4.5 (`glm4_moe`) and GLM-4.7-Flash (`glm4_moe_lite`)
//! (docs/architectures/deepseek.md).

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::mistral3::wrapped_text_config;
use super::mistral4::text_model_type;
use super::shared::{
    experts, optional_usize, positive_finite, required_size, size, MlaConfig, MoeConfig, MoeRouter,
};
use crate::checkpoint::LoadError;
use crate::model::rope::{Rope, RopeScaling};

/// `DeepseekV3ForCausalLM`, or the text model of a `Mistral3ForConditionalGeneration` whose
/// `text_config` is a DeepSeek-V3's (transformers builds any text model there).
pub(super) struct DeepseekV3 {
    pub(super) vision_language: bool,
}

impl ArchitectureConfig for DeepseekV3 {
    fn hf_name(&self) -> &'static str {
        match self.vision_language {
            false => "DeepseekV3ForCausalLM",
            true => "Mistral3ForConditionalGeneration",
        }
    }

    fn is_vision_language(&self) -> bool {
        self.vision_language
    }

    fn reads(&self, root: &Value) -> bool {
        !self.vision_language || text_model_type(root) == Some("deepseek_v3")
    }

    /// `DeepseekV3Config`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
            "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "norm_topk_prob": true, "rope_interleave": true, "num_nextn_predict_layers": 1,
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Mla
    }

    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        Ok(attribute_names(match self.vision_language {
            false => root,
            true => wrapped_text_config(&root)?,
        }))
    }

    fn mla(&self, root: &Value, rope: &Rope) -> Result<Option<MlaConfig>, LoadError> {
        mla(root, rope).map(Some)
    }

    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        let sparse = first_k_dense(root, num_layers)?;
        deepseek_moe(root, sparse).map(Some)
    }

    fn mtp_layers(&self, root: &Value) -> Result<usize, LoadError> {
        Ok(optional_usize(root, "num_nextn_predict_layers")?.unwrap_or(0))
    }
}

/// The config classes' `attribute_map`: a file may say `num_local_experts` for
/// `n_routed_experts` and `num_mtp_layers` for `num_nextn_predict_layers`; the file's name wins
/// over the default of the other.
pub(super) fn attribute_names(mut root: Value) -> Value {
    if let Some(map) = root.as_object_mut() {
        for (alias, key) in [
            ("num_local_experts", "n_routed_experts"),
            ("num_mtp_layers", "num_nextn_predict_layers"),
        ] {
            if let Some(v) = map.remove(alias) {
                map.insert(key.to_string(), v);
            }
        }
    }
    root
}

/// The latent attention's dimensions and score scale (`DeepseekV3Attention`).
pub(super) fn mla(root: &Value, rope: &Rope) -> Result<MlaConfig, LoadError> {
    let dim = |key: &str| required_size(optional_usize(root, key)?, key, 1 << 16);
    let q_lora_rank = match root.get("q_lora_rank") {
        None | Some(Value::Null) => None,
        Some(_) => Some(dim("q_lora_rank")?),
    };
    let (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) = (
        dim("kv_lora_rank")?,
        dim("qk_nope_head_dim")?,
        dim("qk_rope_head_dim")?,
        dim("v_head_dim")?,
    );
    if !qk_rope_head_dim.is_multiple_of(2) {
        return Err(LoadError::config(
            "qk_rope_head_dim",
            format!("{qk_rope_head_dim} must be even"),
        ));
    }
    let rope_interleave = match root.get("rope_interleave") {
        None => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| LoadError::config("rope_interleave", format!("{v} is not a boolean")))?,
    };
    // Python floats: `qk_head_dim ** -0.5`, then `scaling * mscale * mscale`.
    let mut softmax_scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
    if let Some(m) = yarn_softmax_mscale(root, rope)? {
        softmax_scale = softmax_scale * m * m;
    }
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        rope_interleave,
        softmax_scale,
        query_scaling: None,
    })
}

/// `yarn_get_mscale(factor, mscale_all_dim)`, which `yarn_apply_mscale` multiplies the score
/// scale by twice, where the RoPE parameters set `mscale_all_dim` (DeepSeek-V3's published
/// config: YaRN factor 40, mscale_all_dim 1). Only YaRN is implemented with it.
fn yarn_softmax_mscale(root: &Value, rope: &Rope) -> Result<Option<f64>, LoadError> {
    let (field, params) = match root.get("rope_parameters").filter(|p| p.is_object()) {
        Some(p) => ("rope_parameters", Some(p)),
        None => (
            "rope_scaling",
            root.get("rope_scaling").filter(|p| p.is_object()),
        ),
    };
    let mscale_all_dim = params
        .and_then(|p| p.get("mscale_all_dim"))
        .and_then(Value::as_f64)
        .filter(|m| *m != 0.0);
    let Some(mscale_all_dim) = mscale_all_dim else {
        return Ok(None);
    };
    match rope.scaling {
        RopeScaling::Default => Ok(None),
        RopeScaling::Yarn { factor, .. } if factor <= 1.0 => Ok(Some(1.0)),
        RopeScaling::Yarn { factor, .. } => Ok(Some(0.1 * mscale_all_dim * factor.ln() + 1.0)),
        _ => Err(LoadError::config(
            format!("{field}.mscale_all_dim"),
            "is implemented with rope_type yarn only",
        )),
    }
}

/// Layers `first_k_dense_replace..` are sparse.
pub(super) fn first_k_dense(root: &Value, num_layers: usize) -> Result<Vec<bool>, LoadError> {
    let key = "first_k_dense_replace";
    let dense = optional_usize(root, key)?
        .ok_or_else(|| LoadError::config(key, "missing (null is not a layer count)"))?;
    Ok((0..num_layers).map(|i| i >= dense).collect())
}

/// DeepSeek-V3's mixture (`DeepseekV3MoE`) in the `sparse` layers: [`shared_expert_moe`],
/// routed by [`MoeRouter::SigmoidGrouped`].
pub(super) fn deepseek_moe(root: &Value, sparse: Vec<bool>) -> Result<MoeConfig, LoadError> {
    let moe = shared_expert_moe(root, sparse)?;
    // A group scores the sum of its two best experts (`topk(2)`), so it needs two.
    let (n_group, topk_group) = expert_groups(root, &moe, 2)?;
    let norm_topk_prob = match root.get("norm_topk_prob") {
        Some(Value::Bool(b)) => *b,
        None => true,
        Some(v) => {
            return Err(LoadError::config(
                "norm_topk_prob",
                format!("{v} is not a boolean"),
            ))
        }
    };
    Ok(MoeConfig {
        norm_topk_prob,
        router: MoeRouter::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling_factor: routed_scaling_factor(root)?,
        },
        ..moe
    })
}

/// DeepSeek's experts in the `sparse` layers: `n_routed_experts` experts of
/// `moe_intermediate_size`, and `n_shared_experts` shared ones fused into one MLP of
/// `moe_intermediate_size * n_shared_experts` (`mlp.shared_experts`, weight 1).
pub(super) fn shared_expert_moe(root: &Value, sparse: Vec<bool>) -> Result<MoeConfig, LoadError> {
    let moe = experts(
        root,
        "n_routed_experts",
        "moe_intermediate_size",
        sparse.len(),
    )?;
    let shared = required_size(
        optional_usize(root, "n_shared_experts")?,
        "n_shared_experts",
        1 << 10,
    )?;
    Ok(MoeConfig {
        sparse_layers: sparse,
        shared_expert_intermediate_size: Some(size(
            moe.expert_intermediate_size * shared,
            "n_shared_experts",
            1 << 20,
        )?),
        shared_expert_gate: false,
        ..moe
    })
}

/// `n_group` and `topk_group` of a group-limited router whose group score reads the best
/// `min_per_group` experts of a group.
pub(super) fn expert_groups(
    root: &Value,
    moe: &MoeConfig,
    min_per_group: usize,
) -> Result<(usize, usize), LoadError> {
    let n_group = required_size(optional_usize(root, "n_group")?, "n_group", moe.num_experts)?;
    let topk_group = required_size(optional_usize(root, "topk_group")?, "topk_group", n_group)?;
    let per_group = moe.num_experts / n_group;
    if !moe.num_experts.is_multiple_of(n_group) || per_group < min_per_group {
        return Err(LoadError::config(
            "n_group",
            format!(
                "{n_group} groups of {} experts (must divide them into groups of at least \
                 {min_per_group})",
                moe.num_experts
            ),
        ));
    }
    // Fewer unmasked experts than k would make topk pick masked ones.
    if moe.experts_per_token > topk_group * per_group {
        return Err(LoadError::config(
            "num_experts_per_tok",
            format!(
                "{} exceeds the {} experts of topk_group = {topk_group} groups",
                moe.experts_per_token,
                topk_group * per_group
            ),
        ));
    }
    Ok((n_group, topk_group))
}

pub(super) fn routed_scaling_factor(root: &Value) -> Result<f64, LoadError> {
    let key = "routed_scaling_factor";
    let scaling = root
        .get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| LoadError::config(key, "missing or not a number"))?;
    positive_finite(scaling, key)
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, ModelConfig, MoeRouter};

    const V3: &str = r#"{"architectures":["DeepseekV3ForCausalLM"],"vocab_size":10,
        "hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,
        "q_lora_rank":null,"kv_lora_rank":32,"qk_nope_head_dim":16,"qk_rope_head_dim":8,
        "v_head_dim":12,"n_routed_experts":8,"n_group":4,"topk_group":2,"num_experts_per_tok":2,
        "moe_intermediate_size":16,"first_k_dense_replace":1,
        "rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":40.0,
          "original_max_position_embeddings":4096,"mscale":1.0,"mscale_all_dim":1.0}}"#;

    #[test]
    fn deepseek_v3_reads_latent_attention_and_grouped_routing() {
        let c = ModelConfig::from_json(V3).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV3);
        let m = c.mla.as_ref().unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim),
            (None, 32, 12)
        );
        assert_eq!((c.head_dim, c.rotary_dim, c.num_kv_heads), (24, 8, 4));
        assert!(m.rope_interleave);
        let mscale = 0.1 * 40f64.ln() + 1.0;
        assert_eq!(c.attention_scale(), 24f64.powf(-0.5) * mscale * mscale);
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, true]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(16));
        assert_eq!(
            moe.router,
            MoeRouter::SigmoidGrouped {
                n_group: 4,
                topk_group: 2,
                routed_scaling_factor: 2.5
            }
        );
        assert_eq!(c.mtp_layers, 1);
    }

    /// Mistral 3's wrapper builds any text model; a DeepSeek-V3 one is read as DeepSeek-V3,
    /// its lm_head tied by the top-level flag.
    #[test]
    fn mistral3_wrapper_reads_a_deepseek_v3_text_model() {
        let mut text: serde_json::Value = serde_json::from_str(V3).unwrap();
        text.as_object_mut().unwrap().remove("architectures");
        text["model_type"] = "deepseek_v3".into();
        text["num_local_experts"] = text
            .as_object_mut()
            .unwrap()
            .remove("n_routed_experts")
            .unwrap();
        let wrapped = serde_json::json!({
            "architectures": ["Mistral3ForConditionalGeneration"], "text_config": text,
            "tie_word_embeddings": false,
        });
        let c = ModelConfig::from_json(&wrapped.to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV3Multimodal);
        assert!(c.architecture.is_vision_language() && !c.tie_word_embeddings);
        assert_eq!(c.mla.unwrap().kv_lora_rank, 32);
        assert_eq!(c.moe.unwrap().num_experts, 8);
    }

    #[test]
    fn deepseek_v3_refuses_what_it_cannot_route() {
        for (from, to, field) in [
            ("\"n_group\":4", "\"n_group\":3", "n_group"),
            ("\"n_group\":4", "\"n_group\":8", "n_group"),
            (
                "\"num_experts_per_tok\":2",
                "\"num_experts_per_tok\":5",
                "num_experts_per_tok",
            ),
            (
                "\"num_attention_heads\":4",
                "\"num_attention_heads\":4,\"num_key_value_heads\":2",
                "num_key_value_heads",
            ),
            (
                "\"first_k_dense_replace\":1",
                "\"first_k_dense_replace\":null",
                "first_k_dense_replace",
            ),
            (
                "\"rope_type\":\"yarn\"",
                "\"rope_type\":\"linear\"",
                "mscale_all_dim",
            ),
        ] {
            let bad = V3.replace(from, to);
            assert_ne!(bad, V3);
            let err = ModelConfig::from_json(&bad).unwrap_err().to_string();
            assert!(err.contains(field), "{to}: {err}");
        }
    }
}

//! `DeepseekV2ForCausalLM` (DeepSeek-V2, -V2-Lite, -V2.5, -Coder-V2): DeepSeek-V3's latent
//! attention ([`MlaConfig`], always the interleaved rope), a mixture of experts routed by
//! softmax scores in f32 ([`MoeRouter::SoftmaxGrouped`]: `topk_method` `greedy` or
//! `group_limited_greedy`) plus shared experts, after `first_k_dense_replace` dense layers
//! (docs/architectures/deepseek.md).

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::deepseek_v3::{
    expert_groups, first_k_dense, mla, routed_scaling_factor, shared_expert_moe,
};
use super::shared::{GroupScore, MlaConfig, MoeConfig, MoeRouter, ProjectionBiases, SharedKeys};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

pub(super) struct DeepseekV2ForCausalLM;

impl ArchitectureConfig for DeepseekV2ForCausalLM {
    fn hf_name(&self) -> &'static str {
        "DeepseekV2ForCausalLM"
    }

    /// `DeepseekV2Config`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_method": "greedy",
            "v_head_dim": 128, "moe_intermediate_size": 1407,
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Mla
    }

    /// The class's `attribute_map` (`num_experts` for `n_routed_experts`). It rotates the
    /// interleaved pairs (`view_as_complex`) whatever a file says: `rope_interleave` is not
    /// one of its keys.
    fn text_config(&self, mut root: Value) -> Result<Value, LoadError> {
        if let Some(map) = root.as_object_mut() {
            if let Some(v) = map.remove("num_experts") {
                map.insert("n_routed_experts".to_string(), v);
            }
            map.remove("rope_interleave");
        }
        Ok(root)
    }

    /// `attention_bias` on the attention's projections, `mlp_bias` on the dense MLPs and the
    /// shared experts (`DeepseekV2MLP`).
    fn biases(&self, keys: &SharedKeys) -> ProjectionBiases {
        ProjectionBiases::attention_and_mlp_bias(keys)
    }

    /// Its rotary pairs `(x0, x1), …` come back in place, not as `[evens'; odds']` as
    /// DeepSeek-V3 writes them; q and k alike, so their dot products are the same.
    fn mla(&self, root: &Value, rope: &Rope) -> Result<Option<MlaConfig>, LoadError> {
        mla(root, rope).map(Some)
    }

    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        let moe = shared_expert_moe(root, first_k_dense(root, num_layers)?)?;
        let (n_group, topk_group) = match topk_method(root)? {
            TopkMethod::Greedy => (1, 1),
            TopkMethod::GroupLimitedGreedy => expert_groups(root, &moe, 1)?,
        };
        // The router never reads `norm_topk_prob`: the weights are the softmax scores.
        Ok(Some(MoeConfig {
            norm_topk_prob: false,
            router: MoeRouter::SoftmaxGrouped {
                n_group,
                topk_group,
                group_score: GroupScore::Max,
                routed_scaling_factor: routed_scaling_factor(root)?,
                in_compute_dtype: false,
            },
            ..moe
        }))
    }
}

/// `DeepseekV2TopkRouter`'s `topk_method`: `greedy` is the top k of every expert (one group,
/// kept), `group_limited_greedy` of the `topk_group` groups whose best expert scores highest.
enum TopkMethod {
    Greedy,
    GroupLimitedGreedy,
}

fn topk_method(root: &Value) -> Result<TopkMethod, LoadError> {
    let key = "topk_method";
    match root.get(key).and_then(Value::as_str) {
        Some("greedy") => Ok(TopkMethod::Greedy),
        Some("group_limited_greedy") => Ok(TopkMethod::GroupLimitedGreedy),
        _ => Err(LoadError::config(
            key,
            format!(
                "{} is not supported (supported: \"greedy\", \"group_limited_greedy\")",
                root.get(key).unwrap_or(&Value::Null)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, GroupScore, ModelConfig, MoeRouter};

    const V2: &str = r#"{"architectures":["DeepseekV2ForCausalLM"],"vocab_size":10,
        "hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,
        "q_lora_rank":null,"kv_lora_rank":32,"qk_nope_head_dim":16,"qk_rope_head_dim":8,
        "v_head_dim":12,"n_routed_experts":8,"n_group":4,"topk_group":2,"num_experts_per_tok":2,
        "moe_intermediate_size":16,"first_k_dense_replace":1,"routed_scaling_factor":16.0,
        "topk_method":"group_limited_greedy","norm_topk_prob":true,"rope_interleave":false,
        "rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":40.0,
          "original_max_position_embeddings":4096,"mscale":0.707,"mscale_all_dim":0.707}}"#;

    #[test]
    fn deepseek_v2_reads_latent_attention_and_softmax_routing() {
        let c = ModelConfig::from_json(V2).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV2);
        let m = c.mla.as_ref().unwrap();
        assert_eq!((m.q_lora_rank, m.kv_lora_rank), (None, 32));
        // the complex-form rope pairs neighbours whatever the file says
        assert!(m.rope_interleave);
        let mscale = 0.1 * 0.707 * 40f64.ln() + 1.0;
        assert_eq!(c.attention_scale(), 24f64.powf(-0.5) * mscale * mscale);
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse_layers, vec![false, true, true]);
        assert_eq!(moe.shared_expert_intermediate_size, Some(32));
        // the router ignores norm_topk_prob
        assert!(!moe.norm_topk_prob && !moe.shared_expert_gate);
        assert_eq!(
            moe.router,
            MoeRouter::SoftmaxGrouped {
                n_group: 4,
                topk_group: 2,
                group_score: GroupScore::Max,
                routed_scaling_factor: 16.0,
                in_compute_dtype: false,
            }
        );
        let greedy = ModelConfig::from_json(&V2.replace("group_limited_greedy", "greedy"));
        assert!(matches!(
            greedy.unwrap().moe.unwrap().router,
            MoeRouter::SoftmaxGrouped {
                n_group: 1,
                topk_group: 1,
                ..
            }
        ));
    }

    #[test]
    fn deepseek_v2_refuses_what_it_cannot_route() {
        for (from, to, field) in [
            ("\"group_limited_greedy\"", "\"noaux_tc\"", "topk_method"),
            ("\"group_limited_greedy\"", "null", "topk_method"),
            ("\"n_group\":4", "\"n_group\":3", "n_group"),
            ("\"n_group\":4", "\"n_group\":null", "n_group"),
            (
                "\"num_experts_per_tok\":2",
                "\"num_experts_per_tok\":5",
                "num_experts_per_tok",
            ),
            (
                "\"n_routed_experts\":8",
                "\"n_routed_experts\":8,\"n_shared_experts\":0",
                "n_shared_experts",
            ),
            (
                "\"routed_scaling_factor\":16.0",
                "\"routed_scaling_factor\":-1",
                "routed_scaling_factor",
            ),
        ] {
            let bad = V2.replace(from, to);
            assert_ne!(bad, V2);
            let err = ModelConfig::from_json(&bad).unwrap_err().to_string();
            assert!(err.contains(field), "{to}: {err}");
        }
    }
}

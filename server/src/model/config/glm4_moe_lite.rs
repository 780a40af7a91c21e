//! `Glm4MoeLiteForCausalLM` (GLM-4.7-Flash): DeepSeek-V3's latent attention and mixture of
//! experts, the dense and sparse layers listed by `mlp_layer_types` (docs/architectures/deepseek.md).

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::deepseek_v3::{attribute_names, deepseek_moe, mla};
use super::shared::{MlaConfig, MoeConfig};
use crate::checkpoint::LoadError;
use crate::model::rope::Rope;

pub(super) struct Glm4MoeLiteForCausalLM;

impl ArchitectureConfig for Glm4MoeLiteForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Glm4MoeLiteForCausalLM"
    }

    /// `Glm4MoeLiteConfig`'s defaults (sizes and vocabulary excepted).
    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 202752,
            "moe_intermediate_size": 1536, "n_shared_experts": 1, "n_routed_experts": 64,
            "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
            "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
            "topk_group": 1, "num_experts_per_tok": 4, "norm_topk_prob": true,
            "rope_interleave": true,
        })
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Mla
    }

    /// The class maps `head_dim` to `qk_rope_head_dim`: a file's `head_dim` is that.
    fn text_config(&self, root: Value) -> Result<Value, LoadError> {
        let mut root = attribute_names(root);
        if let Some(map) = root.as_object_mut() {
            if let Some(v) = map.remove("head_dim") {
                map.entry("qk_rope_head_dim").or_insert(v);
            }
        }
        Ok(root)
    }

    fn mla(&self, root: &Value, rope: &Rope) -> Result<Option<MlaConfig>, LoadError> {
        mla(root, rope).map(Some)
    }

    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        deepseek_moe(root, mlp_layer_types(root, num_layers)?).map(Some)
    }

    /// `_keys_to_ignore_on_load_unexpected`: the one layer after the last.
    fn mtp_layers(&self, _root: &Value) -> Result<usize, LoadError> {
        Ok(1)
    }
}

/// `mlp_layer_types` (`dense` / `sparse` per layer); absent or null: the first dense, the rest
/// sparse.
fn mlp_layer_types(root: &Value, num_layers: usize) -> Result<Vec<bool>, LoadError> {
    let key = "mlp_layer_types";
    let Some(types) = root.get(key).filter(|v| !v.is_null()) else {
        return Ok((0..num_layers).map(|i| i > 0).collect());
    };
    let types: Vec<String> = serde_json::from_value(types.clone())
        .map_err(|_| LoadError::config(key, format!("{types} is not a list of strings")))?;
    if types.len() != num_layers {
        return Err(LoadError::config(
            key,
            format!("{} entries for {num_layers} layers", types.len()),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            "dense" => Ok(false),
            "sparse" => Ok(true),
            other => Err(LoadError::config(
                key,
                format!("`{other}` is neither `dense` nor `sparse`"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::model::config::ModelConfig;

    #[test]
    fn glm4_moe_lite_reads_mlp_layer_types() {
        let text = r#"{"architectures":["Glm4MoeLiteForCausalLM"],"vocab_size":10,
            "hidden_size":48,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":5,
            "kv_lora_rank":32,"q_lora_rank":24,"qk_nope_head_dim":16,"head_dim":8,
            "v_head_dim":20,"n_routed_experts":8,"num_experts_per_tok":2,
            "moe_intermediate_size":16,"mlp_layer_types":["dense","sparse","dense"]}"#;
        let c = ModelConfig::from_json(text).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (24, 8));
        assert_eq!(c.moe.unwrap().sparse_layers, vec![false, true, false]);
        let bad = text.replace("\"dense\"]", "\"moe\"]");
        let err = ModelConfig::from_json(&bad).unwrap_err().to_string();
        assert!(err.contains("mlp_layer_types"), "{err}");
    }
}

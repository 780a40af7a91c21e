//! `Qwen3MoeForCausalLM`: Qwen3 whose feed-forward is a mixture of experts in the layers that
//! `decoder_sparse_step` and `mlp_only_layers` pick.

use serde_json::{json, Value};

use super::architecture::ArchitectureConfig;
use super::qwen2::window_if_used;
use super::shared::{
    experts, keys_set, optional_usize, size, MoeConfig, SharedKeys, SOFTCAPPING_KEYS,
};
use crate::checkpoint::LoadError;

pub(super) struct Qwen3MoeForCausalLM;

impl ArchitectureConfig for Qwen3MoeForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Qwen3MoeForCausalLM"
    }

    fn transformers_defaults(&self) -> Value {
        json!({
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
            "num_key_value_heads": 4,
        })
    }

    /// A shared expert (Qwen2-MoE's) is refused whatever its value.
    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        let mut refused = keys_set(root, &SOFTCAPPING_KEYS);
        if root.get("shared_expert_intermediate_size").is_some() {
            refused.push("shared_expert_intermediate_size");
        }
        refused
    }

    fn sliding_window(&self, window: Option<usize>, keys: &SharedKeys) -> Option<usize> {
        window_if_used(window, keys)
    }

    /// transformers 5 writes `num_experts` as `num_local_experts` (its attribute map).
    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        let experts_key = match root.get("num_experts") {
            None => "num_local_experts",
            Some(_) => "num_experts",
        };
        let moe = experts(root, experts_key, "moe_intermediate_size", num_layers)?;
        Ok(Some(MoeConfig {
            sparse_layers: sparse_layers(root, num_layers)?,
            norm_topk_prob: root
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            weights_in_compute_dtype: true,
            ..moe
        }))
    }

    fn qk_norm(&self, _root: &Value) -> bool {
        true
    }
}

/// Every `decoder_sparse_step`-th layer is sparse, except those in `mlp_only_layers`.
pub(super) fn sparse_layers(root: &Value, num_layers: usize) -> Result<Vec<bool>, LoadError> {
    let step = size(
        optional_usize(root, "decoder_sparse_step")?.unwrap_or(1),
        "decoder_sparse_step",
        1 << 12,
    )?;
    let dense: Vec<usize> = match root.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
            LoadError::config(
                "mlp_only_layers",
                format!("{v} is not a list of layer indices"),
            )
        })?,
    };
    Ok((0..num_layers)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect())
}

#[cfg(test)]
mod tests {
    use crate::model::config::ModelConfig;

    #[test]
    fn qwen3_moe_sparse_layers() {
        let text = r#"{"architectures":["Qwen3MoeForCausalLM"],"vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":4,"num_attention_heads":2,"rope_theta":1e6,
            "num_key_value_heads":1,"num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":4,"norm_topk_prob":true,
            "decoder_sparse_step":2,"mlp_only_layers":[3]}"#;
        let m = ModelConfig::from_json(text).unwrap().moe.unwrap();
        assert_eq!(m.sparse_layers, vec![false, true, false, false]);
        assert!(m.norm_topk_prob && m.weights_in_compute_dtype && !m.mixtral_names);
        let bad = text.replace("\"num_experts_per_tok\":2", "\"num_experts_per_tok\":9");
        let err = ModelConfig::from_json(&bad).unwrap_err().to_string();
        assert!(err.contains("num_experts_per_tok"), "{err}");
    }
}

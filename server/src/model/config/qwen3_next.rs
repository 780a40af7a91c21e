//! `Qwen3NextForCausalLM`: a hybrid of Gated DeltaNet (linear-attention) layers and gated
//! full-attention layers (`layer_types`, else every `full_attention_interval`-th layer full),
//! `(1 + w)` RMSNorms, partial rotary, and a mixture of experts with a sigmoid-gated shared
//! expert in the layers that `decoder_sparse_step` and `mlp_only_layers` pick
//! (docs/architectures/qwen3_5.md). Qwen3.5 and Qwen3.5-MoE (`qwen3_5.rs`, `qwen3_5_moe.rs`)
//! are built from its modules and read their keys with the functions here.
//!
//! Keys the published configs carry that transformers 5.17 never reads, and neither do we:
//! `attn_output_gate` (the output gate is always there), `mtp_num_hidden_layers`,
//! `mtp_use_dedicated_embeddings`, `full_attention_interval` once `layer_types` is given, and
//! `mrope_section` / `mrope_interleaved`: with text-only input transformers gives the three
//! position rows (temporal, height, width) the same `arange`, so whatever the sections and the
//! interleaving, every frequency takes the same angle and mrope is the plain partial rope
//! (`Qwen3_5TextRotaryEmbedding.recomposition_frequencies` picks, per frequency, among three
//! equal rows). The Qwen3.5 fixtures carry `mrope_section` `[3, 3, 2]` with
//! `mrope_interleaved`, and score within 1e-5 of transformers with the plain rope.

use serde_json::{json, Value};

use super::architecture::{ArchitectureConfig, DecoderFamily};
use super::qwen3_moe::sparse_layers;
use super::shared::{
    experts, keys_set, optional_usize, size, LinearAttentionConfig, MoeConfig, SharedKeys,
    SOFTCAPPING_KEYS,
};
use crate::checkpoint::LoadError;

pub(super) struct Qwen3NextForCausalLM;

/// Tensor prefixes Qwen3-Next never reads: the multi-token-prediction head (`mtp.*`; every
/// class of the family lists `^mtp.*` in `_keys_to_ignore_on_load_unexpected`).
pub(super) const MTP_PREFIXES: [&str; 1] = ["mtp."];

/// Qwen3.5's: `mtp.*`, and the vision tower (`model.visual.*`), which the text-only classes
/// ignore too (`[r"^mtp.*", r"^model.visual.*"]`) and the `ForConditionalGeneration` classes
/// hold but never run for text.
pub(super) const UNREAD_PREFIXES: [&str; 2] = ["mtp.", "model.visual."];

impl ArchitectureConfig for Qwen3NextForCausalLM {
    fn hf_name(&self) -> &'static str {
        "Qwen3NextForCausalLM"
    }

    /// `Qwen3NextConfig`'s defaults (sizes and vocabulary excepted, which must be given).
    fn transformers_defaults(&self) -> Value {
        let mut d = hybrid_defaults(2);
        for (k, v) in json!({
            "decoder_sparse_step": 1, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
            "norm_topk_prob": true, "mlp_only_layers": [],
        })
        .as_object()
        .unwrap()
        {
            d[k.as_str()] = v.clone();
        }
        d
    }

    fn decoder_family(&self) -> DecoderFamily {
        DecoderFamily::Qwen3Next
    }

    fn unimplemented_keys(&self, root: &Value) -> Vec<&'static str> {
        keys_set(root, &SOFTCAPPING_KEYS)
    }

    fn unread_prefixes(&self) -> &'static [&'static str] {
        &MTP_PREFIXES
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
        linear_attention(root, num_layers, true).map(Some)
    }

    /// Layer `i` is sparse iff `i ∉ mlp_only_layers`, `num_experts > 0` and
    /// `(i + 1) % decoder_sparse_step == 0`; `norm_topk_prob` as the config says.
    fn moe(&self, root: &Value, num_layers: usize) -> Result<Option<MoeConfig>, LoadError> {
        if optional_usize(root, "num_experts")? == Some(0) {
            return Ok(None);
        }
        let moe = experts(root, "num_experts", "moe_intermediate_size", num_layers)?;
        Ok(Some(MoeConfig {
            sparse_layers: sparse_layers(root, num_layers)?,
            norm_topk_prob: match root.get("norm_topk_prob") {
                Some(Value::Bool(b)) => *b,
                None | Some(Value::Null) => true,
                Some(v) => return Err(LoadError::config("norm_topk_prob", format!("{v}"))),
            },
            shared_expert_intermediate_size: Some(shared_expert_size(root)?),
            weights_in_compute_dtype: true,
            ..moe
        }))
    }

    fn qk_norm(&self, _root: &Value) -> bool {
        true
    }

    fn attn_output_gate(&self) -> bool {
        true
    }
}

/// The defaults every class of the family shares (`num_key_value_heads` differs).
pub(super) fn hybrid_defaults(num_kv_heads: usize) -> Value {
    json!({
        "num_key_value_heads": num_kv_heads, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "attention_bias": false, "head_dim": 256, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "full_attention_interval": 4,
    })
}

/// `shared_expert_intermediate_size`: the width of the shared expert.
pub(super) fn shared_expert_size(root: &Value) -> Result<usize, LoadError> {
    let key = "shared_expert_intermediate_size";
    size(
        optional_usize(root, key)?.ok_or_else(|| LoadError::config(key, "missing"))?,
        key,
        1 << 20,
    )
}

/// Which layers are linear attention: `layer_types` (legacy names `conv`/`mamba` → linear,
/// `attention` → full, as `remap_legacy_layer_types`), else every `full_attention_interval`-th
/// layer full (`(i + 1) % interval == 0`). Then the Gated DeltaNet's sizes; `grouped`:
/// Qwen3-Next's head-grouped `in_proj_qkvz` / `in_proj_ba`, else Qwen3.5's separate projections.
pub(super) fn linear_attention(
    root: &Value,
    num_layers: usize,
    grouped: bool,
) -> Result<LinearAttentionConfig, LoadError> {
    let layers = match root.get("layer_types") {
        None | Some(Value::Null) => {
            let interval = size(
                optional_usize(root, "full_attention_interval")?.unwrap_or(4),
                "full_attention_interval",
                1 << 12,
            )?;
            (0..num_layers).map(|i| (i + 1) % interval != 0).collect()
        }
        Some(v) => {
            let names: Vec<String> = serde_json::from_value(v.clone())
                .map_err(|_| LoadError::config("layer_types", format!("{v} is not a list")))?;
            if names.len() != num_layers {
                return Err(LoadError::config(
                    "layer_types",
                    format!("{} entries for {num_layers} layers", names.len()),
                ));
            }
            names
                .iter()
                .map(|n| match n.as_str() {
                    "linear_attention" | "conv" | "mamba" => Ok(true),
                    "full_attention" | "attention" => Ok(false),
                    other => Err(LoadError::config(
                        "layer_types",
                        format!(
                            "`{other}` is not supported (supported: linear_attention, \
                             full_attention)"
                        ),
                    )),
                })
                .collect::<Result<Vec<bool>, LoadError>>()?
        }
    };
    let get = |key: &str| -> Result<usize, LoadError> {
        size(
            optional_usize(root, key)?.ok_or_else(|| LoadError::config(key, "missing"))?,
            key,
            1 << 14,
        )
    };
    let (k_heads, v_heads) = (get("linear_num_key_heads")?, get("linear_num_value_heads")?);
    // transformers assumes it (`repeat_interleave(v_heads // k_heads)`) without checking.
    if !v_heads.is_multiple_of(k_heads) {
        return Err(LoadError::config(
            "linear_num_value_heads",
            format!("{v_heads} is not a multiple of linear_num_key_heads = {k_heads}"),
        ));
    }
    Ok(LinearAttentionConfig {
        linear_layers: layers,
        conv_kernel: get("linear_conv_kernel_dim")?,
        k_heads,
        v_heads,
        k_dim: get("linear_key_head_dim")?,
        v_dim: get("linear_value_head_dim")?,
        grouped_projections: grouped,
    })
}

#[cfg(test)]
mod tests {
    use crate::model::config::{Architecture, ModelConfig};

    const NEXT: &str = r#"{"architectures":["Qwen3NextForCausalLM"],"vocab_size":10,
        "hidden_size":8,"intermediate_size":16,"num_hidden_layers":8,"num_attention_heads":2,
        "head_dim":16,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":4,
        "shared_expert_intermediate_size":6,"mlp_only_layers":[1],"linear_num_key_heads":2,
        "linear_num_value_heads":4,"linear_key_head_dim":8,"linear_value_head_dim":8}"#;

    #[test]
    fn qwen3_next_defaults_and_layer_kinds() {
        let c = ModelConfig::from_json(NEXT).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3Next);
        let la = c.linear_attention.as_ref().unwrap();
        // every 4th layer full
        assert_eq!(
            la.linear_layers,
            vec![true, true, true, false, true, true, true, false]
        );
        assert!(la.grouped_projections && la.conv_kernel == 4);
        assert_eq!((c.rotary_dim, c.head_dim, c.num_kv_heads), (4, 16, 2));
        assert_eq!(c.rope.theta, 10000.0);
        let m = c.moe.unwrap();
        assert!(m.norm_topk_prob && m.weights_in_compute_dtype);
        assert_eq!(m.shared_expert_intermediate_size, Some(6));
        assert_eq!(m.sparse_layers[..3], [true, false, true]);
        assert!(c.attn_output_gate && c.qk_norm);
    }

    #[test]
    fn qwen3_next_refuses_what_it_does_not_implement() {
        for (from, to, field) in [
            (
                r#""head_dim":16"#,
                r#""head_dim":16,"partial_rotary_factor":0.1"#,
                "partial_rotary_factor",
            ),
            (
                r#""linear_num_value_heads":4"#,
                r#""linear_num_value_heads":3"#,
                "linear_num_value_heads",
            ),
            (
                r#""head_dim":16"#,
                r#""head_dim":16,"layer_types":["linear_attention","sliding_attention","a","b","c","d","e","f"]"#,
                "layer_types",
            ),
        ] {
            let text = NEXT.replace(from, to);
            let err = ModelConfig::from_json(&text).unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        // legacy names and the nested factor, which wins over the top-level one
        let text = NEXT.replace(
            r#""head_dim":16"#,
            r#""head_dim":16,"partial_rotary_factor":0.5,"rope_parameters":{"rope_type":"default",
            "rope_theta":1e6,"partial_rotary_factor":1.0},
            "layer_types":["mamba","attention","conv","full_attention","linear_attention",
            "linear_attention","linear_attention","full_attention"]"#,
        );
        let c = ModelConfig::from_json(&text).unwrap();
        assert_eq!(c.rotary_dim, 16);
        assert_eq!(
            c.linear_attention.unwrap().linear_layers,
            vec![true, false, true, false, true, true, true, false]
        );
    }
}

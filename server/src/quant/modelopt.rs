//! NVIDIA ModelOpt checkpoints (`quant_method: modelopt`, NVIDIA's `*-FP4` and `*-FP8`
//! releases), read as vLLM's `ModelOptNvFp4Config` and `ModelOptFp8Config` read them. FP8 per
//! Linear: `weight` F8_E4M3, `weight_scale` F32 scalar, `input_scale` F32 scalar (a static
//! activation scale), the tensor strategy of [`super::float_quantized`]. NVFP4 per Linear: `weight` U8 `[out, in / 2]`
//! (fp4 e2m1 codes, low nibble first), `weight_scale` F8_E4M3 `[out, in / 16]`,
//! `weight_scale_2` F32 (a per-tensor scale that multiplies: compressed-tensors stores its
//! inverse as `weight_global_scale`) and `input_scale` F32 (the activations' per-tensor scale;
//! vLLM quantizes the input to NVFP4 against the global scale `1 / input_scale`).
//!
//! The config comes in two spellings: config.json's `quantization_config` `{"quant_method":
//! "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": [...], "kv_cache_scheme":
//! ...}`, and the legacy `hf_quant_config.json` `{"producer": ..., "quantization":
//! {"quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules"}}`.

use regex::Regex;
use serde_json::Value;

use super::compressed_tensors::{Format, LayerScheme, QuantArgs, QuantType, Strategy};
use super::{load_scalar, ActivationQdq};
use crate::checkpoint::{Checkpoint, LoadError};

/// The file an older ModelOpt export keeps its config in, beside a config.json without
/// `quantization_config`.
pub const LEGACY_CONFIG: &str = "hf_quant_config.json";

/// The NVFP4 block: one fp8 scale per 16 weights (and activations).
pub const GROUP: usize = 16;

const ROOT: &str = "quantization_config";

/// The schemes of a ModelOpt config and the modules it leaves unquantized.
pub struct ModeloptConfig {
    pub layers: ModeloptLayers,
    /// `exclude_modules` / `ignore`, each matched as vLLM matches it: a shell wildcard over
    /// the whole module name, or a substring of it.
    pub excluded: Vec<Regex>,
}

/// Which Linears a ModelOpt config quantizes, and how.
pub enum ModeloptLayers {
    /// `quant_algo` NVFP4 or FP8: every Linear not excluded.
    All(LayerScheme),
    /// `quant_algo: MIXED_PRECISION`: the modules `quantized_layers` names, each with its own
    /// algorithm (a `….experts` entry, vLLM's fused-mixture prefix, covers every expert's
    /// projections), the most specific name first; the others stay unquantized, as vLLM's
    /// `ModelOptMixedPrecisionConfig` reads them.
    Listed(Vec<(String, LayerScheme)>),
}

/// Parses a ModelOpt config (either spelling); refuses every algorithm and option that is not
/// implemented, by name.
pub fn parse_config(raw: &Value) -> Result<ModeloptConfig, LoadError> {
    // The legacy file nests the keys under `quantization`.
    let (cfg, prefix) = match raw.get("quantization") {
        Some(inner) => (inner, format!("{ROOT}.quantization")),
        None => (raw, ROOT.to_string()),
    };
    let field = |f: &str| format!("{prefix}.{f}");
    let get = |key: &str| cfg.get(key).filter(|v| !v.is_null());
    let algo = get("quant_algo")
        .and_then(Value::as_str)
        .ok_or_else(|| LoadError::config(field("quant_algo"), "missing or not a string"))?;
    let mixed = algo.eq_ignore_ascii_case("MIXED_PRECISION");
    if let Some(v) = get("kv_cache_quant_algo") {
        return Err(LoadError::config(
            field("kv_cache_quant_algo"),
            format!("{v}: KV-cache quantization is not supported"),
        ));
    }
    if let Some(v) = get("kv_cache_scheme") {
        return Err(LoadError::config(
            field("kv_cache_scheme"),
            format!("{v}: KV-cache quantization is not supported"),
        ));
    }
    if let Some(v) = get("nvfp4_embed").filter(|v| v.as_bool() != Some(false)) {
        return Err(LoadError::config(
            field("nvfp4_embed"),
            format!("{v}: NVFP4 embeddings are not supported"),
        ));
    }
    let key = ["exclude_modules", "ignore"]
        .into_iter()
        .find(|k| get(k).is_some())
        .unwrap_or("exclude_modules");
    let excluded = match get(key) {
        None => Vec::new(),
        Some(v) => {
            let names: Option<Vec<&str>> = v
                .as_array()
                .and_then(|l| l.iter().map(Value::as_str).collect());
            names
                .ok_or_else(|| LoadError::config(field(key), format!("{v} is not a list")))?
                .into_iter()
                .map(|p| exclude_pattern(p, &field(key)))
                .collect::<Result<_, _>>()?
        }
    };
    let layers = match mixed {
        false => ModeloptLayers::All(layer_scheme(algo, get("group_size"), &field)?),
        true => {
            let listed = get("quantized_layers")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    LoadError::config(
                        field("quantized_layers"),
                        "MIXED_PRECISION needs a map of module names to their quant_algo",
                    )
                })?;
            let mut layers = listed
                .iter()
                .map(|(name, entry)| {
                    let at = |f: &str| field(&format!("quantized_layers.{name}.{f}"));
                    let algo = entry
                        .get("quant_algo")
                        .and_then(Value::as_str)
                        .ok_or_else(|| LoadError::config(at("quant_algo"), "missing"))?;
                    let group = entry.get("group_size").filter(|v| !v.is_null());
                    Ok((name.clone(), layer_scheme(algo, group, &at)?))
                })
                .collect::<Result<Vec<_>, LoadError>>()?;
            refuse_split_fused_layers(&layers, &field)?;
            // the most specific name decides
            layers.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
            ModeloptLayers::Listed(layers)
        }
    };
    Ok(ModeloptConfig { layers, excluded })
}

/// Refuses listed algorithms that differ between the shards of one layer vLLM fuses
/// ([`super::fused_shards::FUSED_SHARDS`]): vLLM refuses such a checkpoint, so it is not served
/// and has no scores to reproduce.
fn refuse_split_fused_layers(
    layers: &[(String, LayerScheme)],
    field: &dyn Fn(&str) -> String,
) -> Result<(), LoadError> {
    // a map, not a scan per entry: a large mixture lists tens of thousands of expert modules
    let formats: std::collections::HashMap<&str, Format> =
        layers.iter().map(|(n, s)| (n.as_str(), s.format)).collect();
    for (name, scheme) in layers {
        let Some((base, leaf)) = name.rsplit_once('.') else {
            continue;
        };
        let Some(shards) = super::fused_shards::FUSED_SHARDS
            .iter()
            .find(|s| s.contains(&leaf))
        else {
            continue;
        };
        for sibling in shards.iter().map(|s| format!("{base}.{s}")) {
            if formats
                .get(sibling.as_str())
                .is_some_and(|&f| f != scheme.format)
            {
                return Err(LoadError::config(
                    field(&format!("quantized_layers.{name}.quant_algo")),
                    format!(
                        "differs from `{sibling}`'s: vLLM fuses them into one layer and refuses \
                         shards of different algorithms"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The scheme of one `quant_algo` (NVFP4 or FP8) and its `group_size`; `field(key)` names
/// the config key in errors.
fn layer_scheme(
    algo: &str,
    group_size: Option<&Value>,
    field: &dyn Fn(&str) -> String,
) -> Result<LayerScheme, LoadError> {
    let format = match algo.to_ascii_uppercase().as_str() {
        "NVFP4" => Format::ModeloptNvfp4,
        "FP8" => Format::ModeloptFp8,
        _ => {
            return Err(LoadError::config(
                field("quant_algo"),
                format!(
                    "`{algo}` is not supported (NVFP4, FP8, and MIXED_PRECISION of them; \
                     W4A16_NVFP4, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO and MXFP8 are not \
                     implemented)"
                ),
            ))
        }
    };
    match group_size {
        None => {}
        Some(v) if v.as_u64() == Some(GROUP as u64) && format == Format::ModeloptNvfp4 => {}
        Some(v) => {
            return Err(LoadError::config(
                field("group_size"),
                format!("{v} is not supported (NVFP4's block is {GROUP}; FP8 has none)"),
            ))
        }
    }
    let fp4 = |dynamic| QuantArgs {
        num_bits: 4,
        kind: QuantType::Float,
        symmetric: true,
        strategy: Strategy::TensorGroup,
        group_size: Some(GROUP),
        block_structure: None,
        dynamic,
        actorder: false,
        power_of_two_scales: false,
    };
    // FP8: e4m3 weights with one scale per tensor, activations with a static one
    // (`input_scale`), as compressed-tensors' float-quantized tensor strategy.
    let fp8 = QuantArgs {
        num_bits: 8,
        strategy: Strategy::Tensor,
        group_size: None,
        ..fp4(false)
    };
    let (weights, input_activations) = match format {
        Format::ModeloptNvfp4 => (fp4(false), fp4(true)),
        _ => (fp8.clone(), fp8),
    };
    Ok(LayerScheme {
        group: "modelopt".into(),
        format,
        weights,
        input_activations: Some(input_activations),
    })
}

/// vLLM's `is_layer_excluded`: `fnmatch(name, pattern)` (`*` any run, `?` one character) or
/// the pattern a substring of the name.
fn exclude_pattern(pattern: &str, field: &str) -> Result<Regex, LoadError> {
    let wildcard: String = pattern
        .chars()
        .map(|c| match c {
            '*' => ".*".to_string(),
            '?' => ".".to_string(),
            c => regex::escape(&c.to_string()),
        })
        .collect();
    Regex::new(&format!("^(?:{wildcard})$|{}", regex::escape(pattern)))
        .map_err(|e| LoadError::config(field, format!("bad pattern `{pattern}`: {e}")))
}

/// The activation QDQ of a ModelOpt NVFP4 Linear: NVFP4 per 16 inputs against the global
/// scale `1 / input_scale` (vLLM's `input_global_scale_inv`, an f32 division).
pub fn input_qdq(ckpt: &Checkpoint, name: &str) -> Result<ActivationQdq, LoadError> {
    let input_scale = load_scalar(ckpt, &format!("{name}.input_scale"))?;
    Ok(ActivationQdq::Nvfp4 {
        global_scale: 1.0 / input_scale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_spellings_read_and_exclusions_match_as_vllm() {
        let legacy = json!({"producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null,
                             "group_size": 16, "exclude_modules": ["lm_head", "model.layers.1*"]}});
        let flat = json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                          "ignore": ["lm_head", "model.layers.1*"]});
        for raw in [legacy, flat] {
            let cfg = parse_config(&raw).unwrap();
            let excluded = |n: &str| cfg.excluded.iter().any(|r| r.is_match(n));
            assert!(excluded("lm_head"));
            assert!(excluded("model.layers.1.mlp.up_proj"));
            assert!(excluded("model.layers.12.mlp.up_proj"));
            assert!(!excluded("model.layers.0.mlp.up_proj"));
            let ModeloptLayers::All(scheme) = cfg.layers else {
                panic!("one scheme for every Linear");
            };
            assert_eq!(scheme.format, Format::ModeloptNvfp4);
        }
    }

    /// MIXED_PRECISION: each listed module its own algorithm, the most specific name first; a
    /// listed algorithm or group size that is not implemented, and shards of one fused layer
    /// listed with different algorithms, are refused naming the module.
    #[test]
    fn mixed_precision_lists_modules_by_specificity_and_refuses_by_module() {
        let raw = json!({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {
                "model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
                "model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"}},
            "ignore": ["lm_head"]});
        let cfg = parse_config(&raw).unwrap();
        let ModeloptLayers::Listed(layers) = cfg.layers else {
            panic!("a list of modules");
        };
        let listed: Vec<(&str, Format)> =
            layers.iter().map(|(n, s)| (n.as_str(), s.format)).collect();
        assert_eq!(
            listed,
            [
                ("model.layers.0.self_attn.q_proj", Format::ModeloptFp8),
                ("model.layers.0.mlp.experts", Format::ModeloptNvfp4),
            ]
        );
        for (entry, needle) in [
            (
                json!({"quant_algo": "W4A16_NVFP4"}),
                "quantized_layers.m.quant_algo",
            ),
            (
                json!({"quant_algo": "NVFP4", "group_size": 32}),
                "quantized_layers.m.group_size",
            ),
            (json!({"group_size": 16}), "quantized_layers.m.quant_algo"),
        ] {
            let raw = json!({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                             "quantized_layers": {"m": entry}});
            let e = parse_config(&raw).err().unwrap().to_string();
            assert!(e.contains(needle), "{e} lacks {needle}");
        }
        let split = json!({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"l.self_attn.q_proj": {"quant_algo": "FP8"},
                                 "l.self_attn.k_proj": {"quant_algo": "NVFP4", "group_size": 16},
                                 "l.mlp.gate_proj": {"quant_algo": "FP8"}}});
        let e = parse_config(&split).err().unwrap().to_string();
        assert!(
            e.contains("quantized_layers.l.self_attn.") && e.contains("differs"),
            "{e}"
        );
        let e = parse_config(&json!({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("quantization_config.quantized_layers"), "{e}");
    }

    #[test]
    fn other_algorithms_kv_cache_and_groups_are_refused_by_name() {
        let refused = |raw: Value, needle: &str| {
            let e = parse_config(&raw).err().unwrap().to_string();
            assert!(e.contains(needle), "{e} lacks {needle}");
        };
        refused(
            json!({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}),
            "quantization_config.quant_algo",
        );
        refused(
            json!({"quant_method": "modelopt", "quant_algo": "FP8", "group_size": 16}),
            "quantization_config.group_size",
        );
        refused(
            json!({"quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}),
            "quantization_config.quantization.kv_cache_quant_algo",
        );
        refused(
            json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}),
            "quantization_config.group_size",
        );
    }
}

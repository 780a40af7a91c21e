//! Hugging Face FP8 (`quant_method: fp8`, transformers' `FineGrainedFP8Config`): the official
//! Qwen3, DeepSeek-V3, Kimi and MiniMax FP8 releases. Per Linear `weight` float8_e4m3fn
//! `[out, in]` and `weight_scale_inv` f32 `[ceil(out/b0), ceil(in/b1)]` for `weight_block_size`
//! `[b0, b1]`: `w[r, c] = f32(weight[r, c]) ·
//! weight_scale_inv[r / b0, c / b1]`, edge blocks included (the block kernels' reading; held as
//! a float-quantized block weight, [`super::float_quantized::Fp8Weight`]).
//!
//! `activation_scheme: dynamic`: vLLM quantizes each token's activations per group of `b1`
//! inputs to e4m3 (`per_token_group_quant_fp8`) before its block GEMM; `--activation-quant
//! emulate` applies that QDQ ([`ActivationQdq::Fp8PerTokenGroup`]), `off` runs what
//! transformers computes on a CPU (the weights dequantized at load, no activation quantization).

use regex::Regex;
use serde_json::Value;

use super::compressed_tensors::{
    skip_pattern, Format, LayerScheme, QuantArgs, QuantType, Strategy,
};
use crate::checkpoint::LoadError;

/// The scale tensor of an FP8 Linear, after its name and a dot.
pub const SCALE: &str = "weight_scale_inv";

const ROOT: &str = "quantization_config";

fn field_error(field: &str, reason: impl Into<String>) -> LoadError {
    LoadError::config(format!("{ROOT}.{field}"), reason)
}

/// The one scheme of a `quant_method: fp8` config and the modules it leaves unquantized.
pub struct Fp8Config {
    pub scheme: LayerScheme,
    /// `modules_to_not_convert` (or MiniMax's `ignored_layers`), each as transformers matches
    /// it (`re.match(key, name)` or `name.endswith(key)`); `lm_head` where the config lists none.
    pub not_converted: Vec<Regex>,
}

/// Parses a `quant_method: fp8` config as transformers 5.17's `FineGrainedFP8Config` reads it
/// (its defaults where a key is absent); refuses every value that changes what the weights or
/// activations mean and is not implemented.
pub fn parse_config(raw: &Value) -> Result<Fp8Config, LoadError> {
    let obj = raw
        .as_object()
        .ok_or_else(|| LoadError::config(ROOT, "is not an object"))?;
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    match get("activation_scheme").map(|v| (v, v.as_str().map(str::to_ascii_lowercase))) {
        None => {}
        Some((_, Some(s))) if s == "dynamic" => {}
        Some((v, _)) => {
            return Err(field_error(
                "activation_scheme",
                format!(
                    "{v} is not supported (dynamic; static per-layer activation scales are not \
                     implemented)"
                ),
            ))
        }
    }
    let block = match obj.get("weight_block_size") {
        None => [128, 128],
        // Per-tensor FP8: vLLM quantizes its activations with one dynamic scale per batch, so
        // a token's score would depend on its batch; not emulated, and not guessed.
        Some(Value::Null) => {
            return Err(field_error(
                "weight_block_size",
                "null (per-tensor scales) is not supported: vLLM quantizes the activations of \
                 such layers with one dynamic scale per batch",
            ))
        }
        Some(v) => {
            let dims: Option<Vec<usize>> = v
                .as_array()
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect());
            match dims.as_deref() {
                Some(&[r, c]) if r > 0 && c > 0 => [r, c],
                _ => {
                    return Err(field_error(
                        "weight_block_size",
                        format!("{v} is not [rows, columns] of positive integers"),
                    ))
                }
            }
        }
    };
    if let Some(v) = get("fmt") {
        if v.as_str() != Some("e4m3") {
            return Err(field_error("fmt", format!("{v} is not supported (e4m3)")));
        }
    }
    // DeepSeek-V3.1's `ue8m0`: the stored weight scales are powers of two, and the dynamic
    // activation scales are rounded up to one, as DeepSeek's reference kernels and DeepGEMM's
    // UE8M0 path (vLLM, with DeepGEMM) compute them.
    let power_of_two_scales = match get("scale_fmt").map(|v| (v, v.as_str())) {
        None | Some((_, Some("float"))) => false,
        Some((_, Some("ue8m0"))) => true,
        Some((v, _)) => {
            return Err(field_error(
                "scale_fmt",
                format!("{v} is not supported (float, ue8m0)"),
            ))
        }
    };
    match get("modules_to_convert") {
        None => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(v) => {
            return Err(field_error(
                "modules_to_convert",
                format!("{v}: FP8 embeddings are not supported"),
            ))
        }
    }
    let skip_key = ["modules_to_not_convert", "ignored_layers"]
        .into_iter()
        .find(|k| get(k).is_some());
    let keys = match skip_key {
        None => vec!["lm_head".to_string()],
        Some(key) => {
            let v = get(key).expect("found above");
            let names: Option<Vec<String>> = v
                .as_array()
                .and_then(|l| l.iter().map(|n| n.as_str().map(String::from)).collect());
            names.ok_or_else(|| field_error(key, format!("{v} is not a list of module names")))?
        }
    };
    let field = skip_key.unwrap_or("modules_to_not_convert");
    let not_converted = keys
        .iter()
        .map(|k| skip_pattern(k, &format!("{ROOT}.{field}")))
        .collect::<Result<_, _>>()?;
    let weights = QuantArgs {
        num_bits: 8,
        kind: QuantType::Float,
        symmetric: true,
        strategy: Strategy::Block,
        group_size: None,
        block_structure: Some(block),
        dynamic: false,
        actorder: false,
        power_of_two_scales,
    };
    // Per token, one scale per group of a block's columns.
    let input_activations = QuantArgs {
        num_bits: 8,
        kind: QuantType::Float,
        symmetric: true,
        strategy: Strategy::Group,
        group_size: Some(block[1]),
        block_structure: None,
        dynamic: true,
        actorder: false,
        power_of_two_scales,
    };
    Ok(Fp8Config {
        scheme: LayerScheme {
            group: "fp8".into(),
            format: Format::HfFp8,
            weights,
            input_activations: Some(input_activations),
        },
        not_converted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen3_fp8_config_is_128_blocks_with_group_activations() {
        let raw = json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128]});
        let cfg = parse_config(&raw).unwrap();
        assert_eq!(cfg.scheme.weights.block_structure, Some([128, 128]));
        let act = cfg.scheme.input_activations.unwrap();
        assert_eq!((act.strategy, act.group_size), (Strategy::Group, Some(128)));
        assert!(cfg.not_converted[0].is_match("lm_head"));
    }

    #[test]
    fn modules_to_not_convert_match_as_transformers_does() {
        let raw =
            json!({"quant_method": "fp8", "modules_to_not_convert": ["gate", "model.layers.0"]});
        let cfg = parse_config(&raw).unwrap();
        let skipped = |name: &str| cfg.not_converted.iter().any(|r| r.is_match(name));
        assert!(skipped("model.layers.3.mlp.gate"));
        assert!(skipped("model.layers.0.self_attn.q_proj"));
        assert!(!skipped("model.layers.3.mlp.gate_proj"));
        // Listing modules replaces the default: lm_head is converted unless named.
        assert!(!skipped("lm_head"));
    }
}

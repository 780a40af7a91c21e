//! AutoRound checkpoints (`quant_method: auto-round`, intel/auto-round's default export), read
//! as vLLM's `AutoRoundConfig` reads them:
//! - `packing_format` `auto_round:auto_gptq` (the default): GPTQ's layout with zero points
//!   stored minus one, no act-order (quant/gptq.rs); `auto_round:auto_awq`: AutoAWQ's GEMM
//!   layout (quant/awq.rs). AutoRound writes the latter for asymmetric 4-bit weights.
//! - `bits`, `group_size`, `sym`, `data_type: int`;
//! - `block_name_to_quantize` (or `to_quant_block_names`): the module prefixes quantized, a
//!   list or a comma-separated string; `lm_head` is not quantized;
//! - `extra_config`: per-module overrides of `bits`, `group_size` and `sym` by exact module
//!   name; 16 bits or more leave that module in its float dtype.
//!
//! Which Linears a checkpoint actually quantized, their `qweight` tensors say, as for GPTQ.
//! Activation quantization (`act_bits` < 16) and other data types are refused by name.

use serde_json::{Map, Value};

use super::compressed_tensors::{Format, LayerScheme, QuantArgs};
use super::gptq::{field_error, group_size};
use crate::checkpoint::LoadError;

/// What an AutoRound config says about each module.
pub struct AutoRoundConfig {
    /// The scheme of every Linear under `blocks` (all Linears when `None`).
    pub scheme: LayerScheme,
    pub blocks: Option<Vec<String>>,
    /// Exact module names with their own scheme (`None`: not quantized).
    pub overrides: Vec<(String, Option<LayerScheme>)>,
}

/// One module's (bits, group_size, sym) as a scheme of the checkpoint's packing; `None` for
/// 16 bits or more. `at` names the config object for errors.
fn scheme(
    obj: &Map<String, Value>,
    defaults: Option<&LayerScheme>,
    format: Format,
    at: &str,
) -> Result<Option<LayerScheme>, LoadError> {
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let field = |key: &str| match at {
        "" => key.to_string(),
        _ => format!("{at}.{key}"),
    };
    if let Some(v) = get("data_type") {
        if v.as_str() != Some("int") {
            return Err(field_error(
                &field("data_type"),
                format!("{v} is not supported (int)"),
            ));
        }
    }
    if let Some(v) = get("act_bits") {
        if v.as_u64().is_none_or(|b| b < 16) {
            return Err(field_error(
                &field("act_bits"),
                format!("{v}: activation quantization is not supported (16)"),
            ));
        }
    }
    for key in ["super_bits", "super_group_size"] {
        if let Some(v) = get(key) {
            return Err(field_error(
                &field(key),
                format!("is set ({v}); double quantization is not supported"),
            ));
        }
    }
    let bits = match (get("bits"), defaults) {
        (Some(v), _) => v
            .as_u64()
            .ok_or_else(|| field_error(&field("bits"), format!("{v} is not a number")))?,
        (None, Some(d)) => u64::from(d.weights.num_bits),
        (None, None) => return Err(field_error(&field("bits"), "missing")),
    };
    if bits >= 16 {
        return Ok(None);
    }
    let allowed: &[u64] = match format {
        Format::Awq => &[4],
        _ => &[2, 3, 4, 8],
    };
    if !allowed.contains(&bits) {
        return Err(field_error(
            &field("bits"),
            format!(
                "{bits} is not supported with {} packing ({allowed:?})",
                format.name()
            ),
        ));
    }
    let group = match (get("group_size"), defaults) {
        (None, Some(d)) => d.weights.group_size,
        (v, _) => group_size(v)?,
    };
    let sym = match (get("sym"), defaults) {
        (Some(Value::Bool(b)), _) => *b,
        (Some(v), _) => return Err(field_error(&field("sym"), format!("{v} is not a boolean"))),
        (None, Some(d)) => d.weights.symmetric,
        (None, None) => true,
    };
    Ok(Some(LayerScheme {
        group: match at {
            "" => "auto-round".into(),
            _ => format!("auto-round {at}"),
        },
        format,
        weights: QuantArgs::int_weights(bits as u32, sym, group, false),
        input_activations: None,
    }))
}

/// Parses a `quant_method: auto-round` config; refuses what it does not implement by name.
pub fn parse_config(raw: &Value) -> Result<AutoRoundConfig, LoadError> {
    let obj = raw
        .as_object()
        .ok_or_else(|| LoadError::config(super::gptq::ROOT, "is not an object"))?;
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let format = match get("packing_format").map(|v| (v, v.as_str())) {
        None | Some((_, Some("auto_round:auto_gptq"))) => Format::Gptq,
        Some((_, Some("auto_round:auto_awq"))) => Format::Awq,
        Some((v, _)) => {
            return Err(field_error(
                "packing_format",
                format!("{v} is not supported (auto_round:auto_gptq, auto_round:auto_awq)"),
            ))
        }
    };
    let scheme = scheme(obj, None, format, "")?.ok_or_else(|| {
        field_error(
            "bits",
            "16 or more: nothing is quantized; load the original",
        )
    })?;
    let blocks = match get("block_name_to_quantize").or_else(|| get("to_quant_block_names")) {
        None => None,
        Some(Value::String(s)) => Some(s.split(',').map(|p| p.trim().to_string()).collect()),
        Some(v) => Some(
            v.as_array()
                .and_then(|l| l.iter().map(|n| n.as_str().map(String::from)).collect())
                .ok_or_else(|| {
                    field_error(
                        "block_name_to_quantize",
                        format!("{v} is neither a string nor a list of names"),
                    )
                })?,
        ),
    };
    let mut overrides = Vec::new();
    if let Some(extra) = get("extra_config") {
        let entries = extra
            .as_object()
            .ok_or_else(|| field_error("extra_config", format!("{extra} is not an object")))?;
        for (name, entry) in entries {
            let at = format!("extra_config.{name}");
            let entry = entry
                .as_object()
                .ok_or_else(|| field_error(&at, format!("{entry} is not an object")))?;
            overrides.push((
                name.clone(),
                self::scheme(entry, Some(&scheme), format, &at)?,
            ));
        }
    }
    Ok(AutoRoundConfig {
        scheme,
        blocks,
        overrides,
    })
}

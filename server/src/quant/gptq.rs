//! Native GPTQ checkpoints (`quant_method: gptq`, as GPTQModel, AutoGPTQ and AutoRound's
//! `auto_gptq` packing write them), converted at load into [`IntWeight`], the layout of
//! compressed-tensors' pack-quantized weights, so that every path that runs those runs these.
//!
//! Per Linear of `K` inputs and `N` outputs, `b` bits, groups of `g` inputs (`G = K / g`):
//! - `qweight` `[K·b/32, N]` i32: the codes of each output column packed along K into one
//!   little-endian bit stream (code `k` in bits `k·b .. (k+1)·b`; 3-bit codes cross words);
//! - `qzeros` `[G, N·b/32]` i32: the zero points of each group packed the same way along N;
//!   format `gptq` (v1) stores `z - 1`, `gptq_v2` stores `z`;
//! - `scales` `[G, N]` float; `g_idx` `[K]` i32: the group of each input (act-order,
//!   `desc_act: true`; else `k / g`).
//!
//! `w[n, k] = (q[k, n] - z[g_idx[k], n]) · s[g_idx[k], n]`, exact in f32, as GPTQModel's torch
//! kernel computes it (`scales[g_idx] * (weight - zeros[g_idx])`) with f32 scales.
//!
//! 2- and 3-bit codes are held as int4 (code and zero point shifted by the same offset, so the
//! difference and the weight are unchanged); `bits_per_weight` counts the stored bits.

use candle_core::Device;
use regex::Regex;
use safetensors::Dtype as StDtype;
use serde_json::Value;

use super::compressed_tensors::{Format, LayerScheme, QuantArgs, Strategy};
use super::pack_quantized::{IntParts, IntWeight};
use super::{to_f32_vec, SCALE_DTYPES};
use crate::checkpoint::{Checkpoint, LoadError};

/// The tensors of a GPTQ Linear, after its name and a dot.
pub const TENSORS: [&str; 4] = ["qweight", "qzeros", "scales", "g_idx"];

pub(super) const ROOT: &str = "quantization_config";

/// An error in `quantization_config.{field}` (the native GPTQ and AWQ configs).
pub(super) fn field_error(field: &str, reason: impl Into<String>) -> LoadError {
    LoadError::config(format!("{ROOT}.{field}"), reason)
}

/// A native config's `group_size`: 128 when absent, `-1` for one group per output channel.
pub(super) fn group_size(value: Option<&Value>) -> Result<Option<usize>, LoadError> {
    match value {
        None => Ok(Some(128)),
        Some(v) => match v.as_i64() {
            Some(-1) => Ok(None),
            Some(g) if g > 0 => Ok(Some(g as usize)),
            _ => Err(field_error(
                "group_size",
                format!("{v} is neither -1 nor positive"),
            )),
        },
    }
}

/// The scheme of a GPTQ `quantization_config`, and whether `lm_head` is quantized too.
pub struct GptqConfig {
    pub scheme: LayerScheme,
    pub lm_head: bool,
    /// `modules_in_block_to_quantize`, flattened: names relative to a decoder layer.
    pub modules: Option<Vec<String>>,
    /// GPTQModel's `dynamic`, in order: the first pattern that matches a module's name decides
    /// (`-:` patterns: not quantized; others: the base scheme with the entry's overrides).
    pub dynamic: Vec<(Regex, Option<LayerScheme>)>,
}

/// Keys of a `dynamic` entry that only steered the quantization run, not what the stored
/// weights mean.
const DYNAMIC_RUN_ONLY: [&str; 6] = [
    "damp_percent",
    "damp_auto_increment",
    "mse",
    "static_groups",
    "true_sequential",
    "v2",
];

/// GPTQModel's `dynamic` (`{pattern: overrides}`, matched with `re.match` in order, as
/// GPTQModel's `dynamic_get` and vLLM's `get_dynamic_override` do).
fn parse_dynamic(
    raw: &Value,
    base: &LayerScheme,
) -> Result<Vec<(Regex, Option<LayerScheme>)>, LoadError> {
    let entries = raw
        .as_object()
        .ok_or_else(|| field_error("dynamic", format!("{raw} is not an object")))?;
    let mut out = Vec::new();
    for (key, overrides) in entries {
        let at = format!("dynamic.{key}");
        let (pattern, quantized) = match key.strip_prefix("-:") {
            Some(p) => (p, false),
            None => (key.strip_prefix("+:").unwrap_or(key), true),
        };
        let regex = Regex::new(&format!("^(?:{pattern})"))
            .map_err(|e| field_error(&at, format!("bad pattern: {e}")))?;
        let overrides = overrides
            .as_object()
            .ok_or_else(|| field_error(&at, format!("{overrides} is not an object")))?;
        if !quantized {
            out.push((regex, None));
            continue;
        }
        let mut w = base.weights.clone();
        for (name, v) in overrides {
            let bad = |why: &str| field_error(&format!("{at}.{name}"), format!("{v} {why}"));
            match name.as_str() {
                "bits" => match v.as_u64() {
                    Some(b @ (2 | 3 | 4 | 8)) => w.num_bits = b as u32,
                    _ => return Err(bad("is not 2, 3, 4 or 8")),
                },
                "group_size" => {
                    w.group_size = group_size(Some(v))?;
                    w.strategy = match w.group_size {
                        Some(_) => Strategy::Group,
                        None => Strategy::Channel,
                    };
                }
                "sym" => w.symmetric = v.as_bool().ok_or_else(|| bad("is not a boolean"))?,
                "desc_act" => w.actorder = v.as_bool().ok_or_else(|| bad("is not a boolean"))?,
                other if DYNAMIC_RUN_ONLY.contains(&other) => {}
                _ => return Err(bad("is an override ExactScore does not implement")),
            }
        }
        out.push((
            regex,
            Some(LayerScheme {
                group: format!("gptq {at}"),
                weights: w,
                ..base.clone()
            }),
        ));
    }
    Ok(out)
}

/// Parses a `quant_method: gptq` config as transformers' `GPTQConfig` and GPTQModel's
/// `QuantizeConfig` read it (their defaults where a key is absent); refuses every value that
/// changes what the weights mean and is not implemented.
pub fn parse_config(raw: &Value) -> Result<GptqConfig, LoadError> {
    let obj = raw
        .as_object()
        .ok_or_else(|| LoadError::config(ROOT, "is not an object"))?;
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let bits = match get("bits") {
        Some(v) => match v.as_u64() {
            Some(b @ (2 | 3 | 4 | 8)) => b as u32,
            _ => return Err(field_error("bits", format!("{v} is not 2, 3, 4 or 8"))),
        },
        None => return Err(field_error("bits", "missing")),
    };
    let group_size = group_size(get("group_size"))?;
    let flag = |key: &str, default: bool| -> Result<bool, LoadError> {
        match get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(field_error(key, format!("{v} is not a boolean"))),
        }
    };
    let desc_act = flag("desc_act", false)?;
    let sym = flag("sym", true)?;
    let lm_head = flag("lm_head", false)?;
    if flag("is_marlin_format", false)? {
        return Err(field_error(
            "is_marlin_format",
            "Marlin-repacked GPTQ weights are not supported (only the gptq and gptq_v2 layouts)",
        ));
    }
    // GPTQModel writes both keys; transformers reads `checkpoint_format`.
    let mut format = None;
    for key in ["checkpoint_format", "format"] {
        let Some(v) = get(key) else { continue };
        let this = match v.as_str() {
            Some("gptq") => Format::Gptq,
            Some("gptq_v2") => Format::GptqV2,
            _ => {
                return Err(field_error(
                    key,
                    format!("{v} is not supported (gptq, gptq_v2)"),
                ))
            }
        };
        if format.is_some_and(|f| f != this) {
            return Err(field_error(key, "disagrees with checkpoint_format"));
        }
        format = Some(this);
    }
    if let Some(v) = get("pack_dtype") {
        if v.as_str() != Some("int32") {
            return Err(field_error(
                "pack_dtype",
                format!("{v} is not supported (int32)"),
            ));
        }
    }
    // Transforms and AutoRound's overrides change what some weights mean: refused, not ignored.
    for key in ["extra_config", "rotation", "activation"] {
        match get(key) {
            None => {}
            Some(Value::Object(m)) if m.is_empty() => {}
            Some(v) => {
                return Err(field_error(
                    key,
                    format!("is set ({v}); not supported: it would be silently ignored"),
                ))
            }
        }
    }
    if let Some(v) = get("data_type") {
        if v.as_str() != Some("int") {
            return Err(field_error(
                "data_type",
                format!("{v} is not supported (int)"),
            ));
        }
    }
    let modules = match get("modules_in_block_to_quantize") {
        None => None,
        Some(v) => {
            let names: Option<Vec<String>> = v.as_array().and_then(|lists| {
                lists
                    .iter()
                    .flat_map(|l| l.as_array().cloned().unwrap_or_else(|| vec![l.clone()]))
                    .map(|n| n.as_str().map(String::from))
                    .collect()
            });
            Some(names.ok_or_else(|| {
                field_error(
                    "modules_in_block_to_quantize",
                    format!("{v} is not a list of lists of module names"),
                )
            })?)
        }
    };
    let scheme = LayerScheme {
        group: "gptq".into(),
        format: format.unwrap_or(Format::Gptq),
        weights: QuantArgs::int_weights(bits, sym, group_size, desc_act),
        input_activations: None,
    };
    let dynamic = match get("dynamic") {
        None => Vec::new(),
        Some(v) => parse_dynamic(v, &scheme)?,
    };
    Ok(GptqConfig {
        scheme,
        lm_head,
        modules,
        dynamic,
    })
}

/// Reads `count` codes of `bits` bits from a little-endian bit stream of i32 words, code `j`
/// in bits `j·bits ..`: GPTQ's packing of every width (3-bit codes cross word boundaries).
pub fn unpack_stream(words: &[u32], bits: usize, count: usize) -> Vec<u32> {
    let mask = (1u64 << bits) - 1;
    (0..count)
        .map(|j| {
            let bit = j * bits;
            let (word, shift) = (bit / 32, bit % 32);
            let low = words[word] as u64;
            let high = words.get(word + 1).copied().unwrap_or(0) as u64;
            (((low | (high << 32)) >> shift) & mask) as u32
        })
        .collect()
}

/// Inverse of [`unpack_stream`] (tests and checkpoint writers).
pub fn pack_stream(values: &[u32], bits: usize) -> Vec<u32> {
    let mut words = vec![0u32; (values.len() * bits).div_ceil(32)];
    for (j, &v) in values.iter().enumerate() {
        let bit = j * bits;
        let wide = (v as u64 & ((1u64 << bits) - 1)) << (bit % 32);
        words[bit / 32] |= wide as u32;
        if let Some(next) = words.get_mut(bit / 32 + 1) {
            *next |= (wide >> 32) as u32;
        }
    }
    words
}

fn words_u32(t: &candle_core::Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<i32>()?
        .into_iter()
        .map(|w| w as u32)
        .collect())
}

/// `/info`'s name of a GPTQ or AWQ packing: prefixed by `auto-round` where an AutoRound
/// config chose it.
pub(super) fn packing_label(scheme: &LayerScheme, packing: &str) -> String {
    match scheme.group.starts_with("auto-round") {
        true => format!("auto-round {packing}"),
        false => packing.to_string(),
    }
}

fn bad(name: String, reason: String) -> LoadError {
    LoadError::BadTensor { name, reason }
}

/// Loads the GPTQ Linear `name` of `(out, inp)` features into an [`IntWeight`].
pub fn load(
    ckpt: &Checkpoint,
    name: &str,
    (out, inp): (usize, usize),
    scheme: &LayerScheme,
    device: &Device,
) -> Result<IntWeight, LoadError> {
    let args = &scheme.weights;
    let bits = args.num_bits as usize;
    let group = args.group_size.unwrap_or(inp);
    let unsupported = |field: &str, reason: String| LoadError::Unsupported {
        layer: name.into(),
        field: field.into(),
        reason,
    };
    if inp % group != 0 {
        return Err(unsupported(
            "group_size",
            format!("{group} does not divide in_features {inp}"),
        ));
    }
    if !(inp * bits).is_multiple_of(32) || !(out * bits).is_multiple_of(32) {
        return Err(unsupported(
            "bits",
            format!("{bits}-bit codes of a [{out}, {inp}] weight do not fill whole int32 words"),
        ));
    }
    let groups = inp / group;
    let cpu = &Device::Cpu;
    let tensor = |suffix: &str, dtypes: &[StDtype], shape: &[usize]| {
        ckpt.tensor(&format!("{name}.{suffix}"), dtypes, Some(shape), cpu)
    };
    let qweight = words_u32(&tensor(
        "qweight",
        &[StDtype::I32],
        &[inp * bits / 32, out],
    )?)?;
    let qzeros = words_u32(&tensor(
        "qzeros",
        &[StDtype::I32],
        &[groups, out * bits / 32],
    )?)?;
    let raw_scale = tensor("scales", SCALE_DTYPES, &[groups, out])?;
    let scale_bits = (raw_scale.dtype().size_in_bytes() * 8) as f64;
    let scales = to_f32_vec(&raw_scale)?;
    let g_idx = load_g_idx(ckpt, &format!("{name}.g_idx"), inp, group, args.actorder)?;

    // Held as int4 (2, 3, 4 bits) or int8, signed: the offset of that width removed.
    let held = if bits <= 4 { 4 } else { 8 };
    let offset = 1i64 << (held - 1);
    let one = i64::from(scheme.format == Format::Gptq);
    let zeros_name = format!("{name}.qzeros");
    let mut zero_point = vec![0i32; out * groups];
    let words_per_group = out * bits / 32;
    for (g, row) in qzeros.chunks(words_per_group).enumerate() {
        for (n, z) in unpack_stream(row, bits, out).into_iter().enumerate() {
            zero_point[n * groups + g] = (z as i64 + one - offset) as i32;
        }
    }
    if args.symmetric {
        // Symmetric kernels (Marlin, vLLM's default) never read qzeros, GPTQModel's torch
        // kernel does: they agree only where every zero point is the midpoint.
        let midpoint = (1i64 << (bits - 1)) - offset;
        if let Some(i) = zero_point.iter().position(|&z| z as i64 != midpoint) {
            return Err(bad(
                zeros_name,
                format!(
                    "`sym: true` but the zero point of output {} in group {} is {} (the \
                     midpoint {} in {} format)",
                    i / groups,
                    i % groups,
                    zero_point[i] as i64 + offset,
                    midpoint + offset,
                    scheme.format.name()
                ),
            ));
        }
    }
    let codes_per_column = inp;
    let words_per_column = inp * bits / 32;
    let mut codes = vec![0i32; out * inp];
    // qweight is [K·b/32, N]: column n's stream is words (0..K·b/32, n).
    let mut column = vec![0u32; words_per_column];
    for n in 0..out {
        for (w, slot) in column.iter_mut().enumerate() {
            *slot = qweight[w * out + n];
        }
        for (k, q) in unpack_stream(&column, bits, codes_per_column)
            .into_iter()
            .enumerate()
        {
            codes[n * inp + k] = (q as i64 - offset) as i32;
        }
    }
    let mut scale = vec![0f32; out * groups];
    for g in 0..groups {
        for n in 0..out {
            scale[n * groups + g] = scales[g * out + n];
        }
    }
    let asym = zero_point.iter().any(|&z| z != 0);
    let grouping_bits = (scale_bits + bits as f64) / group as f64;
    Ok(IntWeight::from_parts(
        IntParts {
            shape: (out, inp),
            bits: held,
            group,
            codes,
            scale,
            scale_dtype: raw_scale.dtype(),
            zero_point: asym.then_some(zero_point),
            g_idx,
            symmetric: args.symmetric,
            // GPTQ stores zero points even when symmetric.
            stored_bits: bits as f64 + grouping_bits,
            label: packing_label(scheme, &format!("{} int{bits}", scheme.format.name())),
        },
        device,
    )?)
}

/// The group of each input from the tensor `g_name`: `None` where it is `k / group`. A
/// checkpoint without act-order may omit it or store the trivial one; with act-order it must
/// store one that puts `group` inputs in each group.
pub(crate) fn load_g_idx(
    ckpt: &Checkpoint,
    g_name: &str,
    inp: usize,
    group: usize,
    actorder: bool,
) -> Result<Option<Vec<u32>>, LoadError> {
    let groups = inp / group;
    let g_name = g_name.to_string();
    if !actorder && !ckpt.contains(&g_name) {
        return Ok(None);
    }
    let values = ckpt
        .tensor(&g_name, &[StDtype::I32], Some(&[inp]), &Device::Cpu)?
        .to_vec1::<i32>()?;
    if let Some(k) = values.iter().position(|&g| g < 0 || g as usize >= groups) {
        return Err(bad(
            g_name,
            format!("input {k} is in group {}, outside 0..{groups}", values[k]),
        ));
    }
    let g_idx: Vec<u32> = values.into_iter().map(|g| g as u32).collect();
    let trivial = g_idx
        .iter()
        .enumerate()
        .all(|(k, &g)| g as usize == k / group);
    if trivial {
        return Ok(None);
    }
    if !actorder {
        // vLLM ignores g_idx without desc_act, GPTQModel applies it: refused as ambiguous.
        return Err(bad(
            g_name,
            "is not `input / group_size` but the config has no act-order (desc_act, actorder)"
                .into(),
        ));
    }
    let mut sizes = vec![0usize; groups];
    for &g in &g_idx {
        sizes[g as usize] += 1;
    }
    if let Some(g) = sizes.iter().position(|&s| s != group) {
        return Err(bad(
            g_name,
            format!("group {g} has {} inputs, not group_size {group}", sizes[g]),
        ));
    }
    Ok(Some(g_idx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn stream_pack_then_unpack_is_identity(
            bits in prop::sample::select(vec![2usize, 3, 4, 8]),
            raw in prop::collection::vec(any::<u32>(), 1..100),
        ) {
            let values: Vec<u32> = raw.iter().map(|v| v & ((1 << bits) - 1)).collect();
            prop_assert_eq!(unpack_stream(&pack_stream(&values, bits), bits, values.len()), values);
        }
    }

    #[test]
    fn three_bit_codes_cross_words_as_gptq_packs_them() {
        // GPTQ's 3-bit packer: code 10 puts its low two bits in bits 30-31 of word 0 and its
        // high bit in bit 0 of word 1; code 11 starts at bit 1 of word 1.
        let mut values = vec![0u32; 32];
        values[10] = 0b101;
        values[11] = 0b011;
        let words = pack_stream(&values, 3);
        assert_eq!(words, vec![0b01 << 30, 0b1 | (0b011 << 1), 0]);
    }
}

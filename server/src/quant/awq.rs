//! Native AWQ (`quant_method: awq`, `version: gemm`): AutoAWQ's `WQLinear_GEMM` layout, which
//! transformers (through GPTQModel) and vLLM read. Per Linear of `[N, K]`, groups of `g` inputs:
//!
//! - `qweight` `[K, N/8]` i32: row k holds the 4-bit codes of every output, eight to a word,
//!   the codes of outputs `8j .. 8j+8` in word j in the order `[0, 2, 4, 6, 1, 3, 5, 7]` (output
//!   `8j + m` in bits `4·r[m] ..` with `r = [0, 4, 1, 5, 2, 6, 3, 7]`);
//! - `qzeros` `[K/g, N/8]` i32: the zero point of each group and output, packed alike;
//! - `scales` `[K/g, N]` float.
//!
//! `w[n, k] = (q[k, n] - z[k/g, n]) · s[k/g, n]`, exact in f32, as GPTQModel's
//! `dequantize_gemm` computes it with f32 scales. Held as compressed-tensors' int4 layout with
//! zero points ([`IntWeight`]), which the GPU int dequant kernel reads.

use candle_core::Device;
use regex::Regex;
use serde_json::Value;

use super::compressed_tensors::{skip_pattern, Format, LayerScheme, QuantArgs};
use super::gptq::{field_error, group_size, ROOT};
use super::pack_quantized::{IntParts, IntWeight};
use super::{to_f32_vec, SCALE_DTYPES};
use crate::checkpoint::{Checkpoint, LoadError};
use safetensors::Dtype as StDtype;

/// The tensors of an AWQ Linear, after its name and a dot.
pub const TENSORS: [&str; 3] = ["qweight", "qzeros", "scales"];

/// Where output `8j + m` of word j sits: bits `4 · WORD_SLOT[m] ..` (AutoAWQ's interleave
/// `[0, 2, 4, 6, 1, 3, 5, 7]` inverted).
const WORD_SLOT: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// The one scheme of an AWQ `quantization_config` and the modules it leaves unquantized.
pub struct AwqConfig {
    pub scheme: LayerScheme,
    /// `modules_to_not_convert`, each as transformers matches it (`re.match(key, name)` or
    /// `name.endswith(key)`), plus `lm_head`, which transformers always skips.
    pub not_converted: Vec<Regex>,
}

/// Parses a `quant_method: awq` config as transformers' `AwqConfig` reads it (its defaults
/// where a key is absent); refuses every layout but GEMM and every value that changes what
/// the weights mean and is not implemented.
pub fn parse_config(raw: &Value) -> Result<AwqConfig, LoadError> {
    let obj = raw
        .as_object()
        .ok_or_else(|| LoadError::config(ROOT, "is not an object"))?;
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    match get("bits") {
        None => {}
        Some(v) if v.as_u64() == Some(4) => {}
        Some(v) => {
            return Err(field_error(
                "bits",
                format!("{v} is not supported (AWQ GEMM packs 4-bit codes)"),
            ))
        }
    }
    let group_size = group_size(get("group_size"))?;
    // transformers reads `format`, and the legacy `version` over it.
    for key in ["format", "version"] {
        let Some(v) = get(key) else { continue };
        match v.as_str().map(str::to_ascii_lowercase).as_deref() {
            Some("gemm") => {}
            Some(other @ ("gemv" | "gemv_fast" | "marlin" | "exllama" | "llm-awq")) => {
                return Err(field_error(
                    key,
                    format!(
                        "`{other}` is an AWQ layout ExactScore does not read (only gemm, \
                         AutoAWQ's WQLinear_GEMM)"
                    ),
                ))
            }
            _ => return Err(field_error(key, format!("{v} is not supported (gemm)"))),
        }
    }
    if let Some(v) = get("zero_point") {
        if v != &Value::Bool(true) {
            return Err(field_error(
                "zero_point",
                format!("{v}: only zero-point AWQ (true) is supported; GEMM kernels read qzeros"),
            ));
        }
    }
    if get("desc_act") == Some(&Value::Bool(true)) {
        return Err(field_error(
            "desc_act",
            "true: AWQ has no act-order (no g_idx)",
        ));
    }
    let mut keys = vec!["lm_head".to_string()];
    if let Some(v) = get("modules_to_not_convert") {
        let names: Option<Vec<String>> = v
            .as_array()
            .and_then(|l| l.iter().map(|n| n.as_str().map(String::from)).collect());
        keys.extend(names.ok_or_else(|| {
            field_error(
                "modules_to_not_convert",
                format!("{v} is not a list of module names"),
            )
        })?);
    }
    let not_converted = keys
        .iter()
        .map(|key| skip_pattern(key, &format!("{ROOT}.modules_to_not_convert")))
        .collect::<Result<_, _>>()?;
    let scheme = LayerScheme {
        group: "awq".into(),
        format: Format::Awq,
        weights: QuantArgs::int_weights(4, false, group_size, false),
        input_activations: None,
    };
    Ok(AwqConfig {
        scheme,
        not_converted,
    })
}

/// The 4-bit codes of `words` (`[rows, cols/8]`, AWQ's interleaved order), row-major
/// `[rows, cols]`.
pub fn unpack_interleaved(words: &[i32], cols: usize) -> Vec<u32> {
    words
        .chunks(cols / 8)
        .flat_map(|row| {
            row.iter()
                .flat_map(|&w| WORD_SLOT.map(|slot| ((w as u32) >> (4 * slot)) & 0xF))
        })
        .collect()
}

/// Inverse of [`unpack_interleaved`] (tests and checkpoint writers).
pub fn pack_interleaved(codes: &[u32], cols: usize) -> Vec<i32> {
    codes
        .chunks(cols)
        .flat_map(|row| {
            row.chunks(8).map(|eight| {
                eight
                    .iter()
                    .zip(WORD_SLOT)
                    .fold(0u32, |w, (&q, slot)| w | ((q & 0xF) << (4 * slot)))
                    as i32
            })
        })
        .collect()
}

/// Loads the AWQ Linear `name` of `(out, inp)` features into an [`IntWeight`].
pub fn load(
    ckpt: &Checkpoint,
    name: &str,
    (out, inp): (usize, usize),
    scheme: &LayerScheme,
    device: &Device,
) -> Result<IntWeight, LoadError> {
    let group = scheme.weights.group_size.unwrap_or(inp);
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
    if out % 8 != 0 {
        return Err(unsupported(
            "bits",
            format!("4-bit codes of {out} outputs do not fill whole int32 words"),
        ));
    }
    let groups = inp / group;
    let cpu = &Device::Cpu;
    let tensor = |suffix: &str, dtypes: &[StDtype], shape: &[usize]| {
        ckpt.tensor(&format!("{name}.{suffix}"), dtypes, Some(shape), cpu)
    };
    let words = |t: candle_core::Tensor| t.flatten_all()?.to_vec1::<i32>();
    let q = unpack_interleaved(
        &words(tensor("qweight", &[StDtype::I32], &[inp, out / 8])?)?,
        out,
    );
    let z = unpack_interleaved(
        &words(tensor("qzeros", &[StDtype::I32], &[groups, out / 8])?)?,
        out,
    );
    let raw_scale = tensor("scales", SCALE_DTYPES, &[groups, out])?;
    let scale_bits = (raw_scale.dtype().size_in_bytes() * 8) as f64;
    let s = to_f32_vec(&raw_scale)?;
    // Held signed (offset 8 removed from code and zero point alike), transposed to [out, ..].
    let mut codes = vec![0i32; out * inp];
    for k in 0..inp {
        for n in 0..out {
            codes[n * inp + k] = q[k * out + n] as i32 - 8;
        }
    }
    // AutoRound's AWQ packing with `sym: true`: symmetric kernels never read qzeros, AutoAWQ's
    // do; they agree only where every zero point is the midpoint.
    if scheme.weights.symmetric {
        if let Some(i) = z.iter().position(|&z| z != 8) {
            return Err(LoadError::BadTensor {
                name: format!("{name}.qzeros"),
                reason: format!(
                    "`sym: true` but the zero point of output {} in group {} is {} (the midpoint 8)",
                    i % out,
                    i / out,
                    z[i]
                ),
            });
        }
    }
    let mut zero_point = vec![0i32; out * groups];
    let mut scale = vec![0f32; out * groups];
    for g in 0..groups {
        for n in 0..out {
            zero_point[n * groups + g] = z[g * out + n] as i32 - 8;
            scale[n * groups + g] = s[g * out + n];
        }
    }
    Ok(IntWeight::from_parts(
        IntParts {
            shape: (out, inp),
            bits: 4,
            group,
            codes,
            scale,
            scale_dtype: raw_scale.dtype(),
            zero_point: Some(zero_point),
            g_idx: None,
            symmetric: false,
            stored_bits: 4.0 + (scale_bits + 4.0) / group as f64,
            label: super::gptq::packing_label(scheme, "awq int4"),
        },
        device,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn interleaved_pack_then_unpack_is_identity(
            raw in prop::collection::vec(0u32..16, 3 * 16),
        ) {
            // Three rows of 16 outputs (two words each).
            let cols = 16;
            prop_assert_eq!(unpack_interleaved(&pack_interleaved(&raw, cols), cols), raw);
        }
    }

    #[test]
    fn outputs_sit_in_autoawq_order() {
        // AutoAWQ packs outputs [0, 2, 4, 6, 1, 3, 5, 7] into nibbles 0..8 of a word.
        let codes: Vec<u32> = (1..=8).collect();
        let word = pack_interleaved(&codes, 8)[0] as u32;
        let nibbles: Vec<u32> = (0..8).map(|i| (word >> (4 * i)) & 0xF).collect();
        assert_eq!(nibbles, vec![1, 3, 5, 7, 2, 4, 6, 8]);
    }
}

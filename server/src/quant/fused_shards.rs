//! Per-tensor fp8 layers that vLLM fuses into one, as it serves them. vLLM multiplies q/k/v as
//! one `qkv_proj`, gate/up as one `gate_up_proj` (Mixtral's w1/w3, each expert's gate/up as its
//! `w13`), MLA's q_a/kv_a as `fused_qkv_a_proj`, Qwen3.5's `in_proj_qkv`/`in_proj_z` and
//! `in_proj_b`/`in_proj_a`, and a fused layer has one weight scale and one
//! static input scale. Where the checkpoint stores a scale per shard, vLLM takes the largest and
//! requantizes each shard's codes to it (`requantize_with_max_scale`, for compressed-tensors'
//! W8A8 tensor strategy always, for ModelOpt FP8 where the shards' scales differ), and takes the
//! largest static input scale; a mixture's experts share the largest static input scale of each
//! projection. nvidia-modelopt 0.47 exports q/k/v with their own weight scales: on its tiny
//! export (`tests/fixtures/llama-modelopt-export-fp8`) 54 % of the fused weights change value
//! and the log-probs 0.061 nats per token on average.
//!
//! The requantization ([`requantize`]) follows vLLM on CUDA: `per_tensor_dequantize` multiplies
//! the codes as float16 by the shard's scale, a 0-dim f32 CUDA tensor that PyTorch's CUDA
//! kernel reads as float16 (`BinaryFunctor<scalar_t, scalar_t>`), rounding the product to
//! float16; `static_scaled_fp8_quant` multiplies by `1.0f / max_scale` and rounds to e4m3.

use candle_core::{Device, Tensor};
use safetensors::Dtype as StDtype;

use super::compressed_tensors::{Format, LayerScheme, QuantType, Strategy};
use super::load_scalar;
use super::minifloat::{fp8_e4m3_from_grid, fp8_e4m3_to_f32, round_to_fp8_e4m3, FP8_E4M3_MAX};
use crate::checkpoint::{Checkpoint, LoadError};

/// The projections vLLM fuses into one layer, by the last part of their names (its models'
/// `packed_modules_mapping`: Qwen3.5's gated delta net fuses `in_proj_qkvz` and `in_proj_ba`).
pub const FUSED_SHARDS: [&[&str]; 6] = [
    &["q_proj", "k_proj", "v_proj"],
    &["gate_proj", "up_proj"],
    &["w1", "w3"],
    &["q_a_proj", "kv_a_proj_with_mqa"],
    &["in_proj_qkv", "in_proj_z"],
    &["in_proj_b", "in_proj_a"],
];

/// How per-tensor fp8 scales of fused layers are read (`--fused-fp8-scales`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FusedFp8Scales {
    /// As vLLM serves them: one weight scale per fused layer, the shards requantized to it,
    /// the largest static input scale (see the module).
    #[default]
    Served,
    /// Each layer's own scales, as transformers and compressed-tensors decompress them.
    PerLayer,
}

/// The Linears fused with `name` that hold the tensor `tensor` in the checkpoint (`name`
/// among them), in the group's order; or `name` alone.
fn shards_of(ckpt: &Checkpoint, name: &str, tensor: &str) -> Vec<String> {
    let Some((base, leaf)) = name.rsplit_once('.') else {
        return vec![name.to_string()];
    };
    match FUSED_SHARDS.iter().find(|group| group.contains(&leaf)) {
        Some(group) => group
            .iter()
            .map(|shard| format!("{base}.{shard}"))
            .filter(|shard| shard == name || ckpt.contains(&format!("{shard}.{tensor}")))
            .collect(),
        None => vec![name.to_string()],
    }
}

/// For a mixture expert's projection (`….experts.<i>.<leaf>`), the same projection of every
/// expert (`w13`: gate/up, w1/w3; `w2`: down, w2) that the checkpoint holds; else the shards of
/// `name`.
fn input_scale_peers(ckpt: &Checkpoint, name: &str) -> Vec<String> {
    let parts: Vec<&str> = name.rsplitn(3, '.').collect();
    let [leaf, index, experts] = parts[..] else {
        return shards_of(ckpt, name, "input_scale");
    };
    if !experts.ends_with("experts") || index.parse::<usize>().is_err() {
        return shards_of(ckpt, name, "input_scale");
    }
    let group: &[&str] = match leaf {
        "gate_proj" | "up_proj" | "w1" | "w3" => &["gate_proj", "up_proj", "w1", "w3"],
        "down_proj" | "w2" => &["down_proj", "w2"],
        _ => return shards_of(ckpt, name, "input_scale"),
    };
    let prefix = format!("{experts}.");
    let mut peers: Vec<String> = ckpt
        .names_with_prefix(&prefix)
        .filter_map(|t| t.strip_suffix(".input_scale"))
        .filter(|n| {
            n[prefix.len()..]
                .split_once('.')
                .is_some_and(|(i, l)| i.parse::<usize>().is_ok() && group.contains(&l))
        })
        .map(str::to_string)
        .collect();
    peers.sort();
    peers
}

/// The largest of the scalar tensors `tensor` of `names`.
fn largest(ckpt: &Checkpoint, names: &[String], tensor: &str) -> Result<f32, LoadError> {
    names.iter().try_fold(f32::NEG_INFINITY, |m, n| {
        Ok(m.max(load_scalar(ckpt, &format!("{n}.{tensor}"))?))
    })
}

/// Whether vLLM gives the layers of `scheme` one weight scale per fused layer: per-tensor fp8
/// weights with fp8 activations (compressed-tensors' `CompressedTensorsW8A8Fp8`; its W8A16
/// scheme keeps the shards' scales, per channel) or ModelOpt FP8.
fn shares_fused_scales(scheme: &LayerScheme) -> bool {
    let fp8_activations = scheme
        .input_activations
        .as_ref()
        .is_some_and(|a| a.kind == QuantType::Float && a.num_bits == 8);
    match scheme.format {
        Format::ModeloptFp8 => true,
        Format::FloatQuantized => scheme.weights.strategy == Strategy::Tensor && fp8_activations,
        _ => false,
    }
}

/// The weight scale that the per-tensor fp8 layer `name` is served with, where vLLM requantizes
/// its codes to one: the largest of its shards' (compressed-tensors: always, even a layer of one
/// shard; ModelOpt: only where the shards' scales differ). `None`: the layer's own scale.
pub fn served_weight_scale(
    ckpt: &Checkpoint,
    name: &str,
    scheme: &LayerScheme,
    mode: FusedFp8Scales,
) -> Result<Option<f32>, LoadError> {
    if mode == FusedFp8Scales::PerLayer || !shares_fused_scales(scheme) {
        return Ok(None);
    }
    let scales = shards_of(ckpt, name, "weight_scale")
        .iter()
        .map(|n| load_scalar(ckpt, &format!("{n}.weight_scale")))
        .collect::<Result<Vec<f32>, LoadError>>()?;
    if scheme.format == Format::ModeloptFp8 && scales.iter().all(|&s| s == scales[0]) {
        return Ok(None);
    }
    Ok(Some(
        scales.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    ))
}

/// The static input scale that the layer `name` is served with: the largest over its fused
/// shards, and over a mixture's experts.
pub fn served_input_scale(
    ckpt: &Checkpoint,
    name: &str,
    scheme: &LayerScheme,
    mode: FusedFp8Scales,
) -> Result<f32, LoadError> {
    match mode == FusedFp8Scales::Served && shares_fused_scales(scheme) {
        true => largest(ckpt, &input_scale_peers(ckpt, name), "input_scale"),
        false => load_scalar(ckpt, &format!("{name}.input_scale")),
    }
}

/// Logs, once a process, a layer whose NVFP4 shards that vLLM fuses carry different global
/// scales (`tensor`: `weight_global_scale` or `weight_scale_2`), asked by the group's first
/// shard. vLLM serves such a layer with one global scale, the largest (a mixture's gate/up: the
/// gate's), without touching the block scales, and warns "Accuracy may be affected" (vLLM
/// issue #54150: real NVFP4 mixtures with gate/up scales up to 10x apart). ExactScore scores
/// each shard with its own, as transformers does: that is the checkpoint's model, and vLLM's
/// reading is a known fault, not a format.
pub fn warn_if_global_scales_differ(ckpt: &Checkpoint, name: &str, tensor: &str) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static WARNED: AtomicBool = AtomicBool::new(false);
    // once warned, the other layers' scales need not be read
    if WARNED.load(Ordering::Relaxed) {
        return;
    }
    let shards = shards_of(ckpt, name, tensor);
    if shards.len() < 2 || shards[0] != name {
        return;
    }
    let values: Vec<f32> = shards
        .iter()
        .filter_map(|n| load_scalar(ckpt, &format!("{n}.{tensor}")).ok())
        .collect();
    if values.windows(2).all(|w| w[0] == w[1]) || WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    tracing::warn!(
        layers = ?shards,
        tensor,
        ?values,
        "these NVFP4 shards, one layer in vLLM, have different global scales: vLLM serves \
         them with one (the largest; a mixture's gate/up with the gate's) and warns that \
         accuracy may be affected (vLLM issue #54150); ExactScore scores each with its own, as \
         transformers does (further such layers are not logged)"
    );
}

/// vLLM's `requantize_with_max_scale` of one shard: each e4m3 code times the shard's `scale`
/// in float16, then quantized against `max_scale` (see the module). NaN codes stay.
pub fn requantize(codes: &mut [u8], scale: f32, max_scale: f32) {
    let scale = half::f16::from_f32(scale).to_f32();
    let inverse = 1.0 / max_scale;
    for code in codes.iter_mut() {
        let value = fp8_e4m3_to_f32(*code);
        if value.is_nan() {
            continue;
        }
        let dequantized = half::f16::from_f32(value * scale).to_f32();
        let x = (dequantized * inverse).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX);
        *code = fp8_e4m3_from_grid(round_to_fp8_e4m3(x));
    }
}

/// The e4m3 weight `name` `[out, in]` with its codes requantized from `scale` to `max_scale`,
/// on `device`.
pub fn requantized_weight(
    ckpt: &Checkpoint,
    name: &str,
    (out, inp): (usize, usize),
    (scale, max_scale): (f32, f32),
    device: &Device,
) -> Result<Tensor, LoadError> {
    let tensor = format!("{name}.weight");
    let codes = ckpt.tensor(
        &tensor,
        &[StDtype::F8_E4M3],
        Some(&[out, inp]),
        &Device::Cpu,
    )?;
    let bad = |e: candle_core::Error| LoadError::BadTensor {
        name: tensor.clone(),
        reason: e.to_string(),
    };
    // the checkpoint hands e4m3 codes over as their bytes (U8)
    let mut bytes = codes
        .flatten_all()
        .and_then(|c| c.to_vec1::<u8>())
        .map_err(bad)?;
    requantize(&mut bytes, scale, max_scale);
    Tensor::from_vec(bytes, (out, inp), device).map_err(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worked by hand: code 0x3B is 1.375 (2^0 × 1.375); the scale 1e-3 is 0.0010004044 in
    /// float16; 1.375 × that = 0.0013755560 → float16 0.0013751984; × (1 / 2e-3) = 0.6875992
    /// → e4m3 0.6875 (0x33: 2^-1 × 1.375). The largest scale itself keeps every code.
    #[test]
    fn requantizes_as_vllm_does() {
        let mut codes = [0x3B_u8];
        requantize(&mut codes, 1e-3, 2e-3);
        assert_eq!(fp8_e4m3_to_f32(codes[0]), 0.6875);
        assert_eq!(codes[0], 0x33);
        let all: Vec<u8> = (0..=255u8)
            .filter(|&c| !fp8_e4m3_to_f32(c).is_nan())
            .collect();
        let mut same = all.clone();
        requantize(&mut same, 3.0 / 4096.0, 3.0 / 4096.0);
        assert_eq!(same, all);
        // clamped at ±448, and -0.0 kept
        let mut edge = [0x7E_u8, 0xFE, 0x80];
        requantize(&mut edge, 2e-3, 1e-3);
        assert_eq!(edge, [0x7E, 0xFE, 0x80]);
    }
}

//! Activation fake-quantization (quantize then dequantize) of a Linear's input, bit-exact with
//! compressed-tensors (all arithmetic in f32, `/` true division, ties to even).

use candle_core::{Result, Tensor};

use super::compressed_tensors::{QuantArgs, QuantType, Strategy};
use super::load_scalar;
use super::minifloat::{round_to_fp4_e2m1, round_to_fp8_e4m3, FP4_E2M1_MAX, FP8_E4M3_MAX};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops;

/// Whether the activation quantization a scheme declares is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationQuantMode {
    /// Apply QDQ exactly as the reference does (default).
    #[default]
    Emulate,
    /// Weights only: how vLLM runs NVFP4 on GPUs without fp4 tensor cores.
    Off,
}

impl std::str::FromStr for ActivationQuantMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "emulate" => Ok(Self::Emulate),
            "off" => Ok(Self::Off),
            other => Err(format!("`{other}`: expected `emulate` or `off`")),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum ActivationQdq {
    /// fp8 e4m3, one dynamic scale per token (row).
    Fp8PerToken,
    /// fp8 e4m3, one static scale (`input_scale`).
    Fp8Static { scale: f32 },
    /// NVFP4: fp4 e2m1 per 16 values, fp8 group scales against a static global scale.
    Nvfp4 { global_scale: f32 },
}

/// Smallest scale compressed-tensors allows (f32 epsilon).
const MIN_SCALE: f32 = f32::EPSILON;
/// Replacement for an NVFP4 group scale that rounds to zero.
const NVFP4_ZERO_SCALE: f32 = 0.125;

impl ActivationQdq {
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        args: &QuantArgs,
    ) -> std::result::Result<Self, LoadError> {
        Ok(match (args.kind, args.num_bits, args.strategy) {
            (QuantType::Float, 8, Strategy::Token) => Self::Fp8PerToken,
            (QuantType::Float, 8, Strategy::Tensor) => Self::Fp8Static {
                scale: load_scalar(ckpt, &format!("{name}.input_scale"))?,
            },
            (QuantType::Float, 4, Strategy::TensorGroup) => Self::Nvfp4 {
                global_scale: load_scalar(ckpt, &format!("{name}.input_global_scale"))?,
            },
            _ => unreachable!("refused by compressed_tensors::check_scheme"),
        })
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Self::Fp8PerToken => "fp8 e4m3 per-token dynamic",
            Self::Fp8Static { .. } => "fp8 e4m3 per-tensor static",
            Self::Nvfp4 { .. } => "nvfp4 g16",
        }
    }

    /// QDQ of `x` (`[tokens, k]`, any float dtype), computed in f32 and returned in x's dtype
    /// (see [`ops::activation_qdq`]).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        ops::activation_qdq(x, self)
    }

    /// QDQ of one token's activations, in place.
    pub fn qdq_row(&self, row: &mut [f32]) {
        match *self {
            Self::Fp8PerToken => {
                let mut scale = absmax(row) / FP8_E4M3_MAX;
                if scale == 0.0 {
                    scale = MIN_SCALE;
                }
                qdq_fp8(row, scale);
            }
            Self::Fp8Static { scale } => qdq_fp8(row, scale),
            Self::Nvfp4 { global_scale } => {
                for group in row.chunks_mut(16) {
                    qdq_nvfp4_group(group, global_scale);
                }
            }
        }
    }
}

/// `max(|min(min x, 0)|, |max(max x, 0)|)`.
fn absmax(values: &[f32]) -> f32 {
    let (lo, hi) = values
        .iter()
        .fold((0f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    lo.abs().max(hi.abs())
}

fn qdq_fp8(row: &mut [f32], scale: f32) {
    for v in row {
        // "+ 0.0" is the stored zero point: it turns -0.0 into +0.0 as the reference does.
        let q = (*v / scale + 0.0).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX);
        *v = round_to_fp8_e4m3(q) * scale;
    }
}

fn qdq_nvfp4_group(group: &mut [f32], global_scale: f32) {
    let s = global_scale * (absmax(group) / FP4_E2M1_MAX);
    let mut s = round_to_fp8_e4m3(s.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX));
    if s == 0.0 {
        s = NVFP4_ZERO_SCALE;
    }
    let eff = s / global_scale;
    for v in group {
        let q = (*v / eff + 0.0).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX);
        *v = round_to_fp4_e2m1(q) * eff;
    }
}

//! Activation fake-quantization (quantize then dequantize) of a Linear's input, bit-exact with
//! compressed-tensors (all arithmetic in f32, `/` true division, ties to even).

use super::compressed_tensors::{QuantArgs, QuantType, Strategy};
use super::load_scalar;
use crate::checkpoint::{Checkpoint, LoadError};
pub use crate::ops::ActivationQdq;

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

/// How a Linear with e4m3 weights (one scale per channel or per tensor) and e4m3 activations
/// (per token, or static) multiplies in bf16/f16 on a GPU with fp8 tensor cores
/// ([`crate::ops::fp8_gemm`]); elsewhere, and in f32, such a layer is always emulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fp8Matmul {
    /// The e4m3 codes on the tensor cores, f32 sums, both scales applied to each sum, rounded
    /// once (default).
    #[default]
    TensorCores,
    /// The same with Hopper's fast fp8 accumulation: the tensor cores' own accumulator, not
    /// promoted to f32 registers every few k-blocks, as vLLM's CUTLASS `…FP8FastAccum` GEMMs
    /// sum.
    TensorCoresFastAccum,
    /// QDQ'd activations times the dequantized weight, both in the compute dtype.
    Emulated,
}

impl Fp8Matmul {
    /// Whether a layer that can multiplies on the fp8 tensor cores.
    pub fn on_tensor_cores(self) -> bool {
        self != Self::Emulated
    }
}

impl ActivationQdq {
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        args: &QuantArgs,
    ) -> std::result::Result<Self, LoadError> {
        Ok(match (args.kind, args.num_bits, args.strategy) {
            (QuantType::Float, 8, Strategy::Token) => Self::Fp8PerToken,
            // Hugging Face FP8's dynamic activations (`super::hf_fp8`).
            (QuantType::Float, 8, Strategy::Group) => Self::Fp8PerTokenGroup {
                group: args.group_size.expect("set by hf_fp8::parse_config"),
                power_of_two: args.power_of_two_scales,
            },
            (QuantType::Float, 8, Strategy::Tensor) => Self::Fp8Static {
                scale: load_scalar(ckpt, &format!("{name}.input_scale"))?,
            },
            (QuantType::Int, 8, Strategy::Token) => Self::Int8PerToken,
            (QuantType::Float, 4, Strategy::TensorGroup) => Self::Nvfp4 {
                global_scale: load_scalar(ckpt, &format!("{name}.input_global_scale"))?,
            },
            _ => unreachable!("refused by compressed_tensors::check_scheme"),
        })
    }
}

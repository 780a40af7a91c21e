//! `float-quantized`: fp8 e4m3 weights with a per-tensor, per-channel or per-block scale; also
//! Hugging Face FP8 (`super::hf_fp8`), whose block scales are called `weight_scale_inv`.
//! `w[r, c] = f32(fp8(weight[r, c])) * f32(scale[..])`, exact in f32.

use candle_core::{DType, Device, Result, Tensor};
use safetensors::Dtype as StDtype;

use super::compressed_tensors::{Format, LayerScheme, Strategy};
use super::minifloat::fp8_e4m3_to_f32;
use super::{fused_shards, to_f32_vec, QuantizedWeight, SCALE_DTYPES};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::Packed;

/// Name of the tensor that holds the scales in `format`.
pub fn scale_tensor(format: Format) -> &'static str {
    if format == Format::HfFp8 {
        super::hf_fp8::SCALE
    } else {
        "weight_scale"
    }
}

pub struct Fp8Weight {
    out: usize,
    inp: usize,
    weight: Tensor,
    /// f32, one per block, row-major.
    scale: Tensor,
    /// Rows and columns covered by one scale.
    block: (usize, usize),
    stored_bits: f64,
    format: Format,
    strategy: Strategy,
    /// `scale_fmt: ue8m0` (checked at load).
    power_of_two_scales: bool,
    /// Codes requantized to the scale of the fused layer vLLM serves (`super::fused_shards`).
    requantized: bool,
}

impl Fp8Weight {
    /// `served_scale`: the scale that vLLM requantizes a per-tensor weight to, asked once the
    /// weight's own tensors are checked (`None`: its own).
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        (out, inp): (usize, usize),
        scheme: &LayerScheme,
        served_scale: impl FnOnce() -> std::result::Result<Option<f32>, LoadError>,
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let block = match scheme.weights.strategy {
            Strategy::Tensor => (out, inp),
            Strategy::Channel => (1, inp),
            _ => {
                let [br, bc] = scheme.weights.block_structure.expect("checked at parse");
                (br, bc)
            }
        };
        let scale_name = format!("{name}.{}", scale_tensor(scheme.format));
        let expected = [out.div_ceil(block.0), inp.div_ceil(block.1)];
        let scale = ckpt.tensor(&scale_name, SCALE_DTYPES, None, &Device::Cpu)?;
        let scale_bits = (scale.dtype().size_in_bytes() * 8) as f64;
        // A per-tensor scale may be stored as [1] or [] as well as [1, 1].
        let ok = scale.dims() == expected || (expected == [1, 1] && scale.elem_count() == 1);
        if !ok {
            return Err(LoadError::WrongShape {
                name: scale_name,
                found: scale.dims().to_vec(),
                expected: expected.to_vec(),
            });
        }
        if scheme.weights.power_of_two_scales {
            // `scale_fmt: ue8m0` declares powers of two; other scales would be requantized by
            // the serving kernels (not emulated): a mislabelled checkpoint.
            let values = to_f32_vec(&scale)?;
            if let Some(i) = values.iter().position(|&v| !is_power_of_two(v)) {
                return Err(LoadError::BadTensor {
                    name: scale_name,
                    reason: format!(
                        "`scale_fmt: ue8m0` but scale {i} is {:e}, not a power of two",
                        values[i]
                    ),
                });
            }
        }
        // One scale for the fused layer this shard belongs to, its codes requantized to it,
        // as vLLM serves them (`super::fused_shards`); read once, after the scale is checked.
        let served_scale = served_scale()?;
        let requantized = served_scale.is_some();
        let (weight, scale) = match served_scale {
            Some(max) => {
                let own = to_f32_vec(&scale)?[0];
                let codes =
                    fused_shards::requantized_weight(ckpt, name, (out, inp), (own, max), device)?;
                (codes, Tensor::new(&[max], device)?)
            }
            None => (
                ckpt.tensor(
                    &format!("{name}.weight"),
                    &[StDtype::F8_E4M3],
                    Some(&[out, inp]),
                    device,
                )?,
                scale
                    .flatten_all()?
                    .to_dtype(DType::F32)?
                    .to_device(device)?,
            ),
        };
        Ok(Self {
            out,
            inp,
            weight,
            scale,
            block,
            stored_bits: 8.0 + scale_bits / (block.0 * block.1) as f64,
            format: scheme.format,
            strategy: scheme.weights.strategy,
            power_of_two_scales: scheme.weights.power_of_two_scales,
            requantized,
        })
    }
}

/// A positive normal power of two (UE8M0's values).
fn is_power_of_two(v: f32) -> bool {
    v.is_normal() && v > 0.0 && v.to_bits() & 0x007f_ffff == 0
}

impl QuantizedWeight for Fp8Weight {
    fn shape(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    fn describe(&self) -> String {
        // By strategy: a 128x128 block of a [128, 128] weight is still a block.
        let how = match (self.strategy, self.block) {
            (Strategy::Tensor, _) => "tensor".to_string(),
            (Strategy::Channel, _) => "channel".to_string(),
            (_, (r, c)) => format!("block {r}x{c}"),
        };
        let source = match self.format {
            Format::HfFp8 => "hf",
            Format::ModeloptFp8 => "modelopt",
            _ => "float-quantized",
        };
        let ue8m0 = match self.power_of_two_scales {
            true => " (ue8m0 scales)",
            false => "",
        };
        let requantized = match self.requantized {
            true => " (requantized to the fused layer's scale, as vLLM serves it)",
            false => "",
        };
        format!("{source} fp8 e4m3 {how}{ue8m0}{requantized}")
    }

    fn bits_per_weight(&self) -> f64 {
        self.stored_bits
    }

    fn dequantize_f32(&self) -> Result<Vec<f32>> {
        let codes = self.weight.flatten_all()?.to_vec1::<u8>()?;
        let scale = to_f32_vec(&self.scale)?;
        let scale_cols = self.inp.div_ceil(self.block.1);
        let mut w = Vec::with_capacity(codes.len());
        for r in 0..self.out {
            for c in 0..self.inp {
                let s = scale[(r / self.block.0) * scale_cols + c / self.block.1];
                w.push(fp8_e4m3_to_f32(codes[r * self.inp + c]) * s);
            }
        }
        Ok(w)
    }

    fn packed(&self) -> Option<Packed<'_>> {
        Some(Packed::Fp8 {
            weight: &self.weight,
            scale: &self.scale,
            block: self.block,
        })
    }
}

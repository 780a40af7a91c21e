//! NVFP4 weights: fp4 e2m1 codes (two per byte, low nibble first), one fp8 e4m3 scale per 16
//! weights, and an f32 per-tensor scale, in two spellings:
//!
//! * compressed-tensors `nvfp4-pack-quantized`: codes in `weight_packed`, a global scale that
//!   divides (`weight_global_scale`): `w = bf16(fp4(code) * (f32(fp8(scale)) / global))`;
//!   compressed-tensors always produces bf16 here, so the f32 reference is rounded to bf16 too.
//! * ModelOpt (`super::modelopt`): codes in `weight`, a scale that multiplies
//!   (`weight_scale_2`): `w = fp4(code) * (f32(fp8(scale)) * weight_scale_2)` in f32, as
//!   ModelOpt's `NVFP4QTensor` dequantizes (per-block scale first), not rounded to bf16.

use candle_core::{Device, Result, Tensor};
use safetensors::Dtype as StDtype;

use super::minifloat::{bf16_round, fp4_e2m1_to_f32, fp8_e4m3_to_f32};
use super::{load_scalar, QuantizedWeight};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::{Nvfp4PerTensor, Packed};

pub const GROUP: usize = 16;

pub struct Nvfp4Weight {
    out: usize,
    inp: usize,
    packed: Tensor,
    scale: Tensor,
    per_tensor: Nvfp4PerTensor,
}

/// `{name}.{codes}`: fp4 codes two per byte `[out, in / 2]` (NVFP4's and MXFP4's packing), for
/// `in` a multiple of the scale `group`.
pub(crate) fn load_fp4_codes(
    ckpt: &Checkpoint,
    name: &str,
    codes: &str,
    (out, inp): (usize, usize),
    group: usize,
    device: &Device,
) -> std::result::Result<Tensor, LoadError> {
    if inp % group != 0 {
        return Err(LoadError::Unsupported {
            layer: name.into(),
            field: "weights.group_size".into(),
            reason: format!("in_features {inp} is not a multiple of {group}"),
        });
    }
    ckpt.tensor(
        &format!("{name}.{codes}"),
        &[StDtype::U8],
        Some(&[out, inp / 2]),
        device,
    )
}

impl Nvfp4Weight {
    /// compressed-tensors' spelling: `weight_packed`, `weight_scale`, `weight_global_scale`.
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        shape: (usize, usize),
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let global = load_scalar(ckpt, &format!("{name}.weight_global_scale"))?;
        super::fused_shards::warn_if_global_scales_differ(ckpt, name, "weight_global_scale");
        Self::load_codes(
            ckpt,
            name,
            "weight_packed",
            shape,
            Nvfp4PerTensor::Divides(global),
            device,
        )
    }

    /// ModelOpt's spelling: `weight`, `weight_scale`, `weight_scale_2`.
    pub fn load_modelopt(
        ckpt: &Checkpoint,
        name: &str,
        shape: (usize, usize),
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let scale_2 = load_scalar(ckpt, &format!("{name}.weight_scale_2"))?;
        super::fused_shards::warn_if_global_scales_differ(ckpt, name, "weight_scale_2");
        Self::load_codes(
            ckpt,
            name,
            "weight",
            shape,
            Nvfp4PerTensor::Multiplies(scale_2),
            device,
        )
    }

    fn load_codes(
        ckpt: &Checkpoint,
        name: &str,
        codes: &str,
        (out, inp): (usize, usize),
        per_tensor: Nvfp4PerTensor,
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let packed = load_fp4_codes(ckpt, name, codes, (out, inp), GROUP, device)?;
        let scale = ckpt.tensor(
            &format!("{name}.weight_scale"),
            &[StDtype::F8_E4M3],
            Some(&[out, inp / GROUP]),
            device,
        )?;
        Ok(Self {
            out,
            inp,
            packed,
            scale,
            per_tensor,
        })
    }
}

impl QuantizedWeight for Nvfp4Weight {
    fn shape(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    fn describe(&self) -> String {
        let source = match self.per_tensor {
            Nvfp4PerTensor::Divides(_) => "nvfp4-pack-quantized",
            Nvfp4PerTensor::Multiplies(_) => "modelopt nvfp4",
        };
        format!("{source} fp4 e2m1 g16 (fp8 scales)")
    }

    fn bits_per_weight(&self) -> f64 {
        4.0 + 8.0 / GROUP as f64
    }

    fn dequantize_f32(&self) -> Result<Vec<f32>> {
        let bytes = self.packed.flatten_all()?.to_vec1::<u8>()?;
        let scales: Vec<f32> = self
            .scale
            .flatten_all()?
            .to_vec1::<u8>()?
            .into_iter()
            .map(|b| match self.per_tensor {
                Nvfp4PerTensor::Divides(g) => fp8_e4m3_to_f32(b) / g,
                Nvfp4PerTensor::Multiplies(m) => fp8_e4m3_to_f32(b) * m,
            })
            .collect();
        let round = match self.per_tensor {
            Nvfp4PerTensor::Divides(_) => bf16_round,
            Nvfp4PerTensor::Multiplies(_) => std::convert::identity,
        };
        let groups = self.inp / GROUP;
        let mut w = Vec::with_capacity(self.out * self.inp);
        for r in 0..self.out {
            for c in 0..self.inp {
                let byte = bytes[(r * self.inp + c) / 2];
                let nibble = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                let s = scales[r * groups + c / GROUP];
                w.push(round(fp4_e2m1_to_f32(nibble) * s));
            }
        }
        Ok(w)
    }

    fn packed(&self) -> Option<Packed<'_>> {
        Some(Packed::Nvfp4 {
            packed: &self.packed,
            scale: &self.scale,
            per_tensor: self.per_tensor,
        })
    }
}

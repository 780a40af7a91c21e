//! `nvfp4-pack-quantized`: fp4 e2m1 codes (two per byte, low nibble first), one fp8 e4m3 scale
//! per 16 weights, and an f32 global scale that divides.
//!
//! `w = bf16(fp4(code) * (f32(fp8(scale)) / global))`: compressed-tensors always produces bf16
//! here, so the f32 reference is rounded to bf16 too.

use candle_core::{Device, Result, Tensor};
use safetensors::Dtype as StDtype;

use super::minifloat::{bf16_round, fp4_e2m1_to_f32, fp8_e4m3_to_f32};
use super::{load_scalar, QuantizedWeight};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::Packed;

pub const GROUP: usize = 16;

pub struct Nvfp4Weight {
    out: usize,
    inp: usize,
    packed: Tensor,
    scale: Tensor,
    global_scale: f32,
}

/// `{name}.weight_packed`: fp4 codes two per byte `[out, in / 2]` (NVFP4's and MXFP4's
/// packing), for `in` a multiple of the scale `group`.
pub(crate) fn load_fp4_codes(
    ckpt: &Checkpoint,
    name: &str,
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
        &format!("{name}.weight_packed"),
        &[StDtype::U8],
        Some(&[out, inp / 2]),
        device,
    )
}

impl Nvfp4Weight {
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        (out, inp): (usize, usize),
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let packed = load_fp4_codes(ckpt, name, (out, inp), GROUP, device)?;
        let scale = ckpt.tensor(
            &format!("{name}.weight_scale"),
            &[StDtype::F8_E4M3],
            Some(&[out, inp / GROUP]),
            device,
        )?;
        let global_scale = load_scalar(ckpt, &format!("{name}.weight_global_scale"))?;
        Ok(Self {
            out,
            inp,
            packed,
            scale,
            global_scale,
        })
    }

    /// The global scale (a divisor), for GPU kernels that decode the same bytes.
    pub fn global_scale(&self) -> f32 {
        self.global_scale
    }
}

impl QuantizedWeight for Nvfp4Weight {
    fn shape(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    fn describe(&self) -> String {
        "nvfp4-pack-quantized fp4 e2m1 g16 (fp8 scales)".into()
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
            .map(|b| fp8_e4m3_to_f32(b) / self.global_scale)
            .collect();
        let groups = self.inp / GROUP;
        let mut w = Vec::with_capacity(self.out * self.inp);
        for r in 0..self.out {
            for c in 0..self.inp {
                let byte = bytes[(r * self.inp + c) / 2];
                let nibble = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                let s = scales[r * groups + c / GROUP];
                w.push(bf16_round(fp4_e2m1_to_f32(nibble) * s));
            }
        }
        Ok(w)
    }

    fn packed(&self) -> Option<Packed<'_>> {
        Some(Packed::Nvfp4 {
            packed: &self.packed,
            scale: &self.scale,
            global_scale: self.global_scale,
        })
    }
}

//! `mxfp4-pack-quantized` (OCP MXFP4): fp4 e2m1 codes (two per byte, low nibble first, the
//! NVFP4 packing), one UE8M0 scale per 32 weights: a byte `e`, the power of two `2^(e - 127)`.
//!
//! `w = bf16(fp4(code) · 2^(e - 127))`: compressed-tensors decodes in bf16
//! (`decompress_mx_scale`), where the product of two such numbers is exact unless it leaves
//! bf16's range. gpt-oss's native `*_blocks` / `*_scales` tensors hold the same bytes
//! (`[out, in/32, 16]` and `[out, in/32]` per expert, [`load_native_experts`]), which
//! transformers decodes the same way, in bf16.
//!
//! Where the layer's scales span at most 18 octaves (every real checkpoint we know of), they
//! are also held as NVFP4's (an e4m3 power of two per 16 weights over an f32 power-of-two
//! global scale, the same products bit for bit), so the NVFP4 GPU kernel decodes them.

use candle_core::{Device, Result, Tensor};
use safetensors::Dtype as StDtype;

use super::minifloat::{bf16_round, fp4_e2m1_to_f32};
use super::nvfp4::load_fp4_codes;
use super::QuantizedWeight;
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::{Nvfp4PerTensor, Packed};

pub const GROUP: usize = 32;
/// UE8M0's NaN.
const NAN_EXPONENT: u8 = 255;

pub struct Mxfp4Weight {
    out: usize,
    inp: usize,
    packed: Tensor,
    /// UE8M0 exponents `[out, in/32]`, on the CPU.
    exponents: Vec<u8>,
    /// The scales as NVFP4's: e4m3 bytes `[out, in/16]` on the layer's device, and the global
    /// scale that divides them.
    as_nvfp4: Option<(Tensor, f32)>,
    /// gpt-oss's native layout rather than compressed-tensors' (the same bytes).
    native: bool,
}

/// `2^(e - 127)` as an f32 (exact: 2^-127 is an f32 subnormal).
pub fn ue8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(1 << 22),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// Refuses UE8M0's NaN anywhere in the exponents of the tensor `name`.
fn refuse_nan(exponents: &[u8], name: &str) -> std::result::Result<(), LoadError> {
    match exponents.iter().position(|&e| e == NAN_EXPONENT) {
        Some(i) => Err(LoadError::BadTensor {
            name: name.into(),
            reason: format!("element {i} is 255, UE8M0's NaN"),
        }),
        None => Ok(()),
    }
}

impl Mxfp4Weight {
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        (out, inp): (usize, usize),
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        // on the host first: the NVFP4 form of the scales is derived from the codes
        let packed = load_fp4_codes(ckpt, name, "weight_packed", (out, inp), GROUP, &Device::Cpu)?;
        let scale_name = format!("{name}.weight_scale");
        let exponents = ckpt
            .tensor(
                &scale_name,
                &[StDtype::U8],
                Some(&[out, inp / GROUP]),
                &Device::Cpu,
            )?
            .flatten_all()?
            .to_vec1::<u8>()?;
        refuse_nan(&exponents, &scale_name)?;
        let codes = packed.flatten_all()?.to_vec1::<u8>()?;
        Ok(Self::from_host(
            codes,
            exponents,
            (out, inp),
            false,
            device,
        )?)
    }

    /// The weight of `codes` (`[out, in/2]`, two per byte, low nibble first) and `exponents`
    /// (`[out, in/32]`), checked already.
    fn from_host(
        codes: Vec<u8>,
        exponents: Vec<u8>,
        (out, inp): (usize, usize),
        native: bool,
        device: &Device,
    ) -> Result<Self> {
        let as_nvfp4 = nvfp4_scales(&codes, &exponents)
            .map(|(bytes, global)| {
                Tensor::from_vec(bytes, (out, inp / 16), device).map(|t| (t, global))
            })
            .transpose()?;
        Ok(Self {
            out,
            inp,
            packed: Tensor::from_vec(codes, (out, inp / 2), device)?,
            exponents,
            as_nvfp4,
            native,
        })
    }
}

/// gpt-oss's native MXFP4 experts (`quant_method: mxfp4`): `{name}_blocks` uint8 `[experts,
/// out, in/32, 16]` and `{name}_scales` uint8 `[experts, out, in/32]`, each expert's `[out,
/// in]` weight in the bytes of `mxfp4-pack-quantized` (transformers' `convert_moe_packed_tensors`
/// decodes them to bf16, low nibble first, times `2^(scale - 127)`, then transposes to
/// `[experts, in, out]` for its `x @ w`). Each expert's rows are dealt into `parts` weights of
/// `out / parts` rows, row `r` to weight `r % parts` (gpt-oss interleaves gate and up rows).
pub fn load_native_experts(
    ckpt: &Checkpoint,
    name: &str,
    experts: usize,
    (out, inp): (usize, usize),
    parts: usize,
    device: &Device,
) -> std::result::Result<Vec<Vec<Mxfp4Weight>>, LoadError> {
    let blocks_name = format!("{name}_blocks");
    if inp % GROUP != 0 || out % parts != 0 {
        return Err(LoadError::BadTensor {
            name: blocks_name,
            reason: format!(
                "{out} x {inp} weights do not split into {parts} parts of groups of {GROUP}"
            ),
        });
    }
    let groups = inp / GROUP;
    let read = |name: &str, shape: &[usize]| -> std::result::Result<Vec<u8>, LoadError> {
        let t = ckpt.tensor(name, &[StDtype::U8], Some(shape), &Device::Cpu)?;
        Ok(t.flatten_all()?.to_vec1::<u8>()?)
    };
    let blocks = read(&blocks_name, &[experts, out, groups, GROUP / 2])?;
    let scales_name = format!("{name}_scales");
    let scales = read(&scales_name, &[experts, out, groups])?;
    refuse_nan(&scales, &scales_name)?;
    let (row_bytes, rows) = (inp / 2, out / parts);
    (0..experts)
        .map(|e| {
            (0..parts)
                .map(|p| {
                    let picked = (0..rows).map(|r| e * out + r * parts + p);
                    let (mut codes, mut exponents) = (
                        Vec::with_capacity(rows * row_bytes),
                        Vec::with_capacity(rows * groups),
                    );
                    for row in picked {
                        codes.extend_from_slice(&blocks[row * row_bytes..(row + 1) * row_bytes]);
                        exponents.extend_from_slice(&scales[row * groups..(row + 1) * groups]);
                    }
                    Ok(Mxfp4Weight::from_host(
                        codes,
                        exponents,
                        (rows, inp),
                        true,
                        device,
                    )?)
                })
                .collect()
        })
        .collect()
}

/// The e4m3 bytes (two per MXFP4 group) and the global scale that express every scale of a
/// layer as NVFP4 does, exactly, where its groups with a non-zero code span at most the 18
/// powers of two of e4m3 (2^-9 ..= 2^8); groups whose codes are all ±0 take any scale.
fn nvfp4_scales(codes: &[u8], exponents: &[u8]) -> Option<(Vec<u8>, f32)> {
    let group_bytes = GROUP / 2;
    let live = |g: usize| {
        codes[g * group_bytes..(g + 1) * group_bytes]
            .iter()
            .any(|b| b & 0x77 != 0)
    };
    let top = (0..exponents.len())
        .filter(|&g| live(g))
        .map(|g| exponents[g] as i32)
        .max()
        .unwrap_or(127);
    // e4m3 2^8 (byte 0x78) for the largest scale: the global scale is 2^(135 - top).
    let shift = 135 - top;
    if !(-126..=127).contains(&shift) {
        return None;
    }
    let mut bytes = Vec::with_capacity(exponents.len() * 2);
    for (g, &e) in exponents.iter().enumerate() {
        let octave = e as i32 - 127 + shift;
        let byte = match octave {
            _ if !live(g) => 0x08,               // 2^-6: any scale of a group of zeros
            -9..=-7 => 1u8 << (octave + 9),      // subnormals 2^-9 .. 2^-7
            -6..=8 => ((octave + 7) as u8) << 3, // normals: exponent field, zero mantissa
            _ => return None,
        };
        bytes.extend([byte, byte]);
    }
    debug_assert_eq!(bytes.len() * 16, exponents.len() * GROUP);
    Some((bytes, f32::from_bits(((127 + shift) as u32) << 23)))
}

impl QuantizedWeight for Mxfp4Weight {
    fn shape(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    fn describe(&self) -> String {
        match self.native {
            true => "mxfp4 fp4 e2m1 g32 (ue8m0 scales)".into(),
            false => "mxfp4-pack-quantized fp4 e2m1 g32 (ue8m0 scales)".into(),
        }
    }

    fn bits_per_weight(&self) -> f64 {
        4.0 + 8.0 / GROUP as f64
    }

    fn dequantize_f32(&self) -> Result<Vec<f32>> {
        let bytes = self.packed.flatten_all()?.to_vec1::<u8>()?;
        let groups = self.inp / GROUP;
        let mut w = Vec::with_capacity(self.out * self.inp);
        for r in 0..self.out {
            for c in 0..self.inp {
                let byte = bytes[(r * self.inp + c) / 2];
                let nibble = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                let s = ue8m0_to_f32(self.exponents[r * groups + c / GROUP]);
                w.push(bf16_round(fp4_e2m1_to_f32(nibble) * s));
            }
        }
        Ok(w)
    }

    fn packed(&self) -> Option<Packed<'_>> {
        self.as_nvfp4
            .as_ref()
            .map(|(scale, global_scale)| Packed::Nvfp4 {
                packed: &self.packed,
                scale,
                per_tensor: Nvfp4PerTensor::Divides(*global_scale),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::minifloat::fp8_e4m3_to_f32;

    #[test]
    fn ue8m0_decodes_every_exponent_as_a_power_of_two() {
        for e in 0..255u8 {
            assert_eq!(ue8m0_to_f32(e), 2f32.powi(e as i32 - 127), "{e}");
        }
    }

    /// The NVFP4 form of the scales gives the same weights, bit for bit, over a span of 18
    /// octaves, with zero groups anywhere; one more octave is refused.
    #[test]
    fn nvfp4_form_decodes_to_the_same_products() {
        // Every code in every group (nibbles 0..16 twice), groups at exponents 100..=117.
        let codes: Vec<u8> = (0..GROUP)
            .map(|i| (i % 16) as u8 | ((15 - i % 16) << 4) as u8)
            .collect();
        for top in [117u8, 127, 140, 254] {
            let exponents: Vec<u8> = (0..18).map(|k| top - k).collect();
            let all: Vec<u8> = exponents
                .iter()
                .flat_map(|_| codes[..16].to_vec())
                .collect();
            let (bytes, global) = nvfp4_scales(&all, &exponents).expect("representable");
            for (g, &e) in exponents.iter().enumerate() {
                let want = ue8m0_to_f32(e);
                assert_eq!(fp8_e4m3_to_f32(bytes[2 * g]) / global, want, "e {e}");
                assert_eq!(bytes[2 * g], bytes[2 * g + 1]);
            }
            let mut wide = exponents.clone();
            wide.push(top - 18);
            let all: Vec<u8> = wide.iter().flat_map(|_| codes[..16].to_vec()).collect();
            assert!(nvfp4_scales(&all, &wide).is_none());
            // ... unless that group's codes are all ±0 (0x0 and 0x8).
            let mut zeros = all.clone();
            zeros[18 * 16..].fill(0x88);
            assert!(nvfp4_scales(&zeros, &wide).is_some());
        }
    }
}

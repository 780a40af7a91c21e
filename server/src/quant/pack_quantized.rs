//! Integer weights: `pack-quantized` (codes packed into int32 words) and `int-quantized` /
//! `naive-quantized` (one signed byte per code). int4 and int8, symmetric or with zero points,
//! `group` or `channel` strategy.
//!
//! `w[r, c] = (q[r, c] - zp[r, c / group]) * scale[r, c / group]`, exact in f32.

use candle_core::{DType, Device, Result, Tensor};
use safetensors::Dtype as StDtype;

use super::compressed_tensors::{Format, LayerScheme, Strategy};
use super::{to_f32_vec, QuantizedWeight, SCALE_DTYPES};
use crate::checkpoint::{Checkpoint, LoadError};
use crate::ops::Packed;

/// Name of the tensor that holds the codes in `format`.
pub fn codes_tensor(format: Format) -> &'static str {
    if format == Format::PackQuantized {
        "weight_packed"
    } else {
        "weight"
    }
}

/// Both on-disk layouts (and native GPTQ, `super::gptq`) are brought at load into one layout
/// that the CPU reference and the GPU kernel share: codes packed into int32 words along each
/// row (the pack-quantized layout, as stored, so the bulk of the bytes is not touched), scales
/// `[out, groups]` in their stored dtype (f32, bf16 or f16: widened to f32 where they are used,
/// exactly; held in f32 they would add 1/16 byte a weight at group 32) and unpacked signed zero
/// points `[out, groups]`, a byte each where they fit ([`zero_point_tensor`]).
pub struct IntWeight {
    out: usize,
    inp: usize,
    bits: usize,
    group: usize,
    codes: Tensor,
    scale: Tensor,
    zero_point: Option<Tensor>,
    symmetric: bool,
    /// Act-order: the group of each input column (`[in]`, u32) where it is not `column / group`.
    g_idx: Option<Tensor>,
    /// Bits per weight as stored on disk (scale dtype and zero points included).
    stored_bits: f64,
    /// What `describe` says before the grouping: `int4`, or `gptq int3` for a GPTQ checkpoint
    /// whose 3-bit codes are held here as int4.
    label: String,
}

/// The parts of an [`IntWeight`] built by another format's loader (`super::gptq`).
pub(crate) struct IntParts {
    pub shape: (usize, usize),
    /// Width of the codes as held in `codes` (4 or 8).
    pub bits: usize,
    pub group: usize,
    /// Signed codes (the `2^(bits-1)` offset removed), row-major `[out, in]`.
    pub codes: Vec<i32>,
    /// `[out, groups]`.
    pub scale: Vec<f32>,
    /// The dtype the checkpoint stores the scales in: each value of `scale` is one of it, so
    /// the weight holds them in it, exactly.
    pub scale_dtype: DType,
    /// Signed zero points `[out, groups]`; `None` when all are zero.
    pub zero_point: Option<Vec<i32>>,
    pub g_idx: Option<Vec<u32>>,
    pub symmetric: bool,
    pub stored_bits: f64,
    pub label: String,
}

/// Unpacks `count` codes of `bits` bits from little-endian int32 words, lowest bits first,
/// removing the `2^(bits-1)` offset.
pub fn unpack_int32(words: &[i32], bits: usize, count: usize) -> Vec<i32> {
    let mask = (1u32 << bits) - 1;
    let offset = 1i32 << (bits - 1);
    (0..count)
        .map(|j| {
            let word = words[(j * bits) / 32] as u32;
            ((word >> ((j * bits) % 32)) & mask) as i32 - offset
        })
        .collect()
}

/// Inverse of [`unpack_int32`] (used by tests and by tools that write checkpoints).
pub fn pack_int32(values: &[i32], bits: usize) -> Vec<i32> {
    let mut words = vec![0u32; (values.len() * bits).div_ceil(32)];
    let offset = 1i32 << (bits - 1);
    let mask = (1u32 << bits) - 1;
    for (j, &v) in values.iter().enumerate() {
        words[(j * bits) / 32] |= (((v + offset) as u32) & mask) << ((j * bits) % 32);
    }
    words.into_iter().map(|w| w as i32).collect()
}

impl IntWeight {
    pub fn load(
        ckpt: &Checkpoint,
        name: &str,
        (out, inp): (usize, usize),
        scheme: &LayerScheme,
        device: &Device,
    ) -> std::result::Result<Self, LoadError> {
        let args = &scheme.weights;
        let bits = args.num_bits as usize;
        let group = match args.strategy {
            Strategy::Channel => inp,
            _ => args.group_size.unwrap_or(inp),
        };
        if inp % group != 0 {
            return Err(LoadError::Unsupported {
                layer: name.into(),
                field: "weights.group_size".into(),
                reason: format!("{group} does not divide in_features {inp}"),
            });
        }
        let groups = inp / group;
        let cpu = &Device::Cpu;
        let packed = scheme.format == Format::PackQuantized;
        let codes = if packed {
            let cols = (inp * bits).div_ceil(32);
            ckpt.tensor(
                &format!("{name}.weight_packed"),
                &[StDtype::I32],
                Some(&[out, cols]),
                device,
            )?
        } else {
            let bytes = ckpt.tensor(
                &format!("{name}.weight"),
                &[StDtype::I8],
                Some(&[out, inp]),
                cpu,
            )?;
            let codes = signed_bytes(&bytes)?;
            // One byte per code holds any width: a code outside `bits` means mislabelled bits.
            let (lo, hi) = (-(1i32 << (bits - 1)), (1i32 << (bits - 1)) - 1);
            if let Some(i) = codes.iter().position(|c| !(lo..=hi).contains(c)) {
                return Err(LoadError::BadTensor {
                    name: format!("{name}.weight"),
                    reason: format!(
                        "code {} at element {i} is outside the {bits}-bit range [{lo}, {hi}] \
                         that weights.num_bits declares",
                        codes[i]
                    ),
                });
            }
            let words: Vec<i32> = codes
                .chunks(inp)
                .flat_map(|row| pack_int32(row, bits))
                .collect();
            let cols = words.len() / out;
            Tensor::from_vec(words, (out, cols), device)?
        };
        let raw_scale = ckpt.tensor(
            &format!("{name}.weight_scale"),
            SCALE_DTYPES,
            Some(&[out, groups]),
            cpu,
        )?;
        let scale_bits = (raw_scale.dtype().size_in_bytes() * 8) as f64;
        let scale = raw_scale.to_device(device)?;
        let zp_name = format!("{name}.weight_zero_point");
        let zero_point = match (args.symmetric, packed) {
            (true, _) => None,
            (false, true) => {
                let rows = (out * bits).div_ceil(32);
                let words = ckpt.tensor(&zp_name, &[StDtype::I32], Some(&[rows, groups]), cpu)?;
                Some(unpack_zero_points(&words, bits, out, groups)?)
            }
            (false, false) => {
                let bytes = ckpt.tensor(&zp_name, &[StDtype::I8], Some(&[out, groups]), cpu)?;
                Some(signed_bytes(&bytes)?)
            }
        }
        .map(|zp| zero_point_tensor(zp, (out, groups), device))
        .transpose()?;
        let zp_bits = if zero_point.is_some() {
            bits as f64
        } else {
            0.0
        };
        // `actorder: group`: the group of each input in `weight_g_idx` (compressed-tensors
        // before 0.19 wrote it; column c uses the scale of group g_idx[c]).
        let g_idx = match args.actorder {
            true => {
                super::gptq::load_g_idx(ckpt, &format!("{name}.weight_g_idx"), inp, group, true)?
            }
            false => None,
        }
        .map(|g| Tensor::from_vec(g, inp, device))
        .transpose()?;
        let shape_name = format!("{name}.weight_shape");
        if ckpt.contains(&shape_name) {
            let stored = ckpt
                .tensor(
                    &shape_name,
                    &[StDtype::I64, StDtype::I32],
                    Some(&[2]),
                    &Device::Cpu,
                )?
                .to_dtype(candle_core::DType::I64)?
                .to_vec1::<i64>()?;
            if stored != [out as i64, inp as i64] {
                return Err(LoadError::BadTensor {
                    name: shape_name,
                    reason: format!("says {stored:?}, the model config implies [{out}, {inp}]"),
                });
            }
        }
        Ok(Self {
            out,
            inp,
            bits,
            group,
            codes,
            scale,
            symmetric: zero_point.is_none(),
            zero_point,
            g_idx,
            stored_bits: bits as f64 + (scale_bits + zp_bits) / group as f64,
            label: format!("int{bits}"),
        })
    }

    /// The weight of `parts`, its codes packed along each row, on `device`.
    pub(crate) fn from_parts(parts: IntParts, device: &Device) -> Result<Self> {
        let (out, inp) = parts.shape;
        let groups = parts.scale.len() / out.max(1);
        let words: Vec<i32> = parts
            .codes
            .chunks(inp)
            .flat_map(|row| pack_int32(row, parts.bits))
            .collect();
        let cols = words.len() / out.max(1);
        Ok(Self {
            out,
            inp,
            bits: parts.bits,
            group: parts.group,
            codes: Tensor::from_vec(words, (out, cols), device)?,
            scale: Tensor::from_vec(parts.scale, (out, groups), &Device::Cpu)?
                .to_dtype(parts.scale_dtype)?
                .to_device(device)?,
            zero_point: parts
                .zero_point
                .map(|zp| zero_point_tensor(zp, (out, groups), device))
                .transpose()?,
            symmetric: parts.symmetric,
            g_idx: parts
                .g_idx
                .map(|g| Tensor::from_vec(g, inp, device))
                .transpose()?,
            stored_bits: parts.stored_bits,
            label: parts.label,
        })
    }

    /// Signed codes, row-major `[out, in]`.
    fn codes(&self) -> Result<Vec<i32>> {
        let words = self.codes.flatten_all()?.to_vec1::<i32>()?;
        let cols = words.len() / self.out;
        let mut q = Vec::with_capacity(self.out * self.inp);
        for row in words.chunks(cols) {
            q.extend(unpack_int32(row, self.bits, self.inp));
        }
        Ok(q)
    }
}

/// Signed zero points `[out, groups]` as the weight holds them: a byte each (u8 holding the i8)
/// where every one fits, as every 4-bit weight's and most 8-bit ones' do, else i32 (GPTQ v1's
/// 8-bit off-by-one reaches 128). The kernels read either (`cuda::dequant`).
fn zero_point_tensor(zp: Vec<i32>, shape: (usize, usize), device: &Device) -> Result<Tensor> {
    match zp.iter().all(|z| i8::try_from(*z).is_ok()) {
        true => {
            let bytes: Vec<u8> = zp.into_iter().map(|z| z as i8 as u8).collect();
            Tensor::from_vec(bytes, shape, device)
        }
        false => Tensor::from_vec(zp, shape, device),
    }
}

/// The values of [`zero_point_tensor`], row-major.
fn zero_points_i32(zp: &Tensor) -> Result<Vec<i32>> {
    let flat = zp.flatten_all()?;
    match flat.dtype() {
        DType::U8 => Ok(flat
            .to_vec1::<u8>()?
            .into_iter()
            .map(|b| b as i8 as i32)
            .collect()),
        _ => flat.to_vec1::<i32>(),
    }
}

/// Zero points packed along dim 0 (column g of the word matrix holds the zero points of every
/// output row for group g) → row-major `[out, groups]`.
fn unpack_zero_points(words: &Tensor, bits: usize, out: usize, groups: usize) -> Result<Vec<i32>> {
    let words = words.flatten_all()?.to_vec1::<i32>()?;
    let rows = words.len() / groups;
    let mut zp = vec![0; out * groups];
    for g in 0..groups {
        let column: Vec<i32> = (0..rows).map(|r| words[r * groups + g]).collect();
        for (r, v) in unpack_int32(&column, bits, out).into_iter().enumerate() {
            zp[r * groups + g] = v;
        }
    }
    Ok(zp)
}

fn signed_bytes(t: &Tensor) -> Result<Vec<i32>> {
    Ok(t.flatten_all()?
        .to_vec1::<u8>()?
        .into_iter()
        .map(|b| b as i8 as i32)
        .collect())
}

impl QuantizedWeight for IntWeight {
    fn shape(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    fn describe(&self) -> String {
        let sym = if self.symmetric { "sym" } else { "asym" };
        let grouping = if self.group == self.inp {
            "channel".to_string()
        } else {
            format!("g{}", self.group)
        };
        let order = if self.g_idx.is_some() {
            " act-order"
        } else {
            ""
        };
        format!("{} {grouping} {sym}{order}", self.label)
    }

    fn bits_per_weight(&self) -> f64 {
        self.stored_bits
    }

    fn dequantize_f32(&self) -> Result<Vec<f32>> {
        let q = self.codes()?;
        let groups = self.scale.dim(1)?;
        let zp = match &self.zero_point {
            Some(zp) => zero_points_i32(zp)?,
            None => vec![0; self.out * groups],
        };
        let scale = to_f32_vec(&self.scale)?;
        let column_group: Vec<usize> = match &self.g_idx {
            Some(g_idx) => g_idx
                .to_vec1::<u32>()?
                .into_iter()
                .map(|g| g as usize)
                .collect(),
            None => (0..self.inp).map(|c| c / self.group).collect(),
        };
        let mut w = Vec::with_capacity(q.len());
        for r in 0..self.out {
            for (c, &group) in column_group.iter().enumerate() {
                let g = r * groups + group;
                w.push((q[r * self.inp + c] - zp[g]) as f32 * scale[g]);
            }
        }
        Ok(w)
    }

    fn packed(&self) -> Option<Packed<'_>> {
        Some(Packed::Int {
            codes: &self.codes,
            scale: &self.scale,
            zero_point: self.zero_point.as_ref(),
            g_idx: self.g_idx.as_ref(),
            bits: self.bits,
            group: self.group,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn int4_pack_then_unpack_is_identity(values in prop::collection::vec(-8i32..8, 1..70)) {
            prop_assert_eq!(unpack_int32(&pack_int32(&values, 4), 4, values.len()), values);
        }

        #[test]
        fn int8_pack_then_unpack_is_identity(values in prop::collection::vec(-128i32..128, 1..70)) {
            prop_assert_eq!(unpack_int32(&pack_int32(&values, 8), 8, values.len()), values);
        }
    }

    #[test]
    fn int4_layout_matches_the_spec_low_nibble_first() {
        // Element 0 in the lowest bits: codes 0x1 (q=-7) then 0xF (q=7).
        let word = 0x0000_00F1u32 as i32;
        assert_eq!(unpack_int32(&[word], 4, 2), vec![-7, 7]);
    }
}

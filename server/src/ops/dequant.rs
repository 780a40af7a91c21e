//! The dequant family: compressed weights decoded to the compute dtype (a GPU kernel per packed
//! format, checked bit for bit against the formats' CPU specifications in `quant`), the GEMM
//! that decodes int4 experts inside the product, and the activation QDQ of quantized Linears'
//! inputs (its CPU reference is here).

use candle_core::{DType, Device, Result, Tensor};

use super::minifloat::{round_to_fp4_e2m1, round_to_fp8_e4m3, FP4_E2M1_MAX, FP8_E4M3_MAX};

/// A stack of pack-quantized weights as the GPU kernels take them: (codes, scales, zero points).
pub type IntWeights<'a> = [(&'a Tensor, &'a Tensor, Option<&'a Tensor>)];

super::gpu_entry_points!(dequant {
    fn qdq_fp8(x: &Tensor, static_scale: Option<f32>) -> Result<Tensor>;
    fn qdq_nvfp4(x: &Tensor, global_scale: f32) -> Result<Tensor>;
    fn qdq_int8_token(x: &Tensor) -> Result<Tensor>;
    fn qdq_fp8_group(x: &Tensor, group: usize, power_of_two: bool) -> Result<Tensor>;
    fn qdq_fp8_heads(
        x: &Tensor,
        heads: usize,
        inner: usize,
        scales: &Tensor,
        absmax: bool,
    ) -> Result<Tensor>;
    fn dequant_int(
        codes: &Tensor,
        scales: &Tensor,
        zero_points: Option<&Tensor>,
        g_idx: Option<&Tensor>,
        shape: (usize, usize),
        bits: usize,
        group: usize,
        dtype: DType,
    ) -> Result<Tensor>;
    fn dequant_int_stacked(
        weights: &IntWeights<'_>,
        shape: (usize, usize),
        bits: usize,
        group: usize,
        dtype: DType,
    ) -> Result<Option<Tensor>>;
    fn int4_gemm_applies(
        weights: &IntWeights<'_>,
        shape: (usize, usize),
        bits: usize,
        group: usize,
        dtype: DType,
    ) -> Result<bool>;
    fn matmul_t_int4_stacked_into_rows(
        out: &Tensor,
        row0: usize,
        x: &Tensor,
        weights: &IntWeights<'_>,
        rows: &[usize],
        shape: (usize, usize),
        group: usize,
        tile_rows: Option<usize>,
    ) -> Result<()>;
    fn matmul_t_int4_tiled_into_rows(
        out: &Tensor,
        row0: usize,
        x: &Tensor,
        weights: &IntWeights<'_>,
        plan: (&Tensor, &Tensor, usize),
        shape: (usize, usize),
        group: usize,
        tile_rows: usize,
    ) -> Result<()>;
    /// `per_tensor`: the scale, and whether it multiplies (ModelOpt) or divides.
    fn dequant_nvfp4(
        packed: &Tensor,
        scales: &Tensor,
        per_tensor: (f32, bool),
        shape: (usize, usize),
        dtype: DType,
    ) -> Result<Tensor>;
    fn dequant_fp8(
        weight: &Tensor,
        scales: &Tensor,
        shape: (usize, usize),
        block: (usize, usize),
        dtype: DType,
    ) -> Result<Tensor>;
});

#[derive(Debug, Clone, PartialEq)]
pub enum ActivationQdq {
    /// fp8 e4m3, one dynamic scale per token (row).
    Fp8PerToken,
    /// fp8 e4m3, one static scale (`input_scale`).
    Fp8Static { scale: f32 },
    /// fp8 e4m3, one dynamic scale per token and `group` inputs, as vLLM's
    /// `per_token_group_quant_fp8` computes it for block-FP8 Linears; with `power_of_two`, the
    /// scale rounded up to a power of two (UE8M0).
    Fp8PerTokenGroup { group: usize, power_of_two: bool },
    /// NVFP4: fp4 e2m1 per 16 values, fp8 group scales against a static global scale.
    Nvfp4 { global_scale: f32 },
    /// int8, one dynamic symmetric scale per token, as vLLM's `dynamic_scaled_int8_quant`
    /// computes it for W8A8-INT8 Linears.
    Int8PerToken,
}

/// Smallest scale compressed-tensors allows (f32 epsilon).
const MIN_SCALE: f32 = f32::EPSILON;
/// vLLM's floor of a token group's absmax (`per_token_group_quant_fp8`'s `eps`).
const VLLM_GROUP_EPS: f32 = 1e-10;
/// Replacement for an NVFP4 group scale that rounds to zero.
const NVFP4_ZERO_SCALE: f32 = 0.125;

impl ActivationQdq {
    pub fn describe(&self) -> &'static str {
        match self {
            Self::Fp8PerToken => "fp8 e4m3 per-token dynamic",
            Self::Fp8Static { .. } => "fp8 e4m3 per-tensor static",
            Self::Fp8PerTokenGroup {
                power_of_two: false,
                ..
            } => "fp8 e4m3 per-token-group dynamic",
            Self::Fp8PerTokenGroup {
                power_of_two: true, ..
            } => "fp8 e4m3 per-token-group dynamic (ue8m0 scales)",
            Self::Nvfp4 { .. } => "nvfp4 g16",
            Self::Int8PerToken => "int8 per-token dynamic",
        }
    }

    /// QDQ of `x` (`[tokens, k]`, any float dtype), computed in f32 and returned in x's dtype
    /// (see [`activation_qdq`]).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        activation_qdq(x, self)
    }

    /// QDQ of one token's activations, in place.
    pub fn qdq_row(&self, row: &mut [f32]) {
        match *self {
            Self::Fp8PerToken => qdq_fp8(row, fp8_token_scale(row)),
            Self::Fp8Static { scale } => qdq_fp8(row, scale),
            Self::Fp8PerTokenGroup {
                group,
                power_of_two,
            } => {
                for part in row.chunks_mut(group) {
                    let scale = fp8_group_scale(part, power_of_two);
                    qdq_fp8(part, scale);
                }
            }
            Self::Nvfp4 { global_scale } => {
                for group in row.chunks_mut(16) {
                    qdq_nvfp4_group(group, global_scale);
                }
            }
            Self::Int8PerToken => qdq_int8_token(row),
        }
    }
}

/// The smallest power of two at least `s` (a positive normal f32): `2^ceil(log2 s)`, exact
/// (a set mantissa carries into the exponent).
pub fn ceil_power_of_two(s: f32) -> f32 {
    f32::from_bits((s.to_bits() + 0x007f_ffff) & 0xff80_0000)
}

/// The scale of one token's group of inputs, as vLLM's `per_token_group_quant_fp8` computes
/// it: max(absmax, 1e-10) / 448, rounded up to a power of two (UE8M0) where `power_of_two`.
pub fn fp8_group_scale(part: &[f32], power_of_two: bool) -> f32 {
    let scale = absmax(part).max(VLLM_GROUP_EPS) / FP8_E4M3_MAX;
    match power_of_two {
        true => ceil_power_of_two(scale),
        false => scale,
    }
}

/// The per-token fp8 scale of a row: absmax / 448, or f32 epsilon for a row of zeros.
pub fn fp8_token_scale(row: &[f32]) -> f32 {
    let scale = absmax(row) / FP8_E4M3_MAX;
    if scale == 0.0 {
        MIN_SCALE
    } else {
        scale
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

/// vLLM's `dynamic_scaled_int8_quant_kernel` (csrc/quantization/compressed_tensors/
/// int8_quant_kernels.cu) followed by the dequantization its GEMM's epilogue applies: scale =
/// absmax / 127, q = `cvt.rni.sat.s8`(x · (127 / absmax)) (a product by the reciprocal, not a
/// division; nearest even; saturated to [-128, 127]), x' = q · scale. An all-zero row gives
/// NaN products there (0 · inf), which the conversion turns into 0.
fn qdq_int8_token(row: &mut [f32]) {
    let absmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = absmax / 127.0;
    let reciprocal = 127.0 / absmax;
    for v in row {
        let q = (*v * reciprocal).round_ties_even();
        let q = if q.is_nan() {
            0.0
        } else {
            q.clamp(-128.0, 127.0)
        };
        *v = q * scale;
    }
}

/// `qdq` of `x` (`[tokens, k]`, any float dtype), computed in f32 and returned in x's dtype:
/// one kernel on a GPU; row by row on the CPU ([`ActivationQdq::qdq_row`]).
pub fn activation_qdq(x: &Tensor, qdq: &ActivationQdq) -> Result<Tensor> {
    if x.device().is_cuda() {
        match *qdq {
            ActivationQdq::Fp8PerToken => return gpu::qdq_fp8(x, None),
            ActivationQdq::Fp8Static { scale } => return gpu::qdq_fp8(x, Some(scale)),
            ActivationQdq::Nvfp4 { global_scale } => return gpu::qdq_nvfp4(x, global_scale),
            ActivationQdq::Fp8PerTokenGroup {
                group,
                power_of_two,
            } => return gpu::qdq_fp8_group(x, group, power_of_two),
            ActivationQdq::Int8PerToken => return gpu::qdq_int8_token(x),
        }
    }
    let (rows, k) = x.dims2()?;
    let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for row in values.chunks_mut(k) {
        qdq.qdq_row(row);
    }
    Tensor::from_vec(values, (rows, k), &Device::Cpu)?
        .to_device(x.device())?
        .to_dtype(x.dtype())
}

/// The fp8 e4m3 scales of [`fp8_head_qdq`]: one per head of the head axis.
#[derive(Debug, Clone, PartialEq)]
pub enum HeadScales {
    /// Static scales: one for every head, or one per head.
    Static(Vec<f32>),
    /// Each head's `absmax / 448` over the whole tensor (f32 epsilon for an all-zero head).
    AbsMax,
}

/// fp8 e4m3 QDQ of `x` per head along `head_axis`: `x / s` clamped to ±448 (a saturating
/// conversion), rounded to e4m3 (ties to even), times `s`; computed in f32 and returned in x's
/// dtype. The KV cache's quantization (`model::blocks::attention`).
pub fn fp8_head_qdq(x: &Tensor, head_axis: usize, scales: &HeadScales) -> Result<Tensor> {
    let dims = x.dims();
    let heads = dims[head_axis];
    let inner: usize = dims[head_axis + 1..].iter().product();
    if x.device().is_cuda() {
        return match scales {
            // One static scale: any split into rows is the same QDQ, with the scale an argument.
            HeadScales::Static(s) if s.len() == 1 => {
                let k = *dims.last().unwrap_or(&1);
                let rows = x.elem_count() / k.max(1);
                gpu::qdq_fp8(&x.reshape((rows, k))?, Some(s[0]))?.reshape(x.shape())
            }
            HeadScales::Static(s) if s.len() == heads => {
                let s = Tensor::from_slice(s, heads, x.device())?;
                gpu::qdq_fp8_heads(x, heads, inner, &s, false)
            }
            HeadScales::Static(s) => candle_core::bail!("{} scales for {heads} heads", s.len()),
            HeadScales::AbsMax => {
                // Each head's absmax over the tensor, on the device (a max: exact in any order).
                let outer = x.elem_count() / (heads * inner).max(1);
                let amax = x
                    .reshape((outer, heads, inner))?
                    .abs()?
                    .max(2)?
                    .max(0)?
                    .to_dtype(DType::F32)?;
                gpu::qdq_fp8_heads(x, heads, inner, &amax, true)
            }
        };
    }
    let mut values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let per_head: Vec<f32> = match scales {
        HeadScales::Static(s) if s.len() == 1 => vec![s[0]; heads],
        HeadScales::Static(s) if s.len() == heads => s.clone(),
        HeadScales::Static(s) => candle_core::bail!("{} scales for {heads} heads", s.len()),
        HeadScales::AbsMax => {
            let mut amax = vec![0f32; heads];
            for (i, chunk) in values.chunks(inner).enumerate() {
                amax[i % heads] = amax[i % heads].max(absmax(chunk));
            }
            amax.iter()
                .map(|&a| match a / FP8_E4M3_MAX {
                    0.0 => MIN_SCALE,
                    s => s,
                })
                .collect()
        }
    };
    for (i, chunk) in values.chunks_mut(inner).enumerate() {
        qdq_fp8(chunk, per_head[i % heads]);
    }
    Tensor::from_vec(values, x.shape(), &Device::Cpu)?
        .to_device(x.device())?
        .to_dtype(x.dtype())
}

/// How an NVFP4 weight's per-tensor scale applies to its fp8 group scales.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Nvfp4PerTensor {
    /// compressed-tensors' `weight_global_scale`: divides; the weight rounded to bf16.
    Divides(f32),
    /// ModelOpt's `weight_scale_2`: multiplies; the weight kept in f32.
    Multiplies(f32),
}

/// A quantized weight's tensors as its GPU dequantization kernel reads them.
pub enum Packed<'a> {
    /// pack-quantized int4/int8 words, scales `[out, groups]` (f32, bf16 or f16, as stored),
    /// signed zero points (u8 holding i8 where they fit, else i32); with act-order, the group
    /// of each input column (`g_idx`, u32 `[in]`) instead of `c / group`.
    Int {
        codes: &'a Tensor,
        scale: &'a Tensor,
        zero_point: Option<&'a Tensor>,
        g_idx: Option<&'a Tensor>,
        bits: usize,
        group: usize,
    },
    /// fp4 codes two per byte, fp8 scales per 16 weights, the per-tensor scale.
    Nvfp4 {
        packed: &'a Tensor,
        scale: &'a Tensor,
        per_tensor: Nvfp4PerTensor,
    },
    /// fp8 codes, f32 scales per `block` (rows, columns).
    Fp8 {
        weight: &'a Tensor,
        scale: &'a Tensor,
        block: (usize, usize),
    },
}

/// The weight `[out, in]` of `packed` in `dtype`: by its GPU kernel where the packed tensors lie
/// on a GPU (bit-exact with the reference), else by `reference` (the format's CPU
/// specification, `QuantizedWeight::dequantize_reference`).
pub fn dequantize(
    packed: Packed<'_>,
    shape: (usize, usize),
    dtype: DType,
    reference: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    let on_gpu = match &packed {
        Packed::Int { codes, .. } => codes.device().is_cuda(),
        Packed::Nvfp4 { packed, .. } => packed.device().is_cuda(),
        Packed::Fp8 { weight, .. } => weight.device().is_cuda(),
    };
    if !on_gpu {
        return reference();
    }
    match packed {
        Packed::Int {
            codes,
            scale,
            zero_point,
            g_idx,
            bits,
            group,
        } => gpu::dequant_int(codes, scale, zero_point, g_idx, shape, bits, group, dtype),
        Packed::Nvfp4 {
            packed,
            scale,
            per_tensor,
        } => {
            let per_tensor = match per_tensor {
                Nvfp4PerTensor::Divides(g) => (g, false),
                Nvfp4PerTensor::Multiplies(m) => (m, true),
            };
            gpu::dequant_nvfp4(packed, scale, per_tensor, shape, dtype)
        }
        Packed::Fp8 {
            weight,
            scale,
            block,
        } => gpu::dequant_fp8(weight, scale, shape, block, dtype),
    }
}

/// Weights of one shape `[out, in]` (a mixture's experts) as one `[weights, out, in]` tensor in
/// `dtype`: pack-quantized int weights of one width and group on a GPU by one launch
/// (bit-identical to [`dequantize`] of each); anything else by `each(i)`, stacked.
pub fn dequantize_stacked(
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    dtype: DType,
    each: impl Fn(usize) -> Result<Tensor>,
) -> Result<Tensor> {
    if let Some((ints, bits, group)) = gpu_ints(packed) {
        if let Some(stacked) = gpu::dequant_int_stacked(&ints, shape, bits, group, dtype)? {
            return Ok(stacked);
        }
    }
    let each: Vec<Tensor> = (0..packed.len()).map(each).collect::<Result<_>>()?;
    Tensor::stack(&each, 0)
}

/// A stack's weights as (codes, scales, zero points) with their width and group, when every one
/// is pack-quantized on a GPU with the same width, group and zero-point presence.
#[allow(clippy::type_complexity)]
fn gpu_ints<'a>(
    packed: &[Option<Packed<'a>>],
) -> Option<(
    Vec<(&'a Tensor, &'a Tensor, Option<&'a Tensor>)>,
    usize,
    usize,
)> {
    let mut ints = Vec::with_capacity(packed.len());
    let mut format = None;
    for p in packed {
        // act-order weights take one launch each (the stacked kernels read `c / group`)
        let Some(Packed::Int {
            codes,
            scale,
            zero_point,
            g_idx: None,
            bits,
            group,
        }) = p
        else {
            return None;
        };
        let this = (*bits, *group, zero_point.is_some());
        if !codes.device().is_cuda() || *format.get_or_insert(this) != this {
            return None;
        }
        ints.push((*codes, *scale, *zero_point));
    }
    format.map(|(bits, group, _)| (ints, bits, group))
}

/// Whether a stack of weights (`packed`, one shape `[n, k]`: a mixture's experts) multiplies in
/// `dtype` by the kernel that decodes int4 weights inside the GEMM
/// ([`matmul_t_int4_stacked_into_rows`]): pack-quantized int4 on a GPU, in a layout it reads.
pub fn decodes_int4_in_gemm(
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    dtype: DType,
) -> Result<bool> {
    match gpu_ints(packed) {
        Some((ints, bits, group)) => gpu::int4_gemm_applies(&ints, shape, bits, group, dtype),
        None => Ok(false),
    }
}

/// How the rows of a stacked GEMM's input split among its weights: each weight's block of
/// consecutive rows, counted on the host, or as a plan made on the GPU laid them out
/// ([`super::moe_plan`]: the counts never leave it).
#[derive(Clone, Copy)]
pub enum StackRows<'a> {
    Counts(&'a [usize]),
    Planned(&'a super::ExpertPlan),
}

impl StackRows<'_> {
    /// The rows of every block together.
    pub fn total(&self) -> usize {
        match self {
            Self::Counts(rows) => rows.iter().sum(),
            Self::Planned(plan) => plan.rows,
        }
    }

    /// The mean rows per block (per weight).
    pub fn mean(&self, blocks: usize) -> usize {
        self.total() / blocks.max(1)
    }
}

/// Writes `x_z · w_zᵀ` for each weight of a stack that [`decodes_int4_in_gemm`] and its block of
/// rows of `x` (`[Σ rows, k]`, `rows`) into rows `row0..` of `out`, by one launch of the kernel
/// that decodes the int4 weights inside the GEMM (the products of the dequantized weights,
/// without writing them to memory).
pub fn matmul_t_int4_stacked_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    rows: StackRows<'_>,
) -> Result<()> {
    let Some((ints, _, group)) = gpu_ints(packed) else {
        candle_core::bail!("matmul_t_int4_stacked_into_rows: weights that are not int4 on a GPU");
    };
    match rows {
        StackRows::Counts(rows) => {
            gpu::matmul_t_int4_stacked_into_rows(out, row0, x, &ints, rows, shape, group, None)
        }
        StackRows::Planned(plan) => gpu::matmul_t_int4_tiled_into_rows(
            out,
            row0,
            x,
            &ints,
            (&plan.offsets, &plan.tiles, plan.rows),
            shape,
            group,
            plan.tile_rows,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qdq(values: &[f32], shape: (usize, usize, usize, usize), scales: HeadScales) -> Vec<f32> {
        let x = Tensor::from_slice(values, shape, &Device::Cpu).unwrap();
        let y = fp8_head_qdq(&x, 1, &scales).unwrap();
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Per-head static scales index the head axis; x / s saturates at ±448 and rounds to e4m3
    /// (subnormals included) before scaling back.
    #[test]
    fn head_qdq_scales_each_head_and_saturates() {
        // [batch 1, heads 2, len 1, dim 3]
        let x = [0.3, -1.1, 1000.0, 3.0, 0.01, -1000.0];
        let got = qdq(&x, (1, 2, 1, 3), HeadScales::Static(vec![0.5, 2.0]));
        assert_eq!(got, [0.3125, -1.125, 224.0, 3.0, 0.01171875, -896.0]);
        let one = qdq(&x, (1, 2, 1, 3), HeadScales::Static(vec![2.0]));
        assert_eq!(one[..3], [0.3125, -1.125, 896.0]);
    }

    /// Dynamic scales: each head's absmax over every other axis, / 448; an all-zero head stays
    /// zero.
    #[test]
    fn head_qdq_absmax_is_per_head_over_the_sequence() {
        // [batch 1, heads 2, len 2, dim 2]: head 0 has absmax 896 (scale 2), head 1 is zero
        let x = [3.0, 0.7, -896.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let got = qdq(&x, (1, 2, 2, 2), HeadScales::AbsMax);
        assert_eq!(got, [3.0, 0.6875, -896.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    }
}

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
    fn dequant_nvfp4(
        packed: &Tensor,
        scales: &Tensor,
        global_scale: f32,
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
    /// `per_token_group_quant_fp8` computes it for block-FP8 Linears.
    Fp8PerTokenGroup { group: usize },
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
            Self::Fp8PerTokenGroup { .. } => "fp8 e4m3 per-token-group dynamic",
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
            Self::Fp8PerToken => {
                let mut scale = absmax(row) / FP8_E4M3_MAX;
                if scale == 0.0 {
                    scale = MIN_SCALE;
                }
                qdq_fp8(row, scale);
            }
            Self::Fp8Static { scale } => qdq_fp8(row, scale),
            Self::Fp8PerTokenGroup { group } => {
                for part in row.chunks_mut(group) {
                    qdq_fp8(part, absmax(part).max(VLLM_GROUP_EPS) / FP8_E4M3_MAX);
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
            // No kernel yet: the rows go through the host (below) and back.
            ActivationQdq::Fp8PerTokenGroup { .. } | ActivationQdq::Int8PerToken => {}
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

/// A quantized weight's tensors as its GPU dequantization kernel reads them.
pub enum Packed<'a> {
    /// pack-quantized int4/int8 words, f32 scales `[out, groups]`, i32 zero points; with
    /// act-order, the group of each input column (`g_idx`, u32 `[in]`) instead of `c / group`.
    Int {
        codes: &'a Tensor,
        scale: &'a Tensor,
        zero_point: Option<&'a Tensor>,
        g_idx: Option<&'a Tensor>,
        bits: usize,
        group: usize,
    },
    /// fp4 codes two per byte, fp8 scales per 16 weights, the global scale.
    Nvfp4 {
        packed: &'a Tensor,
        scale: &'a Tensor,
        global_scale: f32,
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
            global_scale,
        } => gpu::dequant_nvfp4(packed, scale, global_scale, shape, dtype),
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

/// Writes `x_z · w_zᵀ` for each weight of a stack that [`decodes_int4_in_gemm`] and its block of
/// `rows[z]` consecutive rows of `x` (`[Σ rows, k]`) into rows `row0..` of `out`, by one launch
/// of the kernel that decodes the int4 weights inside the GEMM (the products of the dequantized
/// weights, without writing them to memory).
pub fn matmul_t_int4_stacked_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Tensor,
    packed: &[Option<Packed<'_>>],
    shape: (usize, usize),
    rows: &[usize],
) -> Result<()> {
    let Some((ints, _, group)) = gpu_ints(packed) else {
        candle_core::bail!("matmul_t_int4_stacked_into_rows: weights that are not int4 on a GPU");
    };
    gpu::matmul_t_int4_stacked_into_rows(out, row0, x, &ints, rows, shape, group, None)
}

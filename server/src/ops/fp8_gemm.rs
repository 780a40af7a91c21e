//! The fp8 tensor-core GEMM family: `QDQ(x) · Wᵀ` for an e4m3 weight with one scale per output
//! channel (or per tensor) and e4m3 activations (a dynamic scale per token, or a static one),
//! computed as vLLM serves such a layer: the activations quantized to e4m3 codes and one f32
//! scale per row ([`quantize_fp8_rows`]), the codes multiplied on the tensor cores with f32
//! sums, and each sum multiplied by its row's and its column's scale and rounded once to the
//! compute dtype ([`fp8_matmul_t`], cuBLASLt's fp8 GEMM with outer-vector scales).
//!
//! Block FP8 (Hugging Face `quant_method: fp8`, DeepSeek's recipe) is the same with finer
//! scales: one per 128 × 128 block of the weight and one per row and 128 inputs of the
//! activations ([`Fp8InputScale::PerTokenGroup128`]); each block's f32 partial sums are
//! multiplied by their two scales and added in f32 (cuBLASLt's `VEC128_32F` and
//! `BLK128x128_32F` scale modes, Hopper).
//!
//! The product of two e4m3 values is exact in f32, and `code · scale` is the QDQ'd activation
//! bit for bit, so this computes the emulated layer (QDQ'd activations times the dequantized
//! weight) with f32 sums in another order and one rounding where the emulated bf16 path rounds
//! the activations, the weight and the sum. It runs on CUDA GPUs with fp8 tensor cores
//! (compute capability 8.9 and newer) in bf16/f16; the f32 path and the CPU keep the emulation.

use candle_core::{DType, Device, Result, Tensor};

use super::dequant::{fp8_group_scale, fp8_token_scale, ActivationQdq};
use super::gpu_only;
use super::minifloat::{fp8_e4m3_from_grid, round_to_fp8_e4m3, FP8_E4M3_MAX};

super::gpu_entry_points!(fp8_gemm {
    fn fp8_gemm_supported(device: &Device) -> Result<bool>;
    fn quantize_fp8_rows(x: &Tensor, static_scale: Option<f32>) -> Result<(Tensor, Tensor)>;
    fn quantize_fp8_row_groups(x: &Tensor, power_of_two: bool) -> Result<(Tensor, Tensor)>;
    fn fp8_matmul_t(
        x_codes: &Tensor,
        x_scales: &Tensor,
        w_codes: &Tensor,
        w_scales: &Tensor,
        dtype: DType,
        fast_accum: bool,
    ) -> Result<Tensor>;
    fn fp8_matmul_t_into_rows(
        out: &Tensor,
        row0: usize,
        x_codes: &Tensor,
        x_scales: &Tensor,
        w_codes: &Tensor,
        w_scales: &Tensor,
        accumulate: bool,
        fast_accum: bool,
    ) -> Result<()>;
});

/// How a Linear on the fp8 tensor cores quantizes its input rows: the scale of
/// [`ActivationQdq::Fp8PerToken`], [`ActivationQdq::Fp8Static`] or, for block-FP8 weights,
/// [`ActivationQdq::Fp8PerTokenGroup`] with groups of 128.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fp8InputScale {
    PerToken,
    Static(f32),
    PerTokenGroup128 { power_of_two: bool },
}

impl Fp8InputScale {
    /// The scale for inputs that `qdq` quantizes, where the fp8 GEMM takes it.
    pub fn of(qdq: &ActivationQdq) -> Option<Self> {
        Some(match *qdq {
            ActivationQdq::Fp8PerToken => Self::PerToken,
            ActivationQdq::Fp8Static { scale } => Self::Static(scale),
            ActivationQdq::Fp8PerTokenGroup {
                group: FP8_BLOCK,
                power_of_two,
            } => Self::PerTokenGroup128 { power_of_two },
            _ => return None,
        })
    }

    /// One scale per row: `Some(static scale)` or `Some(None)` per token; `None` per group.
    pub fn per_row(self) -> Option<Option<f32>> {
        match self {
            Self::PerToken => Some(None),
            Self::Static(s) => Some(Some(s)),
            Self::PerTokenGroup128 { .. } => None,
        }
    }
}

/// The side of the scale blocks of block FP8, weights (square) and activations (per row).
pub const FP8_BLOCK: usize = 128;

/// Rows of activations as e4m3 codes (`[m, k]`, u8) and f32 scales: one per row (`[m]`; row
/// `i` stands for `codes[i, :] · scales[i]`) or one per row and 128 inputs (`[k / 128, m]`,
/// each group's scales for every row side by side, as cuBLASLt reads them).
pub struct Fp8Rows {
    pub codes: Tensor,
    pub scales: Tensor,
}

/// An e4m3 weight as the GEMM reads it: codes `[n, k]` (u8) and f32 scales, one per output
/// channel (`[n]`) or one per 128 × 128 block ([`fp8_block_scales_for_gemm`]); and how its
/// products are summed: in f32
/// (the tensor cores' partial sums promoted to f32 registers every few k-blocks), or with
/// `fast_accum` in the tensor cores' own accumulator (Hopper's fast fp8 accumulation, per
/// row scales only).
pub struct Fp8Columns<'a> {
    pub codes: &'a Tensor,
    pub scales: &'a Tensor,
    pub fast_accum: bool,
}

/// Whether `device` runs [`fp8_matmul_t`]: a CUDA GPU with fp8 tensor cores.
pub fn fp8_tensor_cores(device: &Device) -> bool {
    device.is_cuda() && gpu::fp8_gemm_supported(device).unwrap_or(false)
}

/// A block-FP8 weight's scales (`[n / 128, k / 128]`, f32) as the GEMM reads them: each row
/// padded with zeros to a multiple of 4 scales (16 bytes; cuBLASLt reads shorter rows wrong,
/// measured by `check`).
pub fn fp8_block_scales_for_gemm(scales: &Tensor) -> Result<Tensor> {
    let (rows, cols) = scales.dims2()?;
    let pad = cols.next_multiple_of(4) - cols;
    if pad == 0 {
        return scales.contiguous();
    }
    let zeros = Tensor::zeros((rows, pad), scales.dtype(), scales.device())?;
    Tensor::cat(&[scales, &zeros], 1)
}

/// `x` (`[m, k]`) quantized as `scale` says: the codes and scales of the activation QDQ, so
/// that `code · scale` is its value bit for bit. On a GPU, `x` is bf16/f16 with k a multiple
/// of 8 (of 128 per group).
pub fn quantize_fp8_rows(x: &Tensor, scale: Fp8InputScale) -> Result<Fp8Rows> {
    if x.device().is_cuda() {
        let (codes, scales) = match scale {
            Fp8InputScale::PerToken => gpu::quantize_fp8_rows(x, None)?,
            Fp8InputScale::Static(s) => gpu::quantize_fp8_rows(x, Some(s))?,
            Fp8InputScale::PerTokenGroup128 { power_of_two } => {
                gpu::quantize_fp8_row_groups(x, power_of_two)?
            }
        };
        return Ok(Fp8Rows { codes, scales });
    }
    let (m, k) = x.dims2()?;
    let group = match scale {
        Fp8InputScale::PerTokenGroup128 { .. } if !k.is_multiple_of(FP8_BLOCK) => {
            candle_core::bail!("quantize_fp8_rows: groups of 128 of rows of {k}")
        }
        Fp8InputScale::PerTokenGroup128 { .. } => FP8_BLOCK,
        _ => k.max(1),
    };
    let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut codes = Vec::with_capacity(m * k);
    let mut scales = Vec::with_capacity(m * k.div_ceil(group));
    for part in values.chunks(group).take(m * k.div_ceil(group)) {
        let s = match scale {
            Fp8InputScale::PerToken => fp8_token_scale(part),
            Fp8InputScale::Static(s) => s,
            Fp8InputScale::PerTokenGroup128 { power_of_two } => fp8_group_scale(part, power_of_two),
        };
        codes.extend(part.iter().map(|&v| {
            // as the activation QDQ computes it, up to the multiplication by the scale
            let q = (v / s + 0.0).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX);
            fp8_e4m3_from_grid(round_to_fp8_e4m3(q))
        }));
        scales.push(s);
    }
    let scales = Tensor::from_vec(scales, (m, k / group), x.device())?;
    Ok(Fp8Rows {
        codes: Tensor::from_vec(codes, (m, k), x.device())?,
        // per group: each group's scales side by side
        scales: match scale {
            Fp8InputScale::PerTokenGroup128 { .. } => scales.t()?.contiguous()?,
            _ => scales.flatten_all()?,
        },
    })
}

/// `x · wᵀ` scaled (`[m, n]` in `dtype`, bf16/f16), on a GPU with fp8 tensor cores.
pub fn fp8_matmul_t(x: &Fp8Rows, w: &Fp8Columns<'_>, dtype: DType) -> Result<Tensor> {
    gpu_only("fp8_matmul_t", &x.codes)?;
    gpu::fp8_matmul_t(&x.codes, &x.scales, w.codes, w.scales, dtype, w.fast_accum)
}

/// Adds [`fp8_matmul_t`] into rows `row0..` of `out` (`[rows, n]`, bf16/f16, contiguous):
/// the sum is rounded once.
pub fn fp8_matmul_t_add_into_rows(
    out: &Tensor,
    row0: usize,
    x: &Fp8Rows,
    w: &Fp8Columns<'_>,
) -> Result<()> {
    gpu_only("fp8_matmul_t_add_into_rows", out)?;
    gpu::fp8_matmul_t_into_rows(
        out,
        row0,
        &x.codes,
        &x.scales,
        w.codes,
        w.scales,
        true,
        w.fast_accum,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::minifloat::fp8_e4m3_to_f32;
    use crate::ops::ActivationQdq;

    /// Rows with zeros, ties, values beyond ±448 · scale and subnormal codes.
    fn rows() -> Tensor {
        let mut v: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173 * (1.0 + (i % 7) as f32))
            .collect();
        v[3] = 0.0;
        v[5] = -0.0;
        v.extend(std::iter::repeat_n(0.0, 64));
        v.extend((0..64).map(|i| 1e-4 * i as f32 - 2e-3));
        Tensor::from_vec(v, (6, 64), &Device::Cpu).unwrap()
    }

    #[test]
    fn codes_times_scales_are_the_qdq_bit_for_bit() {
        // rows of 128: one group each, and rows of 256: two groups with their own scales
        for x in [
            rows().reshape((3, 128)).unwrap(),
            rows()
                .reshape((1, 384))
                .unwrap()
                .narrow(1, 0, 256)
                .unwrap()
                .contiguous()
                .unwrap(),
        ] {
            let groups = |power_of_two| ActivationQdq::Fp8PerTokenGroup {
                group: 128,
                power_of_two,
            };
            for qdq in [
                ActivationQdq::Fp8PerToken,
                ActivationQdq::Fp8Static { scale: 0.02 },
                groups(false),
                groups(true),
            ] {
                let scale = Fp8InputScale::of(&qdq).unwrap();
                let q = quantize_fp8_rows(&x, scale).unwrap();
                let codes = q.codes.to_vec2::<u8>().unwrap();
                // as [row][group]
                let scales = match scale.per_row() {
                    Some(_) => q.scales.unsqueeze(1).unwrap(),
                    None => q.scales.t().unwrap(),
                };
                let scales = scales.to_vec2::<f32>().unwrap();
                let expected = qdq.apply(&x).unwrap().to_vec2::<f32>().unwrap();
                for (i, row) in codes.iter().enumerate() {
                    for (j, &c) in row.iter().enumerate() {
                        let group = j * scales[i].len() / row.len();
                        let value = fp8_e4m3_to_f32(c) * scales[i][group];
                        let want = expected[i][j].to_bits();
                        assert_eq!(value.to_bits(), want, "{qdq:?} row {i} col {j}");
                    }
                }
            }
        }
    }

    /// Only the group of the block-scaled GEMM (128) runs there; other groups stay emulated.
    #[test]
    fn only_groups_of_128_are_quantized_for_the_gemm() {
        let groups = |group| ActivationQdq::Fp8PerTokenGroup {
            group,
            power_of_two: true,
        };
        assert_eq!(
            Fp8InputScale::of(&groups(128)),
            Some(Fp8InputScale::PerTokenGroup128 { power_of_two: true })
        );
        assert_eq!(Fp8InputScale::of(&groups(64)), None);
        assert_eq!(Fp8InputScale::of(&ActivationQdq::Int8PerToken), None);
        let odd = Tensor::zeros((2, 192), DType::F32, &Device::Cpu).unwrap();
        let scale = Fp8InputScale::PerTokenGroup128 {
            power_of_two: false,
        };
        assert!(quantize_fp8_rows(&odd, scale).is_err());
    }

    #[test]
    fn block_scales_are_padded_to_rows_of_16_bytes() {
        let scales = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let padded = fp8_block_scales_for_gemm(&scales).unwrap();
        let want = [[1f32, 2.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]];
        assert_eq!(padded.to_vec2::<f32>().unwrap(), want);
        let whole = Tensor::ones((3, 8), DType::F32, &Device::Cpu).unwrap();
        let same = fp8_block_scales_for_gemm(&whole).unwrap();
        assert_eq!(
            same.to_vec2::<f32>().unwrap(),
            whole.to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn the_gemm_refuses_the_cpu() {
        let q = quantize_fp8_rows(&rows(), Fp8InputScale::PerToken).unwrap();
        let w = Fp8Columns {
            codes: &q.codes,
            scales: &q.scales,
            fast_accum: false,
        };
        let err = fp8_matmul_t(&q, &w, DType::BF16).unwrap_err().to_string();
        assert!(err.contains("CUDA devices only"), "{err}");
    }
}
